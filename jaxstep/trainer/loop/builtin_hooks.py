"""The hooks both run clients build: the guard, callbacks, checkpoints, evaluation,
samples, profiling and trackers (``jaxstep.trainer.loop.hooks`` says when each moment comes)."""

from __future__ import annotations

import dataclasses
import logging
import pathlib
from collections.abc import Callable, Sequence

from jaxstep.trainer.config.schema import (
  EXTERNAL_TRACKERS,
  HARNESS_SET,
  MlflowConfig,
  WandbConfig,
  parse_profile_steps,
)
from jaxstep.trainer.loop.callbacks import Callback, EarlyStopping, TrainerControl
from jaxstep.trainer.loop.hooks import Hook
from jaxstep.trainer.loop.nonfinite_guard import NonFiniteGuard
from jaxstep.trainer.tracking import profiler as profiling
from jaxstep.trainer.tracking import trackers as trackers_lib
from jaxstep.trainer.tracking.loss_plot import plot_quietly

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
    evaluate: ``what → {set name: record}`` (records without ``step``/``set``).
    every: update steps between evaluations (0: at the end only).
    params_of: what of the loop's state ``evaluate`` takes (its params by default).
    at_start: also evaluate before the first update of a fresh run (step 0: the "before"
      of a fine-tuning run).
  """

  wants_metrics = True

  def __init__(
    self,
    evaluate: Callable,
    every: int,
    params_of: Callable = lambda s: s.params,
    at_start: bool = False,
  ):
    self.evaluate, self.every, self.params_of = evaluate, every, params_of
    self.at_start = at_start
    self.last_step: int | None = None

  def on_start(self, loop):
    if self.at_start and loop.step == 0:
      self.on_step(loop)

  def on_step(self, loop):
    self.last_step = loop.step
    for name, values in self.evaluate(self.params_of(loop.state)).items():
      loop.report_eval(name, {"step": loop.step, "set": name, **values})

  def on_end(self, loop):
    """The end's evaluation: not after a signal, not twice at one step, and not when this
    start made no update (its step was evaluated before, or never trained)."""
    if loop.stopped_by is None and self.last_step != loop.step and loop.step > loop.start_step:
      self.on_step(loop)


class SamplesHook(Hook):
  """Text samples every ``every`` update steps: ``generate(step, params) → records``."""

  wants_metrics = True

  def __init__(self, generate: Callable, every: int):
    self.generate, self.every = generate, every

  def on_step(self, loop):
    loop.report_samples(self.generate(loop.step, loop.state.params))


class ProfilerHook(Hook):
  """A ``jax.profiler`` trace of update steps ``first..last`` in ``run_dir/profile``: it
  starts before update ``first`` is dispatched and stops right after ``last`` is (first of
  the hooks, so no checkpoint, evaluation or sample of theirs is in it)."""

  def __init__(self, steps: tuple[int, int], run_dir: pathlib.Path):
    self.profiler = profiling.StepProfiler(steps, run_dir)

  def before_step(self, loop, step):
    self.profiler.before(step)

  def after_step(self, loop):
    self.profiler.after(loop.step, loop.state)

  def on_end(self, loop):
    self.profiler.stop()  # the run ended before the last profiled step

  def on_close(self, loop, failed):
    self.profiler.stop()


def profiler_hooks(spec: str, run_dir: pathlib.Path) -> list[Hook]:
  """The hook of ``train.profile_steps`` (``"A:B"``; empty: none)."""
  steps = parse_profile_steps(spec)
  return [ProfilerHook(steps, run_dir)] if steps else []


class TrackersHook(Hook):
  """Train metrics (at ``log_every`` and the last update), evaluations and samples to the
  external trackers (``jaxstep.trainer.tracking.trackers``); after the final checkpoint
  ``artifacts()`` (the loss plot, the config) and a close. Their run ids go into every
  checkpoint's run state, so a resumed run continues the same tracker runs."""

  def __init__(self, trackers, *, artifacts: Callable):
    self.trackers, self.artifacts, self.sent = trackers, artifacts, None

  def on_start(self, loop):
    loop.run_info["trackers"] = dict(self.trackers.ids)

  def _send(self, loop, record: dict) -> None:
    self.trackers.metrics(record["step"], record, "train")
    self.sent = record["step"]
    loop.run_info["trackers"] = dict(self.trackers.ids)  # a tracker slow to start

  def on_metrics(self, loop, reported):
    if reported.logged is not None:
      self._send(loop, reported.logged)

  def on_eval(self, loop, name, record):
    values = {k: v for k, v in record.items() if k not in ("step", "set")}
    if name == HARNESS_SET:  # lm-evaluation-harness tasks: harness/<task>/<metric>
      values = {k.removeprefix(f"{name}/"): v for k, v in values.items()}
      self.trackers.metrics(record["step"], values, name)
      return
    self.trackers.metrics(record["step"], values, f"eval/{name}")

  def on_samples(self, loop, samples):
    text = "\n".join(f"[{s['mode']}] {s['prompt']!r} → {s['text']!r}" for s in samples)
    self.trackers.text(loop.step, "samples", text)

  def on_end(self, loop):
    last = loop.late.unlogged()  # the updates since the last record, as metrics.jsonl has it
    if last and last["step"] != self.sent:  # a run stopped between two logged steps
      self._send(loop, last)

  def on_close(self, loop, failed):
    if not failed:
      self.trackers.artifacts([p for p in self.artifacts() if p is not None])
    self.trackers.close(failed=failed)


@dataclasses.dataclass(frozen=True)
class Tracking:
  """The external trackers' settings: the run's config as they record it, where they go,
  and the tracker runs a resumed run continues (``ids``)."""

  config: dict
  mlflow: MlflowConfig = MlflowConfig()
  wandb: WandbConfig = WandbConfig()
  ids: dict = dataclasses.field(default_factory=dict)
  resumed: bool = False


@dataclasses.dataclass(frozen=True)
class Evaluation:
  """What the built-in hooks score and generate: ``evaluate(state) → {set: record}`` every
  ``train.eval_every`` update steps (None: no sets), ``first_set`` (the one early stopping
  and ``on_evaluate`` callbacks watch), ``samples(step, params) → records`` every
  ``train.sample_every`` (None: no samples), ``harness(state) → {set: record}`` every
  ``harness_every`` (0: ``train.eval_every``; None: no lm-evaluation-harness tasks)."""

  evaluate: Callable | None = None
  first_set: str | None = None
  samples: Callable | None = None
  harness: Callable | None = None
  harness_every: int = 0


def trackers_hook(
  train_cfg, run_dir: pathlib.Path, tracking: Tracking, *, writer: bool
) -> TrackersHook | None:
  """The external trackers ``train.trackers`` names (process 0 only), continuing the
  tracker runs of ``tracking.ids`` when ``tracking.resumed``; None when there are none."""
  t, k = train_cfg, tracking
  if not writer or not any(name in EXTERNAL_TRACKERS for name in t.trackers):
    return None
  trackers = trackers_lib.open_trackers(
    t.trackers, run_dir=run_dir, config=k.config, mlflow=k.mlflow, wandb=k.wandb, ids=k.ids,
    resumed=k.resumed,
  )  # fmt: skip
  return TrackersHook(
    trackers,
    artifacts=lambda: [plot_quietly(run_dir), run_dir / "config.yaml"],
  )


def standard_hooks(
  train_cfg,
  run_dir: pathlib.Path,
  evaluation: Evaluation,
  checkpoint_every: int,
  callbacks: Sequence[Callback],
  writer: bool,
) -> list[Hook]:
  """The built-in hooks of a run, in the order they act at one update step: the profiler
  (first, so nothing else is in its trace), the guard, callbacks (with early stopping on
  ``evaluation.first_set``), checkpoints, evaluation, samples. Your hooks go after these
  and the trackers after yours (``trackers_hook``), so they see what your hooks report."""
  t = train_cfg
  evaluate, first_set, samples = evaluation.evaluate, evaluation.first_set, evaluation.samples
  guard = NonFiniteGuard(t.nonfinite, run_dir if writer else None, t.max_consecutive_skips)
  hooks = [*profiler_hooks(t.profile_steps, run_dir), GuardHook(guard)]
  calls = callbacks_hook(callbacks, t.early_stopping_patience, first_set)
  hooks += [calls] if calls else []
  if checkpoint_every:
    hooks.append(CheckpointHook(checkpoint_every))
  if evaluate is not None:
    hooks.append(
      EvalHook(evaluate, t.eval_every, params_of=lambda state: state, at_start=t.eval_at_start)
    )
  if samples is not None:
    hooks.append(SamplesHook(samples, t.sample_every))
  if evaluation.harness is not None:
    every = evaluation.harness_every or t.eval_every
    hooks.append(EvalHook(evaluation.harness, every, params_of=lambda state: state))
  return hooks
