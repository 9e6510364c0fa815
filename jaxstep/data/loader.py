"""Global batches in training order, read ahead by a Grain pipeline.

Batch ``b`` of a run is batch ``step`` of ``epoch`` with ``(epoch, step) = divmod(b,
steps_per_epoch)``: ``dataset.global_batch``, a pure function of (seed, epoch, step). The
pipeline is a ``grain.MapDataset`` from ``b`` to that batch, read ahead in a background
thread. Its position follows from the run state's ``(epoch, step_in_epoch)``, which every
checkpoint records: a resumed run starts it there with nothing replayed, so the loader
keeps no state of its own that could disagree with the run's.
"""

from __future__ import annotations

import grain
import numpy as np

from jaxstep.data.dataset import global_batch, split_steps_per_epoch


class BatchLoader:
  """Iterates global batches from ``(epoch, step_in_epoch)`` on, ``prefetch`` ahead.

  Args:
    split: the training windows.
    seed: the run's seed (epoch order).
    global_batch_size: G.
    pad_id: fills the rows past the end of an epoch.
    rows: the rows of each global batch to read (this process's devices'); None: all G.
    prefetch: batches read ahead in the background.
  """

  def __init__(
    self,
    split,
    *,
    seed: int,
    global_batch_size: int,
    pad_id: int,
    rows: np.ndarray | None = None,
    prefetch: int = 2,
  ):
    self.steps_per_epoch = split_steps_per_epoch(split, global_batch_size)

    def batch(b: int) -> dict:
      epoch, step = divmod(b, self.steps_per_epoch)
      return global_batch(split, seed, epoch, step, global_batch_size, pad_id, rows)

    options = grain.ReadOptions(num_threads=1, prefetch_buffer_size=prefetch)
    self._batches = grain.MapDataset.range(2**62).map(batch).to_iter_dataset(options)
    self._it = None

  def start(self, epoch: int, step_in_epoch: int) -> BatchLoader:
    """Positions the loader at batch ``step_in_epoch`` of ``epoch``."""
    self.close()
    self._it = iter(self._batches)
    self._it.set_state({"next_index": epoch * self.steps_per_epoch + step_in_epoch})
    return self

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    return next(self._it)

  def close(self) -> None:
    """Ends the read-ahead thread (started by ``start``); ``start`` starts it again."""
    it, self._it = self._it, None
    if callable(getattr(it, "close", None)):
      it.close()

  def __enter__(self) -> BatchLoader:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def state(self) -> dict:
    """The position of the next batch (JSON-able): ``epoch × steps_per_epoch +
    step_in_epoch``, for inspection; resume restarts from the run state instead."""
    return dict(self._it.get_state())
