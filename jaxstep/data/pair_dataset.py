"""A preference run's data: a JSONL file of pairs (``preference_pairs``) split into train
and held-out pairs, each a split that the epoch order and the loaders read as they read
windows (``len`` and ``rows``), so a preference run's batches, their order and a resumed
run's position are the supervised run's.

The unit of a split is the pair: ``len`` counts pairs, a global batch is G pairs, and the
last batch of an epoch is padded with rows of ``pair_mask`` 0, which the step's unit count
(``Σ pair_mask``) leaves out.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib

import numpy as np

from jaxstep.data import preference_pairs, row_files
from jaxstep.data.preference_pairs import PairCounts, PairSet
from jaxstep.data.tokenizer_loading import load_tokenizer
from jaxstep.errors import DataError

log = logging.getLogger("jaxstep")


@dataclasses.dataclass(frozen=True)
class PairSplit:
  """Some of a ``PairSet``'s pairs, in file order (``index`` into the set)."""

  pairs: PairSet
  index: np.ndarray
  buckets: int = 1  # preference.length_buckets: the lengths a batch is cut to (1: seq_len)
  multiple: int = 1  # each length a multiple of this (or seq_len)

  def __len__(self) -> int:
    return len(self.index)

  def length_for(self, index: np.ndarray) -> int | None:
    """The length the global batch of pairs ``index`` (indices into this split) is cut to:
    the shortest of ``step · i`` (at most ``seq_len``; ``step``: ``⌈seq_len / buckets⌉``
    rounded up to a multiple of ``multiple``) that holds every
    position one of its pairs reads (``preference_pairs.used_length``); None with one
    bucket. Past it every row is padding no loss term reads, and causal attention never
    lets it change a term before it, so cutting it changes no value: a batch of short
    pairs costs what its pairs need, as a batch padded to its longest pair does, while the
    step compiles at most ``buckets`` shapes."""
    if self.buckets <= 1:
      return None
    used = preference_pairs.used_length(self.pairs, self.index[np.asarray(index, np.int64)])
    step = -(-self.pairs.seq_len // self.buckets)
    step = -(-step // self.multiple) * self.multiple
    return min(self.pairs.seq_len, max(1, -(-used // step)) * step)

  def rows(self, index: np.ndarray, n: int, pad_id: int) -> dict[str, np.ndarray]:
    """Pairs ``index`` of this split as ``n`` batch rows, the rest padding (``pair_mask``
    0); ``pad_id`` is unused: a padding row is zeros, read by nothing."""
    del pad_id
    return preference_pairs.pair_batch(self.pairs, self.index[np.asarray(index)], n)


@dataclasses.dataclass(frozen=True)
class PairDataset:
  """What a preference run reads: ``train`` and ``eval`` (``None`` without held-out pairs)
  splits of one file's pairs, with the fields a run reads of any dataset."""

  train: PairSplit
  eval: PairSplit | None
  counts: PairCounts
  fingerprint: str  # of the files' bytes, the tokenizer and the length settings
  pad_id: int
  vocab_size: int
  tokenizer_spec: str  # data.tokenizer: "byte", a file, or a model folder
  tokenizer: object = dataclasses.field(repr=False, compare=False)  # the one the pairs used
  kind: str = "pairs"
  source_evals: dict = dataclasses.field(default_factory=dict)  # no mixture: none

  @property
  def pairs(self) -> PairSet:
    """Every kept pair, train and held-out, in file order."""
    return self.train.pairs

  def with_reference(self, ref_logps: np.ndarray) -> PairDataset:
    """This dataset with the reference's ``(chosen, rejected)`` log-probs of every pair
    (float32[N, 2], file order), which its batches then carry as ``ref_*_logps``."""
    pairs = dataclasses.replace(self.pairs, ref_logps=np.asarray(ref_logps, np.float32))
    split = lambda s: s and dataclasses.replace(s, pairs=pairs)  # noqa: E731
    return dataclasses.replace(self, train=split(self.train), eval=split(self.eval))

  def tokenizer_files(self) -> list[pathlib.Path]:
    """The files that carry the tokenizer: what a run dir keeps a copy of."""
    return row_files.tokenizer_files(self.tokenizer_spec)


def load_pair_dataset(
  path: str,
  tokenizer: str,
  *,
  seq_len: int,
  max_prompt_len: int | None,
  eval_fraction: float,
  length_buckets: int = 1,
  length_multiple: int = 1,
) -> PairDataset:
  """The pairs of ``path`` (a JSONL file, folder or glob) encoded with ``tokenizer``, cut
  to the lengths (``preference_pairs.pair_set``), ``eval_fraction`` of them held out by a
  fixed hash of the pair's place (the held-out pairs do not move with ``train.seed``);
  ``length_buckets``, ``length_multiple``: ``PairSplit.length_for``'s.

  Raises:
    DataError: the file's rows (one line naming the row), or no pair kept.
  """
  tok = load_tokenizer(tokenizer)
  rows = preference_pairs.read_pairs(path)
  pairs = preference_pairs.pair_set(rows, tok, seq_len=seq_len, max_prompt_len=max_prompt_len)
  held = row_files.held_out(len(pairs), eval_fraction)
  c = pairs.counts
  log.info(
    "preference pairs: %d rows read, %d kept (%d held out); %d prompts and %d completions "
    "truncated, %d pairs dropped (a completion kept no token, or %d with chosen = rejected)",
    c.rows,
    len(pairs),
    int(held.sum()),
    c.prompt_truncated,
    c.completion_truncated,
    c.dropped,
    c.identical,
  )
  settings = {"tokenizer": tok.describe(), "seq_len": seq_len, "max_prompt_len": max_prompt_len}
  digest = row_files.fingerprint(path, tokenizer, {**settings, "eval_fraction": eval_fraction})
  return PairDataset(
    train=PairSplit(pairs, np.flatnonzero(~held), length_buckets, length_multiple),
    eval=PairSplit(pairs, np.flatnonzero(held), length_buckets, length_multiple)
    if held.any()
    else None,
    counts=c,
    fingerprint=digest,
    pad_id=tok.PAD,
    vocab_size=tok.vocab_size,
    tokenizer_spec=tokenizer,
    tokenizer=tok,
  )


def load_pair_eval_set(
  name: str, path: str, dataset: PairDataset, *, seq_len: int, max_prompt_len: int
) -> PairSplit:
  """``eval.sets.<name>``: every pair of ``path`` (a JSONL file, folder, glob or bundled
  set), encoded with the training pairs' tokenizer and cut to the same lengths.

  Raises:
    DataError: one line naming ``eval.sets.<name>`` and what is wrong with its rows.
  """
  try:
    rows = preference_pairs.read_pairs(path)
    pairs = preference_pairs.pair_set(
      rows, dataset.tokenizer, seq_len=seq_len, max_prompt_len=max_prompt_len
    )
  except DataError as e:
    raise DataError(f"eval.sets.{name}: {e}") from e
  c = pairs.counts
  log.info(
    "eval.sets.%s: %d pairs of %d rows (%d pairs dropped: a completion kept no token, or %d "
    "with chosen = rejected)",
    name,
    len(pairs),
    c.rows,
    c.dropped,
    c.identical,
  )
  return dataclasses.replace(dataset.train, pairs=pairs, index=np.arange(len(pairs)))
