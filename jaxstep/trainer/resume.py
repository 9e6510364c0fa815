"""Where a run starts: fresh, from its own newest checkpoint, or from ``--resume-from``.

Also reconciles the saved ``RunState`` with the current config: the dataset fingerprint
and the global batch size must match (G defines what a position and an update step mean);
``grad_accum_steps`` may change while G stays, since the update is the same by construction.
A vocabulary that changed together with the data (re-prepared with another tokenizer) is
reported as the data's change, not the model's, since ``model.vocab_size`` follows it.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib

from jaxstep.errors import CheckpointError
from jaxstep.models import hf_weights
from jaxstep.trainer import checkpoint_read, steps
from jaxstep.trainer.checkpoint import Checkpointer, list_checkpoints, step_dirs
from jaxstep.trainer.records import read_records
from jaxstep.trainer.run_dir import archive_previous
from jaxstep.trainer.run_state import RunState

log = logging.getLogger("jaxstep")


# Model keys that change no array and no computation a checkpoint depends on.
HARMLESS_MODEL_KEYS = ("dropout",)
# Model keys that choose kernels or memory layout only: the same parameters and the same
# math (a different block layout is converted at restore), so a change is simply taken.
KERNEL_MODEL_KEYS = ("attention", "remat", "scan_layers", "init_from")  # init_from: the
# folder the first params came from; a resume reads them from the checkpoint instead
# Train-state leaves outside the model whose shape a config key sets: the leaf → the key and
# its value read back from the leaf's shape, so a checkpoint that does not fit names the key.
STATE_SHAPE_KEYS = {"recent_losses": ("train.spike_window", lambda shape: shape[0])}


def _model_changes(saved: dict, current: RunState) -> dict:
  """``{key: (old, new)}`` of the model keys that differ from the checkpoint's, kernel
  choices left out."""
  before = {"family": "gpt", **saved["model"]}  # checkpoints older than model.family: GPTs
  return {
    k: (old, v)
    for k, v in current.model.items()
    if k not in KERNEL_MODEL_KEYS and (old := before.get(k)) != v
  }


def _check_same_run(saved: dict, current: RunState, allow_schedule_change: bool) -> None:
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
  if saved["seed"] != current.seed:
    raise CheckpointError(
      f"train.seed changed since the checkpoint ({saved['seed']} → {current.seed}); it sets "
      f"the data order, so set it back or start a new run_dir"
    )
  old, new = saved["schedule_steps"], current.schedule_steps
  if old != new:
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
) -> RunState:
  """The position to continue from, after checking the saved run fits the current one."""
  _check_same_vocabulary(saved, current)
  _check_same_run(saved, current, allow_schedule_change)
  if saved["global_batch_size"] != current.global_batch_size:
    raise CheckpointError(
      f"the checkpoint was written with train.global_batch_size "
      f"{saved['global_batch_size']}, the config says {current.global_batch_size}; G must "
      f"stay the same to resume (set it back, or start a new run_dir)"
    )
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
    sample_cursor=step_in_epoch * current.global_batch_size if step_in_epoch else 0,
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


def start(
  cfg,
  run_dir: pathlib.Path,
  state,
  run_state: RunState,
  *,
  steps_per_epoch: int,
  resume: bool = True,
  resume_from: str | None = None,
):
  """Restores where the run starts (checking it fits), then opens ``run_dir/checkpoints``
  for saving; returns ``(checkpointer, state, run_state)``. Nothing is written before the
  checks pass except moving a corrupt checkpoint of this run aside; ``resume_from``'s
  source is only read."""
  if not resume:
    archive_previous(run_dir)
  c, own = cfg.checkpoint, run_dir / "checkpoints"
  kept = steps.stored(cfg)  # a LoRA run's checkpoints hold its adapters, not its base
  restored = None
  if resume_from:
    if step_dirs(own):
      raise CheckpointError(
        f"{run_dir} already has checkpoints; --resume-from needs a new "
        f"run_dir (or --no-resume to set them aside)"
      )
    directory, step = _locate(resume_from)
    source = Checkpointer(directory, read_only=True, stored=kept)
    restored = _restore(source, state, step, run_state, way_out="")
  elif resume and step_dirs(own):
    way_out = ", or --no-resume to start over"
    own_ckpt = Checkpointer(own, keep=c.keep, stored=kept)
    restored = _restore(own_ckpt, state, None, run_state, way_out=way_out)
  elif resume:
    refuse_history_without_checkpoint(run_dir)
  if restored is not None:
    state, saved, step = restored
    run_state = reconcile(
      saved,
      run_state,
      state_step=int(state.step),
      steps_per_epoch=steps_per_epoch,
      allow_data_change=c.allow_data_change,
      allow_schedule_change=c.allow_schedule_change,
    )
    if resume_from:  # another run's checkpoint: its tracker runs stay its own
      run_state = dataclasses.replace(run_state, trackers={})
    log.info(
      "resumed from the checkpoint of update step %d (epoch %d, step_in_epoch %d)",
      step,
      run_state.epoch,
      run_state.step_in_epoch,
    )
  return Checkpointer(own, keep=c.keep, async_save=c.async_, stored=kept), state, run_state


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


def _restore(checkpointer: Checkpointer, state, step: int | None, current: RunState, way_out: str):
  """``checkpointer.restore``; a checkpoint that does not fit is blamed on what changed: the
  data's vocabulary, a config key that sizes the state, or the model keys (``way_out``:
  the alternative to setting a key back, as the message's tail)."""
  try:
    return checkpointer.restore(state, step)
  except CheckpointError as e:
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
    if info.run and (step is None or info.step == step) and not getattr(info, "in_progress", 0):
      _check_same_vocabulary(info.run, current)
      return
