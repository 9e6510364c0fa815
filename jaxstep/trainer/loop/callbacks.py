"""Hooks into the run loop, with a ``TrainerControl`` they may set (like HF's)."""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass
class TrainerControl:
  """What callbacks ask of the loop. ``should_stop`` ends it after the current update step."""

  should_stop: bool = False
  reason: str = ""

  def stop(self, reason: str) -> None:
    self.should_stop, self.reason = True, reason


class Callback:
  """Override what you need. ``metrics`` are host floats; steps are update steps."""

  def on_step_end(self, step: int, metrics: dict, control: TrainerControl) -> None:
    """After update ``step``'s metrics came back (one step late, so the device never waits)."""

  def on_evaluate(self, step: int, metrics: dict, control: TrainerControl) -> None:
    """After an evaluation at update ``step``; ``metrics`` has ``eval_loss``, ``eval_ppl``."""


class EarlyStopping(Callback):
  """Stops when ``eval_loss`` has not improved by ``min_delta`` for ``patience`` evaluations."""

  def __init__(self, patience: int, min_delta: float = 0.0):
    self.patience, self.min_delta = patience, min_delta
    self.best, self.bad_evals = math.inf, 0

  def on_evaluate(self, step, metrics, control):
    if metrics["eval_loss"] < self.best - self.min_delta:
      self.best, self.bad_evals = metrics["eval_loss"], 0
      return
    self.bad_evals += 1
    if self.bad_evals >= self.patience:
      control.stop(
        f"early stopping at update step {step}: eval_loss did not improve on "
        f"{self.best:.4f} for {self.patience} evaluations"
      )
