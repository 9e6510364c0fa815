"""Documents → token streams with per-token target flags (what ``prepare`` writes).

A *target flag* says whether a token may be predicted, decided here once, never at
training time. Text: ``BOS doc EOS`` with BOS unflagged, so the target that would predict
across an EOS into the next document is masked. Chat: only assistant content and each
assistant turn's EOS are flagged. ``shards.Windows`` cuts the windows.
"""

from __future__ import annotations

import numpy as np

from jaxstep.data.tokenizer import Tokenizer


def encode_text(doc: str, tok: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
  """``BOS ids EOS`` and flags ``0 1…1 1``: EOS is learned, the next document's BOS is not.
  (``prepare`` frames a whole batch of documents this way at once.)"""
  ids = tok.encode(doc)
  tokens = np.concatenate([[tok.BOS], ids, [tok.EOS]]).astype(np.int32)
  flags = np.concatenate([[0], np.ones(len(ids) + 1)]).astype(np.int8)
  return tokens, flags


def encode_chat(messages: list[dict], tok: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
  """``BOS`` then per message ``<|role|>\\n content EOS``; flags 1 only on assistant content
  and its EOS (the end token is what teaches the model to stop)."""
  tokens, flags = [np.array([tok.BOS], np.int32)], [np.zeros(1, np.int8)]
  for m in messages:
    header = tok.encode(f"<|{m['role']}|>\n")
    body = np.concatenate([tok.encode(m["content"]), [tok.EOS]]).astype(np.int32)
    tokens += [header, body]
    flags += [np.zeros(len(header), np.int8), np.full(len(body), m["role"] == "assistant", np.int8)]
  return np.concatenate(tokens), np.concatenate(flags)
