"""A mixture-of-experts MLP for the Llama family: a router, E SwiGLU experts run through a
grouped matmul (``grouped.py``), optional shared experts.

Per token ``x`` (``d_model``): router logits ``z = x·W_r`` (``[E]``); scores ``s =
softmax(z)`` (fp32) or ``sigmoid(z)``; the top ``k`` experts by score, their weights the
top-k scores, renormalized to sum to 1 when ``norm_topk`` (Mixtral, Qwen3-MoE) or kept as
they are (OLMoE, Qwen2-MoE); output ``Σ_j w_j · expert_{e_j}(x)`` with ``expert_e(x) =
down_e(silu(gate_e(x)) · up_e(x))``, plus the shared experts' SwiGLU (times
``sigmoid(x·w_g)`` when gated, Qwen2-MoE). This is Hugging Face's arithmetic, so converted
weights give the same logits.

Dispatch is dropless: the ``T·k`` (token, expert) assignments are sorted by expert, each
expert's rows multiplied by its weights in one grouped product, and gathered back (the
backward passes of both gathers are gathers too: ``grouped.take_rows``). With a
``capacity_factor`` c > 0 each expert takes at most ``⌈c·S·k/E⌉`` assignments from each
sequence of S tokens, the first in token order (MaxText's per-sequence rule); the rest are
dropped (their weight is zero, the token keeps its residual) and counted. Counted per
sequence, the drops do not depend on the micro-batch size, the mesh or the expert split.

The layer also returns the routing sums the load-balancing and z-losses need, over the
tokens weighted by ``route_weights`` (``[B, S]``, the loss mask; None: all ones):
``counts[e] = Σ_t m_t·[e ∈ top-k(t)]`` (no gradient), ``probs[e] = Σ_t m_t·p_t[e]`` with
``p_t`` the softmax (or the sigmoid scores normalized to sum 1), ``z = Σ_t m_t·
logsumexp(z_t)²``, and ``dropped`` (assignments over capacity, every token). They are sums,
so a step adds them up exactly across micro-batches and devices (``core/router_loss.py``).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxstep.core import layout
from jaxstep.errors import ConfigError
from jaxstep.models import grouped, lora
from jaxstep.models.gpt import platform_kernels

SCORES = ("softmax", "sigmoid")
LBL_SCOPES = ("global", "micro_batch")


class Routing(NamedTuple):
  """The router's decision for ``T`` tokens."""

  probs: jax.Array  # f32[T, E]: each token's distribution over experts (the LBL's p)
  weights: jax.Array  # f32[T, k]: the chosen experts' mixing weights
  experts: jax.Array  # int32[T, k]: the chosen experts


def route(logits: jax.Array, k: int, scores: str, norm_topk: bool) -> Routing:
  """Top-``k`` routing of ``logits [T, E]`` (scores in fp32, as Hugging Face computes them)."""
  z = logits.astype(jnp.float32)
  if scores == "softmax":
    s = jax.nn.softmax(z, axis=-1)
    probs = s
  else:
    s = jax.nn.sigmoid(z)
    probs = s / jnp.sum(s, axis=-1, keepdims=True)
  top, experts = jax.lax.top_k(s, k)
  if norm_topk:
    top = top / jnp.sum(top, axis=-1, keepdims=True)
  return Routing(probs, top, experts.astype(jnp.int32))


class Dispatch(NamedTuple):
  """Where each assignment's row goes in the expert-sorted layout (``R`` rows)."""

  row_token: jax.Array  # int32[R]: the token each row holds (T: an empty row)
  row_assign: jax.Array  # int32[R]: the assignment t·k + j each row holds (T·k: none)
  dest: jax.Array  # int32[T, k]: the row of each assignment (R: dropped)
  group_sizes: jax.Array  # int32[E]: rows per expert, padded to whole tiles
  tile_groups: jax.Array  # int32[R / tile]: each tile's expert


def capacity(seq_len: int, k: int, experts: int, factor: float) -> int | None:
  """Assignments one expert takes from one sequence: ``⌈factor·S·k/E⌉``, or None
  (dropless) for ``factor`` 0."""
  return math.ceil(factor * seq_len * k / experts) if factor > 0 else None


def over_capacity(experts: jax.Array, n_experts: int, cap: int) -> jax.Array:
  """``experts [B, S, k]`` with every assignment past the first ``cap`` of its expert in its
  sequence (in token order) sent to ``n_experts`` (nowhere: dropped). Per sequence, so what
  is dropped does not depend on the micro-batch, the mesh or the expert split."""
  b, s, k = experts.shape
  row = jnp.arange(b, dtype=jnp.int32)[:, None]
  key = (row * n_experts + experts.reshape(b, s * k)).reshape(-1)
  order = jnp.argsort(key, stable=True)
  counts = jnp.bincount(key, length=b * n_experts).astype(jnp.int32)
  rank_sorted = jnp.arange(key.size, dtype=jnp.int32) - (jnp.cumsum(counts) - counts)[key[order]]
  rank = jnp.zeros_like(rank_sorted).at[order].set(rank_sorted)
  return jnp.where(rank < cap, experts.reshape(-1), n_experts).reshape(b, s, k)


def dispatch(experts: jax.Array, n_experts: int, tile: int, most: int | None = None) -> Dispatch:
  """The expert-sorted layout of ``experts [T, k]``: groups in expert order, each padded to
  a multiple of ``tile`` rows (1: unpadded); a stable sort keeps token order inside a
  group. An expert id ``>= n_experts`` (dropped over capacity, or another device's expert
  under expert parallelism) gets no row.

  The layout's static size is the most rows the assignments can fill: ``min(T·k, n·m)``
  plus each group's padding, where an expert gets at most ``m = min(T, most)`` assignments:
  one per token (a token's k experts are distinct), and ``most`` where a capacity bounds
  it (``rows_bound``)."""
  t, k = experts.shape
  flat = experts.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  sorted_e = flat[order]
  counts = jnp.bincount(flat, length=n_experts + 1).astype(jnp.int32)  # last: no row
  group = jnp.minimum(sorted_e, n_experts)
  rank = jnp.arange(t * k, dtype=jnp.int32) - (jnp.cumsum(counts) - counts)[group]
  counts = counts[:n_experts]
  sizes = (counts + tile - 1) // tile * tile
  starts = jnp.cumsum(sizes) - sizes
  rows = rows_bound(t, k, n_experts, tile, most)
  here = sorted_e < n_experts
  dest_sorted = jnp.where(here, starts[jnp.minimum(sorted_e, n_experts - 1)] + rank, rows)
  dest = jnp.zeros(t * k, jnp.int32).at[order].set(dest_sorted).reshape(t, k)
  assignment = jnp.arange(t * k, dtype=jnp.int32)
  row_assign = jnp.full(rows, t * k, jnp.int32).at[dest.reshape(-1)].set(assignment, mode="drop")
  tile_start = jnp.arange(rows // tile, dtype=jnp.int32) * tile
  ends = jnp.cumsum(sizes)
  tile_groups = jnp.minimum(jnp.searchsorted(ends, tile_start, side="right"), n_experts - 1)
  return Dispatch(row_assign // k, row_assign, dest, sizes, tile_groups.astype(jnp.int32))


def layout_sizes(cfg, n: int, seq_len: int) -> tuple[int, int | None]:
  """``(tile, most)`` of a layer's ``dispatch`` for ``n`` tokens in sequences of
  ``seq_len`` (the expert group's, under expert parallelism): tiles sized by the mean group,
  the ``n·k`` assignments over all E experts (1: ``ragged``, unpadded), and with a capacity
  each expert's most rows, ``cap`` from each of the ``n / S`` sequences."""
  k = cfg.experts_per_token
  ragged = grouped.resolve(cfg.moe_matmul) == "ragged"
  tile = 1 if ragged else grouped.tile_rows(n * k, cfg.num_experts)
  cap = capacity(seq_len, k, cfg.num_experts, cfg.capacity_factor)
  return tile, None if cap is None else cap * (n // seq_len)


def rows_bound(t: int, k: int, n_experts: int, tile: int, most: int | None = None) -> int:
  """The rows of ``dispatch``'s layout: ``T·k`` assignments, or fewer where the experts here
  cannot take them all (``n_experts·m``, ``m = min(T, most)``), plus ``tile − 1`` padding
  rows per group, in whole tiles; never more than ``n_experts`` groups of ``⌈m⌉_tile``.
  Under expert parallelism ``T`` is the expert group's tokens: without a capacity the
  worst case is all of them routed here; with one, the capacity of the group's sequences."""
  m = t if most is None else min(t, most)
  up = lambda a: (a + tile - 1) // tile * tile  # noqa: E731
  return min(up(min(t * k, n_experts * m) + n_experts * (tile - 1)), n_experts * up(m))


class SwiGLU(nnx.Module):
  """``down(silu(gate(x)) · up(x))``: a dense MLP (the shared experts)."""

  def __init__(self, d: int, hidden: int, linear):
    self.gate_proj = linear("gate_proj", d, hidden)
    self.up_proj = linear("up_proj", d, hidden)
    self.down_proj = linear("down_proj", hidden, d)

  def __call__(self, x):
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nnx.Module):
  """E SwiGLU experts as stacked weights: ``gate_proj``, ``up_proj`` ``[E, d, f]`` and
  ``down_proj`` ``[E, f, d]`` (``[in, out]`` per expert, as the dense kernels); with LoRA
  on them (``lora.ROUTED`` in ``model.lora.targets``), an adapter per expert on the fused
  ``gate|up`` (``gate_up``: ``[E, d, r]``, ``[E, r, 2f]``, one adapter on both halves, as
  PEFT's on transformers' fused ``gate_up_proj``) and on ``down`` (``[E, f, r]``, ``[E, r, d]``)."""

  def __init__(self, n: int, d: int, f: int, *, rngs: nnx.Rngs, lora_cfg=None):
    init = nnx.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=0)
    self.gate_proj = nnx.Param(init(rngs.params(), (n, d, f)))
    self.up_proj = nnx.Param(init(rngs.params(), (n, d, f)))
    self.down_proj = nnx.Param(init(rngs.params(), (n, f, d)))
    adapts = lambda name: lora_cfg is not None and lora_cfg.adapts(name)  # noqa: E731
    gate_up, down = lora.ROUTED
    self.gate_up = lora.ExpertAdapter(n, d, 2 * f, lora_cfg) if adapts(gate_up) else None
    self.down = lora.ExpertAdapter(n, f, d, lora_cfg) if adapts(down) else None


class MoeMLP(nnx.Module):
  """The MoE MLP of a block (``cfg``: a ``LlamaConfig`` with ``num_experts > 0``)."""

  def __init__(self, cfg, linear, *, rngs: nnx.Rngs):
    """``linear(name, in, out)``: a projection the config's LoRA may adapt (the shared
    experts'); the routed experts are adapted when ``model.lora.targets`` names them, the
    router never (docs/moe.md)."""
    d, e = cfg.d_model, cfg.num_experts
    self.cfg = cfg
    dense, _ = platform_kernels()
    self.router = nnx.Linear(d, e, use_bias=False, **dense, rngs=rngs)
    self.experts = Experts(e, d, cfg.expert_size, rngs=rngs, lora_cfg=cfg.lora)
    width = cfg.shared_width
    self.shared_expert = SwiGLU(d, width, linear) if width else None
    gate = cfg.shared_expert_gate
    self.shared_expert_gate = nnx.Linear(d, 1, use_bias=False, **dense, rngs=rngs) if gate else None

  def __call__(self, x: jax.Array, route_weights: jax.Array | None = None):
    """``x [B, S, d]`` → ``(out [B, S, d], routing sums)`` (module docstring)."""
    cfg = self.cfg
    b, s, d = x.shape
    tokens = x.reshape(b * s, d)
    logits = self.router(tokens)
    r = route(logits, cfg.experts_per_token, cfg.router_scores, cfg.norm_topk)
    out, dropped = self._experts(tokens, r, s)
    if self.shared_expert is not None:
      shared = self.shared_expert(tokens)
      if self.shared_expert_gate is not None:
        shared = jax.nn.sigmoid(self.shared_expert_gate(tokens)) * shared
      out = out + shared
    m = jnp.ones((b * s,), jnp.float32) if route_weights is None else route_weights.reshape(-1)
    return out.reshape(b, s, d), routing_sums(logits, r, m, cfg.num_experts, dropped)

  def _experts(self, tokens: jax.Array, r: Routing, seq_len: int):
    """``Σ_j w_j · expert_{e_j}(x)`` for ``tokens [T, d]``, and the dropped assignments.

    Under expert parallelism (``layout.expert_shards() = P > 1``: inside the sharded step,
    this device holding experts ``[p·E/P, (p+1)·E/P)`` and its own rows of the batch) the
    P devices of an expert group all-gather their tokens and routings, each runs its own
    experts on the assignments routed to them, and a reduce-scatter sums the P partial
    outputs back onto the rows' own devices: Megatron's all-gather token dispatcher. It is
    dropless and exact (the same sums as one device); its traffic per MoE layer is the
    group's tokens twice (``d`` floats each), where an all-to-all moves each token's k
    routed copies."""
    cfg, ex = self.cfg, self.experts
    shards = layout.expert_shards()
    weights, experts, dropped = r.weights, r.experts, jnp.zeros((), jnp.float32)
    cap = capacity(seq_len, cfg.experts_per_token, cfg.num_experts, cfg.capacity_factor)
    if cap is not None:  # on this device's own rows, before any exchange
      kept = over_capacity(experts.reshape(-1, seq_len, experts.shape[1]), cfg.num_experts, cap)
      experts = kept.reshape(experts.shape)
      dropped = jnp.sum(experts == cfg.num_experts).astype(jnp.float32)
    if shards > 1:
      gather = functools.partial(jax.lax.all_gather, axis_name=layout.EXPERT, tiled=True)
      tokens, weights, experts = gather(tokens), gather(weights), gather(experts)
      here = ex.gate_proj.shape[0]  # this device's experts
      experts = experts - jax.lax.axis_index(layout.EXPERT) * here
      experts = jnp.where((experts >= 0) & (experts < here), experts, here)
    n, d = tokens.shape
    n_here = ex.gate_proj.shape[0]
    impl = grouped.resolve(cfg.moe_matmul)
    tile, most = layout_sizes(cfg, n, seq_len)
    plan = dispatch(experts, n_here, tile, most)
    rows = grouped.take_rows(tokens, plan.row_token, plan.dest)
    mm = functools.partial(
      grouped.grouped_matmul,
      group_sizes=plan.group_sizes,
      tile_groups=plan.tile_groups,
      impl=impl,
    )
    w = lambda p: jnp.asarray(p[...], tokens.dtype)  # noqa: E731 - numpy params too
    # gate and up in one grouped product: half the groups' passes over their rows
    gate_up = mm(rows, jnp.concatenate([w(ex.gate_proj), w(ex.up_proj)], axis=-1))
    gate_up = _adapted(gate_up, rows, ex.gate_up, mm, w)
    gate, up = jnp.split(gate_up, 2, axis=-1)
    hidden = jax.nn.silu(gate) * up
    out_rows = _adapted(mm(hidden, w(ex.down_proj)), hidden, ex.down, mm, w)
    picked = grouped.take_rows(out_rows, plan.dest.reshape(-1), plan.row_assign[:, None])
    picked = picked.reshape(*plan.dest.shape, d)  # [T, k, d]; not here: 0
    out = jnp.einsum("tkd,tk->td", picked, weights.astype(tokens.dtype))
    if shards > 1:
      out = jax.lax.psum_scatter(out, layout.EXPERT, scatter_dimension=0, tiled=True)
    return out, dropped


def _adapted(y, rows, adapter, mm, w):
  """``y + (α/r)·(rows·A_e)·B_e`` on each expert's rows (two grouped products through rank
  ``r``: the routed rows' FLOPs, never a merged ``[E, in, out]`` copy); ``y`` without an
  adapter."""
  if adapter is None:
    return y
  factors = adapter.lora
  low = mm(mm(rows, w(factors.lora_a)), w(factors.lora_b))
  return y + jnp.asarray(adapter.scale, y.dtype) * low


def routing_sums(logits, r: Routing, m: jax.Array, n_experts: int, dropped) -> dict:
  """The additive routing statistics of one layer over tokens weighted by ``m [T]``."""
  m = m.astype(jnp.float32)
  chosen = jnp.sum(jax.nn.one_hot(r.experts, n_experts, dtype=jnp.float32), axis=1)  # [T, E]
  lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
  return {
    "counts": jax.lax.stop_gradient(m @ chosen),
    "probs": m @ r.probs,
    "z": jnp.sum(m * lse * lse),
    "dropped": dropped,
  }


def dense_sums(n_experts: int) -> dict:
  """A dense layer's routing sums in an MoE model: zeros shaped like ``routing_sums``'."""
  zeros = jnp.zeros((n_experts,), jnp.float32)
  return {"counts": zeros, "probs": zeros, "z": jnp.zeros(()), "dropped": jnp.zeros(())}


def check_config(cfg) -> None:
  """ConfigError for mixture-of-experts settings that cannot build or train."""
  for name in ("num_experts", "moe_intermediate_size", "shared_experts", "shared_expert_size"):
    if getattr(cfg, name) < 0:
      raise ConfigError(f"model.{name} must be >= 0, got {getattr(cfg, name)}")
  if not cfg.num_experts:
    return
  if cfg.mlp_activation != "silu":
    raise ConfigError(
      f"model.mlp_activation {cfg.mlp_activation} is not computed by the experts (SwiGLU): "
      "set model.mlp_activation=silu or model.num_experts=0"
    )
  if not 1 <= cfg.experts_per_token <= cfg.num_experts:
    raise ConfigError(
      f"model.experts_per_token must be in [1, num_experts={cfg.num_experts}], "
      f"got {cfg.experts_per_token}"
    )
  if cfg.moe_every < 1:
    raise ConfigError(f"model.moe_every must be >= 1, got {cfg.moe_every}")
  if bad := [i for i in cfg.dense_layers if not 0 <= i < cfg.n_layers]:
    raise ConfigError(f"model.dense_layers {bad} are not layers of 0 … {cfg.n_layers - 1}")
  choices = {
    "router_scores": SCORES,
    "moe_matmul": grouped.IMPLS,
    "lbl_scope": LBL_SCOPES,
  }
  for name, allowed in choices.items():
    if getattr(cfg, name) not in allowed:
      raise ConfigError(
        f"model.{name} must be one of {', '.join(allowed)}, got {getattr(cfg, name)!r}"
      )
  for name in ("capacity_factor", "router_aux_loss", "router_z_loss"):
    if not getattr(cfg, name) >= 0:
      raise ConfigError(f"model.{name} must be >= 0, got {getattr(cfg, name)}")
