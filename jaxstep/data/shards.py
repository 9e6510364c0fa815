"""Reading prepared data: one split's token stream over memory-mapped shard files, and the
fixed-length windows (samples) cut from it at read time.

A window holds ``seq_len + 1`` tokens: ``inputs = w[:-1]``, ``targets = w[1:]``,
``loss_mask = flags[1:]``, where a token's flag says whether it may be a target (chat: the
stored flags; text: every token but each document's first, its BOS, found by position, so
the target that would predict across an EOS into the next document is masked). Windows
advance by ``seq_len``, so every flagged token is a target exactly once; the last window of
a stream (or of a document) is padded with PAD tokens whose flag is 0. Packed
(``pack=True``): windows run over the whole stream; otherwise each document starts its own
windows.

Nothing is read until a window is asked for, so start-up time and memory do not grow with
the corpus: the only arrays built up front are the document offsets (unpacked windows).
"""

from __future__ import annotations

import mmap
import pathlib

import numpy as np


def _random_access(array: np.memmap) -> np.memmap:
  """Training reads windows in a shuffled order: the kernel is told not to read ahead, which
  on a disk with a large read-ahead (8 MiB is common on cloud VMs) would otherwise read
  megabytes for each window of a few kilobytes (a global batch took seconds instead of
  milliseconds on a 200 GB corpus)."""
  handle = getattr(array, "_mmap", None)
  if handle is not None and hasattr(mmap, "MADV_RANDOM"):
    handle.madvise(mmap.MADV_RANDOM)
  return array


class TokenStream:
  """One split of a prepared folder: tokens (and chat flags) across its shard files,
  memory-mapped for random access."""

  def __init__(self, folder: pathlib.Path, entry: dict, dtype: str):
    self.tokens = [
      _random_access(np.memmap(folder / s["file"], dtype, mode="r")) for s in entry["shards"]
    ]
    self.flags = (
      [_random_access(np.memmap(folder / s["file"], np.uint8, mode="r")) for s in entry["flags"]]
      if entry.get("flags")
      else None
    )
    self.bounds = np.cumsum([0, *(len(t) for t in self.tokens)])  # shard i: [b_i, b_i+1)
    self.doc_starts = np.fromfile(folder / entry["docs"]["file"], np.uint64).astype(np.int64)

  def __len__(self) -> int:
    return int(self.bounds[-1])

  def read(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Tokens ``[start, stop)`` of the stream as int32 (and their flags), across shards."""
    first = int(np.searchsorted(self.bounds, start, side="right")) - 1
    tokens, flags = [], []
    while start < stop:
      lo, hi = self.bounds[first], self.bounds[first + 1]
      end = min(stop, hi)
      tokens.append(self.tokens[first][start - lo : end - lo])
      if self.flags is not None:
        flags.append(self.flags[first][start - lo : end - lo])
      start, first = end, first + 1
    joined = np.concatenate(tokens).astype(np.int32) if tokens else np.zeros(0, np.int32)
    return joined, (np.concatenate(flags) if flags else None)


class Windows:
  """The samples of one split: window ``i`` is ``[start_i, min(start_i + S + 1, end_i))``
  of the stream, padded to ``S + 1``.

  Args:
    stream: the split's tokens.
    seq_len: S, input tokens per sample.
    pack: windows over the whole stream, or each document on its own windows.
    pad_id: the tokenizer's PAD (fills; never a target).
  """

  def __init__(self, stream: TokenStream, seq_len: int, pack: bool, pad_id: int):
    self.stream, self.seq_len, self.pad_id = stream, seq_len, pad_id
    self.document_mask = False  # rows() adds segment_ids/positions (data.document_mask)
    total = len(stream)
    if pack:  # window i starts at i·S and may run to the stream's end: nothing to store
      self.count = max(0, -(-(total - 1) // seq_len))
      self.starts = self.ends = None
    else:
      doc_ends = np.append(stream.doc_starts[1:], total)
      per_doc = np.maximum(0, -(-(doc_ends - stream.doc_starts - 1) // seq_len))
      first = np.repeat(np.cumsum(per_doc) - per_doc, per_doc)
      within = np.arange(int(per_doc.sum()), dtype=np.int64) - first
      self.starts = np.repeat(stream.doc_starts, per_doc) + within * seq_len
      self.ends = np.repeat(doc_ends, per_doc)
      self.count = len(self.starts)

  def __len__(self) -> int:
    return self.count

  def window(self, i: int) -> tuple[np.ndarray, np.ndarray]:
    """Window ``i``: ``S + 1`` tokens and their flags (int32), padded."""
    if self.starts is None:
      start, end = i * self.seq_len, len(self.stream)
    else:
      start, end = int(self.starts[i]), int(self.ends[i])
    tokens, flags = self.stream.read(start, min(start + self.seq_len + 1, end))
    flags = self._text_flags(start, len(tokens)) if flags is None else flags
    pad = self.seq_len + 1 - len(tokens)
    return (
      np.concatenate([tokens, np.full(pad, self.pad_id, np.int32)]),
      np.concatenate([flags.astype(np.int32), np.zeros(pad, np.int32)]),
    )

  def _text_flags(self, start: int, length: int) -> np.ndarray:
    """Text: every token is a target but each document's first (its BOS), found by position,
    not by id: a model folder without a start token begins documents with EOS, which the
    previous document's end must still learn."""
    flags = np.ones(length, bool)
    starts = self.stream.doc_starts
    lo, hi = np.searchsorted(starts, [start, start + length])
    flags[starts[lo:hi] - start] = False
    return flags

  def rows(
    self, index: np.ndarray, num_rows: int, pad_id: int, document_mask: bool = False
  ) -> dict[str, np.ndarray]:
    """The windows at ``index`` as ``{"inputs", "targets", "loss_mask"}``, ``int32[rows,
    S]``, padded to ``num_rows`` rows of PAD tokens with loss_mask 0.

    ``document_mask``: also ``segment_ids`` and ``positions``, ``int32[rows, S]``, for the
    model to attend within each document only (``docs/data.md``, "Document masking"):
    the input tokens of a window's documents are segments ``1, 2, 3, …`` in order and
    count positions ``0, 1, 2, …`` from each document's start; padding is segment 0 at
    position 0. A document starts at the offsets ``prepare`` recorded (its BOS in text
    and in jaxstep's chat format; a chat template may write no BOS, the offset still
    holds). A window that starts inside a document holds that document's tail as segment
    1, counted from 0: the earlier tokens are in another window, which no query here can
    see anyway, so the tail is a document of its own to the model. Without the flag the
    output is the three fields, as they always were."""
    s = self.seq_len
    tokens = np.full((num_rows, s + 1), pad_id, np.int32)
    flags = np.zeros((num_rows, s + 1), np.int32)
    for row, i in enumerate(index):
      tokens[row], flags[row] = self.window(int(i))
    out = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": flags[:, 1:]}
    if document_mask or self.document_mask:
      out["segment_ids"] = np.zeros((num_rows, s), np.int32)
      out["positions"] = np.zeros((num_rows, s), np.int32)
      for row, i in enumerate(index):
        segments, positions = self._documents(int(i))
        out["segment_ids"][row, : len(segments)] = segments
        out["positions"][row, : len(positions)] = positions
    return out

  def _documents(self, i: int) -> tuple[np.ndarray, np.ndarray]:
    """Segment ids (from 1) and positions of window ``i``'s real input tokens (at most S:
    the last token of a window is only a target). The stream offsets ``[start, start +
    n)`` are cut where a document starts: at the window's start, and at every recorded
    document start after it."""
    if self.starts is None:
      start, end = i * self.seq_len, len(self.stream)
    else:
      start, end = int(self.starts[i]), int(self.ends[i])
    n = max(0, min(self.seq_len, end - start))
    starts = self.stream.doc_starts
    lo, hi = np.searchsorted(starts, [start + 1, start + n])  # starts in (start, start + n)
    new = np.zeros(n, bool)
    new[starts[lo:hi] - start] = True
    new[:1] = True
    segments = np.cumsum(new, dtype=np.int32)
    first = np.flatnonzero(new)  # where each segment starts, in the window
    positions = (np.arange(n) - first[segments - 1]).astype(np.int32)
    return segments, positions
