"""The files a run keeps: strict JSON lines, readers that survive a cut line, and rewrites
that a kill cannot cut."""

import os
import signal
import subprocess
import sys

import pytest

from jaxstep.trainer.store import records


def _history(path, steps):
  path.write_text(
    "".join(
      records.dumps({"step": s, "loss": 1.0 / s, "pad": "x" * 200}) + "\n"
      for s in range(1, steps + 1)
    )
  )


def test_write_atomic_replaces_and_a_failed_write_leaves_the_old_file(tmp_path, monkeypatch):
  path = tmp_path / "config.yaml"
  records.write_atomic(path, "a: 1\n")
  assert path.read_text() == "a: 1\n"

  def full_disk(*_):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(os, "replace", full_disk)
  with pytest.raises(OSError, match="No space"):
    records.write_atomic(path, "a: 2\n")
  assert path.read_text() == "a: 1\n"
  assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]  # no temporary left


def test_truncate_keeps_the_steps_up_to_the_checkpoint(tmp_path):
  path = tmp_path / "metrics.jsonl"
  _history(path, 50)
  records.truncate_records(path, 20)
  assert [r["step"] for r in records.read_records(path)] == list(range(1, 21))


@pytest.mark.slow
def test_a_process_killed_while_rewriting_the_history_loses_none_of_it(tmp_path):
  """A real kill in the middle of the rewrite: the process may write at most 256 KiB to any
  file (RLIMIT_FSIZE), so the kernel kills it with SIGXFSZ partway through the ~2 MiB it
  rewrites. The history must still hold every record (before: truncated to 256 KiB)."""
  path = tmp_path / "metrics.jsonl"
  _history(path, 10_000)
  before = path.read_bytes()
  code = (
    "import pathlib, resource, signal, sys\n"
    "from jaxstep.trainer.store import records\n"
    "signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; the kernel kills\n"
    "resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))\n"
    "records.truncate_records(pathlib.Path(sys.argv[1]), 9_000)\n"
  )
  proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True)
  assert proc.returncode == -signal.SIGXFSZ, proc.stderr.decode()[-2000:]
  assert path.read_bytes() == before
  records.truncate_records(path, 9_000)  # the next start rewrites it whole
  assert len(records.read_records(path)) == 9_000


def test_write_atomic_takes_bytes(tmp_path):
  path = tmp_path / "tokenizer.model"
  blob = bytes(range(256)) * 4  # not text: a sentencepiece model is binary
  records.write_atomic(path, blob)
  assert path.read_bytes() == blob
