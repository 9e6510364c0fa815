"""Sliding windows that score every token once with up to ``seq_len − stride`` tokens of
context before it: the transformers perplexity guide's method (``evaluate --stride``).

In each document (or the whole stream, packed) window ``k`` covers ``[b_k, min(b_k + S + 1,
end))`` with ``b_k = start + k · stride``, and only its targets past the previous window's
last one count (the document's first token, its BOS, is never a target). So the first window
scores its whole length, and each later one only its last ``stride`` targets, each with the
``S − stride`` tokens before them as context; the windows stop at the one that reaches the
document's end. ``stride = S`` is the plain non-overlapping windows of ``Windows``.
"""

from __future__ import annotations

import numpy as np

from jaxstep.data.shards import TokenStream, Windows


class StridedWindows(Windows):
  """``Windows`` of ``seq_len`` positions ``stride`` apart; ``rows`` masks the targets an
  earlier window scored already."""

  def __init__(self, stream: TokenStream, seq_len: int, stride: int, pack: bool, pad_id: int):
    if not 1 <= stride <= seq_len:
      raise ValueError(f"stride must be in [1, seq_len {seq_len}], got {stride}")
    self.stream, self.seq_len, self.pad_id, self.stride = stream, seq_len, pad_id, stride
    self.document_mask = False
    total = len(stream)
    if pack:
      doc_starts, doc_ends = np.array([0]), np.array([total])
    else:
      doc_starts, doc_ends = stream.doc_starts, np.append(stream.doc_starts[1:], total)
    starts, ends, scored = [], [], []
    for ds, de in zip(doc_starts.tolist(), doc_ends.tolist(), strict=True):
      done = ds + 1  # tokens before this one have been scored (or are the document's start)
      begin = ds
      while done < de:
        end = min(begin + seq_len + 1, de)
        starts.append(begin), ends.append(de), scored.append(done)
        done = end
        begin += stride
    self.starts = np.asarray(starts, np.int64)
    self.ends = np.asarray(ends, np.int64)
    self.scored = np.asarray(scored, np.int64)  # the first token position a window scores
    self.count = len(self.starts)

  def rows(self, index, num_rows: int, pad_id: int, document_mask: bool = False):
    out = super().rows(index, num_rows, pad_id, document_mask)
    target = np.arange(1, self.seq_len + 1)  # target t of a window is token start + 1 + t
    for row, i in enumerate(index):
      fresh = self.starts[int(i)] + target >= self.scored[int(i)]
      out["loss_mask"][row] *= fresh.astype(out["loss_mask"].dtype)
    return out
