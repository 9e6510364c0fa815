"""Where metrics go: ``metrics.jsonl`` / ``eval.jsonl``, TensorBoard events, progress bar.

TensorBoard events are written with tensorboardX: maintained, small, and needs neither
TensorFlow nor a JAX-specific runtime (clu's writers pull in TensorFlow).
"""

from __future__ import annotations

import json
import logging
import math
import pathlib
import sys

import numpy as np
import tqdm
from tensorboardX import SummaryWriter

log = logging.getLogger("jaxstep")

# What every metrics.jsonl line holds (DESIGN §8); aux sums and counters come on top.
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


def truncate_jsonl(path: pathlib.Path, last_step: int) -> None:
  """Drops lines with ``step > last_step`` (a resumed run rewrites them; no duplicates)."""
  if not path.exists():
    return
  keep = [
    line
    for line in path.read_text().splitlines()
    if line.strip() and json.loads(line)["step"] <= last_step
  ]
  path.write_text("".join(line + "\n" for line in keep))


def _clean(value):
  """JSON has no NaN/inf: write them as strings a reader can still parse with float()."""
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)
  return value


class MetricsSink:
  """Writes one JSON line per logged update step and per evaluation; mirrors to TensorBoard.

  Args:
    run_dir: output folder.
    start_step: update steps already done (a resumed run); later lines are discarded.
    total_steps: for the progress bar.
    progress: show a tqdm bar (only when stderr is a terminal; plain log lines otherwise).
  """

  def __init__(self, run_dir: pathlib.Path, *, start_step: int, total_steps: int, progress: bool):
    self.run_dir = run_dir
    self.train_path, self.eval_path = run_dir / "metrics.jsonl", run_dir / "eval.jsonl"
    for path in (self.train_path, self.eval_path):
      truncate_jsonl(path, start_step)
    # purge_step tells TensorBoard to drop events a resumed run is about to write again
    self.tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start_step + 1)
    self.bar = tqdm.tqdm(
      total=total_steps,
      initial=start_step,
      unit="step",
      dynamic_ncols=True,
      disable=not (progress and sys.stderr.isatty()),
    )

  def _append(self, path: pathlib.Path, record: dict) -> None:
    with path.open("a") as f:
      f.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")

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
        self.tb.add_scalar(f"train/{key}", float(value), record["step"])
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
    self._append(self.eval_path, record)
    for key in ("eval_loss", "eval_ppl"):
      self.tb.add_scalar(f"eval/{key[5:]}", record[key], record["step"])
    message = (
      f"eval at step {record['step']}: loss {record['eval_loss']:.4f}  ppl {record['eval_ppl']:.2f}"
    )
    if self.bar.disable:
      log.info(message)
    else:
      self.bar.write(message)

  def bad_batch(self, step: int, batch: dict, position: dict) -> pathlib.Path:
    """Saves a global batch whose update was non-finite: ``bad_batches/step_N.npz``."""
    folder = self.run_dir / "bad_batches"
    folder.mkdir(exist_ok=True)
    path = folder / f"step_{step:08d}.npz"
    np.savez(path, **batch)
    path.with_suffix(".json").write_text(json.dumps({"step": step, **position}) + "\n")
    return path

  def close(self) -> None:
    self.bar.close()
    self.tb.close()


class NullSink:
  """What processes other than 0 write: nothing (process 0 speaks for the job)."""

  def advance(self, record: dict) -> None:
    pass

  train = eval = advance

  def bad_batch(self, step: int, batch: dict, position: dict) -> None:
    return None

  def close(self) -> None:
    pass
