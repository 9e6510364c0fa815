"""Checkpoints with orbax and exact resume.

``run_dir/checkpoints/<update step>/`` holds two orbax items: ``state`` (the ``TrainState``
via ``StandardSave``) and ``run`` (the ``RunState`` via ``JsonSave``). orbax writes each
step into a temporary directory and renames it when complete, so a killed process leaves
at worst a ``*.orbax-checkpoint-tmp*`` directory, which the next start removes.

Restore takes the newest step that restores cleanly. A newer one that does not is reported
loudly and moved to ``run_dir/checkpoints.corrupt/`` (never deleted), but only once an older
one did restore; if none restores, ``CheckpointError`` — never a silent restart at step 0.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import shutil

import jax
import orbax.checkpoint as ocp

from jaxstep.core.trees import path_name
from jaxstep.errors import CheckpointError
from jaxstep.trainer.run_dir import stamped
from jaxstep.trainer.run_state import RunState

log = logging.getLogger("jaxstep")
STATE, RUN = "state", "run"
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


def _params_mismatch(saved_tree, abstract_params) -> str | None:
  """First difference between saved and expected parameter shapes, or None."""

  def flat(tree):
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {path_name(path): tuple(leaf.shape) for path, leaf in leaves}

  saved, expected = flat(saved_tree), flat(abstract_params)
  if saved.keys() != expected.keys():
    missing = sorted(expected.keys() - saved.keys())[:3]
    extra = sorted(saved.keys() - expected.keys())[:3]
    return f"parameter names differ (missing {missing}, unexpected {extra})"
  for name, shape in expected.items():
    if saved[name] != shape:
      return f"parameter {name} has shape {saved[name]} in the checkpoint, {shape} in the model"
  return None


class Checkpointer:
  """Saves and restores ``(TrainState, RunState)`` under one directory.

  Args:
    directory: ``run_dir/checkpoints``.
    every: save every this many update steps (0 = only forced saves).
    keep: newest checkpoints kept.
    async_save: write in a background thread (the loop continues after the device→host copy).
    read_only: for restoring from someone else's directory (``--resume-from``).
  """

  def __init__(
    self,
    directory,
    *,
    every: int = 0,
    keep: int = 3,
    async_save: bool = True,
    read_only: bool = False,
  ):
    self.directory = pathlib.Path(directory).resolve()
    self.every = every
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
      item_handlers={STATE: ocp.StandardCheckpointHandler(), RUN: ocp.JsonCheckpointHandler()},
    )

  def save(self, state, run_state: RunState, *, force: bool = False) -> bool:
    """Saves at ``run_state.step`` if due (or forced) and not saved yet; returns whether."""
    step = run_state.step
    if not force and (not self.every or step % self.every):
      return False
    if step in self.manager.all_steps():
      return False
    self.manager.save(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), run=ocp.args.JsonSave(run_state.to_json())
      ),
      force=True,
    )
    return True

  def has_checkpoints(self) -> bool:
    return bool(step_dirs(self.directory))

  def restore(self, abstract_state, step: int | None = None):
    """Restores the newest usable checkpoint (or exactly ``step``) into ``abstract_state``.

    ``abstract_state`` is a pytree of ``jax.ShapeDtypeStruct`` carrying the *current*
    shardings, so a checkpoint written on another device layout is resharded on read.

    Returns:
      ``(state, run_dict, step)``, or None when the directory holds no checkpoint at all.

    Raises:
      CheckpointError: the parameters do not match the model, or no checkpoint restores.
    """
    candidates = [(s, p) for s, p in step_dirs(self.directory) if step is None or s == step]
    if step is not None and not candidates:
      raise CheckpointError(f"no checkpoint for update step {step} in {self.directory}")
    skipped = []
    for s, path in candidates:
      restored, problem = self._try_restore(s, path, abstract_state)
      if restored is not None:
        self._quarantine(skipped)
        return restored.state, dict(restored.run), s
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

  def _try_restore(self, step, path, abstract_state):
    problem = _layout_problem(path)
    if problem:
      return None, problem
    try:
      saved_params = self.manager.item_metadata(step)[STATE].tree["params"]
    except Exception as e:  # noqa: BLE001 - any failure to read means unusable
      return None, f"metadata unreadable ({_first_line(e)})"
    mismatch = _params_mismatch(saved_params, abstract_state.params)
    if mismatch:
      raise CheckpointError(
        f"checkpoint at update step {step} does not fit the model: "
        f"{mismatch}; use the model config it was written with or a new "
        f"run_dir"
      )
    try:
      return self.manager.restore(
        step,
        args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state), run=ocp.args.JsonRestore()
        ),
      ), None
    except Exception as e:  # noqa: BLE001
      return None, f"unreadable ({_first_line(e)})"

  def _quarantine(self, skipped) -> None:
    """Moves unusable newer steps aside so new saves can take their step numbers."""
    if not skipped:
      return
    target = self.directory.parent / f"{self.directory.name}.corrupt"
    target.mkdir(exist_ok=True)
    for s, path, problem in skipped:
      dest = target / stamped(str(s))
      shutil.move(str(path), dest)
      log.warning("moved unusable checkpoint of update step %d (%s) to %s", s, problem, dest)
    self.manager.reload()

  def wait(self) -> None:
    """Blocks until any background save is on disk."""
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()


def list_checkpoints(directory) -> list[CheckpointInfo]:
  """Every step directory with its size, saved RunState and what (if anything) is wrong."""
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
    infos.append(CheckpointInfo(s, path, problem, _dir_size(path), run))
  reader.close()
  return infos
