"""Loading a run's data (``load_dataset``); its epoch order and global batches.

Units: a *sample* is one window of ``seq_len`` targets; a *global batch* is G samples (one
update step). ``steps_per_epoch = ceil(num_samples / G)``; the last batch of an epoch is
padded to G with loss_mask-0 rows (static shapes, no recompile) and still makes an update.

``load_dataset`` is the one entry point: one corpus (``data.path``: ``single_corpus``) or a
mixture of several (``data.sources``: ``mixture``). It sits above both loaders; neither
imports the other or this module. ``DataConfig`` is ``data_config``'s, ``Dataset``
``single_corpus``'s.
"""

from __future__ import annotations

import numpy as np

from jaxstep.data.data_config import DataConfig
from jaxstep.data.mixture import load_mixture
from jaxstep.data.permutation import shuffled_index
from jaxstep.data.single_corpus import Dataset, load_single_corpus


def load_dataset(data_cfg: DataConfig, seq_len: int, progress: bool = False) -> Dataset:
  """The train and eval windows of ``data_cfg`` (prepared first if it is raw input): its
  ``data.sources`` mixed by weight (``mixture.load_mixture``) when it has any, else its
  ``data.path`` (``single_corpus.load_single_corpus``).

  Raises:
    DataError: missing/empty/malformed data, damaged prepared files, or no sample with a
      loss-masked token.
  """
  if data_cfg.sources:
    return load_mixture(data_cfg, seq_len, progress, load_source=load_single_corpus)
  return load_single_corpus(data_cfg, seq_len, progress)


ENDLESS_STEPS = 2**50  # "steps per epoch" of a mixture: it has no epochs, one count of batches


def split_steps_per_epoch(split, global_batch_size: int) -> int:
  """Update steps per pass over ``split``; a mixture (``split.endless``) never ends a pass."""
  if getattr(split, "endless", False):
    return ENDLESS_STEPS
  return steps_per_epoch(len(split), global_batch_size)


def steps_per_epoch(num_samples: int, global_batch_size: int) -> int:
  """``ceil(num_samples / G)`` update steps per pass over the data."""
  return -(-num_samples // global_batch_size)


def epoch_order(seed: int, epoch: int, num_samples: int) -> np.ndarray:
  """The whole order of ``epoch``: window ``epoch_order(…)[p]`` is the ``p``-th of the epoch.

  A pure function of (seed, epoch, num_samples), the same as ``global_batch`` reads a
  batch at a time. O(num_samples): for inspection and tests; a batch needs only its own
  positions, ``shuffled_index(seed, epoch, num_samples, positions)``, O(G).
  """
  if num_samples == 0:
    return np.zeros(0, np.int64)
  return shuffled_index(seed, epoch, num_samples, np.arange(num_samples))


def global_batch(
  split,
  seed: int,
  epoch: int,
  step_in_epoch: int,
  global_batch_size: int,
  pad_id: int,
  rows: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
  """Global batch number ``step_in_epoch`` of ``epoch``: G rows, ``int32[G, seq_len]``.

  Row ``r`` is window ``π(step_in_epoch·G + r)`` of the epoch's keyed permutation ``π``
  (``permutation.shuffled_index``), computed for these G positions only: O(G) time and
  memory whatever the number of windows, and any batch is reached without the ones before.

  ``rows`` (indices into the G rows) reads only those rows, e.g. the ones this process's
  devices hold; the result then has ``len(rows)`` rows.
  """
  if getattr(split, "endless", False):  # a mixture: batch number b is its whole position
    return split.global_batch(seed, epoch * ENDLESS_STEPS + step_in_epoch, global_batch_size,
                              pad_id, rows)  # fmt: skip
  n, start = len(split), step_in_epoch * global_batch_size
  positions = np.arange(min(start, n), min(start + global_batch_size, n))
  index = shuffled_index(seed, epoch, n, positions) if len(positions) else positions
  if rows is None:
    batch = split.rows(index, global_batch_size, pad_id)
  else:
    present = rows[rows < len(index)]  # rows sorted; those past the epoch's end are padding
    batch = split.rows(index[present], len(rows), pad_id)
  return _cut(split, index, batch)


def _cut(split, index: np.ndarray, batch: dict) -> dict:
  """``batch`` cut to the length its split gives the whole global batch ``index`` (pairs:
  ``PairSplit.length_for``; every process computes it from the same global batch, so every
  process's rows have one shape); other splits' batches as they are."""
  length_for = getattr(split, "length_for", None)
  if length_for is None:
    return batch
  length = length_for(index)
  if length is None:
    return batch
  return {k: v[:, :length] if np.ndim(v) == 2 else v for k, v in batch.items()}


def eval_batches(split, global_batch_size: int, pad_id: int, limit: int = 0):
  """The eval split in order, G rows at a time (last padded); ``limit`` 0 = all."""
  n = steps_per_epoch(len(split), global_batch_size)
  for b in range(min(n, limit) if limit else n):
    index = np.arange(b * global_batch_size, min((b + 1) * global_batch_size, len(split)))
    yield _cut(split, index, split.rows(index, global_batch_size, pad_id))
