"""What a ``metrics.jsonl`` line holds when it is written every ``train.log_every`` updates:
each per-update number's mean over the updates since the line before (``Window``), beside
the last update's step, epoch, lr and flags (``LAST_VALUE``)."""

from __future__ import annotations

# What a written record gives as the last update's value; every other number an update
# reports is the mean over the updates since the record before (``Window``)
LAST_VALUE = frozenset(
  {"step", "epoch", "lr", "loss_scale", "spikes_total", "nonfinite_total", "rl_pass"}
)


class Window:
  """The updates since the last written record: a record written every ``train.log_every``
  updates carries each per-update number's mean over them (the HF Trainer and TRL average
  the loss they log the same way), so a logged reward or loss is not one update's noise.
  Updates the step skipped (a non-finite or spiking loss) are left out of the means; the
  values in ``LAST_VALUE`` and the flags are the last update's. A number only some updates
  report (a sampler's speed, where others trained on given completions) is the mean over
  those."""

  def __init__(self):
    self.sums: dict[str, float] = {}
    self.counts: dict[str, int] = {}
    self.last: dict | None = None

  def add(self, record: dict) -> None:
    self.last = record
    if not record["updated"]:
      return
    for k, v in record.items():
      if k not in LAST_VALUE and isinstance(v, int | float) and not isinstance(v, bool):
        self.sums[k] = self.sums.get(k, 0.0) + v
        self.counts[k] = self.counts.get(k, 0) + 1

  def mean(self) -> dict | None:
    """The last update's record with its numbers averaged over the window; None if empty."""
    if self.last is None:
      return None
    means = {k: self.sums[k] / self.counts[k] for k in self.sums}
    out = {k: means.get(k, v) for k, v in self.last.items()}
    out |= {k: v for k, v in means.items() if k not in out}  # reported by some updates only
    return {**out, "tokens": int(round(out["tokens"]))} if "tokens" in out else out

  def clear(self) -> None:
    self.sums, self.counts, self.last = {}, {}, None
