"""The sampler's log-probs, checked against the training pass's.

On the first pass over a rollout the policy being trained is the one that sampled it, so
the log-prob the loss computes for each completion token (``core.rl.token_logps``: the
sampler's allowed ids, temperature and truncation) must equal the one the sampler drew it
with, to float rounding. The loss counts the tokens whose gap exceeds
``rl.logp_tolerance`` (``logp_gap_excess``, a sum: exact over micro-batches and devices,
and no extra forward pass); this hook reads that count from each first pass's record and
stops the run with one line naming the setting that makes the two differ.
"""

from __future__ import annotations

from collections.abc import Callable

from jaxstep.core.rl import GAP_EXCESS
from jaxstep.errors import ConfigError
from jaxstep.trainer.loop.hooks import Hook


class LogpCheck(Hook):
  """Stops at a first pass whose gap count is not 0; ``tolerance`` is the loss's, and
  ``cause()`` the line's end: which setting to change."""

  def __init__(self, tolerance: float, cause: Callable[[], str]):
    self.tolerance, self.cause = tolerance, cause

  def on_metrics(self, loop, reported) -> None:
    record = reported.record
    if record.get("rl_pass") != 0 or not record.get(GAP_EXCESS):
      return
    raise ConfigError(
      f"the training pass of update {reported.step} gives {int(record[GAP_EXCESS])} of "
      f"{int(record['completion_tokens'])} completion tokens another log-prob than the "
      f"sampler drew them with (more than rl.logp_tolerance {self.tolerance} "
      f"nats; mean gap {record['logp_gap']:.3g}): {self.cause()}"
    )


def gap_cause(cfg) -> str:
  """Which setting makes the training pass see another distribution than the sampler."""
  model, t = cfg.model, cfg.train
  if getattr(model, "dropout", 0.0):
    return f"model.dropout={model.dropout} drops units in training that the sampler kept; set 0"
  if t.precision != "fp32":
    return (
      f"train.precision={t.precision} computes the training pass at lower precision than the "
      f"fp32 sampler; use fp32, or raise rl.logp_tolerance to accept the gap"
    )
  return "the model's training forward differs from its decode; raise rl.logp_tolerance"
