"""The pieces of the Llama decoder that the GPT has no counterpart for: RMSNorm, Granite's
multipliers and grouped-query attention over a key/value cache (rotary position embeddings:
``rope.py``). Each computes exactly what Hugging Face's Llama/Qwen/Mistral modules
compute, so converted weights give the same logits.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
  """``scale · (x / √(mean(x²) + ε))`` over the last axis (Hugging Face's ``LlamaRMSNorm``).

  The statistics are fp32 whatever the compute dtype; the normalized ``x`` is cast back to
  the input dtype before the scale multiplies it (in the promoted dtype of the two), in
  that order, because that is where a bf16 model rounds in the reference implementation.
  ``round_last`` (OLMo 2's ``Olmo2RMSNorm``): the scale multiplies the fp32 normalized
  ``x``, and the product is rounded to the input dtype once. In fp32 the two are the same.
  ``offset`` (Gemma's ``Gemma3RMSNorm``): ``(offset + scale) · normed`` in fp32, rounded
  once; the scale starts at ``1 − offset``, so every norm starts as the identity's scale.
  """

  def __init__(self, dim: int, eps: float, round_last: bool = False, offset: float = 0.0):
    self.scale = nnx.Param(jnp.full((dim,), 1.0 - offset, jnp.float32))
    self.eps = eps
    self.round_last = round_last
    self.offset = offset

  def __call__(self, x: jax.Array) -> jax.Array:
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    if self.offset:  # Gemma: (1 + w) in fp32, the product rounded once
      return ((self.offset + self.scale[...].astype(jnp.float32)) * normed).astype(x.dtype)
    if self.round_last:
      return (self.scale[...] * normed).astype(x.dtype)
    return self.scale[...] * normed.astype(x.dtype)


def times(x: jax.Array, m: float) -> jax.Array:
  """``x · m`` rounded once to ``x``'s dtype (Granite's multipliers; transformers multiplies
  by a Python float): the constant stays fp32, where a weakly typed one would first round
  to bf16. ``m == 1``: ``x`` itself, the graph of a model without multipliers."""
  return x if m == 1.0 else (x.astype(jnp.float32) * m).astype(x.dtype)


def grouped_attention_over_cache(q, kt, v, positions, window: int = 0, cap: float = 0.0):
  """``gpt.attention_over_cache`` for grouped queries: ``q [B, S, H, Dh]`` against a cache
  of ``KV`` heads, keys ``kt [B, KV, Dh, T]``, values ``v [B, KV, T, Dh]`` (``window`` > 0:
  only the last ``window`` positions of the cache, the query's included); query head
  ``h`` reads cache head ``h // (H / KV)``. The query heads are grouped instead of the
  cache repeated, so each step reads the cache once. Same arithmetic as the GPT's (scores
  in the compute dtype, softmax in fp32, masked at the fp32 minimum). ``[B, S, H, Dh]``."""
  b, s, h, dh = q.shape
  kv = kt.shape[1]
  qg = q.reshape(b, s, kv, h // kv, dh).transpose(0, 2, 3, 1, 4)  # [B, KV, G, S, Dh]
  scores = jnp.einsum("bkgqd,bkdt->bkgqt", qg, kt).astype(jnp.float32) / math.sqrt(dh)
  if cap:  # Gemma 2's soft-capped scores
    scores = cap * jnp.tanh(scores / cap)
  slots = jnp.arange(kt.shape[-1])[None, None, :]
  visible = slots <= positions[:, :, None]  # [B, S, T]
  if window:  # sliding-window attention: the window's keys of a full-length cache
    visible = visible & (slots > positions[:, :, None] - window)
  scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
  p = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("bkgqt,bktd->bkgqd", p.astype(v.dtype), v)  # [B, KV, G, S, Dh]
  return out.reshape(b, h, s, dh).transpose(0, 2, 1, 3)
