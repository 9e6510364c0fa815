"""Writes that fail: a full disk, a read-only or vanished directory, a failed save, metrics
write or bad-batch dump, mid-run or before the first step. Each ends in one ``error:`` line
and exit 74 (or 2 before anything is written), never a hang, with the newest complete
checkpoint intact and resumable."""

import pathlib

import pytest
from conftest import make_cfg, remount_read_only_when_free
from fault_helpers import (
  IO_EXIT,
  SMALL,
  assert_resumable_from,
  enospc,
  failing_after,
  newest_in,
  one_error,
  train_main,
)

# Each of these trains, kills or mounts: the whole file is in the slow tier (CI runs it).
pytestmark = pytest.mark.slow


def test_a_failed_metrics_write_stops_with_one_line_and_keeps_the_checkpoint(
  tmp_path, monkeypatch, capsys
):
  from jaxstep.trainer.store import records

  target = tmp_path / "run" / "metrics.jsonl"
  monkeypatch.setattr(
    records, "append", failing_after(6, lambda: enospc(str(target)), records.append)
  )
  assert train_main(tmp_path) == IO_EXIT
  line = one_error(capsys)
  assert f"writing {target} failed (No space left on device)" in line
  assert "the newest complete checkpoint is update step 4" in line
  assert_resumable_from(tmp_path / "run", 4)


def test_a_dead_tensorboard_writer_thread_stops_the_run_instead_of_hanging(
  tmp_path, monkeypatch, capsys
):
  from tensorboardX import event_file_writer

  writer = event_file_writer.EventsWriter
  monkeypatch.setattr(
    writer, "write_event", failing_after(30, enospc, writer.write_event), raising=True
  )
  assert train_main(tmp_path, "train.max_steps=400", "checkpoint.every=100") == IO_EXIT
  line = one_error(capsys)
  assert "No space left on device" in line and str(tmp_path / "run") in line


def test_a_tensorboard_flush_that_fails_at_the_end_leaves_no_writer_thread(
  tmp_path, monkeypatch, capsys
):
  """The disk fills before the run's last flush of its TensorBoard events: tensorboardX's
  own close stops at the failed flush, leaving its writer thread alive with the file open,
  and that thread's next flush failed later under another test. The run stops in one line
  and ends the thread and closes the file anyway."""
  import threading

  from tensorboardX import event_file_writer

  writer = event_file_writer.EventsWriter
  # the writer thread flushes once, at its first event; the next flush is the close's
  monkeypatch.setattr(writer, "flush", failing_after(1, enospc, writer.flush), raising=True)
  assert train_main(tmp_path) == IO_EXIT
  assert "No space left on device" in one_error(capsys)
  assert [t.name for t in threading.enumerate() if "tensorboardX" in type(t).__module__] == []
  events = tmp_path / "run" / "tensorboard"
  assert not [p for p in pathlib.Path("/proc/self/fd").iterdir() if str(events) in _target(p)]


def _target(fd: pathlib.Path) -> str:
  try:
    return str(fd.readlink())
  except OSError:
    return ""


def test_a_failed_checkpoint_save_is_one_line_and_older_ones_stay(tmp_path, monkeypatch, capsys):
  import orbax.checkpoint as ocp

  manager = ocp.CheckpointManager
  monkeypatch.setattr(
    manager,
    "save",
    failing_after(
      1, lambda: ValueError("RESOURCE_EXHAUSTED: Failed writing: No space"), manager.save
    ),
  )
  assert train_main(tmp_path) == IO_EXIT
  line = one_error(capsys)
  assert "saving the checkpoint of update step 8" in line and "RESOURCE_EXHAUSTED" in line
  assert "the newest complete checkpoint is update step 4" in line
  assert_resumable_from(tmp_path / "run", 4)


def test_too_little_room_for_a_checkpoint_is_refused_before_writing(tmp_path, monkeypatch, capsys):
  import shutil

  from jaxstep.trainer.store import checkpoint

  real = shutil.disk_usage
  calls = {"n": 0}

  def usage(path):
    calls["n"] += 1
    total, used, free = real(path)
    # the check before the first step, then the save of step 4, see the real disk
    return type(real(path))(total, used, free if calls["n"] <= 2 else 1024)

  monkeypatch.setattr(checkpoint.shutil, "disk_usage", usage)
  assert train_main(tmp_path) == IO_EXIT
  line = one_error(capsys)
  assert "0.0 MiB free, the checkpoint of update step 8 needs" in line
  assert_resumable_from(tmp_path / "run", 4)


def test_a_failed_bad_batch_dump_is_one_line(tmp_path, monkeypatch, capsys):
  from jaxstep.trainer.loop import nonfinite_guard as guards

  def savez(path, **arrays):
    raise enospc(str(path))

  monkeypatch.setattr(guards.np, "savez", savez)
  assert train_main(tmp_path, "train.debug_nan_step=6") == IO_EXIT
  assert "bad_batches/step_00000006.npz failed (No space left on device)" in one_error(capsys)
  assert_resumable_from(tmp_path / "run", 4)


def test_a_full_disk_ends_the_run_in_one_line_without_hanging(tmp_path, tmpfs):
  """A real full filesystem: the events and metrics fill it, or the next checkpoint does
  not fit. Either way: exit 74, one line, no traceback, within the timeout, and the
  checkpoints that were completed are intact."""
  import subprocess
  import sys

  make_cfg(tmp_path)
  for size, overrides in (
    ("64k", ["train.max_steps=2000", "checkpoint.every=0"]),
    ("1600k", ["train.max_steps=40", "checkpoint.every=5"]),
  ):
    run_dir = tmpfs(size) / "run"
    proc = subprocess.run(
      [
        sys.executable,
        "-m",
        "jaxstep.train",
        *SMALL,
        f"data.path={tmp_path / 'corpus.txt'}",
        f"run_dir={run_dir}",
        "train.log_every=1",
        *overrides,
      ],
      capture_output=True,
      text=True,
      timeout=240,
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == IO_EXIT and len(errors) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Event loop is closed" not in proc.stderr
    if size == "64k":  # no room for one checkpoint: refused before the first step
      assert "MiB free, a checkpoint needs about" in errors[0]
      assert not run_dir.exists()
    else:
      assert "MiB free" in errors[0]
      assert_resumable_from(run_dir, newest_in(errors[0]))


def test_a_disk_that_fills_during_a_checkpoint_write(tmp_path, tmpfs, monkeypatch, capsys):
  """The free-space check passed, then orbax's own write fails: one line, exit 74, naming
  the save that failed (it stays a temporary directory) and the intact one before it."""
  import collections
  import re

  from jaxstep.trainer.store import checkpoint

  usage = collections.namedtuple("usage", "total used free")
  monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: usage(2**40, 0, 2**40))
  run_dir = tmpfs("700k") / "run"
  code = train_main(tmp_path, f"run_dir={run_dir}", "train.max_steps=40", "checkpoint.every=2")
  assert code == IO_EXIT
  line = one_error(capsys)
  assert "No space left on device" in line
  failed = int(re.search(r"the checkpoint of update step (\d+) in", line).group(1))
  assert (run_dir / "checkpoints" / f"{failed}.orbax-checkpoint-tmp").is_dir()  # that one
  assert "the newest complete checkpoint is update step" in line
  assert_resumable_from(run_dir, newest_in(line))


@pytest.mark.parametrize("disk", ["full", "read_only"])
def test_a_disk_that_refuses_the_run_before_its_first_step_leaves_nothing(
  tmp_path, tmpfs, capsys, disk
):
  """A checkpoints folder that cannot take one checkpoint (no room, read-only) is found
  before the first update: exit 74, one line, nothing written, and the next try with the
  disk fixed trains as if nothing had happened."""
  import subprocess

  point = tmpfs("64k" if disk == "full" else "16m")
  run_dir = point / "run"
  if disk == "read_only":
    run_dir.mkdir()
    (run_dir / "checkpoints").mkdir()
    subprocess.run(
      ["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(run_dir / "checkpoints")],
      check=True,
    )
  try:
    assert train_main(tmp_path, f"run_dir={run_dir}") == IO_EXIT
    line = one_error(capsys)
    if disk == "full":
      assert "MiB free, a checkpoint needs about" in line and not run_dir.exists()
    else:
      assert "checkpoints cannot be written (Read-only file system)" in line
      assert sorted(p.name for p in run_dir.iterdir()) == [".lock", "checkpoints"]
  finally:
    if disk == "read_only":
      subprocess.run(["umount", "-l", str(run_dir / "checkpoints")], check=True)
  if disk == "full":
    subprocess.run(["mount", "-o", "remount,size=16m", str(point)], check=True)
  assert train_main(tmp_path, f"run_dir={run_dir}") == 0
  assert_resumable_from(run_dir, 12)


def test_checkpoints_that_is_a_file_is_refused_before_anything_is_written(tmp_path, capsys):
  run_dir = tmp_path / "run"
  run_dir.mkdir()
  (run_dir / "checkpoints").write_text("mine")
  assert train_main(tmp_path) == 2
  assert f"{run_dir / 'checkpoints'} is a file, not a folder" in one_error(capsys)
  assert sorted(p.name for p in run_dir.iterdir()) == [".lock", "checkpoints"]
  assert (run_dir / "checkpoints").read_text() == "mine"
  (run_dir / "checkpoints").unlink()
  assert train_main(tmp_path) == 0  # fixed: not refused as a run with history
  assert_resumable_from(run_dir, 12)


def _train_in_background(tmp_path, run_dir, *overrides):
  import subprocess
  import sys

  make_cfg(tmp_path)
  argv = [
    *SMALL,
    f"data.path={tmp_path / 'corpus.txt'}",
    f"run_dir={run_dir}",
    "train.max_steps=100000",
    "checkpoint.every=5",
    *overrides,
  ]
  cmd = [sys.executable, "-m", "jaxstep.train", *argv]
  return subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)


def _wait_for(path: pathlib.Path, proc, seconds: float = 120) -> None:
  import time

  deadline = time.monotonic() + seconds
  while not path.exists():
    assert proc.poll() is None and time.monotonic() < deadline, f"no {path}"
    time.sleep(0.1)


def test_checkpoints_that_turn_read_only_mid_run_end_in_one_line_without_hanging(tmp_path, tmpfs):
  """orbax's save threads wait 20 minutes for signals a failed save never sends; the command
  reports the failure and ends anyway."""
  import subprocess
  import time

  run_dir = tmp_path / "run"
  (run_dir / "checkpoints").mkdir(parents=True)
  subprocess.run(
    ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(run_dir / "checkpoints")], check=True
  )
  try:
    proc = _train_in_background(tmp_path, run_dir)
    _wait_for(run_dir / "checkpoints" / "5", proc)
    remount_read_only_when_free(run_dir / "checkpoints")
    start = time.monotonic()
    _, err = proc.communicate(timeout=120)
  finally:
    proc.kill()
    subprocess.run(["umount", "-l", str(run_dir / "checkpoints")])
  errors = [line for line in err.splitlines() if line.startswith("error:")]
  assert proc.returncode == IO_EXIT and len(errors) == 1, err[-3000:]
  assert "Read-only file system" in errors[0] and "Traceback" not in err
  assert time.monotonic() - start < 60


def test_a_run_dir_removed_mid_run_is_one_line_and_not_recreated(tmp_path):
  """The run stops at its next update step, writes nothing more, and says so; only a save
  already under way (asynchronous) may still land its step there, and the line says which."""
  import re
  import shutil
  import time

  run_dir = tmp_path / "run"
  proc = _train_in_background(tmp_path, run_dir)
  try:
    _wait_for(run_dir / "checkpoints" / "5", proc)
    run_dir.rename(tmp_path / "moved")  # one atomic step; rmtree races the run's writes
    shutil.rmtree(tmp_path / "moved")
    _, err = proc.communicate(timeout=120)
  finally:
    proc.kill()
  errors = [line for line in err.splitlines() if line.startswith("error:")]
  assert proc.returncode == IO_EXIT and len(errors) == 1, err[-3000:]
  assert f"run_dir {run_dir} was removed or replaced during the run" in errors[0]
  failed = re.search(
    r"the checkpoint save of update step (\d+) that was under way failed", errors[0]
  )
  if failed:  # its writer threads may still land files of that step, and nothing else
    time.sleep(2)
    if run_dir.exists():
      assert [p.name for p in run_dir.iterdir()] == ["checkpoints"]
      names = [p.name for p in (run_dir / "checkpoints").iterdir()]
      assert all(n.startswith(f"{failed.group(1)}.orbax-checkpoint-tmp") for n in names), names
    return
  if "nothing more was written" in errors[0]:
    assert not run_dir.exists(), sorted(str(p) for p in run_dir.rglob("*"))
    return
  assert [p.name for p in run_dir.iterdir()] == ["checkpoints"]
  step = re.search(r"with update step (\d+), which a re-run resumes from", errors[0])
  if step:
    assert_resumable_from(run_dir, int(step.group(1)))
  else:
    assert "with no complete checkpoint" in errors[0]
