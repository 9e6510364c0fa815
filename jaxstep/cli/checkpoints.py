"""``jaxstep checkpoints RUN_DIR``: list checkpoints with step, epoch, loss, size, validity.

Every checkpoint is read back the way a resume reads it: its arrays and its run state
checked against the checksums saved with them (and for NaN/inf), so "ok" means a resume
would restore it. A step orbax is still writing (a save under way) is "in progress". The
loss is the ``metrics.jsonl`` line of that update step (the mean over the updates since the
line before; "-" if none was written at that step).
"""

from __future__ import annotations

import logging
import pathlib

from jaxstep.cli._common import Parser, report
from jaxstep.errors import RunDirError
from jaxstep.trainer.store.checkpoint import list_checkpoints
from jaxstep.trainer.store.records import read_records


def table(run_dir: pathlib.Path) -> list[str]:
  losses = {  # a line without a step or a loss (edited, foreign) is passed over
    r["step"]: r["loss"]
    for r in read_records(run_dir / "metrics.jsonl")
    if isinstance(r.get("step"), int) and isinstance(r.get("loss"), int | float | str)
  }
  rows = [f"{'step':>8} {'epoch':>6} {'loss':>9} {'size MB':>9}  status"]
  for info in list_checkpoints(run_dir / "checkpoints", verify=True):
    epoch = info.run.get("epoch", "-") if info.run else "-"
    loss = losses.get(info.step)
    try:
      loss = f"{float(loss):.4f}"
    except (TypeError, ValueError):
      loss = "-"
    status = "ok" if info.problem is None else f"INVALID: {info.problem}"
    if info.in_progress:
      status = "in progress"
    rows.append(f"{info.step:>8} {epoch!s:>6} {loss:>9} {info.size_bytes / 2**20:>9.3f}  {status}")
  return rows


def main(argv=None) -> int:
  p = Parser(prog="jaxstep checkpoints", description=__doc__)
  p.add_argument("run_dir")
  args = p.parse_args(argv)
  logging.getLogger("absl").setLevel(logging.ERROR)  # orbax's read-only notices
  run_dir = pathlib.Path(args.run_dir)
  if not (run_dir / "checkpoints").is_dir():
    return report(RunDirError(f"{run_dir / 'checkpoints'} does not exist"))
  print("\n".join(table(run_dir)))
  return 0
