"""The hooks both run clients build: the guard, callbacks, checkpoints, evaluation,
samples, profiling and trackers (``jaxstep.trainer.hooks`` says when each moment comes)."""

from __future__ import annotations

import logging
import pathlib
from collections.abc import Callable, Sequence

from jaxstep.trainer import profiling
from jaxstep.trainer.callbacks import Callback, EarlyStopping, TrainerControl
from jaxstep.trainer.guards import NonFiniteGuard
from jaxstep.trainer.hooks import Hook

log = logging.getLogger("jaxstep")


class GuardHook(Hook):
  """Skipped updates under ``train.nonfinite`` (``NonFiniteGuard``): logs them, keeps the
  batch, and halts when the policy or ``max_consecutive_skips`` says so."""

  def __init__(self, guard: NonFiniteGuard):
    self.guard = guard
    self.needs_every_step = guard.needs_every_step

  def on_metrics(self, loop, reported):
    self.guard.after_step(reported.step, reported.record, reported.batch, reported.position)


class CallbacksHook(Hook):
  """``Callback`` objects (``on_step_end`` / ``on_evaluate``, HF-style) as one hook; their
  ``TrainerControl`` stop ends the run. ``on_evaluate`` sees the first eval set."""

  def __init__(self, callbacks: Sequence[Callback], primary_set: str | None):
    self.callbacks, self.primary = list(callbacks), primary_set
    self.control = TrainerControl()

  def _forward(self, loop):
    if self.control.should_stop and not loop.should_stop:
      loop.stop(self.control.reason)

  def on_metrics(self, loop, reported):
    for cb in self.callbacks:
      cb.on_step_end(reported.step, reported.record, self.control)
    self._forward(loop)

  def on_eval(self, loop, name, record):
    if name == self.primary:
      for cb in self.callbacks:
        cb.on_evaluate(record["step"], record, self.control)
      self._forward(loop)


def callbacks_hook(
  callbacks: Sequence[Callback], patience: int, primary_set: str | None
) -> CallbacksHook | None:
  """The callbacks, with ``EarlyStopping(patience)`` on the first eval set when set."""
  callbacks = list(callbacks)
  if patience:
    callbacks.append(EarlyStopping(patience))
  return CallbacksHook(callbacks, primary_set) if callbacks else None


class CheckpointHook(Hook):
  """A checkpoint every ``every`` update steps (the loop saves the last one itself)."""

  def __init__(self, every: int):
    self.every = every

  def on_step(self, loop):
    loop.save()


class EvalHook(Hook):
  """Evaluates every set every ``every`` update steps and once at the end (not after a
  signal, and not twice at one step).

  Args:
    evaluate: ``params → {set name: record}`` (records without ``step``/``set``).
    every: update steps between evaluations (0: at the end only).
    params_of: the params of the loop's state.
  """

  wants_metrics = True

  def __init__(self, evaluate: Callable, every: int, params_of: Callable = lambda s: s.params):
    self.evaluate, self.every, self.params_of = evaluate, every, params_of
    self.last_step: int | None = None

  def on_step(self, loop):
    self.last_step = loop.step
    for name, values in self.evaluate(self.params_of(loop.state)).items():
      loop.report_eval(name, {"step": loop.step, "set": name, **values})

  def on_end(self, loop):
    if loop.stopped_by is None and self.last_step != loop.step:
      self.on_step(loop)


class SamplesHook(Hook):
  """Text samples every ``every`` update steps: ``generate(step, params) → records``."""

  wants_metrics = True

  def __init__(self, generate: Callable, every: int):
    self.generate, self.every = generate, every

  def on_step(self, loop):
    loop.report_samples(self.generate(loop.step, loop.state.params))


class ProfilerHook(Hook):
  """A ``jax.profiler`` trace of update steps ``first..last`` in ``run_dir/profile``."""

  every = 1

  def __init__(self, steps: tuple[int, int], run_dir: pathlib.Path):
    self.profiler = profiling.StepProfiler(steps, run_dir)

  def before_step(self, loop, step):
    self.profiler.before(step)

  def on_step(self, loop):
    self.profiler.after(loop.step, loop.state)

  def on_end(self, loop):
    self.close()  # the run ended before the last profiled step

  def close(self) -> None:
    self.profiler.stop()


def profiler_hooks(spec: str, run_dir: pathlib.Path) -> list[Hook]:
  """The hook of ``train.profile_steps`` (``"A:B"``; empty: none)."""
  steps = profiling.parse_steps(spec)
  return [ProfilerHook(steps, run_dir)] if steps else []


class TrackersHook(Hook):
  """Train metrics (at ``log_every``), evaluations and samples to the external trackers
  (``jaxstep.trainer.trackers``); at the end ``artifacts()`` (the loss plot, the config)
  and a close. Their run ids go into every checkpoint's run state, so a resumed run
  continues the same tracker runs."""

  def __init__(self, trackers, *, log_every: int, total_steps: int, artifacts: Callable):
    self.trackers, self.log_every, self.total = trackers, log_every, total_steps
    self.artifacts = artifacts

  def on_start(self, loop):
    loop.run_info["trackers"] = dict(self.trackers.ids)

  def on_metrics(self, loop, reported):
    if reported.step % self.log_every == 0 or reported.step == self.total:
      self.trackers.metrics(reported.step, reported.record, "train")
      loop.run_info["trackers"] = dict(self.trackers.ids)  # a tracker slow to start

  def on_eval(self, loop, name, record):
    values = {k: v for k, v in record.items() if k not in ("step", "set")}
    self.trackers.metrics(record["step"], values, f"eval/{name}")

  def on_samples(self, loop, samples):
    text = "\n".join(f"[{s['mode']}] {s['prompt']!r} → {s['text']!r}" for s in samples)
    self.trackers.text(loop.step, "samples", text)

  def on_end(self, loop):
    self.trackers.artifacts(self.artifacts())
    self.close()

  def close(self) -> None:
    self.trackers.close()
