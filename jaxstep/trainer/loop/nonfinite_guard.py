"""What the loop does after an update the step skipped.

The jitted step never applies a non-finite update (or, with the spike guard on, a loss
spike): it leaves params and optimizer state as they were and reports ``updated = False``.
A program on the device cannot raise, so the host decides what happens next, here: the
global batch is saved for debugging, and under ``halt`` a non-finite update stops the run.
A loss spike is a finite loss the step's spike guard judged an outlier: it is skipped and
logged as a spike, never halts, and only counts towards ``max_consecutive``.
"""

from __future__ import annotations

import logging
import pathlib

import numpy as np

from jaxstep.errors import ConfigError, EmptyBatchError, NonFiniteError
from jaxstep.trainer.config.schema import NONFINITE_POLICIES
from jaxstep.trainer.store import records
from jaxstep.trainer.tracking.metrics import is_spike_skip

log = logging.getLogger("jaxstep")


def _save_bad_batch(run_dir: pathlib.Path, step: int, batch: dict, position: dict) -> pathlib.Path:
  """Writes ``run_dir/bad_batches/step_N.npz`` (the global batch) and ``.json`` (where it
  came from); returns the ``.npz`` path."""
  folder = run_dir / "bad_batches"
  folder.mkdir(exist_ok=True)
  path = folder / f"step_{step:08d}.npz"
  np.savez(path, **batch)
  records.write_atomic(path.with_suffix(".json"), records.dumps({"step": step, **position}) + "\n")
  return path


class NonFiniteGuard:
  """Acts on skipped updates by ``policy`` (one of ``NONFINITE_POLICIES``).

  Args:
    policy: ``skip`` logs and saves the batch; ``halt`` then raises ``NonFiniteError`` for a
      non-finite update (a loss spike is skipped under either policy).
    run_dir: where bad batches go; None on processes that write nothing (all but 0).
    max_consecutive: this many skipped updates in a row raise ``NonFiniteError`` (a run
      whose every update is skipped is not training; 0 = never): under ``skip`` any skips,
      under ``halt`` loss spikes (a non-finite update has halted already).
  """

  def __init__(self, policy: str, run_dir: pathlib.Path | None, max_consecutive: int = 0):
    if policy not in NONFINITE_POLICIES:
      raise ConfigError(f"policy must be one of {NONFINITE_POLICIES}, got {policy!r}")
    self.policy, self.run_dir, self.max_consecutive = policy, run_dir, max_consecutive
    self.consecutive = 0

  @property
  def needs_every_step(self) -> bool:
    """``halt`` must see each update's metrics before the next update is dispatched."""
    return self.policy == "halt"

  def after_step(self, step: int, record: dict, batch: dict, position: dict) -> None:
    """Called with every update's host metrics and the global batch it consumed (this
    process's rows of it). A batch without tokens is an error: a process that holds the
    whole batch catches it before dispatch; one that holds only its rows learns the global
    N here."""
    if record["tokens"] == 0:
      raise EmptyBatchError(
        f"the global batch of update step {step} had no loss-masked tokens (its update was "
        f"skipped); raise train.global_batch_size or check the data's masks"
      )
    if not record["skipped"]:
      self.consecutive = 0
      return
    self.consecutive += 1
    saved = None
    if self.run_dir is not None:
      saved = _save_bad_batch(self.run_dir, step, batch, {**position, "loss": record["loss"]})
    if is_spike_skip(record):
      log.warning(
        "update step %d was a loss spike (loss %s above train.spike_factor × the recent "
        "median): skipped; batch saved to %s",
        step,
        record["loss"],
        saved,
      )
    else:
      log.warning(
        "update step %d was non-finite (loss %s): skipped; batch saved to %s",
        step,
        record["loss"],
        saved,
      )
      if self.policy == "halt":
        raise NonFiniteError(
          f"update step {step} was non-finite (loss {record['loss']}); train.nonfinite=halt "
          f"stops here with the last good parameters checkpointed and the batch in {saved}"
        )
    if self.max_consecutive and self.consecutive >= self.max_consecutive:
      raise NonFiniteError(
        f"{self.consecutive} updates in a row were skipped (the last at update step {step}, "
        f"loss {record['loss']}); the last good parameters are checkpointed. Lower optim.lr "
        f"or check the data; train.max_consecutive_skips=0 trains on regardless"
      )
