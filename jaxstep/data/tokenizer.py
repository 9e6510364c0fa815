"""Byte-level tokenizer: UTF-8 bytes are ids 0-255, then PAD, BOS, EOS. No downloads."""

from __future__ import annotations

import numpy as np

from jaxstep.errors import ConfigError


class ByteTokenizer:
  """ids 0-255 = bytes; ``PAD = 256``, ``BOS = 257``, ``EOS = 258``; ``vocab_size = 259``."""

  PAD, BOS, EOS = 256, 257, 258
  vocab_size = 259

  def encode(self, text: str) -> np.ndarray:
    """UTF-8 bytes of ``text`` as int32 ids (no specials added)."""
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

  def decode(self, ids) -> str:
    """Bytes back to text; special ids are dropped, invalid UTF-8 replaced."""
    return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


def get_tokenizer(name: str) -> ByteTokenizer:
  if name != "byte":
    raise ConfigError(f"unknown tokenizer {name!r}; only 'byte' is bundled")
  return ByteTokenizer()
