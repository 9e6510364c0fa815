"""Prepared data checks itself cheaply at every start (sizes and times, no shard read) and
thoroughly on request (``verify``: every shard re-hashed); a damaged or self-contradicting
folder is one data error naming the file."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from prepare_helpers import write_corpus

from jaxstep import DataError
from jaxstep.data.manifest import MANIFEST, read_manifest
from jaxstep.data.preparation import prepare


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


def test_the_verify_command_exits_0_when_intact_and_2_naming_a_flipped_byte(tmp_path, capsys):
  """In this process through the commands' dispatcher, and the damaged folder also as
  ``python -m jaxstep.prepare``: the exit code of a process."""
  from jaxstep.cli import run

  write_corpus(tmp_path / "c.txt", n=400)
  prepare([str(tmp_path / "c.txt")], tmp_path / "p", progress=False, shard_tokens=999)

  def verify(*args):
    try:
      code = run("prepare", ["--verify", *map(str, args)])
    except SystemExit as stop:  # a usage error
      code = stop.code
    out, err = capsys.readouterr()
    return code, out, err

  def verify_in_a_process(*args):
    cmd = [sys.executable, "-m", "jaxstep.prepare", "--verify", *map(str, args)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    return done.returncode, done.stdout, done.stderr

  code, out, err = verify(tmp_path / "p")
  assert code == 0 and "OK" in out and err == "", err
  flip_a_byte_keeping_its_time(tmp_path / "p" / "train-00002.bin", at=5)
  for code, out, err in (verify(tmp_path / "p"), verify_in_a_process(tmp_path / "p")):
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and out == "", err
    assert "train-00002.bin does not match its checksum" in errors[0]
  code, _, err = verify(tmp_path / "nowhere")
  assert code == 2 and "holds no manifest.json" in err
  code, _, err = verify(tmp_path / "p", tmp_path / "c.txt")
  assert code == 2 and "--verify" in err and not (tmp_path / "q").exists()


def test_zero_shard_tokens_is_a_domain_error_naming_the_option(tmp_path, capsys, monkeypatch):
  from jaxstep.cli import prepare as cli

  monkeypatch.setattr(cli, "setup_logging", lambda: None)
  write_corpus(tmp_path / "c.txt")
  args = [str(tmp_path / "c.txt"), "--out", str(tmp_path / "p"), "--no-progress"]
  assert cli.main([*args, "--shard-tokens", "0"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "--shard-tokens must be >= 1" in err[0]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt"]


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
