"""The pieces of the Llama decoder that the GPT has no counterpart for: RMSNorm, rotary
position embeddings (with Llama 3.1's frequency scaling) and grouped-query attention over
a key/value cache. Each computes exactly what Hugging Face's Llama/Qwen/Mistral modules
compute, so converted weights give the same logits.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from jaxstep.errors import ConfigError


class RMSNorm(nnx.Module):
  """``scale · (x / √(mean(x²) + ε))`` over the last axis (Hugging Face's ``LlamaRMSNorm``).

  The statistics are fp32 whatever the compute dtype; the normalized ``x`` is cast back to
  the input dtype before the scale multiplies it (in the promoted dtype of the two), in
  that order, because that is where a bf16 model rounds in the reference implementation.
  ``round_last`` (OLMo 2's ``Olmo2RMSNorm``): the scale multiplies the fp32 normalized
  ``x``, and the product is rounded to the input dtype once. In fp32 the two are the same.
  """

  def __init__(self, dim: int, eps: float, round_last: bool = False):
    self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))
    self.eps = eps
    self.round_last = round_last

  def __call__(self, x: jax.Array) -> jax.Array:
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    if self.round_last:
      return (self.scale[...] * normed).astype(x.dtype)
    return self.scale[...] * normed.astype(x.dtype)


def times(x: jax.Array, m: float) -> jax.Array:
  """``x · m`` rounded once to ``x``'s dtype (Granite's multipliers; transformers multiplies
  by a Python float): the constant stays fp32, where a weakly typed one would first round
  to bf16. ``m == 1``: ``x`` itself, the graph of a model without multipliers."""
  return x if m == 1.0 else (x.astype(jnp.float32) * m).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama 3.1's RoPE frequency scaling (Hugging Face ``rope_type: llama3``).

  With ``L = original_max_position_embeddings``, a frequency whose wavelength ``λ = 2π/f``
  is longer than ``L / low_freq_factor`` is divided by ``factor``; one shorter than
  ``L / high_freq_factor`` is kept; between the two, ``f`` is interpolated with
  ``s = (L/λ − low) / (high − low)``: ``(1 − s)·f/factor + s·f``. Long-range (low
  frequency) rotations are stretched to cover a longer context, local ones are untouched.
  """

  rope_type: str = "llama3"
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192

  def __post_init__(self):
    if self.rope_type != "llama3":
      raise ConfigError(
        f"model.rope_scaling type {self.rope_type!r} is not supported: only 'llama3' "
        "(or None for plain RoPE)"
      )
    for name in ("factor", "low_freq_factor", "original_max_position_embeddings"):
      if getattr(self, name) <= 0:
        raise ConfigError(f"model.rope_scaling.{name} must be > 0, got {getattr(self, name)}")
    if self.high_freq_factor <= self.low_freq_factor:
      raise ConfigError(
        f"model.rope_scaling.high_freq_factor {self.high_freq_factor} must be > "
        f"low_freq_factor {self.low_freq_factor}"
      )


def rope_scaling_of(value) -> RopeScaling | None:
  """The ``rope_scaling`` setting (None, a ``RopeScaling``, a mapping or ``(key, value)``
  pairs in Hugging Face's spelling: ``rope_type`` or ``type``) → a ``RopeScaling`` or None
  (no scaling; also for ``rope_type: default``). Unknown types and keys are ConfigErrors."""
  if value is None or isinstance(value, RopeScaling):
    return value
  try:
    items = dict(value.items() if isinstance(value, Mapping) else value)
  except (TypeError, ValueError) as e:
    raise ConfigError(f"model.rope_scaling must be a mapping or None, got {value!r}") from e
  kind = items.pop("rope_type", items.pop("type", "llama3"))
  if kind == "default" and not items:
    return None
  fields = {f.name for f in dataclasses.fields(RopeScaling)}
  if unknown := sorted(set(items) - fields):
    raise ConfigError(f"model.rope_scaling: unknown keys {', '.join(map(str, unknown))}")
  return RopeScaling(rope_type=kind, **items)


def inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> jax.Array:
  """RoPE's inverse frequencies ``f_i = 1 / θ^(2i / Dh)``, ``i < Dh/2``, fp32 (then
  ``scaling``'s adjustment): Hugging Face's ``_compute_llama3_parameters`` step by step."""
  freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  if scaling is None:
    return freq
  old, low, high = (
    scaling.original_max_position_embeddings,
    scaling.low_freq_factor,
    scaling.high_freq_factor,
  )
  wavelen = 2 * math.pi / freq
  scaled = jnp.where(wavelen > old / low, freq / scaling.factor, freq)
  smooth = (old / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
  medium = (wavelen >= old / high) & (wavelen <= old / low)
  return jnp.where(medium, smoothed, scaled)


def rope_tables(positions: jax.Array, freq: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
  """``cos`` and ``sin`` of ``p · f`` (fp32, then cast to the compute ``dtype``) for
  positions ``[..., S]``, each ``[..., S, 1, Dh]``: the Dh/2 angles twice over (the
  non-interleaved layout), with a head axis to broadcast over."""
  angles = positions[..., None].astype(jnp.float32) * freq  # [..., S, Dh/2]
  emb = jnp.concatenate([angles, angles], axis=-1)[..., None, :]
  return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """``x·cos + rotate_half(x)·sin`` for ``x [B, S, H, Dh]``, where ``rotate_half`` maps
  halves ``(x1, x2)`` to ``(−x2, x1)``: each pair ``(x_i, x_{i+Dh/2})`` is rotated by its
  angle, so ``q·k`` depends on the positions only through their difference."""
  x1, x2 = jnp.split(x, 2, axis=-1)
  return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


def grouped_attention_over_cache(q, kt, v, positions):
  """``gpt.attention_over_cache`` for grouped queries: ``q [B, S, H, Dh]`` against a cache
  of ``KV`` heads, keys ``kt [B, KV, Dh, T]``, values ``v [B, KV, T, Dh]``; query head
  ``h`` reads cache head ``h // (H / KV)``. The query heads are grouped instead of the
  cache repeated, so each step reads the cache once. Same arithmetic as the GPT's (scores
  in the compute dtype, softmax in fp32, masked at the fp32 minimum). ``[B, S, H, Dh]``."""
  b, s, h, dh = q.shape
  kv = kt.shape[1]
  qg = q.reshape(b, s, kv, h // kv, dh).transpose(0, 2, 3, 1, 4)  # [B, KV, G, S, Dh]
  scores = jnp.einsum("bkgqd,bkdt->bkgqt", qg, kt).astype(jnp.float32) / math.sqrt(dh)
  visible = jnp.arange(kt.shape[-1])[None, None, :] <= positions[:, :, None]  # [B, S, T]
  scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
  p = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("bkgqt,bktd->bkgqd", p.astype(v.dtype), v)  # [B, KV, G, S, Dh]
  return out.reshape(b, h, s, dh).transpose(0, 2, 1, 3)
