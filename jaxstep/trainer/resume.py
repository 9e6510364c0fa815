"""Where a run starts: fresh, from its own newest checkpoint, or from ``--resume-from``.

Also reconciles the saved ``RunState`` with the current config: the dataset fingerprint
and the global batch size must match (G defines what a position and an update step mean);
``grad_accum_steps`` may change while G stays, since the update is the same by construction.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib

from jaxstep.errors import CheckpointError
from jaxstep.models import GPTConfig
from jaxstep.trainer import config as config_lib
from jaxstep.trainer.checkpoint import Checkpointer, step_dirs
from jaxstep.trainer.run_dir import archive_previous
from jaxstep.trainer.run_state import RunState

log = logging.getLogger("jaxstep")


def _convert_legacy(saved: dict) -> dict:
  """A RunState without ``batch_size_semantics`` counted micro-batches.

  Its ``batch_size`` is the micro-batch, so ``G = batch_size × grad_accum_steps``, and its
  ``step_in_epoch`` counted micro-steps; the position moves to the next update boundary
  (the micro-steps of an interrupted accumulation never reached the parameters).
  """
  k = int(saved.get("grad_accum_steps", 1))
  g = int(saved["batch_size"]) * k
  micro = int(saved.get("step_in_epoch", 0))
  updates = -(-micro // k)
  log.warning(
    "legacy checkpoint (micro-batch semantics): batch_size %s × grad_accum_steps "
    "%d → global_batch_size %d; %d micro-steps into the epoch → update step %d of "
    "the epoch",
    saved["batch_size"],
    k,
    g,
    micro,
    updates,
  )
  return {
    **{k_: v for k_, v in saved.items() if k_ != "batch_size"},
    "global_batch_size": g,
    "grad_accum_steps": k,
    "step_in_epoch": updates,
    "sample_cursor": updates * g,
    "batch_size_semantics": "global",
  }


# Model keys that change no array and no computation a checkpoint depends on.
HARMLESS_MODEL_KEYS = ("dropout",)
# Model keys that choose kernels or memory layout only: the same parameters and the same
# math (a different block layout is converted at restore), so a change is simply taken.
KERNEL_MODEL_KEYS = ("attention", "remat", "scan_layers")


def _check_same_run(saved: dict, current: RunState, allow_schedule_change: bool) -> None:
  """Refuses a resume whose model, seed or lr schedule differs from the checkpoint's (a
  checkpoint written before these were recorded is not checked); states a harmless model
  change in one line."""
  if saved.get("model"):
    defaults = config_lib.to_dict(GPTConfig())  # keys added since the checkpoint was written
    changed = {
      k: (old, v)
      for k, v in current.model.items()
      if k not in KERNEL_MODEL_KEYS and (old := saved["model"].get(k, defaults.get(k))) != v
    }
    for key in HARMLESS_MODEL_KEYS:
      if key in changed:
        old, new = changed.pop(key)
        log.warning("RESUME WITH A CHANGE: model.%s %s → %s since the checkpoint", key, old, new)
    if changed:
      diff = ", ".join(f"model.{k} {old} → {new}" for k, (old, new) in changed.items())
      raise CheckpointError(
        f"the model changed since the checkpoint ({diff}); set it back or start a new run_dir"
      )
  if "seed" in saved and saved["seed"] != current.seed:
    raise CheckpointError(
      f"train.seed changed since the checkpoint ({saved['seed']} → {current.seed}); it sets "
      f"the data order, so set it back or start a new run_dir"
    )
  old, new = saved.get("schedule_steps"), current.schedule_steps
  if old and old != new:
    if not allow_schedule_change:
      raise CheckpointError(
        f"the lr schedule was planned for {old} update steps, this config plans {new} "
        f"(train.max_steps or epochs changed); set train.schedule_steps={old} to keep it (the "
        f"lr then holds its final value past step {old}), or "
        f"checkpoint.allow_schedule_change=true to re-plan it for {new} steps"
      )
    log.warning("RESUME WITH A CHANGE: the lr schedule re-planned from %d to %d steps", old, new)


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
  if "batch_size_semantics" not in saved:
    saved = _convert_legacy(saved)
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
  restored = None
  if resume_from:
    if step_dirs(own):
      raise CheckpointError(
        f"{run_dir} already has checkpoints; --resume-from needs a new "
        f"run_dir (or --no-resume to set them aside)"
      )
    directory, step = _locate(resume_from)
    restored = _restore(Checkpointer(directory, read_only=True), state, step)
  elif resume and step_dirs(own):
    restored = _restore(Checkpointer(own, keep=c.keep), state, None)
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
    log.info(
      "resumed from the checkpoint of update step %d (epoch %d, step_in_epoch %d)",
      step,
      run_state.epoch,
      run_state.step_in_epoch,
    )
  return Checkpointer(own, keep=c.keep, async_save=c.async_), state, run_state


def _restore(checkpointer: Checkpointer, state, step: int | None):
  try:
    return checkpointer.restore(state, step)
  finally:
    checkpointer.close()
