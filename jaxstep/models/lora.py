"""Low-rank adapters (LoRA) on the projections of the bundled models.

A targeted projection computes ``y = x·W + b + (α/r)·(x·A)·B`` with ``A`` ``[in, r]`` and
``B`` ``[r, out]`` (flax's ``nnx.LoRALinear``, whose params sit beside the projection's as
``…/lora/lora_a`` and ``…/lora/lora_b``, plus PEFT's ``α/r`` scale). ``A`` starts uniform
in ``±1/√in`` (PEFT's Kaiming-uniform with ``a = √5``) and ``B`` at zero, so the first
forward pass is the base model's exactly. With ``model.lora.rank > 0`` everything but the
adapters is frozen (``optim.trainable`` may add leaves back).

A mixture of experts' routed experts (stacked ``[E, in, out]`` weights, not projections)
are adapted only when ``targets`` names them (``ROUTED``): one adapter per expert,
``ExpertAdapter``'s ``A`` ``[E, in, r]`` and ``B`` ``[E, r, out]``, applied by ``moe.MoeMLP``
on each expert's rows.

``merged`` folds the adapters into the base weights (``W + (α/r)·A·B``) for an export.

Your own model (any params tree whose projections are ``{"kernel": [in, out], …}``
mappings, as flax's linen and NNX modules keep them): ``add_adapters`` puts adapters beside
the kernels whose path matches a pattern, and ``merged_apply`` wraps your ``apply_fn`` so
it computes with ``W + (α/r)·A·B``; train with ``trainable=freeze.by_patterns([ADAPTER])``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxstep.core.trees import node_at, path_name
from jaxstep.errors import ConfigError

ADAPTER = r"/lora/lora_[ab]$"  # the names of adapter leaves (core.freeze patterns)
# an MoE layer's routed experts, adapted only when named in model.lora.targets (as PEFT's
# target_parameters name them): one adapter per expert on the fused gate|up and on down
ROUTED = ("experts.gate_up_proj", "experts.down_proj")
QTYPES = ("none", "int8", "nf4")  # model.lora.base_quant: the frozen base's storage (quant.py)


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Low-rank adapters on the model's projections (rank 0: none)."""

  rank: int = 0  # adapter rank r (0 = off: the whole model trains)
  alpha: float = 16.0  # scale α: the adapter's output is multiplied by α / r
  dropout: float = 0.0  # dropout on the adapter's input x (training only), as PEFT's
  targets: tuple[str, ...] = ()  # projection names to adapt (empty: every projection)
  base_quant: str = "none"  # none | int8 | nf4: the frozen base stored quantized (QLoRA)
  quant_block: int = 64  # input rows per quantization scale (bitsandbytes' blocksize)

  def __post_init__(self):
    object.__setattr__(self, "targets", tuple(self.targets))  # a list from Python: hashable
    if self.base_quant not in QTYPES:
      raise ConfigError(
        f"model.lora.base_quant must be one of {', '.join(QTYPES)}, got {self.base_quant!r}"
      )
    if self.base_quant != "none" and self.rank == 0:
      raise ConfigError(
        f"model.lora.base_quant {self.base_quant} quantizes a frozen base for adapters to "
        f"train on: set model.lora.rank > 0 (or model.lora.base_quant=none)"
      )
    if self.quant_block < 2 or self.quant_block % 2:
      raise ConfigError(
        f"model.lora.quant_block must be an even number >= 2, got {self.quant_block}"
      )
    if self.rank < 0:
      raise ConfigError(f"model.lora.rank must be >= 0 (0: off), got {self.rank}")
    if not 0.0 <= self.dropout < 1.0:
      raise ConfigError(f"model.lora.dropout must be in [0, 1), got {self.dropout}")
    if not (math.isfinite(self.alpha) and self.alpha > 0):
      raise ConfigError(f"model.lora.alpha must be > 0, got {self.alpha}")

  @property
  def scale(self) -> float:
    return self.alpha / self.rank if self.rank else 0.0

  def check_targets(self, available: tuple[str, ...]) -> None:
    """``ConfigError`` for a target that names no projection of the model, and for adapter
    dropout on routed experts (their adapters act on the expert-sorted rows, as PEFT's on
    an expert parameter, which has no dropout either)."""
    unknown = [t for t in self.targets if t not in available]
    if unknown:
      raise ConfigError(
        f"model.lora.targets: {', '.join(map(repr, unknown))} is not a projection of this "
        f"model; its projections are {', '.join(available)}"
      )
    if self.dropout and any(t in ROUTED for t in self.targets):
      raise ConfigError(
        "model.lora.dropout must be 0 with routed experts in model.lora.targets (an adapter "
        "on an expert parameter has no dropout, in PEFT either): set model.lora.dropout=0"
      )

  def adapts(self, name: str) -> bool:
    """Whether projection ``name`` gets an adapter: every one when ``targets`` is empty,
    but routed experts (``ROUTED``) only when named."""
    if name in ROUTED:
      return bool(self.rank) and name in self.targets
    return bool(self.rank) and (not self.targets or name in self.targets)


def a_init(key, shape, dtype=jnp.float32):
  """``A``'s initial values: uniform in ``±1/√in`` (``in`` = ``shape[-2]``)."""
  bound = 1.0 / math.sqrt(shape[-2])
  return jax.random.uniform(key, shape, dtype, -bound, bound)


class LoRALinear(nnx.Linear):
  """``nnx.Linear`` plus flax's ``nnx.LoRA`` beside it, scaled by PEFT's ``α/r``. The adapter
  draws nothing from ``rngs`` (its ``A`` is set by ``init_adapters`` once the model is
  built), so a seed initialises the same base weights with or without adapters."""

  def __init__(self, in_features: int, out_features: int, *, lora: LoraConfig, rngs, **kwargs):
    super().__init__(in_features, out_features, rngs=rngs, **kwargs)
    self.lora = nnx.LoRA(in_features, lora.rank, out_features, rngs=nnx.Rngs(0))
    self.scale, self.rate = lora.scale, lora.dropout

  def __call__(self, x: jax.Array, out_sharding=None) -> jax.Array:
    y = nnx.Linear.__call__(self, x, out_sharding=out_sharding)
    return y + self.scale * self.lora(_dropped(x, self.rate)).astype(y.dtype)


class ExpertFactors(nnx.Module):
  """One adapter per expert: ``lora_a`` ``[E, in, r]`` and ``lora_b`` ``[E, r, out]`` (set
  by ``init_adapters``, as ``LoRALinear``'s)."""

  def __init__(self, experts: int, in_features: int, out_features: int, rank: int):
    self.lora_a = nnx.Param(jnp.zeros((experts, in_features, rank), jnp.float32))
    self.lora_b = nnx.Param(jnp.zeros((experts, rank, out_features), jnp.float32))


class ExpertAdapter(nnx.Module):
  """The adapters of one stacked expert weight ``[E, in, out]``, at ``…/lora/lora_a`` and
  ``…/lora/lora_b`` like every adapter (``ADAPTER``). Expert ``e`` computes ``x·W_e +
  (α/r)·(x·A_e)·B_e`` on the rows routed to it (``moe.MoeMLP``)."""

  def __init__(self, experts: int, in_features: int, out_features: int, lora: LoraConfig):
    self.lora = ExpertFactors(experts, in_features, out_features, lora.rank)
    self.scale = lora.scale


_DROPOUT = contextvars.ContextVar("lora_dropout", default=None)


@contextlib.contextmanager
def dropout_keys(rng):
  """Inside: each adapter called drops its input with a key of its own, folded from
  ``rng`` (None: no dropout, as at inference). A block opens it around its own forward
  pass with its dropout key, so the keys follow the block under ``scan`` and remat."""
  token = _DROPOUT.set(None if rng is None else [rng, 0])
  try:
    yield
  finally:
    _DROPOUT.reset(token)


def block_key(rng, train: bool):
  """The adapters' dropout key in a block called with ``rng`` (None when not training):
  folded from it, so the block's own dropout keys stay what they were."""
  return jax.random.fold_in(rng, 2) if train and rng is not None else None


def _dropped(x: jax.Array, rate: float) -> jax.Array:
  """``x`` with inverted dropout at ``rate`` when ``dropout_keys`` is open with a key."""
  state = _DROPOUT.get()
  if not rate or state is None:
    return x
  key = jax.random.fold_in(state[0], state[1])
  state[1] += 1
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def linear(lora: LoraConfig, name: str, in_features: int, out_features: int, **kwargs):
  """The projection ``name``: a ``LoRALinear`` if ``lora`` adapts it, else ``nnx.Linear``."""
  if lora.adapts(name):
    return LoRALinear(in_features, out_features, lora=lora, **kwargs)
  return nnx.Linear(in_features, out_features, **kwargs)


def has_adapters(params) -> bool:
  return any(_is_adapter(path_name(p)) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0])


def _is_adapter(name: str) -> bool:
  return name.endswith(("/lora/lora_a", "/lora/lora_b"))


def adapter_key(rng) -> jax.Array:
  """The adapters' key for a model built from ``rng`` (an int seed or a key): a stream of
  its own, so the base weights do not depend on whether adapters are there."""
  key = jax.random.PRNGKey(rng) if isinstance(rng, int) else rng
  return jax.random.fold_in(key, 0x10A)


def initialised(params, rng):
  """``params`` with every adapter set by ``init_adapters`` (the base leaves unchanged)."""
  return with_adapters(params, params, init_adapters(params, rng))


def init_adapters(abstract, rng) -> dict:
  """Concrete adapters for the adapter leaves of ``abstract`` (a params tree of shapes):
  ``A`` by ``a_init`` from ``fold_in(rng, i)`` (i: the leaf's index), ``B`` zeros. Returns
  ``{name: array}`` (``"a/b/lora/lora_a"`` names)."""
  out = {}
  for i, (path, leaf) in enumerate(jax.tree_util.tree_flatten_with_path(abstract)[0]):
    name = path_name(path)
    if name.endswith("/lora/lora_a"):
      out[name] = a_init(jax.random.fold_in(rng, i), leaf.shape, leaf.dtype)
    elif name.endswith("/lora/lora_b"):
      out[name] = jnp.zeros(leaf.shape, leaf.dtype)
  return out


def with_adapters(base, abstract, adapters: dict):
  """``abstract``'s tree filled with ``base``'s leaves (a params tree without adapters) and
  ``adapters`` (``init_adapters``)."""

  def fill(path, leaf):
    name = path_name(path)
    if name in adapters:
      return adapters[name]
    return node_at(base, path)

  return jax.tree_util.tree_map_with_path(fill, abstract)


def attach(params, model_cfg, seed: int = 0, place=None) -> dict:
  """``params`` of ``model_cfg``'s model without adapters (a folder's weights), with fresh
  adapters where ``model_cfg.lora`` puts them: ``A`` by ``a_init`` from
  ``adapter_key(seed)``, ``B`` zeros (the model computes what the weights alone compute).
  ``place(array) -> leaf`` puts each adapter (e.g. onto its sharding)."""
  from jaxstep import models  # the models import this module

  _, abstract = models.build(model_cfg, 0, abstract=True)
  adapters = init_adapters(abstract, adapter_key(jax.random.PRNGKey(seed)))
  if place is not None:
    adapters = {name: place(a) for name, a in adapters.items()}
  return with_adapters(params, abstract, adapters)


def add_adapters(params, patterns, *, rank: int, rng) -> dict:
  """``params`` with an adapter (``lora: {lora_a, lora_b}``) beside every 2-D ``kernel``
  whose module path (``"a/b/0/c"``) matches one of ``patterns`` (``re.search``); ``A`` as
  ``a_init``, ``B`` zeros. ``ConfigError`` when a pattern matches no kernel (the kernels'
  paths are named)."""
  import re

  if rank <= 0:
    raise ConfigError(f"rank must be > 0, got {rank}")
  kernels = [
    (path[:-1], leaf)
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
    if path_name(path[-1:]) == "kernel" and leaf.ndim == 2
  ]
  names = [path_name(p) for p, _ in kernels]
  for pattern in patterns:
    if not any(re.search(pattern, n) for n in names):
      raise ConfigError(f"{pattern!r} matches no kernel; the kernels are {', '.join(names)}")
  out = jax.tree.map(lambda x: x, params)  # a copy of the containers, the leaves shared
  for i, ((path, kernel), name) in enumerate(zip(kernels, names, strict=True)):
    if any(re.search(p, name) for p in patterns):
      node = node_at(out, path)
      a = a_init(jax.random.fold_in(rng, i), (kernel.shape[0], rank), kernel.dtype)
      node["lora"] = {"lora_a": a, "lora_b": jnp.zeros((rank, kernel.shape[1]), kernel.dtype)}
  return out


def merged_apply(apply_fn, scale: float):
  """``apply_fn`` of a model that has no adapters, taking params with adapters
  (``add_adapters``): it computes with every kernel ``W + scale·A·B``."""
  return lambda params, *args, **kwargs: apply_fn(merged(params, scale), *args, **kwargs)


def merged(params, scale: float):
  """``params`` with every adapter folded in: each module holding ``lora`` gets ``kernel +
  scale·A·B`` (over a leading layer axis too) and loses its ``lora`` entry; stacked experts
  get ``W_e + scale·A_e·B_e`` per expert (``gate_up``'s columns split between ``gate_proj``
  and ``up_proj``) and lose their ``gate_up`` and ``down`` adapters. A quantized base
  (``quant.py``) is dequantized first, so the result holds plain arrays only."""
  from jaxstep.models import quant

  if isinstance(params, dict):
    if _EXPERT_ADAPTERS & params.keys() and not isinstance(params.get("down_proj"), dict):
      return _merged_experts(params, scale)
    out = {k: merged(v, scale) for k, v in params.items() if k != "lora"}
    if "lora" in params and "kernel" in params:
      out["kernel"] = _plus_delta(out["kernel"], params["lora"], scale)
    return out
  return quant.dequantize(params) if quant.is_quantized(params) else params


def _plus_delta(w, factors: dict, scale: float):
  """``w + scale·A·B`` in fp32, cast back to ``w``'s dtype (leading axes batched)."""
  a, b = factors["lora_a"].astype(jnp.float32), factors["lora_b"].astype(jnp.float32)
  delta = jnp.einsum("...ir,...ro->...io", a, b)
  return (w.astype(jnp.float32) + scale * delta).astype(w.dtype)


_EXPERT_ADAPTERS = {"gate_up", "down"}  # ExpertAdapter's names beside the stacked experts


def _merged_experts(experts: dict, scale: float) -> dict:
  """A stacked-experts node (``gate_proj``, ``up_proj``, ``down_proj`` ``[…, E, in, out]``)
  with its ``gate_up`` and ``down`` adapters folded in."""
  out = {k: merged(v, scale) for k, v in experts.items() if k not in _EXPERT_ADAPTERS}
  if "gate_up" in experts:
    f = out["gate_proj"].shape[-1]
    both = jnp.concatenate([out["gate_proj"], out["up_proj"]], axis=-1)
    both = _plus_delta(both, experts["gate_up"]["lora"], scale)
    out["gate_proj"], out["up_proj"] = both[..., :f], both[..., f:]
  if "down" in experts:
    out["down_proj"] = _plus_delta(out["down_proj"], experts["down"]["lora"], scale)
  return out


def adapters_off(params):
  """``params`` with every adapter's ``B`` at zero: the model with its adapters switched off,
  whose forward is its base's (``x·W + b + s·(x·A)·0`` adds exact zeros). A preference run's
  reference is this, the same weights in memory, not a second copy of the model."""
  if isinstance(params, dict):
    out = {k: adapters_off(v) for k, v in params.items()}
    if isinstance(params.get("lora"), dict) and "lora_b" in params["lora"]:
      out["lora"] = {**out["lora"], "lora_b": jnp.zeros_like(params["lora"]["lora_b"])}
    return out
  return params
