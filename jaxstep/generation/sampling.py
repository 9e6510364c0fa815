"""The next token from a row of logits: greedy, or a draw at a temperature from the top-k
ids and/or the nucleus (the fewest ids whose probability reaches top-p).

Every argument is traced, so one compiled decode loop serves every setting: temperature 0
takes the argmax, ``top_k`` 0 and ``top_p`` 1 switch those filters off. Ids the model must
never produce (PAD, BOS, the padded rows of the vocabulary past the tokenizer's) are removed
before anything else, for greedy too; a stop id is never removed, even where a pretrained
model's PAD or BOS is the same id as one of its stop ids.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


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


def filter_logits(logits, temperature, top_k, top_p):
  """``logits [B, V]`` (fp32) divided by the temperature, with every id outside the top-k
  and outside the top-p nucleus set to −inf. Ties at a cut-off are kept."""
  neg = jnp.array(-jnp.inf, logits.dtype)
  scaled = logits / jnp.maximum(temperature, 1e-6)
  desc = -jnp.sort(-scaled, axis=-1)  # [B, V], largest first
  k = jnp.clip(top_k, 1, logits.shape[-1])
  kth = jax.lax.dynamic_index_in_dim(desc, k - 1, axis=-1)  # [B, 1]
  scaled = jnp.where((top_k > 0) & (scaled < kth), neg, scaled)
  desc = jnp.where((top_k > 0) & (desc < kth), neg, desc)
  probs = jax.nn.softmax(desc, axis=-1)
  before = jnp.cumsum(probs, axis=-1) - probs  # probability of the ids ranked above
  smallest_kept = jnp.min(jnp.where(before < top_p, desc, jnp.inf), axis=-1, keepdims=True)
  return jnp.where((top_p < 1.0) & (scaled < smallest_kept), neg, scaled)


def next_tokens(logits, keys, allowed, temperature, top_k, top_p):
  """``int32[B]``: one id per row of ``logits [B, V]``, drawn with that row's ``keys[b]``
  (greedy when ``temperature`` is 0)."""
  logits = jnp.where(allowed, logits.astype(jnp.float32), -jnp.inf)

  def draw():  # the sorts of the filters only run when a filter is on
    filtered = jax.lax.cond(
      (top_k > 0) | (top_p < 1.0),
      lambda: filter_logits(logits, temperature, top_k, top_p),
      lambda: logits / jnp.maximum(temperature, 1e-6),
    )
    return jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)

  greedy = lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32)  # noqa: E731
  return jax.lax.cond(temperature <= 0, greedy, draw)
