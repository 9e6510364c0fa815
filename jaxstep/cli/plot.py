"""``jaxstep plot RUN_DIR``: ``RUN_DIR/loss.png`` with train/eval loss, lr, grad norm.

The x axis is the update step throughout.
"""

from __future__ import annotations

import argparse
import pathlib

import matplotlib

from jaxstep.cli._common import report
from jaxstep.errors import RunDirError, RunIOError
from jaxstep.trainer.records import read_records

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402

FIELDS = ("step", "loss", "lr", "grad_norm")  # what every training metrics line holds


def _usable(records: list[dict], fields: tuple[str, ...]) -> list[dict]:
  """The records that hold every field as a number (a hand-edited or foreign line is
  passed over, as a cut one is)."""

  def number(value) -> bool:
    try:
      float(value)
    except (TypeError, ValueError):
      return False
    return not isinstance(value, bool)

  return [r for r in records if all(number(r.get(f)) for f in fields)]


def plot_run(run_dir: str | pathlib.Path) -> pathlib.Path:
  """Writes and returns ``run_dir/loss.png``; raises ``RunDirError`` without usable metrics
  and ``RunIOError`` when the picture cannot be written."""
  run_dir = pathlib.Path(run_dir)
  train = _usable(read_records(run_dir / "metrics.jsonl"), FIELDS)
  if not train:
    raise RunDirError(
      f"{run_dir / 'metrics.jsonl'} is missing or has no line with {', '.join(FIELDS)}"
    )
  evals = _usable(read_records(run_dir / "eval.jsonl"), ("step", "eval_loss"))
  steps = [float(r["step"]) for r in train]
  fig, (ax_loss, ax_lr, ax_norm) = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
  ax_loss.plot(steps, [float(r["loss"]) for r in train], label="train loss")
  if evals:
    ax_loss.plot(
      [float(r["step"]) for r in evals],
      [float(r["eval_loss"]) for r in evals],
      "o-",
      label="eval loss",
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
  try:
    fig.savefig(out, dpi=100)
  except OSError as e:
    raise RunIOError(
      f"cannot write {out} ({e.strerror}); plot a run dir you can write to"
    ) from None
  finally:
    plt.close(fig)
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="jaxstep plot", description=__doc__)
  p.add_argument("run_dir")
  args = p.parse_args(argv)
  try:
    print(plot_run(args.run_dir))
  except (RunDirError, RunIOError) as e:
    return report(e)
  return 0
