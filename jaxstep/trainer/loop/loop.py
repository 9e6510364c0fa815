"""The run loop every run goes through: ``jaxstep train`` (the bundled models) and
``jaxstep.Trainer`` (any model) build their parts and hand them to one ``Loop``.

Per update step: stop requests and liveness checks → next global batch → jitted step (state
donated) → the *previous* update's metrics read back (the host never stalls the device) →
hooks at their cadence. Everything else (evaluation, checkpoints at a cadence, samples,
profiling, the non-finite guard, callbacks, trackers) is a hook (``jaxstep.trainer.loop.hooks``).

What the loop guarantees whatever the hooks do: the state it reached is checkpointed at the
end, on a signal and on an error (a failed write is one ``RunIOError`` naming the newest
complete checkpoint); SIGTERM/SIGINT stop at an update boundary, every process of a job at
the same one; a background thread's failure (TensorBoard's writer) stops the run instead of
hanging it; a removed ``run_dir`` stops it at the next update.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import pathlib
import signal
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from jaxstep.errors import Interrupted, RunIOError
from jaxstep.trainer.loop.hooks import Hook
from jaxstep.trainer.loop.signals import stop_on_signals
from jaxstep.trainer.store import run_dir as run_dir_lib
from jaxstep.trainer.store.checkpoint import Checkpointer, step_dirs
from jaxstep.trainer.tracking.metrics import LateMetrics, Reported
from jaxstep.trainer.tracking.threads import watch_threads

log = logging.getLogger("jaxstep")


class BatchSource(Protocol):
  """Where global batches come from, and where the next one starts.

  ``next_batch()`` returns the next global batch (this process's rows; a dict of host
  arrays with leading dimension G) or raises ``StopIteration`` when the data has ended;
  ``where()`` is a small JSON dict naming the next batch's position (``epoch`` at least),
  kept with a skipped batch; ``mark()`` is a cheap token of the position after the batches
  fetched so far (taken after every update), and ``position(mark)`` its JSON dict, which a
  checkpoint records so a resumed run continues with the batch after the last one used."""

  def next_batch(self) -> dict: ...

  def where(self) -> dict: ...

  def mark(self) -> Any: ...

  def position(self, mark) -> dict: ...


@dataclasses.dataclass(frozen=True)
class LoopResult:
  state: Any
  step: int  # update steps done
  position: dict  # the data position after them (what the last checkpoint records)
  last_record: dict  # the last metrics line written (the means of its window)
  evals: dict  # set name -> its last evaluation record
  stop_reason: str
  run_info: dict = dataclasses.field(default_factory=dict)  # what checkpoints kept besides


class Loop:
  """Runs update steps ``start_step + 1 .. total_steps`` (or until a stop).

  Args:
    state: the train state at ``start_step`` (donated to ``step_fn``).
    step_fn: jitted ``(state, device_batch) -> (state, device metrics)``.
    put_batch: host global batch → device batch (sharded as the step expects).
    source: a ``BatchSource`` positioned at the batch after ``start_step`` (closed, if it
      has ``close``, when the run ends).
    start_step, total_steps: update steps done, and where the run ends.
    run_dir: the run's folder (checked still there at every update).
    ckpt: where the final save (and any ``loop.save()``) goes.
    late: reads metrics back one update late and writes the records (``LateMetrics``).
    sink: metrics.jsonl / eval.jsonl / TensorBoard / progress (``MetricsSink``; a
      ``NullSink`` on processes other than 0).
    hooks: called at their cadence, in order.
    run_info: JSON kept with every checkpoint besides the data position (hooks add to it).

  Hooks read ``loop.step``, ``loop.state``, ``loop.last_record``, ``loop.evals``,
  ``loop.run_dir`` and ``loop.writer`` (this process writes the run's files).
  """

  def __init__(
    self,
    *,
    state,
    step_fn: Callable,
    put_batch: Callable[[dict], Any],
    source: BatchSource,
    start_step: int,
    total_steps: int,
    run_dir: pathlib.Path,
    ckpt: Checkpointer,
    late: LateMetrics,
    sink,
    hooks: Sequence[Hook] = (),
    run_info: dict | None = None,
    writer: bool = True,
  ):
    self.state, self.step_fn, self.put_batch, self.source = state, step_fn, put_batch, source
    self.step, self.start_step, self.total_steps = start_step, start_step, total_steps
    self.run_dir, self.ckpt, self.late, self.sink = run_dir, ckpt, late, sink
    self.hooks, self.run_info, self.writer = list(hooks), dict(run_info or {}), writer
    self.evals: dict[str, dict] = {}
    self._mark = source.mark()  # the data position after ``self.step`` updates
    self.stopped_by: int | None = None
    self.should_stop, self.stop_reason = False, ""

  @property
  def last_record(self) -> dict:
    return self.late.last_record

  def stop(self, reason: str) -> None:
    """Ends the run after the current update (its state is checkpointed as at any end)."""
    self.should_stop, self.stop_reason = True, reason

  def metadata(self) -> dict:
    """What a checkpoint records besides the state: the data position after exactly
    ``loop.step`` updates (a batch fetched for an update that then failed is not counted)
    and ``run_info``."""
    return {**self.source.position(self._mark), **self.run_info}

  def save(self) -> None:
    """Checkpoints the state of update ``loop.step`` (asynchronously)."""
    self.ckpt.save(self.step, self.state, self.metadata())

  def report_eval(self, name: str, record: dict) -> None:
    """An evaluation's record (``step``, ``set`` and the values) to eval.jsonl and hooks."""
    self.evals[name] = record
    self.sink.eval(record)
    for hook in self.hooks:
      hook.on_eval(self, name, record)

  def report_samples(self, samples: list[dict]) -> None:
    self.sink.samples(self.step, samples)
    for hook in self.hooks:
      hook.on_samples(self, samples)

  def _report(self, reported: Reported | None) -> None:
    if reported is not None:
      for hook in self.hooks:
        hook.on_metrics(self, reported)

  def _update(self, every_step: bool) -> bool:
    """One update step; False when the data has ended."""
    where = self.source.where()
    try:
      batch = self.source.next_batch()
    except StopIteration:
      self.stop(f"the train data ended after {self.step} update steps")
      return False
    for hook in self.hooks:
      hook.before_step(self, self.step + 1)
    self.state, metrics = self.step_fn(self.state, self.put_batch(batch))
    self.step += 1
    self._mark = self.source.mark()
    for hook in self.hooks:
      hook.after_step(self)
    self._report(self.late.submit(self.step, metrics, batch, where))
    if every_step:  # read back now: stop before another update is dispatched
      self._report(self.late.flush())
    return True

  def _cadence(self) -> None:
    for hook in self.hooks:
      if hook.every and self.step % hook.every == 0:
        if hook.wants_metrics:
          self._report(self.late.flush())
        hook.on_step(self)
        if hook.wants_metrics:
          self.late.restart_clock()  # its time is not the next update's

  def run(self) -> LoopResult:
    """The loop, then the final checkpoint; raises ``Interrupted`` after a signal's save.
    However it ends, the checkpointer, the sink (TensorBoard's writer thread), the hooks and
    the source (a read-ahead thread) are closed."""
    try:
      return self._run()
    finally:
      if callable(getattr(self.source, "close", None)):
        self._close_quietly(self.source)

  def _run(self) -> LoopResult:
    started_in = run_dir_lib.identity(self.run_dir)
    try:
      with stop_on_signals() as stop, watch_threads() as threads:
        self._loop(stop, threads, started_in)
        self.stopped_by = stop.signum  # ends evaluations and samples: save first
        for hook in self.hooks:
          hook.on_end(self)
        self.stopped_by = stop.signum  # one that came during the last hooks counts too
        threads.check()
        self.sink.close()
    except BaseException as e:  # a halt or an error: keep the state it got to, re-raise
      self._close_quietly(self.sink)
      if isinstance(e, OSError):
        straggler = self._close_after_failure()  # a save in flight finishes (or fails)
        self._close_hooks(failed=True)
        raise self._io_failure(e, started_in, straggler) from e
      if self.step > self.start_step:  # nothing new to keep before the first update: a
        self._final_save(quiet=True)  # run failing there leaves no checkpoint 0 behind
      else:
        self._close_quietly(self.ckpt)
      self._close_hooks(failed=True)
      raise
    try:
      run_dir_lib.check_still_there(self.run_dir, started_in)
      self._final_save()  # always: at the end and on a signal
    except RunIOError as e:
      straggler = self._close_after_failure()
      self._close_hooks(failed=True)
      raise self._io_failure(e, started_in, straggler) from e
    self._close_hooks(failed=False)  # trackers upload after the checkpoint is safe
    if self.stopped_by is not None:
      name = signal.Signals(self.stopped_by).name
      raise Interrupted(
        f"stopped by {name} at update step {self.step}; checkpoint saved in "
        f"{self.ckpt.directory}; re-run the same command to resume",
        self.stopped_by,
      )
    reason = self.stop_reason or f"reached {self.step} update steps"
    log.info("done: %s; run_dir %s", reason, self.run_dir)
    return LoopResult(
      self.state,
      self.step,
      self.source.position(self._mark),
      self.late.last_logged or self.last_record,
      self.evals,
      reason,
      dict(self.run_info),
    )

  def _loop(self, stop, threads, started_in) -> None:
    """Update steps until the end, a stop, a signal or the end of the data."""
    every_step = any(h.needs_every_step for h in self.hooks)
    for hook in self.hooks:
      hook.on_start(self)
    while self.step < self.total_steps and not self.should_stop:
      stop.poll(self.step)  # multi-host: has every process agreed to stop here?
      if stop.signum:
        break
      run_dir_lib.check_still_there(self.run_dir, started_in)  # one stat call
      self.ckpt.check()  # a failed background save (as one RunIOError)
      threads.check()  # a dead TensorBoard writer, say
      if not self._update(every_step):
        break
      self._cadence()
    self._report(self.late.flush())
    self.late.log_last()

  def _close_hooks(self, failed: bool) -> None:
    """Every hook's ``on_close`` once the final checkpoint is saved (or has failed): an
    error here is logged, never raised over the run's own outcome."""
    for hook in self.hooks:
      try:
        hook.on_close(self, failed)
      except Exception as e:  # noqa: BLE001 - the run's outcome is decided already
        log.warning("closing %s failed: %s", type(hook).__name__, e)

  @staticmethod
  def _close_quietly(closable) -> None:
    """Closes a writer while another error is already on its way up."""
    try:
      closable.close()
    except Exception as e:  # noqa: BLE001 - the error being raised says what went wrong
      log.debug("closing %s after an error failed too: %s", type(closable).__name__, e)

  def _final_save(self, quiet: bool = False) -> None:
    """Saves ``loop.step`` (a no-op if saved already), waits for it, closes the
    checkpointer; ``quiet``: another error is on its way up, so a failure is only logged."""
    try:
      self.save()
      self.ckpt.wait()
    except Exception as e:
      self._close_quietly(self.ckpt)
      if not quiet:
        raise
      log.error("final checkpoint at update step %d failed: %s", self.step, e)  # keep the cause
      return
    self.ckpt.close()

  def _close_after_failure(self) -> int | None:
    """Closes the checkpointer while a failure is on its way up, waiting for a save in
    flight; returns that save's update step if it failed. orbax stops waiting for a save
    at its first failed write while the save's other writes (tensorstore's threads) go on,
    so files of a failed save may still appear after this returns; of a save that
    completed, or of none, nothing more will."""
    step = self.ckpt.pending
    try:
      self.ckpt.close()
    except Exception as e:  # noqa: BLE001 - the error being raised says what went wrong
      log.debug("closing the checkpointer after an error failed too: %s", e)
      return step
    return None

  def _io_failure(
    self, error: OSError, started_in: int | None, straggler: int | None = None
  ) -> RunIOError:
    """A failed write as one ``RunIOError`` naming what failed and the checkpoint to resume
    from; a write that failed because ``run_dir`` itself went away says that instead
    (``straggler``: the update step of a failed save whose writes may still land)."""
    run_dir = self.run_dir
    try:
      run_dir_lib.check_still_there(run_dir, started_in)
    except run_dir_lib.RemovedError as removed:
      error = removed
    if isinstance(error, run_dir_lib.RemovedError):
      return _removed(error, run_dir, straggler)
    if isinstance(error, RunIOError):
      what = str(error)
    else:  # a write here, or TensorBoard's writer thread (which names no file)
      what = f"writing {error.filename or f'in {run_dir}'} failed ({error.strerror or error})"
    newest = step_dirs(self.ckpt.directory)
    where = (
      f"the newest complete checkpoint is update step {newest[0][0]}"
      if newest
      else "no checkpoint was completed"
    )
    return RunIOError(f"{what}; {where}. Make room (or fix the directory) and re-run to resume")


@contextlib.contextmanager
def closed_on_error():
  """For what a run opens before its ``Loop`` runs (the checkpointer; the sink, with
  TensorBoard's writer thread; the source, with its read-ahead thread), which the ``Loop``
  closes once it runs: ``opened(part)`` registers ``part`` (and returns it), and if the block
  raises, every part is closed, newest first, before the error goes on."""
  with contextlib.ExitStack() as parts:

    def opened(part):
      parts.callback(Loop._close_quietly, part)
      return part

    yield opened
    parts.pop_all()  # the block built the Loop: it closes them from now on


def _removed(error: RunIOError, run_dir: pathlib.Path, straggler: int | None) -> RunIOError:
  """The run stopped writing when it found ``run_dir`` gone; an asynchronous save already
  under way may have written its step there (orbax creates missing folders). When that
  save failed (``straggler``: its update step), its remaining writes may still land after
  this line, so the line says that instead of describing the folder as it is now."""
  if straggler is not None:
    return RunIOError(
      f"{error}; the checkpoint save of update step {straggler} that was under way failed, "
      f"and its writer threads may still re-create {run_dir / 'checkpoints'} with that "
      f"step's temporary files (not a checkpoint: delete them); nothing else was written. "
      f"Restore run_dir to resume, or re-run"
    )
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
