"""Where a run starts, for both clients: fresh, from its own newest checkpoint, or from
another run's (``--resume-from``). ``start`` is the one path; what differs between
``jaxstep train`` and ``jaxstep.Trainer`` comes in as arguments.

A checkpoint resumes only into the run it came from. Both clients refuse another seed,
another global batch size and (with a jaxstep schedule) another schedule length in
``refuse_a_different_run``; ``jaxstep train`` also reconciles the saved ``RunState`` with
its config (``reconcile``): the model, the base weights' fingerprint and the dataset
fingerprint must match, ``grad_accum_steps`` may change while G stays (the update is the
same by construction), and a vocabulary that changed together with the data (re-prepared
with another tokenizer) is reported as the data's change, not the model's, since
``model.vocab_size`` follows it.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
from collections.abc import Callable

from jaxstep.errors import CheckpointError
from jaxstep.models import hf_weights
from jaxstep.trainer.store import checkpoint_read
from jaxstep.trainer.store.checkpoint import Checkpointer, Restored, list_checkpoints, step_dirs
from jaxstep.trainer.store.records import read_records
from jaxstep.trainer.store.run_dir import archive_previous
from jaxstep.trainer.store.run_state import (
  RunState,
  optimizer_change,
  saved_optimizer,
  teacher_change,
)

log = logging.getLogger("jaxstep")


# Model keys that change no array and no computation a checkpoint depends on.
HARMLESS_MODEL_KEYS = ("dropout",)
# Model keys that choose kernels or memory layout only: the same parameters and the same
# math (a different block layout is converted at restore), so a change is simply taken.
KERNEL_MODEL_KEYS = ("attention", "remat", "scan_layers", "init_from", "loss_chunk")
# init_from: the folder the first params came from; a resume reads them from the checkpoint
# instead; loss_chunk: the same loss summed in chunks (checkpoints older than it lack it)
# Train-state leaves outside the model whose shape a config key sets: the leaf → the key and
# its value read back from the leaf's shape, so a checkpoint that does not fit names the key.
STATE_SHAPE_KEYS = {"recent_losses": ("train.spike_window", lambda shape: shape[0])}


def _with_defaults(model: dict) -> dict:
  """A checkpoint's model section with the keys it predates at their defaults (a key is
  added with the default that computes what the model did before it), ``lora``'s too."""
  from jaxstep import models
  from jaxstep.trainer.config import loading as config_lib

  cls = models.FAMILIES.get(model["family"])
  if cls is None:
    return model
  defaults = config_lib.to_dict(cls())
  out = {**defaults, **model}
  if isinstance(out.get("lora"), dict):
    out["lora"] = {**defaults["lora"], **out["lora"]}
  return out


def _model_changes(saved: dict, current: RunState) -> dict:
  """``{key: (old, new)}`` of the model keys that differ from the checkpoint's, kernel
  choices left out."""
  before = _with_defaults({"family": "gpt", **saved["model"]})  # older than family: GPTs
  return {
    k: (old, v)
    for k, v in current.model.items()
    if k not in KERNEL_MODEL_KEYS and (old := before.get(k)) != v
  }


def _check_same_run(
  saved: dict, current: RunState, allow_schedule_change: bool, step: int, stable_end
) -> None:
  """Refuses a resume whose model, seed or lr schedule differs from the checkpoint's; states
  a harmless model change in one line and takes a kernel choice as it is."""
  changed = _model_changes(saved, current)
  for key in HARMLESS_MODEL_KEYS:
    if key in changed:
      old, new = changed.pop(key)
      log.warning("RESUME WITH A CHANGE: model.%s %s → %s since the checkpoint", key, old, new)
  if changed:
    diff = ", ".join(f"model.{k} {old} → {new}" for k, (old, new) in changed.items())
    raise CheckpointError(
      f"the model changed since the checkpoint ({diff}); set it back or start a new run_dir"
    )
  old, new = saved.get("base") or {}, current.base
  if old and new:  # the read's fingerprint against the recorded (an older run's: sampled) one
    same, now = hf_weights.matches(old.get("fingerprint"), new["path"], new["fingerprint"])
    if not same:
      raise CheckpointError(
        f"the base weights in {new['path']} changed since the checkpoint (fingerprint "
        f"{old.get('fingerprint')} → {now}); its checkpoints hold the trained parameters "
        f"only and need the base they were trained on: put it back or start a new run_dir"
      )
  changed = teacher_change(saved.get("teacher") or {}, current.teacher)
  if changed:
    raise CheckpointError(changed)
  refuse_a_different_run(
    saved, dataclasses.asdict(current), allow_schedule_change=allow_schedule_change,
    way_out=", or start a new run_dir", step=step, stable_end=stable_end,
  )  # fmt: skip


_WHY_G = "G defines what a data position and an update step mean"


def refuse_a_different_run(
  saved: dict,
  current: dict,
  *,
  allow_schedule_change: bool,
  way_out: str,
  step: int | None = None,
  stable_end=None,
) -> None:
  """The refusals both clients share: a checkpoint resumes only into the run it came from.

  ``saved`` and ``current`` hold ``seed`` (it sets the data order and dropout),
  ``global_batch_size`` (G: it defines what a data position and an update step mean) and
  ``schedule_steps`` (the update steps the lr schedule spans; a ``current`` value of None
  means the run's optimizer has no jaxstep schedule to compare). ``way_out`` ends each
  message with the client's other choice (", or start a new run_dir").

  A warmup-stable-decay schedule (``lr_schedule`` "wsd" in both, ``stable_end(T)``: the
  steps a plan of T applies before its decay) changes length freely while the checkpoint's
  ``step`` is still in the stable phase of both plans: the lr so far is the same under
  either, and the decay moves (a longer run, or a decay branched from a stable checkpoint)."""
  for key, why in (("seed", "it sets the data order"), ("global_batch_size", _WHY_G)):
    if saved.get(key) != current[key]:
      raise CheckpointError(
        f"train.{key} changed since the checkpoint ({saved.get(key)} → {current[key]}); "
        f"{why}, so set it back{way_out}"
      )
  old, new = saved.get("schedule_steps"), current["schedule_steps"]
  if new is None or old == new:
    return
  wsd = saved.get("lr_schedule") == current.get("lr_schedule") == "wsd" and stable_end
  if wsd and step is not None and step <= min(stable_end(old), stable_end(new)):
    log.info(
      "the warmup-stable-decay schedule goes from %d to %d update steps: its decay now "
      "starts after step %d (the checkpoint's step %d is in the stable phase of both)",
      old,
      new,
      stable_end(new),
      step,
    )
    return
  if not allow_schedule_change:
    raise CheckpointError(
      f"the lr schedule was planned for {old} update steps, this config plans {new} "
      f"(train.max_steps or epochs changed); set train.schedule_steps={old} to keep it (the "
      f"lr then holds its final value past step {old}), or "
      f"checkpoint.allow_schedule_change=true to re-plan it for {new} steps"
    )
  log.warning("RESUME WITH A CHANGE: the lr schedule re-planned from %d to %d steps", old, new)


def _check_same_vocabulary(saved: dict, current: RunState) -> None:
  """A vocabulary that moved together with the data is the data's doing: ``model.vocab_size``
  follows the tokenizer, so re-prepared data with another tokenizer would otherwise read as
  a model change. Named as what it is; not resumable even with ``allow_data_change`` (the
  embedding tables no longer fit)."""
  old = saved["model"].get("vocab_size")
  new = current.model.get("vocab_size")
  if old is None or old == new or saved.get("dataset_fingerprint") == current.dataset_fingerprint:
    return
  raise CheckpointError(
    f"the data's tokenizer changed since the checkpoint (model.vocab_size, which follows it, "
    f"{old} → {new}; "
    f"dataset fingerprint {saved.get('dataset_fingerprint')} → "
    f"{current.dataset_fingerprint}): point data.path back at the data the run was trained "
    f"on (or prepare it again with the run's tokenizer), or start a new run_dir"
  )


def reconcile(
  saved: dict,
  current: RunState,
  *,
  state_step: int,
  steps_per_epoch: int,
  allow_data_change: bool,
  allow_schedule_change: bool = False,
  stable_end=None,
) -> RunState:
  """The position to continue from, after checking the saved run fits the current one
  (``stable_end``: a warmup-stable-decay schedule's, see ``refuse_a_different_run``)."""
  _check_same_vocabulary(saved, current)
  _check_same_run(saved, current, allow_schedule_change, state_step, stable_end)
  if saved.get("dataset_fingerprint") != current.dataset_fingerprint and not allow_data_change:
    raise CheckpointError(
      f"the dataset changed since the checkpoint (fingerprint "
      f"{saved.get('dataset_fingerprint')} → {current.dataset_fingerprint}); set "
      f"checkpoint.allow_data_change=true to resume on the new data anyway"
    )
  if saved.get("grad_accum_steps") != current.grad_accum_steps:
    log.info(
      "grad_accum_steps %s → %d with global_batch_size %d unchanged: updates are "
      "identical by construction",
      saved.get("grad_accum_steps"),
      current.grad_accum_steps,
      current.global_batch_size,
    )
  epoch, step_in_epoch = int(saved.get("epoch", 0)), int(saved["step_in_epoch"])
  if step_in_epoch >= steps_per_epoch:
    epoch, step_in_epoch = epoch + 1, 0
  return dataclasses.replace(
    current,
    step=state_step,
    epoch=epoch,
    step_in_epoch=step_in_epoch,
    trackers=dict(saved.get("trackers") or {}),
  )


def _locate(path: str) -> tuple[pathlib.Path, int | None]:
  """``--resume-from``: a step directory, a checkpoints directory, or a run directory."""
  p = pathlib.Path(path)
  if p.name.isdigit() and p.is_dir():
    return p.parent, int(p.name)
  if (p / "checkpoints").is_dir():
    return p / "checkpoints", None
  if step_dirs(p):
    return p, None
  raise CheckpointError(f"--resume-from {path}: no checkpoint there")


@dataclasses.dataclass(frozen=True)
class Start:
  """Where a run starts: ``ckpt`` open for saving in ``run_dir/checkpoints``, the state to
  continue from (the initial one when nothing was restored) and what the client's ``fits``
  made of the restored checkpoint (None: a fresh start)."""

  ckpt: Checkpointer
  state: object
  fitted: object = None


def start(
  run_dir: pathlib.Path,
  state,
  *,
  checkpoint,
  fits: Callable[[Restored], object],
  way_out: str,
  stored=None,
  resume: bool = True,
  resume_from: str | None = None,
  current: RunState | None = None,
  model: dict | None = None,
) -> Start:
  """The one resume both clients call: fresh, from ``run_dir``'s newest valid checkpoint,
  or from another run's (``resume_from``, only read).

  ``fits(restored)`` checks the checkpoint belongs to this run (``refuse_a_different_run``
  and the client's own checks) and returns what the client continues with (its data
  position); ``way_out`` is the client's other choice, at the end of a refusal (", or
  --no-resume to start over"). ``checkpoint`` is the ``checkpoint`` config section;
  ``stored`` the predicate of the leaves a checkpoint holds (a LoRA run's: its adapters);
  ``current`` the run's ``RunState``, which lets a checkpoint that does not fit be blamed on
  the config key that changed; ``model`` the bundled model's config section when the
  checkpoints' metadata may not name it (a Python-API trainer's: ``param_layout``).
  ``resume=False`` sets an earlier run aside first. Nothing is
  written before the checks pass except moving a corrupt checkpoint of this run aside."""
  if not resume:
    archive_previous(run_dir)
  own = run_dir / "checkpoints"
  restored = None
  if resume_from:
    if step_dirs(own):
      raise CheckpointError(
        f"{run_dir} already has checkpoints; --resume-from needs a new "
        f"run_dir (or --no-resume to set them aside)"
      )
    directory, step = _locate(resume_from)
    source = Checkpointer(directory, read_only=True, stored=stored, model=model)
    restored = _restore(source, state, step, current, way_out="")
  elif resume and step_dirs(own):
    restored = _restore(
      Checkpointer(own, keep=checkpoint.keep, stored=stored, model=model),
      state,
      None,
      current,
      way_out,
    )
    if restored is None:  # every step vanished while it was read
      raise CheckpointError(f"{own} holds no checkpoint that restores{way_out}")
  elif resume:
    refuse_history_without_checkpoint(run_dir)
  fitted = None
  if restored is not None:
    fitted = fits(restored)
    log.info("resumed from the checkpoint of update step %d", restored.step)
    state = restored.state
  ckpt = Checkpointer(own, keep=checkpoint.keep, async_save=checkpoint.async_, stored=stored)
  return Start(ckpt, state, fitted)


def refuse_history_without_checkpoint(run_dir: pathlib.Path) -> None:
  """A run dir that recorded update steps but holds no checkpoint (deleted, or a run killed
  before its first save) is not started over from step 0 on its own: that would rewrite
  its metrics and evaluations. The user chooses: ``--no-resume`` sets it aside."""
  history = [
    (name, max((r["step"] for r in recs if isinstance(r.get("step"), int)), default=0))
    for name in ("metrics.jsonl", "eval.jsonl")
    if (recs := read_records(run_dir / name))
  ]
  if history:
    name, step = max(history, key=lambda h: h[1])
    raise CheckpointError(
      f"{run_dir} holds an earlier run's history ({name} up to update step {step}) but no "
      f"checkpoint to resume from; re-run with --no-resume to set it aside and start over "
      f"(or choose a new run_dir)"
    )


def _restore(
  checkpointer: Checkpointer, state, step: int | None, current: RunState | None, way_out: str
) -> Restored | None:
  """``checkpointer.restore``; a checkpoint that does not fit is blamed on what changed: the
  data's vocabulary, a config key that sizes the state, or the model keys (``way_out``:
  the alternative to setting a key back, as the message's tail)."""
  try:
    return checkpointer.restore(state, step)
  except CheckpointError as e:
    if current is None:  # a Trainer's: no config to blame
      raise
    _blame_a_new_vocabulary(checkpointer.directory, step, current)
    _blame_a_changed_key(checkpointer.directory, step, state, current, e, way_out)
    raise
  finally:
    checkpointer.close()


def _blame_a_changed_key(directory, step, state, current: RunState, error, way_out: str) -> None:
  """Names the config key whose change keeps the checkpoint from restoring, read from the
  newest step's metadata and run state (no array): a state leaf sized by a key in
  ``STATE_SHAPE_KEYS`` replaces the error with one line naming the key; model keys that
  changed are added to the error (a model change is refused whatever it does to shapes)."""
  for s, path in step_dirs(directory):
    if step is not None and s != step:
      continue
    shapes = checkpoint_read.saved_shapes(path)
    if shapes is None:
      continue
    if changed := _state_shape_changes(shapes, state):
      raise CheckpointError(
        f"{changed} since the checkpoint of update step {s} (it sizes the train state): "
        f"resume with the old value{way_out}"
      ) from None
    run = checkpoint_read.read_step(path, arrays=False).run
    model = _model_changes(run, current) if run and "model" in run else {}
    if shaping := {k: v for k, v in model.items() if k not in HARMLESS_MODEL_KEYS}:
      diff = ", ".join(f"model.{k} {old} → {new}" for k, (old, new) in shaping.items())
      raise CheckpointError(f"{error} (changed since the checkpoint: {diff})") from None
    old = (run or {}).get("trainable", [])
    if old != current.trainable:
      raise CheckpointError(
        f"optim.trainable changed since the checkpoint of update step {s} ({old} → "
        f"{current.trainable}): it decides which parameters have optimizer state; resume "
        f"with the old value{way_out}"
      ) from None
    key, change = optimizer_change(saved_optimizer(run, directory.parent), current.optim)
    if key:  # the optimizer state's layout follows them
      fresh = "--no-resume or a new run_dir" if way_out else "a run without --resume-from"
      raise CheckpointError(
        f"the checkpoint of update step {s} was written with {change} needs {fresh} (or set "
        f"{key} back)"
      ) from None
    return


def _state_shape_changes(saved_shapes: dict, state) -> str:
  """``"<key> changed from <old> to <new>"`` for each ``STATE_SHAPE_KEYS`` leaf whose saved
  shape differs from ``state``'s, joined; "" when none does."""
  changes = []
  for leaf, (key, value_of) in STATE_SHAPE_KEYS.items():
    old, new = saved_shapes.get(leaf), getattr(state, leaf, None)
    if old is not None and new is not None and tuple(old) != tuple(new.shape):
      changes.append(f"{key} changed from {value_of(old)} to {value_of(new.shape)}")
  return "; ".join(changes)


def _blame_a_new_vocabulary(directory, step: int | None, current: RunState) -> None:
  """A checkpoint whose embeddings do not fit fails at restore, before ``reconcile``: if its
  run state shows the data's tokenizer moved the vocabulary, say that instead of "the
  model" (only the run-state JSON is read, no array)."""
  for info in list_checkpoints(directory):
    if info.run and (step is None or info.step == step) and not info.in_progress:
      _check_same_vocabulary(info.run, current)
      return
