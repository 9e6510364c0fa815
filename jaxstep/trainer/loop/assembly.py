"""How every client turns its parts into a running ``Loop``: ``jaxstep train`` (the bundled or
an imported model) and ``jaxstep.Trainer`` (any model) differ in where their state, step,
batches and evaluation come from, and in nothing after that.

``assemble`` opens the run's records (metrics.jsonl, eval.jsonl, TensorBoard, progress),
builds the built-in hooks, the user's hooks after them and the external trackers last, and
hands everything to one ``Loop``; if any of that fails, what was opened is closed again.
``already_finished`` is the one answer to a re-run of a run that reached its end.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxstep.trainer.config.schema import TrainConfig
from jaxstep.trainer.loop.builtin_hooks import (  # what a client hands to assemble
  Evaluation,
  Tracking,
  standard_hooks,
  trackers_hook,
)
from jaxstep.trainer.loop.callbacks import Callback
from jaxstep.trainer.loop.hooks import Hook
from jaxstep.trainer.loop.loop import BatchSource, Loop, LoopResult, closed_on_error
from jaxstep.trainer.store import records
from jaxstep.trainer.store.checkpoint import Checkpointer
from jaxstep.trainer.tracking.metrics import open_records

log = logging.getLogger("jaxstep")


@dataclasses.dataclass(frozen=True)
class Throughput:
  """What the metrics records measure throughput and MFU against.

  ``tokens_per_step``: tokens one update reads (None: the batch's normalization units N per
  second); ``flops_per_token``: the model's training FLOPs per token (0: no MFU);
  ``peak_flops``: one device's peak; ``host_fields``: extra per-update host columns (a
  mixture's tokens per source)."""

  tokens_per_step: Any = None  # positions per update, or batch -> positions
  flops_per_token: float = 0.0
  peak_flops: float = 1.0
  host_fields: Any = None


def assemble(
  *,
  state,
  step_fn: Callable,
  put_batch: Callable,
  source: BatchSource,
  start_step: int,
  total_steps: int,
  run_dir: pathlib.Path,
  ckpt: Checkpointer,
  train: TrainConfig,
  checkpoint_every: int,
  evaluation: Evaluation,
  tracking: Tracking,
  throughput: Throughput,
  callbacks: Sequence[Callback] = (),
  hooks: Sequence[Hook] = (),
  run_info: dict | None = None,
) -> Loop:
  """The ``Loop`` from update ``start_step`` to ``total_steps``: the built-in hooks (the
  profiler, the guard, callbacks, checkpoints every ``checkpoint_every``, evaluation,
  samples), then ``hooks``, then the trackers (so they see what the user's hooks report).
  ``ckpt``, the records and ``source`` are closed if building fails; the ``Loop`` closes
  them once it runs."""
  writer = jax.process_index() == 0
  with closed_on_error() as opened:
    opened(ckpt)
    if callable(getattr(source, "close", None)):
      opened(source)
    sink, late = open_records(
      run_dir,
      train,
      start_step=start_step,
      total_steps=total_steps,
      writer=writer,
      tokens_per_step=throughput.tokens_per_step,
      flops_per_token=throughput.flops_per_token,
      peak_flops=throughput.peak_flops,
      host_fields=throughput.host_fields,
    )
    opened(sink)
    builtin = standard_hooks(train, run_dir, evaluation, checkpoint_every, callbacks, writer)
    tracked = trackers_hook(train, run_dir, tracking, writer=writer)
    return Loop(
      state=state,
      step_fn=step_fn,
      put_batch=put_batch,
      source=source,
      start_step=start_step,
      total_steps=total_steps,
      run_dir=run_dir,
      ckpt=ckpt,
      late=late,
      sink=sink,
      hooks=[*builtin, *hooks, *([tracked] if tracked else [])],
      run_info=run_info,
      writer=writer,
    )


def already_finished(
  state, step: int, position: dict, run_dir: pathlib.Path, first_set: str, run_info: dict
) -> LoopResult:
  """A re-run of a run that reached its end: says so, writes nothing, and reports the end
  its records hold (the last metrics line, each set's last evaluation)."""
  reason = f"already finished at update step {step}"
  log.info("%s; nothing to do (run_dir %s)", reason, run_dir)
  last, evals = records.recorded_end(run_dir, first_set)
  return LoopResult(state, step, position, last, evals, reason, dict(run_info))
