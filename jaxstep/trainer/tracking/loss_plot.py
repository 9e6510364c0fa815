"""``run_dir/loss.png``: train loss with every eval set's loss, the lr and the grad norm,
against the update step (what ``jaxstep plot`` writes and trackers receive at the end).
"""

from __future__ import annotations

import logging
import pathlib

from jaxstep.errors import RunDirError, RunIOError
from jaxstep.trainer.store.records import read_records

log = logging.getLogger("jaxstep")

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
  plt = _pyplot()
  fig, (ax_loss, ax_lr, ax_norm) = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
  ax_loss.plot(steps, [float(r["loss"]) for r in train], label="train loss")
  for name in dict.fromkeys(r.get("set", "heldout") for r in evals):
    mine = [r for r in evals if r.get("set", "heldout") == name]
    steps_of = [float(r["step"]) for r in mine]
    ax_loss.plot(steps_of, [float(r["eval_loss"]) for r in mine], "o-", label=f"eval loss: {name}")
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


def plot_quietly(run_dir: pathlib.Path) -> pathlib.Path | None:
  """``plot_run``, or None with one warning when there is nothing to plot or no room."""
  try:
    return plot_run(run_dir)
  except (RunDirError, RunIOError) as e:
    log.warning("no loss plot for the trackers: %s", e)
    return None


def _pyplot():
  """matplotlib's pyplot on the file-only Agg backend (never needs a display), imported when
  a plot is drawn rather than at every run's start (~0.3 s)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  return plt
