"""The distribution a token is drawn from, shared by the sampler and the trainer.

Given a row of logits, the sampler draws from ``softmax(sampling_logits(…))``: the ids a
continuation may contain (``allowed``), divided by the temperature, with every id outside
the top-k and outside the top-p nucleus removed. RL needs the log-prob of each drawn token
under exactly that distribution twice — once while sampling, once in the training pass —
and the two agree only if both apply the same temperature, the same allowed ids and the
same truncation; this module is the one place that says what they are.

Every argument is traced, so one compiled loop serves every setting: temperature 0 takes
the argmax, ``top_k`` 0 and ``top_p`` 1 switch those filters off.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def filter_logits(logits, temperature, top_k, top_p):
  """``logits [..., V]`` (fp32) divided by the temperature, with every id outside the top-k
  and outside the top-p nucleus set to −inf. Ties at a cut-off are kept."""
  neg = jnp.array(-jnp.inf, logits.dtype)
  scaled = logits / jnp.maximum(temperature, 1e-6)
  desc = -jnp.sort(-scaled, axis=-1)  # largest first
  k = jnp.clip(top_k, 1, logits.shape[-1])
  kth = jax.lax.dynamic_index_in_dim(desc, k - 1, axis=-1)  # [..., 1]
  scaled = jnp.where((top_k > 0) & (scaled < kth), neg, scaled)
  desc = jnp.where((top_k > 0) & (desc < kth), neg, desc)
  probs = jax.nn.softmax(desc, axis=-1)
  before = jnp.cumsum(probs, axis=-1) - probs  # probability of the ids ranked above
  smallest_kept = jnp.min(jnp.where(before < top_p, desc, jnp.inf), axis=-1, keepdims=True)
  return jnp.where((top_p < 1.0) & (scaled < smallest_kept), neg, scaled)


def sampling_logits(logits, allowed, temperature, top_k, top_p):
  """The logits a draw at ``temperature`` > 0 is made from: ``allowed`` ids only (bool[V],
  or None for all), ÷ temperature, filtered (the sorts only run when a filter is on)."""
  logits = logits.astype(jnp.float32)
  if allowed is not None:
    logits = jnp.where(allowed, logits, -jnp.inf)
  return jax.lax.cond(
    (top_k > 0) | (top_p < 1.0),
    lambda: filter_logits(logits, temperature, top_k, top_p),
    lambda: logits / jnp.maximum(temperature, 1e-6),
  )


def draw(logits, keys, allowed, temperature, top_k, top_p):
  """``(ids int32[B], logps float32[B])``: one id per row of ``logits [B, V]``, drawn with
  that row's ``keys[b]``, and its log-prob under the distribution it was drawn from
  (greedy when ``temperature`` is 0: the argmax of the allowed ids, and its log-prob at
  temperature 1)."""
  rows = jnp.arange(logits.shape[0])

  def sample():
    filtered = sampling_logits(logits, allowed, temperature, top_k, top_p)
    ids = jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)
    return ids, jax.nn.log_softmax(filtered, axis=-1)[rows, ids]

  def greedy():
    masked = jnp.where(allowed, logits.astype(jnp.float32), -jnp.inf)
    ids = jnp.argmax(masked, axis=-1).astype(jnp.int32)
    return ids, jax.nn.log_softmax(masked, axis=-1)[rows, ids]

  return jax.lax.cond(temperature <= 0, greedy, sample)
