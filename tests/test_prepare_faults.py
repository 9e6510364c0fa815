"""A prepare that is interrupted (Ctrl-C, a killed worker, the OOM killer) or meets a full or
read-only disk: one line, the documented exit code, no temporary folder or orphaned worker
left, and the next prepare starts clean."""

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from prepare_helpers import write_corpus

from jaxstep.data.manifest import read_manifest
from jaxstep.data.preparation import prepare


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
