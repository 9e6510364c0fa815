"""Optimizer and lr schedule from config, built only from optax parts.

Schedules count *update steps* (optax's own count advances once per applied update).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import optax

from jaxstep.core.trees import key_name
from jaxstep.errors import ConfigError

SCHEDULES = ("constant", "cosine", "linear")
FROZEN_DTYPES = ("fp32", "bf16")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """AdamW + clipping + lr schedule. All step counts are update steps."""

  lr: float = 1e-3  # peak learning rate
  schedule: str = "cosine"  # constant | cosine | linear (after warmup)
  warmup_steps: int = 0  # linear warmup from 0 to lr, in update steps
  final_lr_fraction: float = 0.1  # cosine/linear end at lr * this
  clip_grad_norm: float = 1.0  # clip the accumulated gradient's global norm; 0 = off
  weight_decay: float = 0.1  # decoupled (AdamW) decay; only on matrices (ndim >= 2)
  decay_embeddings: bool = False  # also decay embedding tables
  b1: float = 0.9  # Adam first-moment decay
  b2: float = 0.95  # Adam second-moment decay
  eps: float = 1e-8  # Adam epsilon
  trainable: tuple[str, ...] = ()  # regexes of the params that train (empty: all); see freeze.py
  frozen_dtype: str = "fp32"  # fp32 | bf16: the dtype frozen params are kept in

  def __post_init__(self):
    if self.schedule not in SCHEDULES:
      raise ConfigError(f"optim.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"optim.{f.name} must be a finite number, got {value}")
    if self.lr <= 0:
      raise ConfigError(f"optim.lr must be > 0, got {self.lr}")
    for name in ("b1", "b2"):
      if not 0 <= getattr(self, name) < 1:
        raise ConfigError(f"optim.{name} must be in [0, 1), got {getattr(self, name)}")
    if self.eps <= 0:
      raise ConfigError(f"optim.eps must be > 0, got {self.eps}")
    if self.weight_decay < 0:
      raise ConfigError(f"optim.weight_decay must be >= 0, got {self.weight_decay}")
    if self.warmup_steps < 0:
      raise ConfigError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
    if not 0 <= self.final_lr_fraction <= 1:
      raise ConfigError(f"optim.final_lr_fraction must be in [0, 1], got {self.final_lr_fraction}")
    if self.frozen_dtype not in FROZEN_DTYPES:
      raise ConfigError(
        f"optim.frozen_dtype must be one of {', '.join(FROZEN_DTYPES)}, got {self.frozen_dtype!r}"
      )
    if self.clip_grad_norm < 0:
      raise ConfigError(f"optim.clip_grad_norm must be >= 0, got {self.clip_grad_norm}")


def make_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
  """lr as a function of the update step, s ∈ [0, total_steps].

  cosine with warmup 0 is ``lr·(f + (1 − f)/2·(1 + cos(π s / T)))``, f = final fraction.
  """
  if total_steps <= 0:
    raise ConfigError(f"the schedule needs total_steps > 0 update steps, got {total_steps}")
  warmup = min(cfg.warmup_steps, total_steps)
  decay_steps = max(total_steps - warmup, 1)
  if cfg.schedule == "cosine":
    main = optax.cosine_decay_schedule(cfg.lr, decay_steps, alpha=cfg.final_lr_fraction)
  elif cfg.schedule == "linear":
    main = optax.linear_schedule(cfg.lr, cfg.lr * cfg.final_lr_fraction, decay_steps)
  else:
    main = optax.constant_schedule(cfg.lr)
  if warmup == 0:
    return main
  return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, warmup), main], [warmup])


def decay_mask(params, *, decay_embeddings: bool = False):
  """True for leaves that get weight decay: matrices, not biases/norm scales (ndim < 2).

  Embedding tables (any path component containing ``embed``) decay only if asked. Scanned
  layers: a leaf under a ``blocks`` mapping that is not keyed by layer index (``0, 1, …``)
  holds every layer along a leading axis, which does not count towards ``ndim``.
  """

  def decays(path, leaf):
    names = [key_name(k) for k in path]
    is_embedding = any("embed" in name.lower() for name in names)
    stacked = any(a == "blocks" and not b.isdigit() for a, b in zip(names, names[1:], strict=False))
    return leaf.ndim - stacked >= 2 and (decay_embeddings or not is_embedding)

  return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
  """``clip_by_global_norm`` (if set) → AdamW(schedule, masked decay).

  The lr is injected as a hyperparameter so the step can report the value it used.
  """
  adamw = optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
    learning_rate=make_schedule(cfg, total_steps),
    b1=cfg.b1,
    b2=cfg.b2,
    eps=cfg.eps,
    weight_decay=cfg.weight_decay,
    mask=lambda p: decay_mask(p, decay_embeddings=cfg.decay_embeddings),
  )
  if cfg.clip_grad_norm > 0:
    return optax.chain(optax.clip_by_global_norm(cfg.clip_grad_norm), adamw)
  return adamw
