"""Documents → token streams with per-token target flags (what ``prepare`` writes).

A *target flag* says whether a token may be predicted, decided here once, never at
training time. Text: ``BOS doc EOS`` with BOS unflagged, so the target that would predict
across an EOS into the next document is masked. Chat: only the assistant's tokens are
flagged, and a document's first token never is. ``shards.Windows`` cuts the windows.
"""

from __future__ import annotations

import numpy as np

from jaxstep.data import chat_template
from jaxstep.data.tokenizer import Tokenizer


def encode_text(doc: str, tok: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
  """``BOS ids EOS`` and flags ``0 1…1 1``: EOS is learned, the next document's BOS is not.
  (``prepare`` frames a whole batch of documents this way at once.)"""
  ids = tok.encode(doc)
  tokens = np.concatenate([[tok.BOS], ids, [tok.EOS]]).astype(np.int32)
  flags = np.concatenate([[0], np.ones(len(ids) + 1)]).astype(np.int8)
  return tokens, flags


def encode_chat(messages: list[dict], tok: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
  """A chat's tokens and flags: rendered with the tokenizer's own chat template when it has
  one (a model folder's: ``encode_templated_chat``), else jaxstep's role format: ``BOS`` then
  per message ``<|role|>\\n content EOS``, flags 1 only on assistant content and its EOS (the
  end token is what teaches the model to stop)."""
  if getattr(tok, "chat_template", None) is not None:
    return encode_templated_chat(messages, tok)
  tokens, flags = [np.array([tok.BOS], np.int32)], [np.zeros(1, np.int8)]
  for m in messages:
    header = tok.encode(f"<|{m['role']}|>\n")
    body = np.concatenate([tok.encode(m["content"]), [tok.EOS]]).astype(np.int32)
    tokens += [header, body]
    flags += [np.zeros(len(header), np.int8), np.full(len(body), m["role"] == "assistant", np.int8)]
  return np.concatenate(tokens), np.concatenate(flags)


def encode_templated_chat(messages: list[dict], tok) -> tuple[np.ndarray, np.ndarray]:
  """``tok.chat_template``'s rendering of the chat, tokenized once as a whole, which gives
  transformers' ``apply_chat_template(messages, tokenize=True)`` ids (its own BOS, if it
  writes one, and no other); flags 1 on each token that overlaps assistant text
  (``chat_template.assistant_spans``: the end-of-turn token in, the whitespace after it
  out), as transformers' ``assistant_masks``, except the first token: a document start is
  never a target.

  Raises:
    DataError: the template refuses the chat, or does not render turns incrementally.
  """
  text, spans = chat_template.assistant_spans(tok.chat_template, messages, **tok.template_tokens)
  tokens, offsets = tok.encode_rendered(text, offsets=True)
  flags = chat_template.token_mask(offsets, spans)
  flags[:1] = 0
  return tokens.astype(np.int32), flags
