"""Checkpoints with orbax: save and restore a train state and a JSON-able dict, exactly.

``<directory>/<update step>/`` holds two orbax items: ``state`` (the ``TrainState`` via
``StandardSave``) and ``run`` (a JSON dict via ``JsonSave``: the CLI's ``RunState``, or
any metadata of yours). orbax writes each
step into a temporary directory and renames it when complete, so a killed process leaves
at worst a ``*.orbax-checkpoint-tmp*`` directory, which the next start removes.

Restore takes the newest step that restores cleanly. A newer one that does not is reported
loudly and moved to ``run_dir/checkpoints.corrupt/`` (never deleted), but only once an older
one did restore; if none restores, ``CheckpointError`` — never a silent restart at step 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pathlib
import re
import shutil
from typing import Any, NamedTuple

import jax
import orbax.checkpoint as ocp

from jaxstep.core.trees import path_name
from jaxstep.errors import CheckpointError, RunIOError
from jaxstep.trainer import block_layout, integrity
from jaxstep.trainer.run_dir import stamped

log = logging.getLogger("jaxstep")
STATE, RUN, VERIFY = "state", "run", "verify"
COMMIT_MARKER = "_CHECKPOINT_METADATA"  # orbax writes it when a step is finalized


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
  step: int
  path: pathlib.Path
  problem: str | None  # None = structurally complete and readable
  size_bytes: int
  run: dict | None  # the saved RunState, if readable


def step_dirs(directory: pathlib.Path) -> list[tuple[int, pathlib.Path]]:
  """Finalized-looking step directories, newest first (tmp directories are not steps)."""
  if not directory.is_dir():
    return []
  steps = [(int(p.name), p) for p in directory.iterdir() if p.is_dir() and p.name.isdigit()]
  return sorted(steps, reverse=True)


def _layout_problem(path: pathlib.Path) -> str | None:
  """Why a step directory cannot be a complete checkpoint, or None."""
  if not (path / COMMIT_MARKER).exists():
    return f"missing commit marker {COMMIT_MARKER}"
  for item in (STATE, RUN):
    if not (path / item).is_dir():
      return f"missing item {item!r}"
  return None


def _dir_size(path: pathlib.Path) -> int:
  return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _first_line(e: Exception) -> str:
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {text[0][:200] if text else ''}"


def _write_cause(e: Exception) -> str:
  """The OS error inside an orbax/tensorstore write error (``[os_error_code='28']`` → "No
  space left on device"), else the error's first line."""
  code = re.search(r"os_error_code='(\d+)'", str(e))
  return os.strerror(int(code.group(1))) if code else _first_line(e)


def _shapes_mismatch(saved_tree, target, what: str) -> str | None:
  """First difference between saved and expected leaf names and shapes, or None."""

  def flat(tree):
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {path_name(path): tuple(leaf.shape) for path, leaf in leaves}

  saved, expected = flat(saved_tree), flat(target)
  if saved.keys() != expected.keys():
    missing = sorted(expected.keys() - saved.keys())[:3]
    extra = sorted(saved.keys() - expected.keys())[:3]
    return f"{what} names differ (missing {missing}, unexpected {extra})"
  for name, shape in expected.items():
    if saved[name] != shape:
      return f"{what} {name} has shape {saved[name]} in the checkpoint, {shape} here"
  return None


def _fields(target) -> dict | None:
  """A dataclass state (``TrainState``) as a dict of its fields; None for other pytrees."""
  if not dataclasses.is_dataclass(target):
    return None
  return {f.name: getattr(target, f.name) for f in dataclasses.fields(target)}


class Restored(NamedTuple):
  state: Any  # the state, laid out like the target it was restored into
  metadata: dict  # the JSON-able dict saved with it
  step: int


class Checkpointer:
  """Saves and restores a train state (a ``TrainState`` or any pytree of arrays) plus a
  JSON-able dict of metadata under one directory: ``<directory>/<step>/{state,run}``.

  Saves are atomic (orbax writes a temporary directory and renames it when complete) and,
  by default, asynchronous: ``save`` returns after the device→host copy. Each save records
  a checksum per array (``integrity``). Restore takes the newest step that restores cleanly
  — structure intact, checksums equal, params and optimizer state finite — into the layout
  of the target you pass, so a state saved on 8 devices restores onto 1 and vice versa.
  A failed write raises ``RunIOError``.

  Args:
    directory: where the step directories go (created if missing).
    keep: newest checkpoints kept; older ones are deleted after each save.
    async_save: write in a background thread.
    read_only: only restore (someone else's directory); never write or delete.

  Example:
    >>> with Checkpointer("ckpt", keep=2) as ckpt:
    ...   ckpt.save(int(state.step), state, {"note": "after warmup"})
    >>> restored = Checkpointer("ckpt").restore(train_step.init(params, 0))
    >>> state, metadata, step = restored  # None if the directory holds no checkpoint
  """

  def __init__(self, directory, *, keep: int = 3, async_save: bool = True, read_only: bool = False):
    self.directory = pathlib.Path(directory).resolve()
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
    self.wait()  # orbax would wait for the previous save anyway; this names it if it failed
    self._check_room(step, state)
    verify = {"checksums": integrity.checksums(state)}
    with self._reported(f"saving the checkpoint of update step {step}"):
      self.manager.save(
        step,
        args=ocp.args.Composite(
          state=ocp.args.StandardSave(state),
          run=ocp.args.JsonSave(dict(metadata or {})),
          verify=ocp.args.JsonSave(verify),
        ),
        force=True,
      )
    self.pending = step
    return True

  def _check_room(self, step: int, state) -> None:
    """Refuses to start a save that cannot fit: the arrays' bytes plus a margin for orbax's
    metadata (10 % + 1 MiB) vs the free space."""
    arrays = sum(x.nbytes for x in jax.tree.leaves(state) if hasattr(x, "nbytes"))
    need = int(arrays * 1.1) + 2**20
    existing = next(p for p in (self.directory, *self.directory.parents) if p.exists())
    free = shutil.disk_usage(existing).free  # another host may not have created it yet
    if free < need:
      raise RunIOError(
        f"{self.directory} has {free / 2**20:.1f} MiB free, the checkpoint of update step "
        f"{step} needs about {need / 2**20:.1f} MiB"
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
    leaves, carrying the shardings wanted *now*. A newer checkpoint that does not restore
    is skipped loudly and moved to ``<directory>.corrupt/`` once an older one restored
    (left in place when read-only).

    Returns:
      ``Restored(state, metadata, step)``, or None when the directory holds no checkpoint.

    Raises:
      CheckpointError: the checkpoint does not fit ``target``, or none restores.
    """
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    candidates = [(s, p) for s, p in step_dirs(self.directory) if step is None or s == step]
    if step is not None and not candidates:
      raise CheckpointError(f"no checkpoint for update step {step} in {self.directory}")
    skipped = []
    for s, path in candidates:
      restored, problem = self._try_restore(s, path, abstract)
      if restored is not None:
        self._quarantine(skipped)
        return Restored(restored[0], restored[1], s)
      log.warning(
        "CHECKPOINT SKIPPED: update step %d in %s is unusable (%s); trying an older one",
        s,
        self.directory,
        problem,
      )
      skipped.append((s, path, problem))
    if not skipped:
      return None
    details = "; ".join(f"step {s}: {p}" for s, _, p in skipped)
    raise CheckpointError(
      f"checkpoints exist in {self.directory} but none restores ({details})"
      f"; refusing to start again from step 0 — move the directory away "
      f"or pass --no-resume to start over"
    )

  def _try_restore(self, step, path, abstract):
    problem = _layout_problem(path)
    if problem:
      return None, problem
    try:
      saved = self.manager.item_metadata(step)[STATE].tree
    except Exception as e:  # noqa: BLE001 - any failure to read means unusable
      return None, f"metadata unreadable ({_first_line(e)})"
    target, abstract = abstract, block_layout.like_saved(saved, abstract)
    item = self._restorable(step, saved, abstract)
    items = {STATE: ocp.args.StandardRestore(item), RUN: ocp.args.JsonRestore()}
    if (path / VERIFY).is_dir():  # checkpoints written before checksums have none
      items[VERIFY] = ocp.args.JsonRestore()
    try:
      out = self.manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:  # noqa: BLE001
      return None, f"unreadable ({_first_line(e)})"
    state = out.state
    if isinstance(item, dict) and _fields(abstract) is not None:
      state = abstract.replace(**state)
    expected = (out.get(VERIFY) or {}).get("checksums", {})
    problem = integrity.mismatch(state, expected) or integrity.nonfinite(state)
    if problem:
      return None, problem
    if abstract is not target:
      state = block_layout.back_to(state, target)
    return (state, dict(out.run or {})), None

  def _restorable(self, step, saved, abstract):
    """What to hand orbax: the target, or (a dataclass state) the dict of those of its
    fields the checkpoint holds — a field added since, with no arrays in the target
    (``model_state=None``), keeps the target's value. Raises ``CheckpointError`` when the
    checkpoint cannot fit."""
    fields = _fields(abstract)
    if fields is None:
      mismatch = _shapes_mismatch(saved, abstract, "leaf")
    else:
      on_disk = set(saved.keys())
      absent = [k for k in fields if k not in on_disk]
      if any(jax.tree.leaves(fields[k]) for k in absent):
        mismatch = f"the checkpoint has no {absent}"
      else:
        fields = {k: v for k, v in fields.items() if k in on_disk}
        mismatch = next(
          (
            problem
            for name, what in (("params", "parameter"), ("model_state", "model state"))
            if name in fields and (problem := _shapes_mismatch(saved.get(name), fields[name], what))
          ),
          None,
        )
    if mismatch:
      raise CheckpointError(
        f"checkpoint at update step {step} does not fit the model: "
        f"{mismatch}; use the model config it was written with or a new "
        f"run_dir"
      )
    return abstract if fields is None else fields

  def _quarantine(self, skipped) -> None:
    """Moves unusable newer steps aside so new saves can take their step numbers (never in
    a directory opened read-only: someone else's run is reported on, not changed)."""
    if not skipped or self.read_only:
      return
    target = self.directory.parent / f"{self.directory.name}.corrupt"
    target.mkdir(exist_ok=True)
    for s, path, problem in skipped:
      dest = target / stamped(str(s))
      shutil.move(str(path), dest)
      log.warning("moved unusable checkpoint of update step %d (%s) to %s", s, problem, dest)
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
  """Every step directory with its size, saved RunState and what (if anything) is wrong;
  ``verify`` also reads every array onto this process's first device and checks its
  checksum and finiteness (what a restore would find)."""
  directory = pathlib.Path(directory)
  reader = Checkpointer(directory, read_only=True)
  infos = []
  for s, path in step_dirs(directory):
    problem, run = _layout_problem(path), None
    if problem is None:
      try:
        reader.manager.item_metadata(s)[STATE].tree["params"]
        run = dict(
          reader.manager.restore(s, args=ocp.args.Composite(run=ocp.args.JsonRestore())).run
        )
      except Exception as e:  # noqa: BLE001
        problem = f"unreadable ({_first_line(e)})"
    if problem is None and verify:
      problem = _verify(reader, s, path)
    infos.append(CheckpointInfo(s, path, problem, _dir_size(path), run))
  reader.close()
  return infos


def _verify(reader: Checkpointer, step: int, path: pathlib.Path) -> str | None:
  """Reads step ``step`` as saved onto one device; the checksum/finiteness problem, if any."""
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  saved = reader.manager.item_metadata(step)[STATE].tree
  target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), saved)
  items = {STATE: ocp.args.StandardRestore(target)}
  if (path / VERIFY).is_dir():
    items[VERIFY] = ocp.args.JsonRestore()
  try:
    out = reader.manager.restore(step, args=ocp.args.Composite(**items))
  except Exception as e:  # noqa: BLE001
    return f"unreadable ({_first_line(e)})"
  expected = (out.get(VERIFY) or {}).get("checksums", {})
  return integrity.mismatch(out.state, expected) or integrity.nonfinite(out.state)
