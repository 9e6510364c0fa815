"""jaxstep prepare: shards + manifest that hold exactly the in-memory path's tokens and
masks; atomic, idempotent, deterministic; bad or damaged inputs are clear errors."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxstep import DataError
from jaxstep.data.manifest import MANIFEST, read_manifest
from jaxstep.data.preparation import prepare
from jaxstep.data.readers import read_documents
from jaxstep.data.samples import encode_chat, encode_text
from jaxstep.data.tokenizer import ByteTokenizer, load_tokenizer


def stream(folder, split="train"):
  """A split's tokens (and flags, for chat) read back from its shard files."""
  manifest = read_manifest(folder)
  dtype, entry = np.dtype(manifest["dtype"]), manifest["splits"][split]
  tokens = np.concatenate([np.fromfile(folder / s["file"], dtype) for s in entry["shards"]])
  flags = (
    np.concatenate([np.fromfile(folder / s["file"], np.uint8) for s in entry["flags"]])
    if entry["flags"]
    else None
  )
  starts = np.fromfile(folder / entry["docs"]["file"], np.uint64)
  return tokens, flags, starts


def write_corpus(path, n=300, seed=0):
  rng = np.random.default_rng(seed)
  words = ["the", "cat", "sat", "on", "a", "mat", "Grüße", "naïve", "☕", "42"]
  docs = [" ".join(rng.choice(words, rng.integers(3, 30))) for _ in range(n)]
  path.write_text("\n\n".join(docs) + "\n")
  return docs


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


def test_the_command_prints_counts_and_bad_input_exits_2(tmp_path):
  write_corpus(tmp_path / "c.txt")
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  cmd = [sys.executable, "-m", "jaxstep.prepare", "--no-progress", "--workers", "1"]
  ok = subprocess.run(
    [*cmd, str(tmp_path / "c.txt"), "--out", str(tmp_path / "p")],
    capture_output=True,
    text=True,
    timeout=300,
    env=env,
  )
  assert ok.returncode == 0, ok.stderr
  assert "train" in ok.stdout and "tokens in" in ok.stdout and "tokenizer byte" in ok.stdout
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
  args = [str(tmp_path / "c.txt"), "--out", str(tmp_path / "mine"), "--no-progress"]
  assert main([*args, "--workers", "1"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error:") and "notes.txt" in err[0]
  assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me\n"
  assert main([str(tmp_path / "c.txt"), "--out", str(tmp_path / "p"), "--no-progress"]) == 0
  assert main([*args[:1], "--out", str(tmp_path / "p"), "--format", "file", "--no-progress"]) == 2
  assert "--force" in capsys.readouterr().err
  assert main([*args[:1], "--out", str(tmp_path / "p"), "--format", "file", "--force"]) == 0


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


def test_start_up_hashes_no_shard_whose_size_and_time_are_as_written(tmp_path, monkeypatch):
  import importlib

  prepare_lib = importlib.import_module("jaxstep.data.manifest")

  write_corpus(tmp_path / "c.txt", n=400)
  manifest = prepare([str(tmp_path / "c.txt")], tmp_path / "p", progress=False, shard_tokens=999)
  files = [e["file"] for s in manifest["splits"].values() for e in [*s["shards"], s["docs"]]]
  hashed = []
  real = prepare_lib.sha256
  monkeypatch.setattr(prepare_lib, "sha256", lambda p: hashed.append(p.name) or real(p))
  assert read_manifest(tmp_path / "p") == manifest and hashed == []  # sizes and times only
  shard = tmp_path / "p" / "train-00001.bin"
  os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
  read_manifest(tmp_path / "p")
  assert hashed == ["train-00001.bin"]  # a moved time: that file is hashed, and it matches
  hashed.clear()
  read_manifest(tmp_path / "p", verify=True)  # on demand: every file
  assert sorted(hashed) == sorted(files) and len(files) > 3


def count_shard_reads(monkeypatch, folder):
  """Every read of a shard's bytes, by file name: hashes, whole-file reads, np.fromfile (a
  memory map reads nothing until a window is asked for)."""
  import jaxstep.data.manifest as manifest_lib

  shards = {p.name for p in folder.glob("*-*.bin")}
  reads = []

  def counting(fn):
    def wrapped(path, *args, **kwargs):
      name = pathlib.Path(getattr(path, "name", path)).name
      if name in shards:
        reads.append(name)
      return fn(path, *args, **kwargs)

    return wrapped

  monkeypatch.setattr(manifest_lib, "sha256", counting(manifest_lib.sha256))
  monkeypatch.setattr(pathlib.Path, "read_bytes", counting(pathlib.Path.read_bytes))
  monkeypatch.setattr(np, "fromfile", counting(np.fromfile))
  return reads


def test_a_normal_start_reads_no_shard_byte_and_a_resized_shard_still_stops_it(
  tmp_path, monkeypatch
):
  from jaxstep.data import DataConfig, load_dataset

  write_corpus(tmp_path / "c.txt", n=400)
  prepare([str(tmp_path / "c.txt")], tmp_path / "p", progress=False, shard_tokens=999)
  load_dataset(DataConfig(path=str(tmp_path / "c.txt")), seq_len=16)  # into the cache
  reads = count_shard_reads(monkeypatch, tmp_path / "p")
  assert len(list((tmp_path / "p").glob("train-*.bin"))) > 3
  for path in (tmp_path / "p", tmp_path / "c.txt"):  # prepared, and raw (found in the cache)
    ds = load_dataset(DataConfig(path=str(path)), seq_len=16)
    assert len(ds.train) > 0 and reads == []
  shard = tmp_path / "p" / "train-00002.bin"
  with shard.open("ab") as f:
    f.write(b"\0\0")
  with pytest.raises(DataError, match="train-00002.bin has .* bytes, manifest.json says"):
    load_dataset(DataConfig(path=str(tmp_path / "p")), seq_len=16)
  assert reads == []


def flip_a_byte_keeping_its_time(shard, at=10):
  stat = shard.stat()
  data = bytearray(shard.read_bytes())
  data[at] ^= 1
  shard.write_bytes(bytes(data))
  os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_verify_folder_rehashes_every_shard_and_names_the_first_damaged_one(tmp_path):
  from jaxstep.data.manifest import verify_folder

  write_corpus(tmp_path / "c.txt", n=400)
  prepare([str(tmp_path / "c.txt")], tmp_path / "p", progress=False, shard_tokens=999)
  checked = verify_folder(tmp_path / "p")
  listed = [p for p in (tmp_path / "p").iterdir() if p.suffix == ".bin"]
  assert checked["files"] == len(listed) and checked["bytes"] == sum(
    p.stat().st_size for p in listed
  )
  for name in ("train-00003.bin", "train-00001.bin"):
    flip_a_byte_keeping_its_time(tmp_path / "p" / name)
  read_manifest(tmp_path / "p")  # start-up compares sizes and times: it cannot see a flip
  with pytest.raises(DataError, match="train-00001.bin does not match its checksum"):
    verify_folder(tmp_path / "p")


def test_the_verify_command_exits_0_when_intact_and_2_naming_a_flipped_byte(tmp_path):
  write_corpus(tmp_path / "c.txt", n=400)
  prepare([str(tmp_path / "c.txt")], tmp_path / "p", progress=False, shard_tokens=999)
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}

  def verify(*args):
    cmd = [sys.executable, "-m", "jaxstep.prepare", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)

  ok = verify("--verify", str(tmp_path / "p"))
  assert ok.returncode == 0 and "OK" in ok.stdout and ok.stderr == "", ok.stderr
  flip_a_byte_keeping_its_time(tmp_path / "p" / "train-00002.bin", at=5)
  bad = verify("--verify", str(tmp_path / "p"))
  errors = [line for line in bad.stderr.splitlines() if line.startswith("error:")]
  assert bad.returncode == 2 and len(errors) == 1 and bad.stdout == "", bad.stderr
  assert "train-00002.bin does not match its checksum" in errors[0]
  missing = verify("--verify", str(tmp_path / "nowhere"))
  assert missing.returncode == 2 and "holds no manifest.json" in missing.stderr
  both = verify("--verify", str(tmp_path / "p"), str(tmp_path / "c.txt"))
  assert both.returncode == 2 and "--verify" in both.stderr and not (tmp_path / "q").exists()


def test_zero_shard_tokens_is_a_domain_error_naming_the_option(tmp_path, capsys, monkeypatch):
  from jaxstep.cli import prepare as cli

  monkeypatch.setattr(cli, "setup_logging", lambda: None)
  write_corpus(tmp_path / "c.txt")
  args = [str(tmp_path / "c.txt"), "--out", str(tmp_path / "p"), "--no-progress"]
  assert cli.main([*args, "--shard-tokens", "0"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "--shard-tokens must be >= 1" in err[0]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt"]


def test_a_symlink_loop_in_a_walked_folder_reads_each_file_once(tmp_path):
  from jaxstep.data.readers import scan

  root = tmp_path / "texts"
  (root / "sub").mkdir(parents=True)
  write_corpus(root / "sub" / "a.txt", n=5)
  (root / "sub" / "back").symlink_to(root, target_is_directory=True)  # a loop
  (root / "again.txt").symlink_to(root / "sub" / "a.txt")  # the same file twice
  listing = scan(str(root))
  assert [f.name for f in listing.files] == ["again.txt"]
  assert sorted(listing.skipped["symlink loop or repeat"]) == ["sub/a.txt", "sub/back"]
  manifest = prepare([str(root)], tmp_path / "p", progress=False)
  assert len(manifest["sources"]) == 1
  walked = scan(str(root / "**" / "*.txt"))  # a glob's ** meets the loop too
  assert len(walked.files) == 1 and walked.skipped["symlink loop or repeat"]


def test_a_recursive_glob_over_two_symlink_loops_walks_each_real_folder_once(tmp_path):
  """Python's recursive glob walks every path through the loops before anything can drop
  repeats: two loops make that exponential in the link depth, a hang. A child process
  with a deadline keeps a regression from hanging the suite."""
  root = tmp_path / "texts"
  for sub in ("a", "b", ".hidden"):
    (root / sub).mkdir(parents=True)
    (root / sub / f"{sub.strip('.')}.txt").write_text(f"{sub}\n")
    (root / sub / "up").symlink_to("..", target_is_directory=True)  # a loop each
  (root / "top.txt").write_text("top\n")
  (root / ".dot.txt").write_text("hidden\n")
  code = (
    "import json, sys\n"
    "from jaxstep.data.readers import scan\n"
    "listing = scan(sys.argv[1])\n"
    "print(json.dumps([[str(f) for f in listing.files], listing.skipped]))\n"
  )
  proc = subprocess.run(
    [sys.executable, "-c", code, str(root / "**" / "*.txt")],
    capture_output=True,
    text=True,
    timeout=30,
  )
  assert proc.returncode == 0, proc.stderr
  files, skipped = json.loads(proc.stdout)
  assert files == [str(root / "a" / "a.txt"), str(root / "b" / "b.txt"), str(root / "top.txt")]
  assert skipped == {"symlink loop or repeat": [str(root / "a" / "up"), str(root / "b" / "up")]}


def test_a_recursive_glob_without_loops_matches_what_python_glob_finds(tmp_path):
  """Walking ``**`` by hand keeps glob's answer where glob ends: hidden names left out,
  ``**`` also matching no folder at all, patterns before and after it, a link to a folder
  followed like any folder, and of two names for one file the first in sorted order read."""
  import glob

  from jaxstep.data.readers import scan

  root = tmp_path / "t"
  for folder in ("a/b/c", "a/x", "d", ".git/e", "a/.h", "../outside"):
    (root / folder).mkdir(parents=True, exist_ok=True)
    (root / folder / "f.txt").write_text("x\n")
    (root / folder / ".g.txt").write_text("x\n")
  (root / "0link").symlink_to(root / "a" / "x", target_is_directory=True)  # read, not a/x
  (root / "link").symlink_to(tmp_path / "outside", target_is_directory=True)
  (root / "top.txt").write_text("x\n")  # "*/**" matches it, but nothing lies under it
  patterns = ("**/*.txt", "a/**/f.txt", "*/**/c/*.txt", "**/b/**/*.txt", "a/**", "**", "*/**")
  for pattern in patterns:
    found = sorted(
      pathlib.Path(f) for f in glob.glob(str(root / pattern), recursive=True) if os.path.isfile(f)
    )
    first = {}
    for f in found:
      first.setdefault(f.resolve(), f)
    expected = sorted(first.values())
    assert expected and scan(str(root / pattern)).files == expected, pattern


@pytest.mark.parametrize(
  "damage, match",
  [
    (lambda m: [], "not a manifest object"),
    (lambda m: {k: v for k, v in m.items() if k != "splits"}, "lacks 'splits'"),
    (
      lambda m: {**m, "dtype": "uint32"},
      r"train-00000.bin has .* bytes, not .* tokens × 4 \(uint32\)",
    ),
    (lambda m: {**m, "dtype": "float7"}, "dtype 'float7'"),
    (
      lambda m: {**m, "tokenizer": {**m["tokenizer"], "vocab_size": 70000}},
      "vocabulary of 70000 ids does not fit its dtype uint16",
    ),
  ],
)
def test_a_manifest_that_disagrees_with_itself_or_its_shards_is_one_data_error(
  tmp_path, damage, match
):
  write_corpus(tmp_path / "c.txt")
  manifest = prepare([str(tmp_path / "c.txt")], tmp_path / "p", progress=False)
  (tmp_path / "p" / MANIFEST).write_text(json.dumps(damage(manifest)))
  with pytest.raises(DataError, match=match) as e:
    read_manifest(tmp_path / "p")
  assert "\n" not in str(e.value) and "prepare the data again" in str(e.value)


@pytest.mark.slow
def test_the_command_leaves_a_users_folder_alone_and_exits_2(tmp_path):
  mine = tmp_path / "mine"
  (mine / "sub").mkdir(parents=True)
  (mine / "notes.txt").write_text("my notes\n")
  (mine / "sub" / "model.bin").write_bytes(b"\x00weights")
  proc = subprocess.run(
    [sys.executable, "-m", "jaxstep.prepare", "bundled:text", "--out", str(mine)],
    capture_output=True,
    text=True,
    timeout=300,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
  assert proc.returncode == 2 and len(errors) == 1 and "notes.txt" in errors[0], proc.stderr
  assert (mine / "notes.txt").read_text() == "my notes\n"
  assert (mine / "sub" / "model.bin").read_bytes() == b"\x00weights"


def big_corpus(path, megabytes=20):
  """Enough documents that a prepare with two workers runs for seconds."""
  doc = "the cat sat on the mat and then went to sleep, quietly\n"
  path.write_text((doc + "\n") * (megabytes * 2**20 // (len(doc) + 1)))


def workers_of(pid):
  """The pids of the prepare worker processes a process started (from /proc)."""
  found = []
  for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
    try:
      ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
      cmdline = (stat.parent / "cmdline").read_bytes()
    except (OSError, IndexError, ValueError):
      continue
    if ppid == pid and b"spawn_main" in cmdline:
      found.append(int(stat.parent.name))
  return found


def running(pid):
  """Whether ``pid`` is still a live process (a zombie is not)."""
  try:
    return (pathlib.Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[
      0
    ] != "Z"
  except (OSError, IndexError):
    return False


def start_busy_prepare(tmp_path):
  """``jaxstep prepare --workers 2`` in its own session, returned once both workers run
  and tokens reach the temporary folder; and the worker pids."""
  big_corpus(tmp_path / "c.txt")
  proc = subprocess.Popen(
    [
      sys.executable,
      "-m",
      "jaxstep",
      "prepare",
      str(tmp_path / "c.txt"),
      "--out",
      str(tmp_path / "p"),
      "--workers",
      "2",
      "--no-progress",
    ],  # fmt: skip
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    start_new_session=True,  # its own process group, as a terminal's foreground job
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  deadline = time.monotonic() + 120
  while time.monotonic() < deadline and proc.poll() is None:
    workers = workers_of(proc.pid)
    shards = list(tmp_path.glob(".p.tmp-*/train-*.bin"))
    if len(workers) == 2 and shards and shards[0].stat().st_size:
      return proc, workers
    time.sleep(0.02)
  proc.kill()
  pytest.fail(f"the prepare never got busy: {proc.communicate()[1][-2000:]}")


def finish(proc, timeout=30):
  """``(exit code, stderr)`` of ``proc``; a hang fails the test (and is killed)."""
  try:
    _, err = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"the prepare hung: {proc.communicate()[1][-2000:]}")
  return proc.returncode, err


def assert_stopped_cleanly(tmp_path, workers, err):
  """One ``error:`` line and no traceback; no worker left; nothing left in the folder."""
  errors = [line for line in err.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
  deadline = time.monotonic() + 10
  while any(running(w) for w in workers) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not any(running(w) for w in workers)
  assert sorted(p.name for p in tmp_path.iterdir()) == [".p.lock", "c.txt"]
  return errors[0]


@pytest.mark.slow
@pytest.mark.parametrize("to", ["process", "group"])  # kill(pid) or Ctrl-C in a terminal
def test_ctrl_c_stops_the_workers_removes_the_temporary_folder_and_exits_130(tmp_path, to):
  proc, workers = start_busy_prepare(tmp_path)
  (os.killpg if to == "group" else os.kill)(proc.pid, signal.SIGINT)
  code, err = finish(proc)
  assert code == 130
  assert "interrupted (SIGINT)" in assert_stopped_cleanly(tmp_path, workers, err)
  manifest = prepare([str(tmp_path / "c.txt")], tmp_path / "p", workers=2, progress=False)
  assert read_manifest(tmp_path / "p") == manifest


@pytest.mark.slow
def test_a_worker_killed_by_the_oom_killer_ends_the_prepare_in_one_line(tmp_path):
  proc, workers = start_busy_prepare(tmp_path)
  os.kill(workers[0], signal.SIGKILL)  # what the kernel's OOM killer sends
  code, err = finish(proc)
  assert code == 1
  line = assert_stopped_cleanly(tmp_path, workers, err)
  assert "worker died (killed by signal 9" in line and "--workers" in line


@pytest.mark.slow
def test_workers_whose_prepare_was_killed_exit_instead_of_waiting_forever(tmp_path):
  proc, workers = start_busy_prepare(tmp_path)
  os.kill(proc.pid, signal.SIGKILL)  # the OOM killer may pick the parent as well
  finish(proc)
  deadline = time.monotonic() + 20
  while any(running(w) for w in workers) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not any(running(w) for w in workers)


def remount(point, options):
  subprocess.run(["mount", "-o", f"remount,{options}", str(point)], check=True)


def leftovers(folder):
  """What a failed prepare left in ``folder``: anything but empty folders and lock files."""
  return sorted(str(p) for p in folder.rglob("*") if p.is_file() and not p.name.endswith(".lock"))


@pytest.mark.parametrize("disk", ["full", "read-only"])
def test_a_full_or_read_only_data_cache_is_exit_74_and_the_next_run_prepares(
  tmp_path, tmpfs, capsys, monkeypatch, disk
):
  from conftest import SMALL_MODEL

  from jaxstep.cli import train as cli
  from jaxstep.data import DataConfig, load_dataset

  monkeypatch.setattr(cli, "setup_logging", lambda: None)
  write_corpus(tmp_path / "c.txt", n=3000)  # ~400 KB of uint16 tokens
  cache = tmpfs("64k")
  if disk == "read-only":
    tmpfs.read_only(cache)
  monkeypatch.setenv("JAXSTEP_CACHE", str(cache))
  args = [*SMALL_MODEL, f"data.path={tmp_path / 'c.txt'}", f"run_dir={tmp_path / 'run'}"]
  assert cli.main(args) == 74
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error:"), err
  assert str(cache) in err[0] and "JAXSTEP_CACHE" in err[0] and "free space" in err[0]
  assert leftovers(cache) == []
  remount(cache, "rw,size=4m")  # room again: the next run prepares the data
  data = load_dataset(DataConfig(path=str(tmp_path / "c.txt")), seq_len=16)
  assert cache in data.folder.parents and len(data.train) > 0


@pytest.mark.parametrize("disk", ["full", "read-only"])
def test_prepare_onto_a_full_or_read_only_out_is_exit_74_and_leaves_nothing(
  tmp_path, tmpfs, capsys, monkeypatch, disk
):
  from jaxstep.cli import prepare as cli

  monkeypatch.setattr(cli, "setup_logging", lambda: None)
  write_corpus(tmp_path / "c.txt", n=3000)
  disk_root = tmpfs("64k")
  if disk == "read-only":
    tmpfs.read_only(disk_root)
  out = disk_root / "prepared" / "p"
  args = [str(tmp_path / "c.txt"), "--out", str(out), "--no-progress", "--workers", "1"]
  assert cli.main(args) == 74
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error:") and str(out) in err[0], err
  assert leftovers(disk_root) == []
  remount(disk_root, "rw,size=4m")
  assert cli.main(args) == 0 and read_manifest(out)


def test_a_prepared_folder_on_a_read_only_disk_is_used_as_it_is(tmp_path, tmpfs):
  write_corpus(tmp_path / "c.txt")
  disk_root = tmpfs("4m")
  manifest = prepare([str(tmp_path / "c.txt")], disk_root / "p", progress=False)
  tmpfs.read_only(disk_root)
  assert prepare([str(tmp_path / "c.txt")], disk_root / "p", progress=False) == manifest


def test_ctrl_c_while_a_prepared_folder_is_replaced_leaves_one_in_place(tmp_path, monkeypatch):
  class Stop(Exception):
    pass

  def stop(signum, frame):
    raise Stop

  write_corpus(tmp_path / "c.txt")
  prepare([str(tmp_path / "c.txt")], tmp_path / "p", progress=False)
  rename = pathlib.Path.rename

  def rename_then_ctrl_c(self, target):  # Ctrl-C lands between moving out aside and the swap
    moved = rename(self, target)
    os.kill(os.getpid(), signal.SIGINT)
    return moved

  monkeypatch.setattr(pathlib.Path, "rename", rename_then_ctrl_c)
  previous = signal.signal(signal.SIGINT, stop)
  try:
    with pytest.raises(Stop):
      prepare(
        [str(tmp_path / "c.txt")], tmp_path / "p", progress=False, eval_fraction=0.2, force=True
      )
  finally:
    signal.signal(signal.SIGINT, previous)
  assert read_manifest(tmp_path / "p")["settings"]["eval_fraction"] == 0.2
  monkeypatch.undo()
  prepare([str(tmp_path / "c.txt")], tmp_path / "p", progress=False, force=True)
  assert sorted(p.name for p in tmp_path.iterdir()) == [".p.lock", "c.txt", "p"]
