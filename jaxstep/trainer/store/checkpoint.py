"""Checkpoints with orbax: save and restore a train state and a JSON-able dict, exactly.

``<directory>/<update step>/`` holds three orbax items: ``state`` (the ``TrainState`` via
``StandardSave``), ``run`` (a JSON dict via ``JsonSave``: the CLI's ``RunState``, or any
metadata of yours) and ``verify`` (the checksums of both). orbax writes each step into a
temporary directory and renames it when complete, so a killed process leaves at worst a
``*.orbax-checkpoint-tmp*`` directory, which the next start removes.

A run that reloads its frozen parameters from elsewhere (a LoRA run's base model, read
from ``model.init_from`` at every start) stores only the parameters that train
(``stored``): the frozen leaves are left out of every save and filled back in from the
target at restore; so is a distillation teacher in the state's ``model_state``.

Reading is ``checkpoint_read``'s: restore takes the newest step that verifies. A newer one
that does not is reported loudly and moved to ``run_dir/checkpoints.corrupt/`` (never
deleted), but only once an older one did restore; if none restores, ``CheckpointError`` —
never a silent restart at step 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pathlib
import re
import shutil
import tempfile
from typing import Any, NamedTuple

import jax
import orbax.checkpoint as ocp

from jaxstep.core import freeze
from jaxstep.core.distill import TEACHER
from jaxstep.errors import CheckpointError, RunDirError, RunIOError, first_line
from jaxstep.trainer.store import checkpoint_read, integrity
from jaxstep.trainer.store.checkpoint_read import RUN, STATE, VERIFY, step_dirs
from jaxstep.trainer.store.orbax_echoes import drop_closed_loop_echoes
from jaxstep.trainer.store.run_dir import stamped

log = logging.getLogger("jaxstep")


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
  step: int
  path: pathlib.Path
  problem: str | None  # None = verified; else why it is not usable
  size_bytes: int
  run: dict | None  # the saved RunState, if readable
  in_progress: bool = False  # orbax is still writing it (a tmp directory)


def _dir_size(path: pathlib.Path) -> int:
  return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _write_cause(e: Exception) -> str:
  """The OS error inside an orbax/tensorstore write error (``[os_error_code='28']`` → "No
  space left on device"), else the error's first line."""
  code = re.search(r"os_error_code='(\d+)'", str(e))
  return os.strerror(int(code.group(1))) if code else first_line(e)


class Restored(NamedTuple):
  state: Any  # the state, laid out like the target it was restored into
  metadata: dict  # the JSON-able dict saved with it
  step: int


class Checkpointer:
  """Saves and restores a train state (a ``TrainState`` or any pytree of arrays) plus a
  JSON-able dict of metadata under one directory: ``<directory>/<step>/{state,run,verify}``.

  Saves are atomic (orbax writes a temporary directory and renames it when complete) and,
  by default, asynchronous: ``save`` returns after the device→host copy. Each save records
  a checksum per array and one of the metadata (``integrity``). Restore takes the newest
  step that verifies — every item there, checksums equal, params and optimizer state
  finite — into the layout of the target you pass, so a state saved on 8 devices restores
  onto 1 and vice versa. A failed write raises ``RunIOError``.

  Args:
    directory: where the step directories go (created if missing).
    keep: newest checkpoints kept; older ones are deleted after each save.
    async_save: write in a background thread.
    read_only: only restore (someone else's directory); never write or delete.
    stored: ``(name, leaf) -> bool`` on the params of a ``TrainState``: only those leaves
      are saved; at restore the others come from the target (None: every leaf).
    model: the bundled model's config section the state holds, for a checkpoint whose
      metadata names none (``param_layout``: an older one is converted as it is read).

  Example:
    >>> with Checkpointer("ckpt", keep=2) as ckpt:
    ...   ckpt.save(int(state.step), state, {"note": "after warmup"})
    >>> restored = Checkpointer("ckpt").restore(train_step.init(params, 0))
    >>> state, metadata, step = restored  # None if the directory holds no checkpoint
  """

  def __init__(
    self,
    directory,
    *,
    keep: int = 3,
    async_save: bool = True,
    read_only: bool = False,
    stored: freeze.Trainable | None = None,
    model: dict | None = None,
  ):
    drop_closed_loop_echoes()  # a failed background write echoes from threads
    self.directory = pathlib.Path(directory).resolve()
    self.stored, self.model = stored, model
    self.read_only = read_only
    self.pending: int | None = None  # the step of a background save not yet waited for
    if read_only:
      options = ocp.CheckpointManagerOptions(
        read_only=True, create=False, save_interval_steps=0, max_to_keep=None
      )
    else:
      options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, cleanup_tmp_directories=True, enable_async_checkpointing=async_save
      )
    self.manager = ocp.CheckpointManager(
      self.directory,
      options=options,
      item_handlers={
        STATE: ocp.StandardCheckpointHandler(),
        RUN: ocp.JsonCheckpointHandler(),
        VERIFY: ocp.JsonCheckpointHandler(),
      },
    )

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.wait()
    self.close()

  def save(self, step: int, state, metadata: dict | None = None) -> bool:
    """Saves ``state`` (and ``metadata``) as ``step`` unless that step is saved already;
    returns whether it saved. Asynchronous by default: ``wait()`` blocks until on disk.

    Raises:
      RunIOError: too little free space for the state's bytes, or this save or an earlier
        background one failed (the step is then not a checkpoint; older ones are intact).
    """
    step = int(step)
    if step in self.manager.all_steps():
      return False
    state = self._stored_part(state)
    self.wait()  # orbax would wait for the previous save anyway; this names it if it failed
    self._check_room(f"the checkpoint of update step {step}", state)
    metadata = dict(metadata or {})
    verify = {"checksums": integrity.checksums(state), "run": integrity.json_checksum(metadata)}
    with self._reported(f"saving the checkpoint of update step {step}"):
      self.manager.save(
        step,
        args=ocp.args.Composite(
          state=ocp.args.StandardSave(state),
          run=ocp.args.JsonSave(metadata),
          verify=ocp.args.JsonSave(verify),
        ),
        force=True,
      )
    self.pending = step
    return True

  def check_can_save(self, state) -> None:
    """Before a run's first update: the directory is a folder this process can write, with
    room for one checkpoint of ``state``, so a run never trains for hours to learn that it
    cannot save (and never leaves a history without a checkpoint behind).

    Raises:
      RunDirError: the path is a file. RunIOError: it cannot be created or written (a
        read-only or full disk, no permission), or has too little free space.
    """
    if self.directory.exists() and not self.directory.is_dir():
      raise RunDirError(
        f"{self.directory} is a file, not a folder: checkpoints are written there; move it "
        f"away or choose another run_dir"
      )
    try:
      self.directory.mkdir(parents=True, exist_ok=True)
      with tempfile.TemporaryFile(dir=self.directory):
        pass
    except OSError as e:
      raise RunIOError(
        f"{self.directory} cannot be written ({e.strerror or e}); make room, make it "
        f"writable, or choose another run_dir"
      ) from None
    self._check_room("a checkpoint", self._stored_part(state))

  def _stored_part(self, state):
    """``state`` with the params leaves that are not stored set to None, and without a
    distillation teacher (read again at every start)."""
    frozen = getattr(state, "model_state", None)
    if isinstance(frozen, dict) and TEACHER in frozen:  # saved as a run without one saves
      rest = {k: v for k, v in frozen.items() if k != TEACHER}
      state = state.replace(model_state=rest or None)
    if self.stored is None:
      return state
    return state.replace(params=freeze.partition(state.params, self.stored)[0])

  def _check_room(self, what: str, state) -> None:
    """Refuses to start a save that cannot fit: the arrays' bytes plus a margin for orbax's
    metadata (10 % + 1 MiB) vs the free space."""
    arrays = sum(x.nbytes for x in jax.tree.leaves(state) if hasattr(x, "nbytes"))
    need = int(arrays * 1.1) + 2**20
    existing = next(p for p in (self.directory, *self.directory.parents) if p.exists())
    free = shutil.disk_usage(existing).free  # another host may not have created it yet
    if free < need:
      raise RunIOError(
        f"{self.directory} has {free / 2**20:.1f} MiB free, {what} needs about "
        f"{need / 2**20:.1f} MiB"
      )

  @contextlib.contextmanager
  def _reported(self, what: str):
    """orbax's errors (raised here, or from a background save) as one ``RunIOError``."""
    try:
      yield
    except Exception as e:  # noqa: BLE001 - any write failure means the same to the caller
      raise RunIOError(f"{what} in {self.directory} failed ({_write_cause(e)})") from e

  def check(self) -> None:
    """Raises ``RunIOError`` if a background save has failed (cheap; no wait)."""
    with self._reported(self._background()):
      self.manager.check_for_errors()

  def steps(self) -> list[int]:
    """Saved steps, oldest first."""
    return sorted(self.manager.all_steps())

  def has_checkpoints(self) -> bool:
    return bool(step_dirs(self.directory))

  def restore(self, target, step: int | None = None) -> Restored | None:
    """Restores the newest usable checkpoint (or exactly ``step``) into ``target``'s layout.

    ``target`` is a state like the saved one: concrete arrays or ``jax.ShapeDtypeStruct``
    leaves, carrying the shardings wanted *now*. A newer checkpoint that does not verify
    (``checkpoint_read.read_step``) is skipped loudly and moved to ``<directory>.corrupt/``
    once an older one restored (left in place when read-only).

    Returns:
      ``Restored(state, metadata, step)``, or None when the directory holds no checkpoint.

    Raises:
      CheckpointError: the checkpoint does not fit ``target``, or none restores.
    """
    if step is not None and not any(s == step for s, _ in step_dirs(self.directory)):
      raise CheckpointError(f"no checkpoint for update step {step} in {self.directory}")
    wanted = self._stored_part(target)
    read, skipped = checkpoint_read.newest(self.directory, wanted, step=step, model=self.model)
    if read is not None:
      self._quarantine(skipped)
      state = read.state
      if self.stored is not None:  # the frozen leaves: the target's own
        frozen = freeze.partition(target.params, self.stored)[1]
        state = state.replace(params=freeze.combine(state.params, frozen))
      if isinstance(target.model_state, dict) and TEACHER in target.model_state:
        teacher = target.model_state[TEACHER]
        state = state.replace(model_state={**(state.model_state or {}), TEACHER: teacher})
      return Restored(state, read.run, read.step)
    if not skipped:
      return None
    details = "; ".join(f"step {r.step}: {r.problem}" for r in skipped)
    raise CheckpointError(
      f"checkpoints exist in {self.directory} but none restores ({details})"
      f"; refusing to start again from step 0 — move the directory away "
      f"or pass --no-resume to start over"
    )

  def _quarantine(self, skipped) -> None:
    """Moves unusable newer steps aside so new saves can take their step numbers (never in
    a directory opened read-only: someone else's run is reported on, not changed)."""
    if not skipped or self.read_only:
      return
    target = self.directory.parent / f"{self.directory.name}.corrupt"
    target.mkdir(exist_ok=True)
    for read in skipped:
      dest = target / stamped(str(read.step))
      shutil.move(str(read.path), dest)
      log.warning(
        "moved unusable checkpoint of update step %d (%s) to %s", read.step, read.problem, dest
      )
    self.manager.reload()

  def wait(self) -> None:
    """Blocks until any background save is on disk (``RunIOError`` if it failed)."""
    with self._reported(self._background()):
      self.manager.wait_until_finished()
    self.pending = None

  def _background(self) -> str:
    step = "" if self.pending is None else f" of update step {self.pending}"
    return f"writing the checkpoint{step}"

  def close(self) -> None:
    self.manager.close()


def list_checkpoints(directory, verify: bool = False) -> list[CheckpointInfo]:
  """Every step directory, newest first, with its size, saved RunState and what (if
  anything) is wrong, plus the steps orbax is still writing (``in_progress``). Every item
  is checked (``checkpoint_read.read_step``); ``verify`` also reads every array onto this
  process's first device and checks its checksum and finiteness (what a restore would
  find)."""
  directory = pathlib.Path(directory).resolve()
  infos = [
    CheckpointInfo(s, path, None, _dir_size(path), None, in_progress=True)
    for s, path in checkpoint_read.in_progress_dirs(directory)
  ]
  for s, path in step_dirs(directory):
    read = checkpoint_read.read_step(path, arrays=verify)
    infos.append(CheckpointInfo(s, path, read.problem, _dir_size(path), read.run))
  return sorted(infos, key=lambda info: info.step, reverse=True)
