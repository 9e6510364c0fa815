"""Rotary position embeddings (RoPE) as transformers computes them for the Llama family:
plain, with Llama 3.1's frequency scaling (``RopeScaling``), or with Phi-3's LongRoPE
(``LongRope``), over the whole head or its first ``rotary_dim`` features (Phi-4-mini's
``partial_rotary_factor``).

Angles are fp32 (``p · f``); cos and sin are cast to the compute dtype once, after
LongRoPE's attention factor multiplies them, where transformers rounds them too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from jaxstep.errors import ConfigError


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


@dataclasses.dataclass(frozen=True)
class LongRope:
  """Phi-3's LongRoPE (Hugging Face ``rope_type: longrope``, older folders' ``su``).

  Each rotary frequency is divided by its own factor, ``f_i = 1 / (e_i · θ^(2i / R))`` with
  ``R`` the rotary width: ``short_factor`` while a sequence stays within
  ``original_max_position_embeddings`` positions, ``long_factor`` once its last position
  passes them (transformers decides per forward pass from the largest position id; here per
  sequence, so a sequence's rotation never depends on the other rows of its micro-batch,
  and the same whole sequences give the same update for any K). cos and sin are multiplied
  by ``attention_factor``, which transformers derives once from the model's lengths:
  ``√(1 + ln s / ln L)`` with ``s`` the folder's ``factor``, else
  ``max_position_embeddings / L`` (1 when ``s ≤ 1``).
  """

  rope_type: str = "longrope"
  short_factor: tuple[float, ...] = ()
  long_factor: tuple[float, ...] = ()
  original_max_position_embeddings: int = 4096
  attention_factor: float = 1.0

  def __post_init__(self):
    for name in ("short_factor", "long_factor"):
      try:
        value = tuple(float(v) for v in getattr(self, name))
      except (TypeError, ValueError):
        raise ConfigError(
          f"model.rope_scaling.{name} must be a list of numbers, got {getattr(self, name)!r}"
        ) from None
      if not value or not all(v > 0 and math.isfinite(v) for v in value):
        raise ConfigError(f"model.rope_scaling.{name} must be positive numbers, got {value}")
      object.__setattr__(self, name, value)
    if len(self.short_factor) != len(self.long_factor):
      raise ConfigError(
        f"model.rope_scaling: short_factor has {len(self.short_factor)} values and "
        f"long_factor {len(self.long_factor)}; both need one per rotary frequency"
      )
    for name in ("original_max_position_embeddings", "attention_factor"):
      if not getattr(self, name) > 0:
        raise ConfigError(f"model.rope_scaling.{name} must be > 0, got {getattr(self, name)}")

  @staticmethod
  def attention_factor_of(factor: float, original: int) -> float:
    """transformers' default attention factor for a context extended ``factor``-fold from
    ``original`` positions."""
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def check_config(cfg) -> None:
  """ConfigError unless a ``LlamaConfig``'s rotated width is even and a LongRoPE has a
  factor per pair."""
  if not 0 < cfg.partial_rotary_factor <= 1:
    raise ConfigError(
      f"model.partial_rotary_factor must be in (0, 1], got {cfg.partial_rotary_factor}"
    )
  if cfg.partial_rotary_factor == 1 and cfg.resolved_head_dim % 2:
    raise ConfigError(f"model.head_dim must be even for RoPE, got {cfg.resolved_head_dim}")
  if cfg.rotary_dim % 2 or not cfg.rotary_dim:
    raise ConfigError(
      f"model.head_dim {cfg.resolved_head_dim} × model.partial_rotary_factor "
      f"{cfg.partial_rotary_factor} = {cfg.rotary_dim} rotated features: RoPE needs an even "
      "number > 0"
    )
  scaling = cfg.rope_scaling
  if isinstance(scaling, LongRope) and len(scaling.short_factor) != cfg.rotary_dim // 2:
    raise ConfigError(
      f"model.rope_scaling's factors number {len(scaling.short_factor)}, the rotated width "
      f"{cfg.rotary_dim} needs {cfg.rotary_dim // 2} (one per pair)"
    )


SCALINGS = {"llama3": RopeScaling, "longrope": LongRope, "su": LongRope}


def rope_scaling_of(value) -> RopeScaling | LongRope | None:
  """The ``rope_scaling`` setting (None, a ``RopeScaling`` / ``LongRope``, a mapping or
  ``(key, value)`` pairs in Hugging Face's spelling: ``rope_type`` or ``type``) → one of
  those or None (no scaling; also for ``rope_type: default``). Unknown types and keys are
  ConfigErrors."""
  if value is None or isinstance(value, RopeScaling | LongRope):
    return value
  try:
    items = dict(value.items() if isinstance(value, Mapping) else value)
  except (TypeError, ValueError) as e:
    raise ConfigError(f"model.rope_scaling must be a mapping or None, got {value!r}") from e
  kind = items.pop("rope_type", items.pop("type", "llama3"))
  if kind == "default" and not items:
    return None
  if kind not in SCALINGS:
    raise ConfigError(
      f"model.rope_scaling type {kind!r} is not supported: only 'llama3', 'longrope' "
      "(or None for plain RoPE)"
    )
  cls = SCALINGS[kind]
  fields = {f.name for f in dataclasses.fields(cls)} - {"rope_type"}
  if unknown := sorted(set(items) - fields):
    raise ConfigError(f"model.rope_scaling: unknown keys {', '.join(map(str, unknown))}")
  return cls(**items) if cls is LongRope else cls(rope_type=kind, **items)


def rotation(
  positions: jax.Array, rotary_dim: int, theta: float, scaling, dtype
) -> tuple[jax.Array, jax.Array]:
  """``cos`` and ``sin`` of ``p · f`` for positions ``[..., S]``, each ``[..., S, 1, R]``
  (``R = rotary_dim``): the R/2 angles twice over (the non-interleaved layout), with a head
  axis to broadcast over; LongRoPE's factors chosen per sequence and its attention factor
  applied in fp32, then cast to the compute ``dtype``."""
  if isinstance(scaling, LongRope):
    base = theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim)
    short, long = (
      1.0 / (jnp.asarray(f, jnp.float32) * base)
      for f in (scaling.short_factor, scaling.long_factor)
    )
    beyond = (
      jnp.max(positions, axis=-1, keepdims=True) + 1 > scaling.original_max_position_embeddings
    )
    freq, scale = jnp.where(beyond[..., None], long, short), scaling.attention_factor
  else:
    freq, scale = inv_freq(rotary_dim, theta, scaling), 1.0
  angles = positions[..., None].astype(jnp.float32) * freq  # [..., S, R/2]
  emb = jnp.concatenate([angles, angles], axis=-1)[..., None, :]
  cos, sin = jnp.cos(emb), jnp.sin(emb)
  if scale != 1.0:
    cos, sin = cos * scale, sin * scale
  return cos.astype(dtype), sin.astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """``x·cos + rotate_half(x)·sin`` over the first ``R`` features of ``x [B, S, H, Dh]``
  (``R``: cos's last axis; the rest pass through), where ``rotate_half`` maps halves
  ``(x1, x2)`` to ``(−x2, x1)``: each pair ``(x_i, x_{i+R/2})`` is rotated by its angle, so
  ``q·k`` depends on the positions only through their difference."""
  r = cos.shape[-1]
  part, rest = (x, None) if r == x.shape[-1] else (x[..., :r], x[..., r:])
  x1, x2 = jnp.split(part, 2, axis=-1)
  rotated = part * cos + jnp.concatenate([-x2, x1], axis=-1) * sin
  return rotated if rest is None else jnp.concatenate([rotated, rest], axis=-1)
