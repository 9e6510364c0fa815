"""Hooks: everything the run loop does besides the update step, each with a cadence.

The loop (``jaxstep.trainer.loop.loop.Loop``) dispatches update steps and calls its hooks at
fixed moments; evaluation, checkpoints, samples, profiling, the non-finite guard,
callbacks and trackers are all hooks, and a user adds their own the same way. Cadences are
in *update* steps (one optimizer update per global batch), never micro-steps.

Moments, in the order the loop reaches them:

- ``on_start(loop)``: once, before the first update of this start (a resumed run's
  ``loop.step`` is the step it resumed at);
- ``before_step(loop, step)`` / ``after_step(loop)``: around the dispatch of update
  ``step`` (profiling);
- ``on_metrics(loop, reported)``: each update's host metrics, read back one update late so
  the host never stalls the device (``reported.step``, ``.record``, ``.batch``);
- ``on_step(loop)``: after update ``loop.step`` when ``loop.step % every == 0``; with
  ``wants_metrics`` every earlier update's metrics have been reported first;
- ``on_eval(loop, name, record)`` / ``on_samples(loop, samples)``: what an evaluation or a
  sample hook reported through ``loop.report_eval`` / ``loop.report_samples``;
- ``on_end(loop)``: once, after the last update of this start (``loop.stopped_by`` is the
  signal number when a signal ended it, else None); the final checkpoint follows;
- ``on_close(loop, failed)``: once, after the final checkpoint (also when the run ends with
  an error: ``failed``), to release what a hook holds (a tracker uploads and closes here,
  so a preempted run's checkpoint never waits on it).

Any hook may end the run after the current update with ``loop.stop(reason)``.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
  from jaxstep.trainer.tracking.metrics import Reported


class LoopView(Protocol):
  """What a hook may read and call on the loop that runs it (``jaxstep.trainer.loop.loop.Loop``
  is one; a hook never needs more, so this module does not import the loop).

  Attributes:
    step: update steps done so far; ``start_step``: where this start began (a resumed run's
      checkpoint step); ``total_steps``: where the run ends.
    state: the train state after ``step`` updates (its ``params``, ``opt_state`` …).
    last_record: the last update's metrics record read back (one update late).
    evals: set name → its last evaluation record.
    run_dir: the run's folder; ``writer``: this process writes the run's files.
    run_info: JSON kept with every checkpoint besides the data position.
    stopped_by: the signal number that ended the run, else None; ``should_stop``: a stop
      was asked for.
  """

  step: int
  start_step: int
  total_steps: int
  state: Any
  evals: dict
  run_dir: pathlib.Path
  writer: bool
  run_info: dict
  stopped_by: int | None
  should_stop: bool

  @property
  def last_record(self) -> dict: ...

  def stop(self, reason: str) -> None:
    """Ends the run after the current update."""

  def save(self) -> None:
    """Checkpoints the state of update ``step``."""

  def report_eval(self, name: str, record: dict) -> None:
    """An evaluation's record to eval.jsonl and every hook's ``on_eval``."""

  def report_samples(self, samples: list[dict]) -> None:
    """Generated samples to the records and every hook's ``on_samples``."""


class Hook:
  """Override the moments you need.

  Attributes:
    every: call ``on_step`` after every this many update steps (0: never).
    wants_metrics: ``on_step`` needs the records of every update so far (and its time is
      not charged to the next update's throughput): evaluation, samples.
    needs_every_step: each update's metrics must be read back before the next update is
      dispatched (a guard that halts on a non-finite update).
  """

  every: int = 0
  wants_metrics: bool = False
  needs_every_step: bool = False

  def on_start(self, loop: LoopView) -> None:
    """Once, before the first update of this start."""

  def before_step(self, loop: LoopView, step: int) -> None:
    """Before update ``step`` is dispatched (its batch is read already)."""

  def after_step(self, loop: LoopView) -> None:
    """Right after update ``loop.step`` is dispatched (its metrics are not read yet)."""

  def on_metrics(self, loop: LoopView, reported: Reported) -> None:
    """Update ``reported.step``'s host record (one update late)."""

  def on_step(self, loop: LoopView) -> None:
    """After update ``loop.step``, when it is a multiple of ``every``."""

  def on_eval(self, loop: LoopView, name: str, record: dict) -> None:
    """An evaluation of set ``name`` at update ``record["step"]``."""

  def on_samples(self, loop: LoopView, samples: list[dict]) -> None:
    """Generated samples at update ``loop.step``."""

  def on_end(self, loop: LoopView) -> None:
    """Once, after the last update of this start, before the final checkpoint."""

  def on_close(self, loop: LoopView, failed: bool) -> None:
    """Once, after the final checkpoint was saved (``failed``: the run is ending with an
    error, its state checkpointed as far as it could be): release what the hook holds."""


class FunctionHook(Hook):
  """``fn(loop)`` every ``every`` update steps, and/or at the start and the end.

  ``fn`` reads ``loop.step``, ``loop.state``, ``loop.last_record`` and may call
  ``loop.stop(reason)``."""

  def __init__(
    self,
    fn: Callable[[LoopView], None],
    *,
    every: int = 0,
    at_start: bool = False,
    at_end: bool = False,
  ):
    if every < 0:
      raise ValueError(f"every must be >= 0 update steps, got {every}")
    if not (every or at_start or at_end):
      raise ValueError("a hook needs every=N, at_start=True or at_end=True")
    self.fn, self.every, self.at_start, self.at_end = fn, every, at_start, at_end
    self.wants_metrics = True  # a user's function sees every record up to its step

  def on_start(self, loop):
    if self.at_start:
      self.fn(loop)

  def on_step(self, loop):
    self.fn(loop)

  def on_end(self, loop):
    if self.at_end:
      self.fn(loop)


def as_hook(hook, *, every: int = 0, at_start: bool = False, at_end: bool = False) -> Hook:
  """A ``Hook`` as it is; a plain function wrapped in a ``FunctionHook`` with the cadence."""
  if isinstance(hook, Hook):
    if every or at_start or at_end:
      raise ValueError("give the cadence to a Hook object as its attributes, not here")
    return hook
  if not callable(hook):
    raise TypeError(f"a hook is a jaxstep Hook or a function of the loop, got {hook!r}")
  return FunctionHook(hook, every=every, at_start=at_start, at_end=at_end)
