"""Documents → token streams with per-token target flags → fixed windows with loss masks.

Masks are decided here, when samples are cut, never at training time:

* A *target flag* says whether a token may be predicted. Text: ``BOS doc EOS`` with BOS
  unflagged, so the target that would predict across an EOS into the next document is
  masked. Chat: only assistant content and each assistant turn's EOS are flagged.
* Windows hold ``seq_len + 1`` tokens and advance by ``seq_len``, so consecutive windows
  share one token and every flagged token of the stream is a target exactly once.
  ``inputs = w[:-1]``, ``targets = w[1:]``, ``loss_mask = flags[1:]``; the last window is
  padded with PAD tokens whose flag is 0.
"""

from __future__ import annotations

import numpy as np

from jaxstep.data.tokenizer import Tokenizer


def framed(ids: np.ndarray, tok: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
  """``BOS ids EOS`` and flags ``0 1…1 1``: EOS is learned, the next document's BOS is not."""
  tokens = np.concatenate([[tok.BOS], ids, [tok.EOS]]).astype(np.int32)
  flags = np.concatenate([[0], np.ones(len(ids) + 1)]).astype(np.int8)
  return tokens, flags


def encode_text(doc: str, tok: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
  """A text document as ``framed`` tokens and flags."""
  return framed(tok.encode(doc), tok)


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


def cut_windows(
  tokens: np.ndarray, flags: np.ndarray, seq_len: int, pad_id: int
) -> dict[str, np.ndarray]:
  """Cuts one stream into ``{"inputs", "targets", "loss_mask"}``, each ``int32[n, seq_len]``."""
  n = max(0, -(-(len(tokens) - 1) // seq_len))  # ceil((len − 1) / seq_len)
  total = n * seq_len + 1
  tokens = np.concatenate([tokens, np.full(total - len(tokens), pad_id, np.int32)])
  flags = np.concatenate([flags, np.zeros(total - len(flags), np.int8)])
  idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None]  # [n, S+1]
  windows, wflags = tokens[idx], flags[idx]
  return {
    "inputs": windows[:, :-1].astype(np.int32),
    "targets": windows[:, 1:].astype(np.int32),
    "loss_mask": wflags[:, 1:].astype(np.int32),
  }


def make_samples(
  docs: list, kind: str, seq_len: int, tok: Tokenizer, pack: bool
) -> dict[str, np.ndarray]:
  """All windows of ``docs``: one packed stream, or each document on its own windows."""
  encode = encode_chat if kind == "chat" else encode_text
  streams = [encode(d, tok) for d in docs]
  if pack:
    streams = [(np.concatenate([s[0] for s in streams]), np.concatenate([s[1] for s in streams]))]
  parts = [cut_windows(t, f, seq_len, tok.PAD) for t, f in streams]
  return {
    k: np.concatenate([p[k] for p in parts]) if parts else np.zeros((0, seq_len), np.int32)
    for k in ("inputs", "targets", "loss_mask")
  }
