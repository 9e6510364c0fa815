"""The run directory: one run at a time (an exclusive lock), written only after every check
passed, earlier outputs set aside on ``--no-resume``, and the one way folders that must not
collide are named (``<name>-<YYYYmmdd-HHMMSS>``)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import pathlib
import shutil
import time

import jax

from jaxstep.errors import RunDirError, RunIOError
from jaxstep.trainer import records

log = logging.getLogger("jaxstep")
LOCK = ".lock"  # holds the pid of the run that owns the directory
ARCHIVES = "previous-"  # folders that --no-resume made


def stamped(name: str) -> str:
  """``name`` with the local time appended: ``previous-20261130-204253``."""
  return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


# a write the disk refused: exit 74 like a failed write during the run, not bad input
WRITE_REFUSED = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT}


def _unusable(run_dir: pathlib.Path, e: OSError) -> RunDirError | RunIOError:
  cls = RunIOError if e.errno in WRITE_REFUSED else RunDirError
  return cls(f"run_dir {run_dir} cannot be used ({e.strerror or e}); choose a writable directory")


def _holds_nothing(run_dir: pathlib.Path) -> bool:
  """Only the lock and empty folders: what a run that stopped before writing leaves."""
  return all(
    p.name == LOCK or (p.is_dir() and not p.is_symlink() and not any(p.iterdir()))
    for p in run_dir.iterdir()
  )


@contextlib.contextmanager
def locked(run_dir: str | pathlib.Path):
  """Creates ``run_dir`` and holds an exclusive lock on ``run_dir/.lock`` for the block.

  ``flock`` is released by the OS when the process dies, so a killed run never leaves a
  stale lock. Only process 0 locks (the processes of one job share the directory). A
  directory this call created and that holds nothing on exit but the lock and empty
  folders is removed.

  Raises:
    RunIOError: the disk refuses the directory (full, read-only, no permission).
    RunDirError: it cannot be created otherwise (a file in the path), or another run holds
      it.
  """
  run_dir = pathlib.Path(run_dir)
  if jax.process_index() != 0:
    yield run_dir
    return
  created = not run_dir.exists()
  try:
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
  except OSError as e:
    raise _unusable(run_dir, e) from None
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      if e.errno not in (errno.EAGAIN, errno.EACCES):
        raise _unusable(run_dir, e) from None
      holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
      raise RunDirError(
        f"run_dir {run_dir} is in use by another run (pid {holder}); wait for it to end or "
        f"choose another run_dir"
      ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    try:
      yield run_dir
    finally:
      with contextlib.suppress(OSError):  # never hides the error on its way up
        if created and run_dir.is_dir() and _holds_nothing(run_dir):
          shutil.rmtree(run_dir, ignore_errors=True)
  finally:
    os.close(fd)


def identity(run_dir: pathlib.Path) -> int | None:
  """The directory's inode: tells it apart from a new one of the same name (the device
  number is left out: an automounted network filesystem may change it)."""
  try:
    return os.stat(run_dir).st_ino
  except OSError:
    return None


class RemovedError(RunIOError):
  """``run_dir`` was deleted (or replaced by another directory) while the run wrote to it."""


def check_still_there(run_dir: pathlib.Path, started: int | None) -> None:
  """Raises ``RemovedError`` if ``run_dir`` is no longer the directory the run started in:
  writing on would re-create it (orbax makes missing parents) as a half-run without its
  history. A passing error of a network filesystem (``ESTALE``, ``EIO``) is not a removal:
  a write that really fails says so itself."""
  if started is None:
    return
  try:
    now = os.stat(run_dir).st_ino
  except (FileNotFoundError, NotADirectoryError):
    now = None
  except OSError:
    return
  if now != started:
    raise RemovedError(f"run_dir {run_dir} was removed or replaced during the run")


def write_config(run_dir: pathlib.Path, config_yaml: str) -> None:
  """(Process 0) writes the resolved config to ``run_dir/config.yaml`` (atomically: a resume
  that is killed while rewriting it leaves the previous one)."""
  if jax.process_index() == 0:
    records.write_atomic(run_dir / "config.yaml", config_yaml)


def archive_previous(run_dir: pathlib.Path) -> None:
  """``--no-resume``: moves everything an earlier run left (checkpoints, metrics, events,
  config, bad batches, plots, samples) into ``run_dir/previous-<time>/``."""
  if jax.process_index() != 0 or not run_dir.is_dir():
    return
  present = sorted(
    p.name for p in run_dir.iterdir() if p.name != LOCK and not p.name.startswith(ARCHIVES)
  )
  if not present:
    return
  dest = run_dir / stamped(ARCHIVES.rstrip("-"))
  dest.mkdir()
  for name in present:
    shutil.move(str(run_dir / name), dest / name)
  log.warning("--no-resume: moved the previous run's %s to %s", ", ".join(present), dest)


def first_writes(run_dir: pathlib.Path, ckpt, state, write) -> None:
  """Before the first update: ``ckpt`` can take a checkpoint of ``state``, then ``write()``
  (the config, the tokenizer copy…). A failure closes ``ckpt`` and is one ``RunIOError``
  (or ``RunDirError`` for a file where the folder belongs) and leaves nothing that blocks
  the next try."""
  try:
    ckpt.check_can_save(state)
    write()
  except (RunIOError, RunDirError):
    ckpt.close()
    raise
  except OSError as e:
    ckpt.close()
    raise RunIOError(
      f"writing {e.filename or run_dir} failed ({e.strerror or e}); make room, make run_dir "
      f"writable, or choose another run_dir"
    ) from None
