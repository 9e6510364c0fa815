"""jaxstep prepare: shards + manifest that hold exactly the in-memory path's tokens and
masks; atomic, idempotent, deterministic; what it may write over and what it refuses.
(Integrity checks: ``test_prepare_integrity.py``; walking inputs: ``test_prepare_inputs.py``;
interrupted workers and full disks: ``test_prepare_faults.py``.)"""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from prepare_helpers import stream, write_corpus

from jaxstep import DataError
from jaxstep.data.manifest import MANIFEST, read_manifest
from jaxstep.data.preparation import prepare
from jaxstep.data.readers import read_documents
from jaxstep.data.samples import encode_chat, encode_text
from jaxstep.data.tokenizer import ByteTokenizer
from jaxstep.data.tokenizer_loading import load_tokenizer


def test_text_shards_hold_exactly_the_in_memory_tokens_across_shards(tmp_path):
  docs = write_corpus(tmp_path / "c.txt")
  manifest = prepare(
    [str(tmp_path / "c.txt")],
    tmp_path / "p",
    eval_fraction=0.0,
    shard_tokens=1000,
    progress=False,
  )
  tokens, flags, starts = stream(tmp_path / "p")
  expected = [encode_text(d, ByteTokenizer()) for d in docs]
  np.testing.assert_array_equal(tokens, np.concatenate([t for t, _ in expected]))
  assert flags is None  # text: every token but BOS is a target
  np.testing.assert_array_equal(np.concatenate([f for _, f in expected]), tokens != 257)
  np.testing.assert_array_equal(starts, np.cumsum([0] + [len(t) for t, _ in expected])[:-1])
  train = manifest["splits"]["train"]
  assert train["documents"] == len(docs) and train["tokens"] == len(tokens)
  assert len(train["shards"]) == -(-len(tokens) // 1000) and manifest["dtype"] == "uint16"


def test_chat_shards_keep_the_assistant_only_flags(tmp_path):
  manifest = prepare(["bundled:chat"], tmp_path / "p", eval_fraction=0.0, progress=False)
  tokens, flags, _ = stream(tmp_path / "p")
  docs, kind = read_documents("bundled:chat")
  expected = [encode_chat(d, ByteTokenizer()) for d in docs]
  assert manifest["kind"] == kind == "chat"
  np.testing.assert_array_equal(tokens, np.concatenate([t for t, _ in expected]))
  np.testing.assert_array_equal(flags, np.concatenate([f for _, f in expected]))


def test_documents_are_split_by_a_fixed_hash_and_none_is_lost(tmp_path):
  docs = write_corpus(tmp_path / "c.txt", n=1000)
  manifest = prepare([str(tmp_path / "c.txt")], tmp_path / "p", eval_fraction=0.1, progress=False)
  splits = manifest["splits"]
  assert splits["train"]["documents"] + splits["eval"]["documents"] == len(docs)
  assert 50 <= splits["eval"]["documents"] <= 150
  total = sum(len(encode_text(d, ByteTokenizer())[0]) for d in docs)
  assert splits["train"]["tokens"] + splits["eval"]["tokens"] == total


def test_trained_bpe_is_saved_next_to_the_shards_and_decodes_them(tmp_path):
  docs = write_corpus(tmp_path / "c.txt")
  manifest = prepare(
    [str(tmp_path / "c.txt")],
    tmp_path / "p",
    train_bpe_vocab=300,
    eval_fraction=0.0,
    progress=False,
  )
  assert manifest["tokenizer"]["file"] == "tokenizer.json"
  tok = load_tokenizer(str(tmp_path / "p" / "tokenizer.json"))
  assert manifest["tokenizer"]["vocab_size"] == tok.vocab_size <= 300  # merges may run out
  tokens, _, starts = stream(tmp_path / "p")
  ends = [*starts[1:], len(tokens)]
  assert [tok.decode(tokens[a:b]) for a, b in zip(starts, ends, strict=True)] == docs


def test_same_inputs_are_a_no_op_and_workers_give_identical_bytes(tmp_path):
  write_corpus(tmp_path / "c.txt", n=2000)
  one = prepare([str(tmp_path / "c.txt")], tmp_path / "a", progress=False)
  stamp = (tmp_path / "a" / MANIFEST).stat().st_mtime_ns
  assert prepare([str(tmp_path / "c.txt")], tmp_path / "a", progress=False) == one
  assert (tmp_path / "a" / MANIFEST).stat().st_mtime_ns == stamp  # nothing rewritten
  two = prepare([str(tmp_path / "c.txt")], tmp_path / "b", workers=2, progress=False)
  assert one["splits"] == two["splits"]  # same files, sizes and checksums


def test_a_killed_prepare_leaves_no_manifest_and_the_next_one_starts_clean(tmp_path):
  write_corpus(tmp_path / "c.txt")
  stale = tmp_path / ".p.tmp-99999"  # what a SIGKILL mid-prepare leaves
  stale.mkdir()
  (stale / "train-00000.bin").write_bytes(b"half")
  assert not (tmp_path / "p").exists()
  prepare([str(tmp_path / "c.txt")], tmp_path / "p", progress=False)
  assert not stale.exists() and read_manifest(tmp_path / "p")


def test_a_failing_prepare_keeps_the_old_output_and_no_temporary_folder(tmp_path):
  write_corpus(tmp_path / "c.txt")
  old = prepare([str(tmp_path / "c.txt")], tmp_path / "p", progress=False)
  (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{oops\n')
  with pytest.raises(DataError, match="bad.jsonl:2: malformed JSON"):
    prepare([str(tmp_path / "bad.jsonl")], tmp_path / "p", progress=False, force=True)
  assert read_manifest(tmp_path / "p") == old
  assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [".p.lock"]


@pytest.mark.parametrize("damage", ["truncated", "changed", "missing", "newer"])
def test_damaged_prepared_data_names_the_file(tmp_path, damage):
  write_corpus(tmp_path / "c.txt")
  prepare([str(tmp_path / "c.txt")], tmp_path / "p", progress=False)
  shard = tmp_path / "p" / "train-00000.bin"
  if damage == "truncated":
    shard.write_bytes(shard.read_bytes()[:-10])
    match = "train-00000.bin has .* bytes"
  elif damage == "changed":
    data = bytearray(shard.read_bytes())
    data[10] ^= 1
    shard.write_bytes(bytes(data))
    match = "train-00000.bin does not match its checksum"
  elif damage == "missing":
    shard.unlink()
    match = "train-00000.bin is missing"
  else:
    manifest = json.loads((tmp_path / "p" / MANIFEST).read_text())
    (tmp_path / "p" / MANIFEST).write_text(json.dumps({**manifest, "format_version": 99}))
    match = "format version 99 is newer"
  with pytest.raises(DataError, match=match):
    read_manifest(tmp_path / "p")


def test_the_command_prints_counts_and_bad_input_exits_2(tmp_path, capsys, monkeypatch):
  """The counts in this process, through the commands' dispatcher; the bad input as
  ``python -m jaxstep.prepare``: the exit code and the one line of a process."""
  from jaxstep.cli import prepare as cli
  from jaxstep.cli import run

  monkeypatch.setattr(cli, "setup_logging", lambda: None)  # keep the root logger as it is
  write_corpus(tmp_path / "c.txt")
  options = ["--no-progress", "--workers", "1"]
  code = run("prepare", [*options, str(tmp_path / "c.txt"), "--out", str(tmp_path / "p")])
  out, err = capsys.readouterr()
  assert code == 0, err
  assert "train" in out and "tokens in" in out and "tokenizer byte" in out
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  cmd = [sys.executable, "-m", "jaxstep.prepare", *options]
  bad = subprocess.run(
    [*cmd, str(tmp_path / "nope.txt"), "--out", str(tmp_path / "q")],
    capture_output=True,
    text=True,
    timeout=300,
    env=env,
  )
  errors = [line for line in bad.stderr.splitlines() if line.startswith("error:")]
  assert bad.returncode == 2 and len(errors) == 1 and "does not exist" in errors[0]
  assert not (tmp_path / "q").exists()


def test_a_prepare_of_a_folder_waits_for_one_already_running_then_finds_it_done(tmp_path):
  import fcntl
  import threading

  write_corpus(tmp_path / "c.txt")
  args = ([str(tmp_path / "c.txt")], tmp_path / "p")
  with open(tmp_path / ".p.lock", "w") as lock:  # another run is preparing tmp_path / "p"
    fcntl.flock(lock, fcntl.LOCK_EX)
    waiting = threading.Thread(target=prepare, args=args, kwargs={"progress": False})
    waiting.start()
    time.sleep(1.0)
    assert waiting.is_alive() and not (tmp_path / "p").exists()  # it waits, writes nothing
    fcntl.flock(lock, fcntl.LOCK_UN)
  waiting.join(timeout=120)
  assert not waiting.is_alive() and read_manifest(tmp_path / "p")


def test_an_out_folder_holding_other_files_is_refused_and_left_alone(tmp_path):
  mine = tmp_path / "mine"
  (mine / "sub").mkdir(parents=True)
  (mine / "notes.txt").write_text("my notes\n")
  (mine / "sub" / "model.bin").write_bytes(b"\x00weights")
  with pytest.raises(DataError, match=r"--out .*mine holds files that are not a prepared"):
    prepare(["bundled:text"], mine, progress=False)
  assert sorted(str(p.relative_to(mine)) for p in mine.rglob("*")) == [
    "notes.txt",
    "sub",
    "sub/model.bin",
  ]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no lock, no temporary


@pytest.mark.parametrize("where", ["same", "inside"])
def test_an_out_folder_equal_to_or_inside_an_input_directory_is_refused(tmp_path, where):
  texts = tmp_path / "texts"
  texts.mkdir()
  write_corpus(texts / "a.txt")
  out = texts if where == "same" else texts / "prepared"
  with pytest.raises(DataError, match="inside the input"):
    prepare([str(texts)], out, progress=False)
  assert sorted(p.name for p in texts.iterdir()) == ["a.txt"]


def test_an_empty_out_folder_and_a_prepared_one_may_be_replaced(tmp_path):
  write_corpus(tmp_path / "c.txt")
  (tmp_path / "p").mkdir()
  prepare([str(tmp_path / "c.txt")], tmp_path / "p", progress=False)
  write_corpus(tmp_path / "c.txt", seed=1)  # the input changed: --force replaces it
  new = prepare([str(tmp_path / "c.txt")], tmp_path / "p", progress=False, force=True)
  assert read_manifest(tmp_path / "p") == new


@pytest.mark.parametrize(
  "change, match",
  [
    ({"fmt": "file"}, "format auto → file"),
    ({"eval_fraction": 0.2}, "eval_fraction 0.05 → 0.2"),
    ({"train_bpe_vocab": 300}, "tokenizer byte → train-bpe:300"),
    ({"inputs": ["other"]}, "inputs"),
  ],
)
def test_preparing_other_settings_over_a_prepared_folder_needs_force(tmp_path, change, match):
  write_corpus(tmp_path / "c.txt")
  write_corpus(tmp_path / "other.txt", seed=2)
  old = prepare([str(tmp_path / "c.txt")], tmp_path / "p", progress=False)
  inputs = [str(tmp_path / n) for n in change.pop("inputs", ["c.txt"])]
  inputs = [i + ".txt" if i.endswith("other") else i for i in inputs]
  with pytest.raises(DataError, match=f"{match}.*--force"):
    prepare(inputs, tmp_path / "p", progress=False, **change)
  assert read_manifest(tmp_path / "p") == old
  new = prepare(inputs, tmp_path / "p", progress=False, force=True, **change)
  assert read_manifest(tmp_path / "p") == new != old


def test_the_command_refuses_a_non_prepared_out_with_exit_2_and_one_line(
  tmp_path, capsys, monkeypatch
):
  from jaxstep.cli import prepare as cli

  monkeypatch.setattr(cli, "setup_logging", lambda: None)  # keep the root logger as it is
  main = cli.main

  write_corpus(tmp_path / "c.txt")
  (tmp_path / "mine").mkdir()
  (tmp_path / "mine" / "notes.txt").write_text("keep me\n")
  one = ["--no-progress", "--workers", "1"]  # no worker processes to start
  args = [str(tmp_path / "c.txt"), "--out", str(tmp_path / "mine")]
  assert main([*args, *one]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error:") and "notes.txt" in err[0]
  assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me\n"
  assert main([*args[:1], "--out", str(tmp_path / "p"), *one]) == 0
  assert main([*args[:1], "--out", str(tmp_path / "p"), "--format", "file", *one]) == 2
  assert "--force" in capsys.readouterr().err
  assert main([*args[:1], "--out", str(tmp_path / "p"), "--format", "file", "--force", *one]) == 0


def test_an_out_that_is_an_existing_file_is_exit_2_one_line_and_the_file_kept(
  tmp_path, capsys, monkeypatch
):
  """``--out`` names a folder: a regular file there is the user's, never replaced or
  removed, and the refusal is one ``error:`` line naming it."""
  from jaxstep.cli import prepare as cli

  monkeypatch.setattr(cli, "setup_logging", lambda: None)  # keep the root logger as it is
  out = tmp_path / "notes.txt"
  out.write_bytes(b"my notes\n\x00")
  before = out.stat()
  assert cli.main(["bundled:text", "--out", str(out), "--no-progress", "--workers", "1"]) == 2
  captured = capsys.readouterr()
  err = captured.err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error:") and str(out) in err[0], captured.err
  assert out.read_bytes() == b"my notes\n\x00"
  assert out.stat().st_mtime_ns == before.st_mtime_ns and out.stat().st_ino == before.st_ino
  assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # no temporary folder
