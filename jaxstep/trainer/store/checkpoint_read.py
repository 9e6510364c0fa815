"""Reading checkpoints: the one routine that reads a step folder and verifies it, and the
newest-first choice of a usable step. ``Checkpointer.restore``, ``jaxstep checkpoints``,
``load_run`` (generate, evaluate) and the tests all read through here.

A step folder ``<directory>/<update step>/`` is usable when every item is there (``state``,
``run``, ``verify`` and orbax's commit marker), the arrays read back fit the target, the
checksums recorded in ``verify`` match both the arrays (``integrity.checksums``) and the
run-state JSON (``integrity.json_checksum``), and the params and optimizer state are finite.
A step that is not usable comes back with the reason, never with its contents. A usable
step comes back in the target's layout: its blocks stacked or not (``block_layout``), a
GPT written by an older jaxstep with its q/k/v columns permuted (``param_layout``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxstep.core.trees import path_name
from jaxstep.errors import CheckpointError, first_line
from jaxstep.trainer.store import block_layout, integrity, param_layout
from jaxstep.trainer.store.orbax_echoes import drop_closed_loop_echoes

log = logging.getLogger("jaxstep")
STATE, RUN, VERIFY = "state", "run", "verify"
COMMIT_MARKER = "_CHECKPOINT_METADATA"  # orbax writes it when a step is finalized
TMP_MARKER = ".orbax-checkpoint-tmp"  # orbax's name for a step still being written
# The state fields the model config shapes, as a misfit names them.
MODEL_FIELDS = {"params": "parameter", "model_state": "model state"}


@dataclasses.dataclass(frozen=True)
class StepRead:
  """One step folder read back. ``problem`` is None when every item verified; else it says
  why the step is not usable and ``state`` is None. ``misfit``: the step is intact but does
  not fit the target (another model, or a state leaf another config sized), which an older
  step of the same run would not fix."""

  step: int
  path: pathlib.Path
  state: Any = None  # in the target's layout and placement
  run: dict | None = None  # the run-state JSON, when it could be read
  problem: str | None = None
  misfit: bool = False


def step_dirs(directory: pathlib.Path) -> list[tuple[int, pathlib.Path]]:
  """Finalized-looking step directories, newest first (tmp directories are not steps)."""
  if not directory.is_dir():
    return []
  steps = [(int(p.name), p) for p in directory.iterdir() if p.is_dir() and p.name.isdigit()]
  return sorted(steps, reverse=True)


def in_progress_dirs(directory: pathlib.Path) -> list[tuple[int, pathlib.Path]]:
  """Steps orbax is still writing (``<step>.orbax-checkpoint-tmp…``), newest first."""
  if not directory.is_dir():
    return []
  found = []
  for p in directory.iterdir():
    head, sep, _ = p.name.partition(TMP_MARKER)
    if sep and head.isdigit() and p.is_dir():
      found.append((int(head), p))
  return sorted(found, reverse=True)


def layout_problem(path: pathlib.Path) -> str | None:
  """Why a step directory cannot be a complete, verifiable checkpoint, or None."""
  if not (path / COMMIT_MARKER).exists():
    return f"missing commit marker {COMMIT_MARKER}"
  for item in (STATE, RUN):
    if not (path / item).is_dir():
      return f"missing item {item!r}"
  if not (path / VERIFY).is_dir():
    return f"missing item {VERIFY!r}: its checksums are gone, so it cannot be verified"
  return None


def shapes_mismatch(saved_tree, target, what: str) -> str | None:
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
      label = f"{what} {name}" if name else what
      return f"{label} has shape {saved[name]} in the checkpoint, {shape} here"
  return None


def saved_shapes(path) -> dict[str, tuple] | None:
  """Every array of a step folder's state item by path name (``params/…``,
  ``recent_losses``) with its shape, from orbax's metadata alone (no array is read); None
  when the metadata does not read."""
  try:
    meta = _state_reader(ocp.StandardCheckpointHandler).metadata(pathlib.Path(path).resolve())
    tree = meta.item_metadata[STATE].tree
  except Exception:  # noqa: BLE001 - unreadable metadata: nothing to compare
    return None
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {path_name(p): tuple(leaf.shape) for p, leaf in leaves}


def _fields(target) -> dict | None:
  """A dataclass state (``TrainState``) as a dict of its fields; None for other pytrees."""
  if not dataclasses.is_dataclass(target):
    return None
  return {f.name: getattr(target, f.name) for f in dataclasses.fields(target)}


def _json(path: pathlib.Path) -> dict:
  """A JSON item of a step, read by orbax's handler itself (no step-metadata lookup, so no
  warning about a metadata file that item folders never have)."""
  return dict(ocp.JsonCheckpointHandler().restore(path, args=ocp.args.JsonRestore()) or {})


@functools.cache
def _state_reader(handler: type = ocp.PyTreeCheckpointHandler) -> ocp.Checkpointer:
  """Reads the state item of a step folder with the step's own metadata (no warning about
  a missing metadata file): its tree metadata with the handler that wrote it
  (``StandardCheckpointHandler``), its arrays, possibly only some, with the pytree handler.
  One each for the process, never closed: closing one while tensorstore still finishes
  the reads of a damaged step makes asyncio print "Event loop is closed"."""
  json = ocp.JsonCheckpointHandler
  return ocp.Checkpointer(
    ocp.CompositeCheckpointHandler(state=handler(), run=json(), verify=json())
  )


def _as_saved(saved_tree):
  """The saved tree's arrays as ``ShapeDtypeStruct``s on this process's first device."""
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), saved_tree)


def _request(saved, abstract, params_only: bool):
  """What to ask orbax for (the target, or a dataclass state as the dict of its fields),
  or the reason the checkpoint does not fit the target."""
  if params_only:
    return {"params": abstract}, shapes_mismatch(saved.get("params", {}), abstract, "parameter")
  fields = _fields(abstract)
  if fields is None:
    return abstract, shapes_mismatch(saved, abstract, "leaf")
  absent = [k for k in fields if k not in saved]
  if absent:
    return None, f"the checkpoint has no {absent}"
  for name, value in fields.items():  # every field: orbax would fail on any, less clearly
    what = MODEL_FIELDS.get(name, f"the train state's {name}")
    if problem := shapes_mismatch(saved.get(name), value, what):
      return None, problem
  return fields, None


def read_step(
  path, target=None, *, params_only: bool = False, arrays: bool = True, model: dict | None = None
) -> StepRead:
  """Reads the step folder ``path`` into ``target``'s layout and verifies every item.

  Args:
    path: ``<directory>/<update step>``.
    target: the state wanted (concrete arrays or ``ShapeDtypeStruct`` leaves, carrying the
      shardings wanted now; only the params when ``params_only``); None = every array as
      saved, onto this process's first device, as a dict.
    params_only: read only ``params`` (the optimizer state stays on disk).
    arrays: False checks the items, the metadata and the run-state JSON only, reading no
      array (``state`` stays None).
    model: the model's config section, for a run state that names none
      (``param_layout.upgrade``).

  Returns:
    A ``StepRead``: the state and run-state JSON, or the reason the step is not usable.
  """
  drop_closed_loop_echoes()  # a damaged step's failed reads echo from threads
  path = pathlib.Path(path).resolve()  # orbax reads relative paths as missing
  step = int(path.name)
  if problem := layout_problem(path):
    return StepRead(step, path, problem=problem)
  return _read(_state_reader(), path, step, target, params_only, arrays, model)


def _read(reader, path, step, target, params_only, arrays, model=None) -> StepRead:
  """``read_step`` past the layout check: metadata, the JSON items and their checksum, then
  the arrays, their checksums and finiteness."""
  try:
    saved = _state_reader(ocp.StandardCheckpointHandler).metadata(path)
    saved = saved.item_metadata[STATE].tree
    run, verify = _json(path / RUN), _json(path / VERIFY)
  except Exception as e:  # noqa: BLE001 - any failure to read means unusable
    return StepRead(step, path, problem=f"metadata unreadable ({first_line(e)})")
  recorded, expected = verify.get("run"), verify.get("checksums")
  if recorded is None or expected is None:
    what = "the run state" if recorded is None else "the arrays"
    problem = f"no checksum recorded for {what}: it cannot be verified"
    return StepRead(step, path, run=run, problem=problem)
  if recorded != integrity.json_checksum(run):
    problem = "the run state changed since it was saved (checksum mismatch)"
    return StepRead(step, path, run=run, problem=problem)
  if not arrays:
    return StepRead(step, path, run=run)
  if target is None:
    target = _as_saved(saved.get("params", {}) if params_only else saved)
  wanted = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
  abstract = block_layout.like_saved(saved.get("params", {}) if params_only else saved, wanted)
  request, misfit = _request(saved, abstract, params_only)
  if misfit:
    return StepRead(step, path, run=run, problem=misfit, misfit=True)
  try:
    restore_args = ocp.checkpoint_utils.construct_restore_args(request)
    state_args = ocp.args.PyTreeRestore(
      item=request, restore_args=restore_args, partial_restore=params_only
    )
    out = reader.restore(path, args=ocp.args.Composite(state=state_args)).state
  except Exception as e:  # noqa: BLE001
    return StepRead(step, path, run=run, problem=f"unreadable ({first_line(e)})")
  state = out["params"] if params_only else out
  if params_only:
    expected = {k[len("params/") :]: v for k, v in expected.items() if k.startswith("params/")}
  checked = {"params": state} if params_only else state
  problem = integrity.mismatch(state, expected) or integrity.nonfinite(checked)
  if problem:
    return StepRead(step, path, run=run, problem=problem)
  state = param_layout.upgrade(state, run, model)
  if _fields(abstract) is not None and not params_only:
    state = abstract.replace(**state)
  if abstract is not wanted:
    state = block_layout.back_to(state, wanted)
  return StepRead(step, path, state=state, run=run)


def newest(
  directory,
  target=None,
  *,
  step: int | None = None,
  params_only: bool = False,
  model: dict | None = None,
) -> tuple[StepRead | None, list[StepRead]]:
  """The newest usable step of ``directory`` (or exactly ``step``), read by ``read_step``.

  Every newer step that is not usable is logged as ``CHECKPOINT SKIPPED`` before an older
  one is tried. Nothing is moved or written here: the caller decides (``Checkpointer``
  moves the skipped steps of its own run aside; ``load_run`` and ``--resume-from`` sources
  leave them).

  Returns:
    ``(read, skipped)``: the usable step (None when there is none) and the unusable newer
    ones, newest first.

  Raises:
    CheckpointError: a step is intact but does not fit ``target`` (another model, or a
      state leaf of another shape).
  """
  directory = pathlib.Path(directory).resolve()
  skipped = []
  for s, path in step_dirs(directory):
    if step is not None and s != step:
      continue
    read = read_step(path, target, params_only=params_only, model=model)
    if read.misfit:
      of_model = read.problem.startswith(tuple(MODEL_FIELDS.values()))
      raise CheckpointError(
        f"checkpoint at update step {s} does not fit the {'model' if of_model else 'train state'}"
        f": {read.problem}; use the {'model ' if of_model else ''}config it was written with "
        f"or a new run_dir"
      )
    if read.problem is None:
      return read, skipped
    log.warning(
      "CHECKPOINT SKIPPED: update step %d is unusable (%s); trying an older one in %s",
      s,
      read.problem,
      directory,
    )
    skipped.append(read)
  return None, skipped
