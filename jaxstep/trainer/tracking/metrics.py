"""Where metrics go: ``metrics.jsonl`` / ``eval.jsonl``, TensorBoard events, progress bar;
and ``LateMetrics``, which reads each update's device metrics back one update late.

TensorBoard events are written with tensorboardX (``tensorboard_events``): maintained,
small, and needs neither TensorFlow nor a JAX-specific runtime (clu's writers pull in
TensorFlow).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import pathlib
import sys
import time

import jax
import tqdm

from jaxstep.trainer.config.eval_section import HARNESS_SET
from jaxstep.trainer.store import records
from jaxstep.trainer.store import run_dir as run_dir_lib
from jaxstep.trainer.tracking import tensorboard_events
from jaxstep.trainer.tracking.mfu import mfu
from jaxstep.trainer.tracking.window import Window

log = logging.getLogger("jaxstep")


# What every metrics.jsonl line holds; aux sums and counters come on top.
TRAIN_FIELDS = (
  "step",
  "epoch",
  "loss",
  "tokens",
  "lr",
  "grad_norm",
  "updated",
  "tokens_per_sec",
  "mfu",
  "step_time",
)


def is_spike_skip(record: dict) -> bool:
  """Was this skipped update a loss spike, not a non-finite one? True when the step flagged
  a spike and its loss, extra loss and gradient norm are all finite (a spike flag on an
  update that also overflowed is non-finite)."""
  return (
    bool(record["skipped"])
    and bool(record.get("spike", False))
    and all(math.isfinite(record.get(k, 0.0)) for k in ("loss", "extra_loss", "grad_norm"))
  )


class MetricsSink:
  """Writes one JSON line per logged update step and per evaluation; mirrors to TensorBoard.

  Args:
    run_dir: output folder.
    start_step: update steps already done (a resumed run); later lines are discarded.
    total_steps: for the progress bar.
    progress: show a tqdm bar (only when stderr is a terminal; plain log lines otherwise).
    tensorboard: also write TensorBoard events (``train.trackers`` names ``tensorboard``).
  """

  def __init__(
    self,
    run_dir: pathlib.Path,
    *,
    start_step: int,
    total_steps: int,
    progress: bool,
    tensorboard: bool = True,
  ):
    self.run_dir = run_dir
    self.train_path, self.eval_path = run_dir / "metrics.jsonl", run_dir / "eval.jsonl"
    self.samples_path = run_dir / "samples.jsonl"
    for path in (self.train_path, self.eval_path, self.samples_path):
      records.truncate_records(path, start_step)
    # held open for the run: the directory's inode cannot be freed and given to a new
    # directory of the same name, so the identity check below cannot be fooled
    self.held = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
    self.tb = (
      tensorboard_events.open_events(run_dir / "tensorboard", purge_step=start_step + 1)
      if tensorboard
      else tensorboard_events.NoEvents()
    )
    self.bar = tqdm.tqdm(
      total=total_steps,
      initial=start_step,
      unit="step",
      dynamic_ncols=True,
      disable=not (progress and sys.stderr.isatty()),
    )

  def _append(self, path: pathlib.Path, record: dict) -> None:
    """One line, unless ``run_dir`` is no longer the directory the run started in
    (``run_dir.RemovedError``): a line appended to a run dir that something else re-created
    (a save still under way makes its missing parents) would start a half-run's history."""
    run_dir_lib.check_still_there(self.run_dir, os.fstat(self.held).st_ino)
    records.append(path, record)

  def advance(self, record: dict) -> None:
    """Every update step: move the bar; show the latest loss and throughput."""
    self.bar.update(1)
    self.bar.set_postfix(
      loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_sec']:.0f}", refresh=False
    )

  def train(self, record: dict) -> None:
    """A logged update step (fields: ``TRAIN_FIELDS`` plus aux such as ``skipped``)."""
    self._append(self.train_path, record)
    for key, value in record.items():
      if key not in ("step", "epoch"):
        self.tb.add_scalar(tensorboard_events.tag(f"train/{key}"), float(value), record["step"])
    if self.bar.disable:
      log.info(
        "step %d  epoch %d  loss %.4f  lr %.2e  grad_norm %.3f  tok/s %.0f",
        record["step"],
        record["epoch"],
        record["loss"],
        record["lr"],
        record["grad_norm"],
        record["tokens_per_sec"],
      )

  def eval(self, record: dict) -> None:
    """One evaluation of one set: an ``eval.jsonl`` line (``step``, ``set`` and the values);
    TensorBoard ``eval/<key>`` for the held-out split, ``eval/<set>/<key>`` for the others.
    Keys other than ``eval_loss``/``eval_ppl``/``eval_bpb`` (a ``Trainer``'s sums) go to
    TensorBoard under their own names."""
    self._append(self.eval_path, record)
    name = record.get("set", "heldout")
    tag = "eval" if name == "heldout" else f"eval/{name}"
    for key, value in record.items():
      if key not in ("step", "set") and not isinstance(value, bool | str):
        # lm-evaluation-harness results are named harness/<task>/<metric> already
        tagged = key if name == HARNESS_SET else f"{tag}/{key.removeprefix('eval_')}"
        self.tb.add_scalar(tensorboard_events.tag(tagged), float(value), record["step"])
    shown = "  ".join(
      f"{key.removeprefix('eval_').removeprefix(f'{HARNESS_SET}/')} {value:.4g}"
      for key, value in record.items()
      if key in ("eval_loss", "eval_ppl", "eval_bpb", "loss", "eval_reward")
      or key.startswith(("eval_rewards/", f"{HARNESS_SET}/"))
    )
    self._say(f"eval {name} at step {record['step']}: {shown}")

  def samples(self, step: int, samples: list[dict]) -> None:
    """Generated samples of update ``step``: one ``samples.jsonl`` line each, TensorBoard
    text per prompt, and the greedy ones in the log."""
    for i, record in enumerate(samples):
      self._append(self.samples_path, record)
      text = f"**{record['mode']}** `{record['prompt']}` → `{record['text']}`"
      self.tb.add_text(f"samples/{i}", text, step)
      if record["mode"] == "greedy":
        self._say(f"sample at step {step}: {record['prompt'] + record['text']!r}")

  def _say(self, message: str) -> None:
    """A line above the progress bar on a terminal; a log line elsewhere."""
    if self.bar.disable:
      log.info(message)
    else:
      self.bar.write(message)

  def close(self) -> None:
    """Closes the bar and the TensorBoard writer; a failed last flush of the events (a full
    disk) is raised, and the writer's thread and file are ended all the same."""
    try:
      self.bar.close()
    finally:
      if self.held is not None:
        os.close(self.held)
        self.held = None
      tensorboard_events.close_events(self.tb)


class NullSink:
  """What processes other than 0 write: nothing (process 0 speaks for the job)."""

  def advance(self, record: dict) -> None:
    pass

  train = eval = advance

  def samples(self, step: int, records: list[dict]) -> None:
    pass

  def close(self) -> None:
    pass


@dataclasses.dataclass(frozen=True)
class Reported:
  """One update step's host record, with the global batch it consumed and where from."""

  step: int
  record: dict
  batch: dict
  position: dict
  logged: dict | None = None  # the record written at this step (a window's means), if any


class LateMetrics:
  """Reads update s's device metrics only after update s+1 was dispatched, so the host
  never stalls the device; turns them into a ``metrics.jsonl`` record and writes it.

  Args:
    sink: where records go (``MetricsSink`` or ``NullSink``).
    log_every: write every this many update steps (and at ``total_steps``).
    total_steps: the run's last update step.
    tokens_per_step: input positions per update (G × S), for ``tokens_per_sec``, or
      ``batch -> positions`` (a batch whose length varies); None: each update's
      normalization units (its ``tokens`` metric) instead.
    flops_per_token: model FLOPs per token, for ``mfu``.
    peak_flops: per-device peak FLOP/s, for ``mfu``.
    spikes_total: loss-spike skips before ``start``: a resumed run continues the count of
      its last logged record. ``nonfinite_total`` is the state's skip count less spikes.
    host_fields: ``batch -> {field: value}`` added to each record from the host batch
      (a mixture's tokens per source); None: none.
  """

  def __init__(
    self,
    sink: MetricsSink | NullSink,
    *,
    log_every: int,
    total_steps: int,
    tokens_per_step,
    flops_per_token: float,
    peak_flops: float,
    spikes_total: int = 0,
    host_fields=None,
  ):
    self.spikes_total, self.host_fields = spikes_total, host_fields
    self.sink, self.log_every, self.total_steps = sink, log_every, total_steps
    self.tokens_per_step, self.flops_per_token, self.peak = (
      tokens_per_step,
      flops_per_token,
      peak_flops,
    )
    self.pending = None
    self.last_record: dict = {}
    self.logged_step: int | None = None
    self.last_logged: dict = {}  # the last line written: its window's means
    self.window = Window()
    self.clock = time.perf_counter()

  def submit(self, step: int, metrics: dict, batch: dict, position: dict) -> Reported | None:
    """Queues update ``step`` (device metrics, host batch, position); reports the previous."""
    previous, self.pending = self.pending, (step, metrics, batch, position)
    return self._report(*previous) if previous else None

  def flush(self) -> Reported | None:
    """Reports the queued update now (waits for it)."""
    previous, self.pending = self.pending, None
    return self._report(*previous) if previous else None

  def restart_clock(self) -> None:
    """Time spent outside the step (an evaluation) is not charged to the next update."""
    self.clock = time.perf_counter()

  def _report(self, step: int, metrics: dict, batch: dict, position: dict) -> Reported:
    values = {k: float(v) for k, v in jax.device_get(metrics).items()}  # waits for the step
    skipped_total = values.pop("skipped_total", 0.0)
    self.spikes_total += is_spike_skip({**values, "skipped": not values["updated"]})
    now = time.perf_counter()
    step_time, self.clock = now - self.clock, now
    per_step = self.tokens_per_step
    if per_step is None:
      per_step = values["tokens"]
    elif callable(per_step):  # preference batches cut to their pairs: from the batch's length
      per_step = per_step(batch)
    tokens_per_sec = per_step / step_time
    record = {
      "step": step,
      "epoch": position["epoch"],
      **values,
      "updated": bool(values["updated"]),
      "skipped": not values["updated"],
      "spike": bool(values.get("spike", 0.0)),
      "spikes_total": self.spikes_total,  # skipped as loss spikes (finite)
      # every other skip is non-finite: the driver never dispatches N = 0
      "nonfinite_total": int(skipped_total) - self.spikes_total,
      "tokens": int(values["tokens"]),
      "tokens_per_sec": tokens_per_sec,
      "mfu": mfu(self.flops_per_token, tokens_per_sec, self.peak, jax.device_count()),
      "step_time": step_time,
      **(self.host_fields(batch) if self.host_fields else {}),
    }
    self.last_record = record
    self.sink.advance(record)
    self.window.add(record)
    logged = None
    if step % self.log_every == 0 or step == self.total_steps:
      logged = self.last_logged = self.unlogged()
      self.sink.train(logged)
      self.logged_step = step
      self.window.clear()
    return Reported(step, record, batch, position, logged)

  def unlogged(self) -> dict | None:
    """The record of the updates since the last written one (``Window.mean``), or None."""
    return self.window.mean()

  def log_last(self) -> None:
    """At the end of a run that stopped between two logged steps (a hook's stop, a signal,
    the data's end): its last update's record is written too, so metrics.jsonl ends at the
    step the final checkpoint holds."""
    step = self.last_record.get("step")
    if step is not None and step != self.logged_step:
      self.last_logged = self.unlogged()
      self.sink.train(self.last_logged)
      self.logged_step = step


def spikes_so_far(run_dir: pathlib.Path) -> int:
  """Loss-spike skips of the run before this start: the count in its last logged record
  (the sink has already dropped the records past the step it resumes from); 0 when new.
  The state counts every skip; this splits spikes from non-finite updates in the records."""
  last = (records.read_records(run_dir / "metrics.jsonl") or [{}])[-1]
  return int(last.get("spikes_total", 0))


def open_records(
  run_dir: pathlib.Path,
  train_cfg,
  *,
  start_step: int,
  total_steps: int,
  writer: bool,
  tokens_per_step,
  flops_per_token: float,
  peak_flops: float,
  host_fields=None,
) -> tuple[MetricsSink | NullSink, LateMetrics]:
  """The sink (process 0: metrics.jsonl, eval.jsonl, TensorBoard if ``train.trackers``
  names it, progress; others: nothing) and the one-update-late reader feeding it."""
  t = train_cfg
  sink = (
    MetricsSink(
      run_dir,
      start_step=start_step,
      total_steps=total_steps,
      progress=t.progress,
      tensorboard="tensorboard" in t.trackers,
    )
    if writer
    else NullSink()
  )
  late = LateMetrics(
    sink,
    log_every=t.log_every,
    total_steps=total_steps,
    tokens_per_step=tokens_per_step,
    flops_per_token=flops_per_token,
    peak_flops=peak_flops,
    spikes_total=spikes_so_far(run_dir) if writer else 0,
    host_fields=host_fields,
  )
  return sink, late
