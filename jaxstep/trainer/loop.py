"""The update-step loop of a CLI run, and ``train(cfg)`` around it.

Per update step: next global batch → host check (N > 0) → device put → jitted step (state
donated) → metrics of the *previous* step read back (so the host never stalls the device)
→ guards and callbacks → checkpoint / eval by update-step cadence.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import pathlib
import signal
from collections.abc import Sequence

import jax
import numpy as np

from jaxstep import data, models, parallel
from jaxstep.core.state import TrainState
from jaxstep.errors import EmptyBatchError, Interrupted, RunDirError, RunIOError
from jaxstep.trainer import config as config_lib
from jaxstep.trainer import profiling, records
from jaxstep.trainer import resume as resume_lib
from jaxstep.trainer import run_dir as run_dir_lib
from jaxstep.trainer.background import watch_threads
from jaxstep.trainer.build import Run, build
from jaxstep.trainer.callbacks import Callback, EarlyStopping, TrainerControl
from jaxstep.trainer.checkpoint import Checkpointer, step_dirs
from jaxstep.trainer.evaluation import eval_record
from jaxstep.trainer.guards import NonFiniteGuard
from jaxstep.trainer.metrics import LateMetrics, MetricsSink, NullSink, Reported
from jaxstep.trainer.perf import peak_flops_per_device
from jaxstep.trainer.run_state import RunState
from jaxstep.trainer.saved_run import save_base_config, save_tokenizer
from jaxstep.trainer.signals import stop_on_signals
from jaxstep.trainer.text_samples import TextSamples

log = logging.getLogger("jaxstep")


@dataclasses.dataclass(frozen=True)
class TrainResult:
  state: TrainState
  run_state: RunState
  last_metrics: dict
  last_eval: dict | None
  stop_reason: str


def _checked(run: Run, rs: RunState, batch: dict, whole: bool) -> dict[str, np.ndarray]:
  """Adds the fault-injection column if asked for, and checks on the host that a global
  batch this process holds whole has N > 0 tokens (else the guard reads N from metrics)."""
  t = run.cfg.train
  if t.debug_nan_step:
    nan = rs.step + 1 == t.debug_nan_step
    batch["poison"] = np.full(len(batch["loss_mask"]), np.nan if nan else 0.0, np.float32)
  if whole and not batch["loss_mask"].any():
    raise EmptyBatchError(
      f"the global batch of epoch {rs.epoch}, step_in_epoch {rs.step_in_epoch} (update "
      f"step {rs.step + 1}) has no loss-masked tokens; raise train.global_batch_size or "
      f"check the data's masks (chat data needs assistant turns)"
    )
  return batch


def next_batch(run: Run, rs: RunState) -> dict[str, np.ndarray]:
  """The global batch at position ``rs`` (every row), checked as the loop checks it."""
  t = run.cfg.train
  batch = data.global_batch(
    run.dataset.train, t.seed, rs.epoch, rs.step_in_epoch, t.global_batch_size, run.dataset.pad_id
  )
  return _checked(run, rs, batch, whole=True)


EVAL_IN_FLIGHT = 4  # eval batches dispatched ahead of the host (see ``evaluate``)


def evaluate(run: Run, params) -> dict:
  """Token-weighted eval loss over the eval split: ``Σ NLL / Σ tokens``, its exp, and bits
  per byte ``Σ NLL / (ln 2 · Σ UTF-8 bytes of the targets)``; the sums are float64 on the
  host.

  At most ``EVAL_IN_FLIGHT`` batches run ahead of the host: dispatching a whole large eval
  split at once (thousands of batches) starves XLA:CPU's collective rendezvous of threads
  and the process aborts after its 40 s timeout; a short queue keeps the device busy all
  the same.
  """
  t, ds = run.cfg.train, run.dataset
  sums, pending = np.zeros(3), collections.deque()
  for b in data.eval_batches(ds.eval, t.global_batch_size, ds.pad_id, t.eval_batches):
    pending.append(run.eval_fn(params, parallel.put_batch(b, run.batch_sharding)))
    if len(pending) >= EVAL_IN_FLIGHT:
      sums += np.asarray(jax.device_get(pending.popleft()), np.float64)
  for out in pending:
    sums += np.asarray(jax.device_get(out), np.float64)
  return eval_record(*sums)


def train(
  cfg: config_lib.Config,
  callbacks: Sequence[Callback] = (),
  *,
  resume: bool = True,
  resume_from: str | None = None,
) -> TrainResult:
  """Trains ``cfg`` to the end (max_steps / epochs / a callback's stop) and returns the state.

  Re-running with the same ``run_dir`` resumes from its newest valid checkpoint, or, if
  that checkpoint is the last step, says so and touches nothing (``resume=False`` sets
  earlier outputs aside; ``resume_from`` starts from another run's checkpoint). One run at
  a time holds ``run_dir``, and nothing is written there before every check has passed.
  SIGTERM/SIGINT save a checkpoint at the update boundary, then raise ``Interrupted``.
  """
  run, state, rs = build(cfg)
  cfg = run.cfg  # resolved: the model's vocabulary follows the tokenizer
  with run_dir_lib.locked(cfg.run_dir) as run_dir:
    ckpt, state, rs = resume_lib.start(
      cfg,
      run_dir,
      state,
      rs,
      resume=resume,
      resume_from=resume_from,
      steps_per_epoch=run.steps_per_epoch,
    )
    if rs.step >= run.total_steps:
      ckpt.close()
      return _already_finished(state, rs, run_dir)
    _first_writes(run, run_dir, ckpt, state)
    return loop(run, state, rs, ckpt=ckpt, run_dir=run_dir, callbacks=callbacks)


def _first_writes(run: Run, run_dir: pathlib.Path, ckpt: Checkpointer, state) -> None:
  """Before the first update: the checkpoint folder can take a checkpoint, then the config
  and the tokenizer copy are written. A failure is one ``RunIOError`` (or ``RunDirError``
  for a file where the folder belongs) and leaves nothing that blocks the next try."""
  try:
    ckpt.check_can_save(state)
    run_dir_lib.write_config(run_dir, config_lib.dump(run.cfg))
    if jax.process_index() == 0:
      save_tokenizer(run_dir, run.dataset)  # generate and evaluate read the run's own copy
      save_base_config(run_dir, run.cfg.model)  # what export writes back out
  except (RunIOError, RunDirError):
    ckpt.close()
    raise
  except OSError as e:
    ckpt.close()
    raise RunIOError(
      f"writing {e.filename or run_dir} failed ({e.strerror or e}); make room, make run_dir "
      f"writable, or choose another run_dir"
    ) from None


def _already_finished(state: TrainState, rs: RunState, run_dir) -> TrainResult:
  """A re-run of a finished command: reports the recorded end, writes nothing."""
  reason = f"already finished at update step {rs.step}"
  log.info("%s; nothing to do (run_dir %s)", reason, run_dir)
  last = (records.read_records(run_dir / "metrics.jsonl") or [{}])[-1]
  evals = records.read_records(run_dir / "eval.jsonl")
  return TrainResult(state, rs, last, evals[-1] if evals else None, reason)


def loop(
  run: Run,
  state: TrainState,
  rs: RunState,
  *,
  ckpt: Checkpointer,
  run_dir: pathlib.Path,
  callbacks: Sequence[Callback] = (),
) -> TrainResult:
  """The update-step loop from position ``rs`` to ``run.total_steps`` (or a stop)."""
  t, t_ckpt = run.cfg.train, run.cfg.checkpoint
  log.info(
    "%d training samples (%d update steps per epoch), %d parameters; update steps "
    "%d → %d of %d samples in %d micro-steps",
    len(run.dataset.train),
    run.steps_per_epoch,
    models.num_params(state.params),
    rs.step,
    run.total_steps,
    t.global_batch_size,
    t.grad_accum_steps,
  )
  writer = jax.process_index() == 0
  sink = (
    MetricsSink(run_dir, start_step=rs.step, total_steps=run.total_steps, progress=t.progress)
    if writer
    else NullSink()
  )
  guard = NonFiniteGuard(t.nonfinite, run_dir if writer else None, t.max_consecutive_skips)
  if t.early_stopping_patience:
    callbacks = [*callbacks, EarlyStopping(t.early_stopping_patience)]
  control = TrainerControl()
  late = LateMetrics(
    sink,
    log_every=t.log_every,
    total_steps=run.total_steps,
    tokens_per_step=t.global_batch_size * t.seq_len,
    flops_per_token=run.flops_per_token,
    peak_flops=peak_flops_per_device(t.peak_tflops),
    spikes_total=_spikes_so_far(run_dir) if writer else 0,
  )

  def after(reported: Reported | None) -> None:
    if reported is not None:
      guard.after_step(reported.step, reported.record, reported.batch, reported.position)
      for cb in callbacks:
        cb.on_step_end(reported.step, reported.record, control)

  def evaluate_and_report() -> dict:
    record = {"step": rs.step, **evaluate(run, state.params)}
    sink.eval(record)
    for cb in callbacks:
      cb.on_evaluate(rs.step, record, control)
    return record

  samples = TextSamples(run.cfg.model, run.dataset.tokenizer, t) if t.sample_every else None
  g = t.global_batch_size
  rows = parallel.local_rows(run.batch_sharding, g)  # None: this process reads every row
  batches = data.BatchLoader(
    run.dataset.train, seed=t.seed, global_batch_size=g, pad_id=run.dataset.pad_id, rows=rows
  ).start(rs.epoch, rs.step_in_epoch)

  def position() -> dict:  # what a checkpoint records besides the state
    return rs.to_json()  # (epoch, step_in_epoch) is the loader's position: start() reads it

  steps = profiling.parse_steps(t.profile_steps)
  profiler = profiling.StepProfiler(steps, run_dir) if steps else None
  started_in = run_dir_lib.identity(run_dir)
  last_eval = None
  try:
    with stop_on_signals() as stop, watch_threads() as threads:
      while rs.step < run.total_steps and not control.should_stop:
        stop.poll(rs.step)  # multi-host: has every process agreed to stop here?
        if stop.signum:
          break
        run_dir_lib.check_still_there(run_dir, started_in)  # one stat call
        ckpt.check()  # a failed background save (as one RunIOError)
        threads.check()  # a dead TensorBoard writer, say
        batch = _checked(run, rs, next(batches), whole=rows is None)
        if profiler is not None:
          profiler.before(rs.step + 1)
        state, metrics = run.step_fn(state, parallel.put_batch(batch, run.batch_sharding, g))
        if profiler is not None:
          profiler.after(rs.step + 1, state)
        where = {"epoch": rs.epoch, "step_in_epoch": rs.step_in_epoch}
        rs = rs.advanced(steps_per_epoch=run.steps_per_epoch, num_samples=len(run.dataset.train))
        after(late.submit(rs.step, metrics, batch, where))
        if guard.needs_every_step:  # read back now: stop before another update is dispatched
          after(late.flush())
        if t_ckpt.every and rs.step % t_ckpt.every == 0:
          ckpt.save(rs.step, state, position())
        if run.dataset.eval and t.eval_every and rs.step % t.eval_every == 0:
          after(late.flush())
          last_eval = evaluate_and_report()
          late.restart_clock()
        if samples is not None and samples.due(rs.step):
          after(late.flush())
          sink.samples(rs.step, samples(rs.step, state.params))
          late.restart_clock()
      if profiler is not None:
        profiler.stop()  # the run ended before the last profiled step
      after(late.flush())
      evaluated = last_eval is not None and last_eval["step"] == rs.step
      if stop.signum is None and run.dataset.eval and not evaluated:
        last_eval = evaluate_and_report()
      threads.check()
      sink.close()
  except BaseException as e:  # a halt or an error: keep the state it got to, then re-raise
    _close_quietly(sink)
    if profiler is not None:
      profiler.stop()
    if not isinstance(e, OSError):
      _final_save(ckpt, state, rs, position(), quiet=True)
      raise
    _close_quietly(ckpt)  # lets a save in flight finish; another would fail like this write
    raise _io_failure(e, run_dir) from e
  try:
    run_dir_lib.check_still_there(run_dir, started_in)
    _final_save(ckpt, state, rs, position())  # always: at the end and on a signal
  except RunIOError as e:
    _close_quietly(ckpt)
    raise _io_failure(e, run_dir) from e
  if stop.signum is not None:
    name = signal.Signals(stop.signum).name
    raise Interrupted(
      f"stopped by {name} at update step {rs.step}; checkpoint saved in "
      f"{run_dir / 'checkpoints'}; re-run the same command to resume",
      stop.signum,
    )
  reason = control.reason or f"reached {rs.step} update steps"
  log.info("done: %s; run_dir %s", reason, run_dir)
  return TrainResult(state, rs, late.last_record, last_eval, reason)


def _spikes_so_far(run_dir: pathlib.Path) -> int:
  """Loss-spike skips of the run before this start: the count in its last logged record
  (the sink has already dropped the records past the step it resumes from); 0 when new.
  The state counts every skip; this splits spikes from non-finite updates in the records."""
  last = (records.read_records(run_dir / "metrics.jsonl") or [{}])[-1]
  return int(last.get("spikes_total", 0))


def _io_failure(error: OSError, run_dir: pathlib.Path) -> RunIOError:
  """A failed write as one ``RunIOError`` naming what failed and the checkpoint to resume
  from."""
  if isinstance(error, run_dir_lib.RemovedError):
    return _removed(error, run_dir)
  if isinstance(error, RunIOError):
    what = str(error)
  else:  # a write here, or TensorBoard's writer thread (which names no file)
    what = f"writing {error.filename or f'in {run_dir}'} failed ({error.strerror or error})"
  newest = step_dirs(run_dir / "checkpoints")
  where = (
    f"the newest complete checkpoint is update step {newest[0][0]}"
    if newest
    else "no checkpoint was completed"
  )
  return RunIOError(f"{what}; {where}. Make room (or fix the directory) and re-run to resume")


def _removed(error: RunIOError, run_dir: pathlib.Path) -> RunIOError:
  """The run stopped writing when it found ``run_dir`` gone; an asynchronous save already
  under way may still have written its step there (orbax creates missing folders)."""
  if not run_dir.exists():
    return RunIOError(f"{error}; nothing more was written. Restore it to resume, or re-run")
  if [p.name for p in run_dir.iterdir()] != ["checkpoints"]:
    return RunIOError(f"{error}; another directory is there now: nothing more was written")
  rewritten = step_dirs(run_dir / "checkpoints")
  what = (
    f"update step {rewritten[0][0]}, which a re-run resumes from"
    if rewritten
    else "no complete checkpoint"
  )
  return RunIOError(
    f"{error}; a checkpoint save already under way re-created {run_dir / 'checkpoints'} with "
    f"{what}, and nothing else"
  )


def _close_quietly(closable) -> None:
  """Closes a writer while another error is already on its way up."""
  try:
    closable.close()
  except Exception as e:  # noqa: BLE001 - the error being raised says what went wrong
    log.debug("closing %s after an error failed too: %s", type(closable).__name__, e)


def _final_save(ckpt, state, rs: RunState, metadata: dict, quiet: bool = False) -> None:
  """Saves ``rs.step`` (a no-op if saved already), waits for it, closes the checkpointer;
  ``quiet``: another error is on its way up, so a failure here is only logged."""
  try:
    ckpt.save(rs.step, state, metadata)
    ckpt.wait()
  except Exception as e:
    _close_quietly(ckpt)
    if not quiet:
      raise
    log.error("final checkpoint at update step %d failed: %s", rs.step, e)  # keep the cause
    return
  ckpt.close()
