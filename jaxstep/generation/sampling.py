"""The next token from a row of logits: greedy, or a draw at a temperature from the top-k
ids and/or the nucleus (the fewest ids whose probability reaches top-p).

Every argument is traced, so one compiled decode loop serves every setting: temperature 0
takes the argmax, ``top_k`` 0 and ``top_p`` 1 switch those filters off. Ids the model must
never produce (PAD, BOS, the padded rows of the vocabulary past the tokenizer's) are removed
before anything else, for greedy too; a stop id is never removed, even where a pretrained
model's PAD or BOS is the same id as one of its stop ids.
"""

from __future__ import annotations

import numpy as np

from jaxstep.core.sampling import draw, filter_logits

__all__ = ["allowed_ids", "filter_logits", "next_tokens", "stop_ids"]


def stop_ids(tokenizer) -> tuple[int, ...]:
  """The ids that end a row: the tokenizer's ``stop_ids`` (a pretrained model folder's EOS
  and the extra end ids its generation config declares), else its EOS alone."""
  return tuple(int(i) for i in getattr(tokenizer, "stop_ids", (tokenizer.EOS,)))


def allowed_ids(model_vocab: int, tokenizer) -> np.ndarray:
  """``bool[model_vocab]``: the ids a continuation may contain (the tokenizer's, minus
  PAD and BOS). Every stop id is allowed, since it ends the row: a folder's PAD or BOS may
  be its EOS (Qwen pads with its end-of-text id), and banning it would never stop a row."""
  allowed = np.arange(model_vocab) < tokenizer.vocab_size
  banned = {tokenizer.PAD, tokenizer.BOS} - set(stop_ids(tokenizer))
  allowed[list(banned)] = False
  return allowed


def next_tokens(logits, keys, allowed, temperature, top_k, top_p):
  """``int32[B]``: one id per row of ``logits [B, V]``, drawn with that row's ``keys[b]``
  (greedy when ``temperature`` is 0); ``jaxstep.core.sampling.draw`` without the log-probs."""
  return draw(logits, keys, allowed, temperature, top_k, top_p)[0]
