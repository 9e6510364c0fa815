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

from jaxstep.errors import WRITE_REFUSED, RunDirError, RunIOError
from jaxstep.models import export_folder
from jaxstep.trainer.store import records

log = logging.getLogger("jaxstep")
LOCK = ".lock"  # holds the pid of the run that owns the directory
ARCHIVES = "previous-"  # folders that --no-resume made


def stamped(name: str) -> str:
  """``name`` with the local time appended: ``previous-20261130-204253``."""
  return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


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
    RunDirError: it cannot be created otherwise (a file in the path), another run holds
      it, or it is a model folder.
  """
  run_dir = pathlib.Path(run_dir)
  refuse_a_model_folder(run_dir)
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
    try:
      try:  # the holder's pid, for the message of a run refused while this one holds it
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
      except OSError as e:  # a full disk has no block for even these few bytes
        raise _unusable(run_dir, e) from None
      yield run_dir
    finally:
      with contextlib.suppress(OSError):  # never hides the error on its way up
        if created and run_dir.is_dir() and _holds_nothing(run_dir):
          shutil.rmtree(run_dir, ignore_errors=True)
  finally:
    os.close(fd)


def refuse_a_model_folder(run_dir: pathlib.Path) -> None:
  """``RunDirError`` for a ``run_dir`` that is a model folder (``config.json`` beside
  safetensors weights, or an export's marker): a run would write its checkpoints, logs and
  ``config.yaml`` among the model's files, and a resume would read them as its own."""
  if not (run_dir / "config.json").is_file():
    return
  weights = next(run_dir.glob("*.safetensors"), None) or next(run_dir.glob("*.bin"), None)
  if weights is not None or (run_dir / export_folder.MARKER).is_file():
    raise RunDirError(
      f"run_dir {run_dir} is a model folder (config.json, {(weights or run_dir).name}): a "
      f"run would write among the model's files; choose another run_dir (a model to start "
      f"from goes in model.init_from)"
    )


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


SHARED_CHECK = ".shared-check"  # the token file check_shared writes and removes
SHARED_WAIT_S = 10.0  # how long a host waits to see it (a network filesystem may lag)


def check_shared(run_dir: str | pathlib.Path) -> None:
  """Multi-process jobs: ``RunDirError`` on every process unless all see the same run_dir.

  Process 0 writes a random token to ``run_dir/.shared-check``; every process reads it
  back (retrying for ``SHARED_WAIT_S``), and all agree through two collectives, so every
  process stops with the same message naming the hosts that do not see it. Orbax writes a
  checkpoint from all processes together: on unshared storage each host would hold only
  its own shards, and no host a checkpoint that restores. The token is removed, and a
  run_dir this call created is removed again if empty: nothing else is written.
  """
  if jax.process_count() <= 1:
    return
  import numpy as np
  from jax.experimental import multihost_utils

  run_dir, token = pathlib.Path(run_dir), os.urandom(16).hex()
  path, created, wrote, failure = run_dir / SHARED_CHECK, not run_dir.exists(), b"", None
  if jax.process_index() == 0:
    try:
      run_dir.mkdir(parents=True, exist_ok=True)
      path.write_text(token)
      wrote = token.encode()
    except OSError as e:
      failure = _unusable(run_dir, e)
  # process 0's token once it is on disk (empty if it could not write), as int32 numbers
  sent = multihost_utils.broadcast_one_to_all(
    np.frombuffer(wrote.ljust(32), np.uint8).astype(np.int32)
  )
  token = np.asarray(sent).astype(np.uint8).tobytes().decode().strip()
  seen, deadline = False, time.monotonic() + SHARED_WAIT_S
  while token:
    with contextlib.suppress(OSError):
      os.listdir(run_dir)  # refreshes a network filesystem's cached view of the folder
    with contextlib.suppress(OSError):
      seen = path.read_text() == token
    if seen or time.monotonic() > deadline:
      break
    time.sleep(0.2)
  host = (b"1" if seen else b"0") + os.uname().nodename.encode()[:63].ljust(63)
  row = np.frombuffer(host, np.uint8).astype(np.int32)
  hosts = np.asarray(multihost_utils.process_allgather(row)).astype(np.uint8)
  names = [h[1:].tobytes().decode(errors="replace").strip() for h in hosts]
  if jax.process_index() == 0:
    with contextlib.suppress(OSError):
      path.unlink(missing_ok=True)
      if created:
        run_dir.rmdir()  # only if empty; locked() creates it again
    if not token:
      raise failure
  blind = [f"process {i} ({names[i]})" for i, h in enumerate(hosts) if h[0] != ord("1")]
  if not token:
    raise RunDirError(f"process 0 could not write to run_dir {run_dir}")
  if blind:
    raise RunDirError(
      f"run_dir {run_dir} is not on storage every host shares: {', '.join(blind)} cannot "
      f"read what process 0 ({names[0]}) wrote there in {SHARED_WAIT_S:.0f} s; put run_dir "
      f"on a filesystem every host mounts at the same path"
    )
