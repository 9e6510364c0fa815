"""``jaxstep plot RUN_DIR``: ``RUN_DIR/loss.png`` with train/eval loss, lr, grad norm.

The x axis is the update step throughout.
"""

from __future__ import annotations

import argparse
import pathlib

import matplotlib

from jaxstep.cli._common import report
from jaxstep.errors import RunDirError
from jaxstep.trainer.records import read_records

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402


def plot_run(run_dir: str | pathlib.Path) -> pathlib.Path:
  """Writes and returns ``run_dir/loss.png``; raises ``RunDirError`` without metrics."""
  run_dir = pathlib.Path(run_dir)
  train = read_records(run_dir / "metrics.jsonl")
  if not train:
    raise RunDirError(f"{run_dir / 'metrics.jsonl'} is missing or empty")
  evals = read_records(run_dir / "eval.jsonl")
  steps = [r["step"] for r in train]
  fig, (ax_loss, ax_lr, ax_norm) = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
  ax_loss.plot(steps, [float(r["loss"]) for r in train], label="train loss")
  if evals:
    ax_loss.plot(
      [r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss"
    )
  ax_loss.set_ylabel("loss (nats / token)")
  ax_loss.legend()
  ax_lr.plot(steps, [float(r["lr"]) for r in train])
  ax_lr.set_ylabel("learning rate")
  ax_norm.plot(steps, [float(r["grad_norm"]) for r in train])
  ax_norm.set_ylabel("grad norm (pre-clip)")
  ax_norm.set_xlabel("update step")
  fig.suptitle(str(run_dir))
  fig.tight_layout()
  out = run_dir / "loss.png"
  fig.savefig(out, dpi=100)
  plt.close(fig)
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="jaxstep plot", description=__doc__)
  p.add_argument("run_dir")
  args = p.parse_args(argv)
  try:
    print(plot_run(args.run_dir))
  except RunDirError as e:
    return report(e)
  return 0
