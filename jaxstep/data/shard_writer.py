"""Writing one split of prepared data: its documents' tokens (and chat flags) appended to
fixed-size shard files, hashed as they are written, and the documents' start offsets; the
layout ``preparation.py`` describes and ``shards.py`` reads."""

from __future__ import annotations

import contextlib
import hashlib
import pathlib

import numpy as np

from jaxstep.data.manifest import sha256


class ShardWriter:
  """Appends documents of one split to fixed-size shard files, hashing as it writes."""

  def __init__(self, folder: pathlib.Path, split: str, dtype, shard_tokens: int, chat: bool):
    self.folder, self.split, self.dtype = folder, split, np.dtype(dtype)
    self.shard_tokens, self.chat = shard_tokens, chat
    self.shards: list[dict] = []
    self.flag_shards: list[dict] = []
    self.doc_starts: list[np.ndarray] = []
    self.tokens = 0
    self.targets = 0  # tokens that may be a target: all but BOS (text), flagged ones (chat)
    self._open = None

  def _roll(self) -> None:
    self._close()
    index = len(self.shards)
    names = [f"{self.split}-{index:05d}.bin"] + (
      [f"{self.split}-{index:05d}.flags.bin"] if self.chat else []
    )
    self._open = [
      (open(self.folder / n, "wb"), hashlib.sha256(), {"file": n, "tokens": 0}) for n in names
    ]

  def _close(self) -> None:
    if self._open is None:
      return
    for i, (f, h, entry) in enumerate(self._open):
      f.close()
      entry.update(bytes=(self.folder / entry["file"]).stat().st_size, sha256=h.hexdigest())
      (self.shards if i == 0 else self.flag_shards).append(entry)
    self._open = None

  def add(self, tokens: np.ndarray, flags: np.ndarray, lengths: np.ndarray) -> None:
    """Appends documents: their tokens and flags back to back, ``lengths`` each."""
    self.doc_starts.append(self.tokens + np.cumsum(lengths) - lengths)
    self.targets += int(np.count_nonzero(flags))
    done = 0
    while done < len(tokens):
      if self._open is None or self._open[0][2]["tokens"] == self.shard_tokens:
        self._roll()
      room = self.shard_tokens - self._open[0][2]["tokens"]
      parts = [tokens[done : done + room].astype(self.dtype)]
      if self.chat:
        parts.append(flags[done : done + room].astype(np.uint8))
      for (f, h, entry), part in zip(self._open, parts, strict=True):
        data = part.tobytes()
        f.write(data)
        h.update(data)
        entry["tokens"] += len(part)
      done += len(parts[0])
    self.tokens += len(tokens)

  def abort(self) -> None:
    """Closes the open shard files, which are being discarded (on a full disk closing fails,
    yet frees the descriptor, and so the space once the files are removed)."""
    for f, _, _ in self._open or []:
      with contextlib.suppress(OSError):
        f.close()
    self._open = None

  def finish(self) -> dict:
    self._close()
    docs = f"{self.split}.docs.bin"
    starts = np.concatenate(self.doc_starts) if self.doc_starts else np.zeros(0, np.int64)
    starts.astype(np.uint64).tofile(self.folder / docs)
    return {
      "tokens": self.tokens,
      "targets": self.targets,
      "documents": len(starts),
      "shards": self.shards,
      "flags": self.flag_shards if self.chat else None,
      "docs": {"file": docs, "sha256": sha256(self.folder / docs)},
    }
