"""Optimizer and lr schedule from config, built only from optax parts.

Schedules count *update steps* (optax's own count advances once per applied update).
Optimizers (``optim.name``), each after the accumulated gradient's clipping and each with
its lr injected (``optax.inject_hyperparams``) so the step reports the lr it used:

- ``adamw``: ``optax.adamw``, decoupled decay on matrices (``decay_mask``);
- ``muon``: ``optax.contrib.muon`` (momentum 0.95, Nesterov, 5 Newton–Schulz steps) on the
  hidden matrices (2-D, not an embedding or the
  output head; a stacked layer axis is a batch axis), ``optax.adamw`` inside it for every
  other leaf (embeddings, head, norms, biases; lr ``muon_adam_lr`` or ``lr``, no decay) —
  the split nanochat and Levanter use (``muon_dims``);
- ``adafactor``: ``optax.adafactor`` (factored second moments for matrices of at least 128
  rows and columns), decoupled decay on matrices;
- ``lion``: ``optax.lion`` (``b1``, ``b2``), decoupled decay on matrices;
- ``sgd``: ``optax.sgd`` with ``momentum`` (0: none) and ``nesterov``; decay is added to
  the gradient (L2, as ``torch.optim.SGD`` does).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax

from jaxstep.core import param_groups
from jaxstep.core.trees import key_name
from jaxstep.errors import ConfigError

OPTIMIZERS = ("adamw", "muon", "adafactor", "lion", "sgd")
SCHEDULES = ("constant", "cosine", "linear", "wsd")
DECAY_SHAPES = ("linear", "cosine", "1-sqrt")
FROZEN_DTYPES = ("fp32", "bf16")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """Clipping + an optimizer + lr schedule. All step counts are update steps."""

  name: str = "adamw"  # adamw | muon | adafactor | lion | sgd
  lr: float = 1e-3  # peak learning rate
  schedule: str = "cosine"  # constant | cosine | linear | wsd (after warmup)
  decay_fraction: float = 0.2  # wsd: the share of the run its final decay takes
  decay_shape: str = "linear"  # wsd: linear | cosine | 1-sqrt
  warmup_steps: int = 0  # linear warmup from 0 to lr, in update steps
  final_lr_fraction: float = 0.1  # cosine/linear end at lr * this
  clip_grad_norm: float = 1.0  # clip the accumulated gradient's global norm; 0 = off
  weight_decay: float = 0.1  # decoupled (AdamW) decay; only on matrices (ndim >= 2)
  decay_embeddings: bool = False  # also decay embedding tables
  b1: float = 0.9  # Adam first-moment decay
  b2: float = 0.95  # Adam second-moment decay
  eps: float = 1e-8  # Adam epsilon
  momentum: float = 0.9  # sgd: momentum (0: none)
  nesterov: bool = False  # sgd: Nesterov momentum
  muon_adam_lr: float = 0.0  # muon: lr of the leaves it leaves to AdamW (0: optim.lr)
  groups: tuple[dict, ...] = ()  # [{match, lr_scale, weight_decay, optimizer}]: param_groups.py
  trainable: tuple[str, ...] = ()  # regexes of the params that train (empty: all); see freeze.py
  frozen_dtype: str = "fp32"  # fp32 | bf16: the dtype frozen params are kept in

  def __post_init__(self):
    object.__setattr__(self, "groups", param_groups.check(self.groups, (self.name, *OPTIMIZERS)))
    if self.name not in OPTIMIZERS:
      raise ConfigError(f"optim.name must be one of {', '.join(OPTIMIZERS)}, got {self.name!r}")
    if self.schedule not in SCHEDULES:
      raise ConfigError(f"optim.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
    if self.decay_shape not in DECAY_SHAPES:
      raise ConfigError(
        f"optim.decay_shape must be one of {', '.join(DECAY_SHAPES)}, got {self.decay_shape!r}"
      )
    if not 0 < self.decay_fraction <= 1:
      raise ConfigError(f"optim.decay_fraction must be in (0, 1], got {self.decay_fraction}")
    if not 0 <= self.momentum < 1 or self.muon_adam_lr < 0:
      raise ConfigError(
        f"optim.momentum must be in [0, 1) and optim.muon_adam_lr >= 0, got "
        f"{self.momentum} and {self.muon_adam_lr}"
      )
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
  if cfg.schedule == "wsd":
    main = wsd_schedule(
      cfg.lr, decay_steps, cfg.decay_fraction, cfg.final_lr_fraction, cfg.decay_shape
    )
  elif cfg.schedule == "cosine":
    main = optax.cosine_decay_schedule(cfg.lr, decay_steps, alpha=cfg.final_lr_fraction)
  elif cfg.schedule == "linear":
    main = optax.linear_schedule(cfg.lr, cfg.lr * cfg.final_lr_fraction, decay_steps)
  else:
    main = optax.constant_schedule(cfg.lr)
  if warmup == 0:
    return main
  return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, warmup), main], [warmup])


def wsd_schedule(
  lr: float, steps: int, decay_fraction: float, final_fraction: float, shape: str
) -> optax.Schedule:
  """Warmup-stable-decay after the warmup: ``lr`` for the first ``steps − D`` update steps,
  then a decay over the last ``D = max(round(decay_fraction · steps), 1)`` to ``lr · f``,
  with ``x`` the decay's progress in [0, 1]: ``linear`` ``lr·(1 − (1 − f)·x)``, ``cosine``
  ``lr·(f + (1 − f)·(1 + cos πx)/2)``, ``1-sqrt`` ``lr·(f + (1 − f)·(1 − √x))``."""
  d = min(max(round(decay_fraction * steps), 1), steps)
  f = final_fraction

  def decay(count):
    x = jnp.clip(count / d, 0.0, 1.0)
    if shape == "linear":
      return lr * (1.0 - (1.0 - f) * x)
    if shape == "cosine":
      return lr * (f + (1.0 - f) * 0.5 * (1.0 + jnp.cos(jnp.pi * x)))
    return lr * (f + (1.0 - f) * (1.0 - jnp.sqrt(x)))

  if d == steps:
    return decay
  return optax.join_schedules([optax.constant_schedule(lr), decay], [steps - d])


def wsd_stable_end(cfg: OptimConfig, total_steps: int) -> int:
  """The number of update steps a ``wsd`` schedule of ``total_steps`` applies before its
  decay lowers the lr (warmup + stable): a run may be extended or shortened at any step up
  to this one, and the lr so far is the same under either plan."""
  warmup = min(cfg.warmup_steps, total_steps)
  steps = max(total_steps - warmup, 1)
  return warmup + steps - min(max(round(cfg.decay_fraction * steps), 1), steps)


def _stacked(names: list[str]) -> bool:
  """A leaf under a ``blocks`` mapping not keyed by layer index holds every layer along a
  leading axis (scanned layers)."""
  return any(a == "blocks" and not b.isdigit() for a, b in zip(names, names[1:], strict=False))


def muon_dims(params):
  """Which leaves Muon orthogonalizes: the hidden matrices (2-D once a stacked layer axis is
  set aside), not embeddings nor the output head; ``None`` (AdamW's) for every other leaf."""
  from optax.contrib import MuonDimensionNumbers

  def dims(path, leaf):
    names = [key_name(k) for k in path]
    stacked = _stacked(names)
    outer = any("embed" in n.lower() or n in ("head", "lm_head") for n in names)
    if outer or leaf.ndim - stacked != 2:
      return None
    return MuonDimensionNumbers(1, 2) if stacked else MuonDimensionNumbers()

  return jax.tree_util.tree_map_with_path(dims, params)


def decay_mask(params, *, decay_embeddings: bool = False):
  """True for leaves that get weight decay: matrices, not biases/norm scales (ndim < 2).

  Embedding tables (any path component containing ``embed``) decay only if asked. Scanned
  layers: a leaf under a ``blocks`` mapping that is not keyed by layer index (``0, 1, …``)
  holds every layer along a leading axis, which does not count towards ``ndim``.
  """

  def decays(path, leaf):
    names = [key_name(k) for k in path]
    is_embedding = any("embed" in name.lower() for name in names)
    return leaf.ndim - _stacked(names) >= 2 and (decay_embeddings or not is_embedding)

  return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
  """``clip_by_global_norm`` (if set) → the ``optim.name`` optimizer (module docstring).

  The lr is injected as a hyperparameter so the step can report the value it used.
  """
  schedule = make_schedule(cfg, total_steps)
  if cfg.groups:
    inner = param_groups.grouped(cfg, schedule, _optimizer)
  else:
    inner = _optimizer(cfg, schedule)
  if cfg.clip_grad_norm > 0:
    return optax.chain(optax.clip_by_global_norm(cfg.clip_grad_norm), inner)
  return inner


def _optimizer(
  cfg: OptimConfig, lr: optax.Schedule, inject: bool = True
) -> optax.GradientTransformation:
  """``cfg.name``'s optax optimizer on ``lr``; ``inject``: its lr kept in its state."""
  mask = lambda p: decay_mask(p, decay_embeddings=cfg.decay_embeddings)  # noqa: E731
  wd = cfg.weight_decay

  def wrap(fn, static=()):
    return optax.inject_hyperparams(fn, static_args=static) if inject else fn

  if cfg.name == "muon":
    static = ("muon_weight_dimension_numbers", "weight_decay_mask", "adam_learning_rate")
    return wrap(optax.contrib.muon, static)(
      learning_rate=lr,
      weight_decay=wd,
      weight_decay_mask=mask,
      adam_b1=cfg.b1,
      adam_b2=cfg.b2,
      adam_learning_rate=(lambda step: lr(step) * cfg.muon_adam_lr / cfg.lr)
      if cfg.muon_adam_lr
      else None,
      muon_weight_dimension_numbers=muon_dims,
    )
  if cfg.name == "adafactor":
    static = ("weight_decay_mask", "min_dim_size_to_factor", "multiply_by_parameter_scale")
    static += ("decay_offset", "dtype_momentum", "factored")
    return wrap(optax.adafactor, static)(
      learning_rate=lr, weight_decay_rate=wd or None, weight_decay_mask=mask
    )
  if cfg.name == "lion":
    return wrap(optax.lion, ("mask",))(
      learning_rate=lr, b1=cfg.b1, b2=cfg.b2, weight_decay=wd, mask=mask
    )
  if cfg.name == "sgd":
    sgd = wrap(optax.sgd, ("nesterov",))(
      learning_rate=lr, momentum=cfg.momentum or None, nesterov=cfg.nesterov
    )
    return optax.chain(optax.add_decayed_weights(wd, mask), sgd) if wd else sgd
  return wrap(optax.adamw, ("mask",))(
    learning_rate=lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=wd, mask=mask
  )
