"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, OLMo 2, Granite, SmolLM3,
Phi-3) in Flax NNX.

Pre-RMSNorm blocks (or, for OLMo 2, RMSNorm on the attention's and the MLP's outputs
instead); separate q/k/v projections with grouped-query attention (``n_kv_heads``
key/value heads shared by groups of query heads); rotary position embeddings, optionally
with Llama 3.1's or Phi-3's frequency scaling and over part of each head (``rope.py``);
optional q/k/v biases (Qwen2) and per-head RMSNorm of q and k before the rotation (Qwen3);
a SwiGLU MLP
``down(silu(gate(x)) · up(x))``; no position embeddings, no biases elsewhere; tied or
untied output head.

Attribute names mirror Hugging Face's (``embed_tokens``, ``input_layernorm``, ``q_proj``,
…, ``norm``, ``lm_head``), so importing or exporting weights is a rename plus a transpose
of each kernel (``[in, out]`` here, ``[out, in]`` in PyTorch). The kernels per platform,
``model.remat`` and ``model.scan_layers`` work as for the GPT (``gpt.py``, ``layers.py``).

``Llama.decode`` runs over a key/value cache that holds ``n_kv_heads`` heads (not
``n_heads``): grouped-query attention's memory saving carries over to generation.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxstep.core import chunked_loss, layout
from jaxstep.errors import ConfigError
from jaxstep.models import backends, layers, lora, moe, rope
from jaxstep.models.gpt import platform_kernels
from jaxstep.models.llama_parts import RMSNorm, grouped_attention_over_cache, times
from jaxstep.models.lora import LoraConfig
from jaxstep.models.rope import LongRope, RopeScaling, apply_rope, rope_scaling_of, rotation
from jaxstep.models.stack import DecoderStack

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QK_NORM_SCOPES = ("head", "projection")
GRANITE_SCALES = {
  "embedding_multiplier": 1.0,
  "attention_multiplier": 0.0,
  "residual_multiplier": 1.0,
  "logits_scaling": 1.0,
}
BLOCK_NORMS = ("pre", "post")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Model shape (Hugging Face names in comments). Defaults: a tiny CPU model."""

  vocab_size: int = 264  # vocab_size; 0: set by the data
  max_seq_len: int = 128  # max_position_embeddings: longest input sequence
  d_model: int = 128  # hidden_size: residual width
  n_layers: int = 2  # num_hidden_layers
  n_heads: int = 4  # num_attention_heads (query heads)
  n_kv_heads: int = 0  # num_key_value_heads: divides n_heads; 1: multi-query; 0: n_heads
  head_dim: int = 0  # head_dim; 0: d_model // n_heads
  intermediate_size: int = 352  # intermediate_size: SwiGLU hidden width
  rms_norm_eps: float = 1e-6  # rms_norm_eps
  rope_theta: float = 10000.0  # rope_theta
  rope_scaling: RopeScaling | LongRope | None = None  # None, llama3 or longrope (rope.py)
  partial_rotary_factor: float = 1.0  # partial_rotary_factor: the share of each head rotated
  tie_embeddings: bool = False  # tie_word_embeddings
  attention_bias: bool = False  # q/k/v biases (Qwen2); o_proj never has one
  qk_norm: bool = False  # RMSNorm of each q and k head before RoPE (Qwen3)
  qk_norm_scope: str = "head"  # head: per head (Qwen3) | projection: whole q, k (OLMoE)
  block_norms: str = "pre"  # pre: norm each branch's input | post: its output (OLMo 2)
  nope_layers: tuple[int, ...] = ()  # layers whose q and k are not rotated (SmolLM3's NoPE)
  sliding_window: int = 0  # sliding_window: a query sees this many keys, itself included; 0: all
  full_layers: tuple[int, ...] = ()  # layers that see every key despite sliding_window
  # Granite's multipliers (GRANITE_SCALES: the values that change nothing)
  embedding_multiplier: float = 1.0  # the token embeddings times this
  attention_multiplier: float = 0.0  # the attention logits' scale; 0: 1/√head_dim
  residual_multiplier: float = 1.0  # each attention and MLP output times this, then added
  logits_scaling: float = 1.0  # the logits divided by this
  dropout: float = 0.0  # on the embeddings, attention output and MLP output
  attention: str = "auto"  # auto | blocked | xla | cudnn (see backends.py)
  remat: str = "none"  # none | block | dots: recompute activations in the backward pass
  scan_layers: bool = False  # stacked block params walked by lax.scan (compile once)
  init_from: str = ""  # a Hugging Face model folder: its config and weights ("" = random)
  lora: LoraConfig = LoraConfig()  # adapters on PROJECTIONS (+ lora.ROUTED if named)
  loss_chunk: int | str = "auto"  # tokens per chunk of the loss's logits; auto; 0: whole
  # mixture of experts (moe.py, docs/moe.md); num_experts 0: every MLP dense
  num_experts: int = 0  # num_experts / num_local_experts
  experts_per_token: int = 2  # num_experts_per_tok: k of the top-k routing
  moe_intermediate_size: int = 0  # each expert's SwiGLU width (0: intermediate_size)
  shared_experts: int = 0  # experts every token goes through, fused as one SwiGLU
  shared_expert_size: int = 0  # that SwiGLU's width (0: shared_experts × expert width)
  shared_expert_gate: bool = False  # sigmoid gate on the shared experts' output (Qwen2-MoE)
  moe_every: int = 1  # decoder_sparse_step: layer i is MoE when (i + 1) % moe_every == 0
  dense_layers: tuple[int, ...] = ()  # mlp_only_layers: layers kept dense anyway
  router_scores: str = "softmax"  # softmax | sigmoid
  norm_topk: bool = True  # norm_topk_prob: renormalize the top-k weights to sum 1
  capacity_factor: float = 0.0  # > 0: an expert takes at most c·T·k/E tokens (0: dropless)
  moe_matmul: str = "auto"  # auto | tiles | ragged (grouped.py)
  router_aux_loss: float = 0.01  # router_aux_loss_coef: weight of the load-balancing loss
  router_z_loss: float = 0.0  # weight of the router z-loss
  lbl_scope: str = "global"  # global | micro_batch: where the LBL's expert shares are counted

  def __post_init__(self):
    chunked_loss.check_setting(self.loss_chunk)
    # a folder's model (init_from) says whether it has experts once it is read
    routed = lora.ROUTED if self.num_experts or self.init_from else ()
    self.lora.check_targets(PROJECTIONS + routed)
    for name in ("dense_layers", "nope_layers", "full_layers"):
      object.__setattr__(self, name, tuple(int(i) for i in getattr(self, name)))
    moe.check_config(self)
    object.__setattr__(self, "rope_scaling", rope_scaling_of(self.rope_scaling))
    for name in ("max_seq_len", "d_model", "n_layers", "n_heads", "intermediate_size"):
      if getattr(self, name) <= 0:
        raise ConfigError(f"model.{name} must be > 0, got {getattr(self, name)}")
    for name in ("vocab_size", "n_kv_heads", "head_dim"):
      if getattr(self, name) < 0:
        raise ConfigError(f"model.{name} must be >= 0 (0: derived), got {getattr(self, name)}")
    if self.n_heads % self.resolved_kv_heads:
      raise ConfigError(
        f"model.n_kv_heads {self.n_kv_heads} does not divide model.n_heads {self.n_heads}"
      )
    if not self.head_dim and self.d_model % self.n_heads:
      raise ConfigError(
        f"model.d_model {self.d_model} is not divisible by model.n_heads {self.n_heads} "
        "(or set model.head_dim)"
      )
    for name in ("nope_layers", "full_layers"):
      if bad := [i for i in getattr(self, name) if not 0 <= i < self.n_layers]:
        raise ConfigError(f"model.{name} {bad} are not layers of 0 … {self.n_layers - 1}")
    if self.sliding_window < 0:
      raise ConfigError(f"model.sliding_window must be >= 0 (0: none), got {self.sliding_window}")
    if self.scan_layers and self.blocks_differ:
      raise ConfigError(
        "model.scan_layers needs every block alike, and this model's differ (dense and MoE "
        "MLPs: moe_every, dense_layers; rotated and NoPE attention: nope_layers; windowed "
        "and full attention: full_layers): set model.scan_layers=false"
      )
    rope.check_config(self)
    scales = [name for name, neutral in GRANITE_SCALES.items() if neutral]  # 0 means "none"
    for name in ("rms_norm_eps", "rope_theta", *scales):
      if getattr(self, name) <= 0:
        raise ConfigError(f"model.{name} must be > 0, got {getattr(self, name)}")
    if self.attention_multiplier < 0:
      raise ConfigError(f"model.attention_multiplier must be >= 0, got {self.attention_multiplier}")
    for name, allowed in (("qk_norm_scope", QK_NORM_SCOPES), ("block_norms", BLOCK_NORMS)):
      if getattr(self, name) not in allowed:
        raise ConfigError(
          f"model.{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}"
        )
    if not 0.0 <= self.dropout < 1.0:
      raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")
    _check_kernels(self)

  @property
  def moe_layers(self) -> tuple[bool, ...]:
    """Per layer, whether its MLP is a mixture of experts."""
    if not self.num_experts:
      return (False,) * self.n_layers
    return tuple(
      (i + 1) % self.moe_every == 0 and i not in self.dense_layers for i in range(self.n_layers)
    )

  @property
  def blocks_differ(self) -> bool:
    """Whether the blocks are not all alike (dense and MoE MLPs, rotated and NoPE
    attention): they cannot be one stack walked by ``lax.scan``."""
    return (
      len(set(self.moe_layers)) > 1
      or len(set(self.windows)) > 1
      or 0 < len(set(self.nope_layers)) < self.n_layers
    )

  @property
  def windows(self) -> tuple[int, ...]:
    """Per layer, the keys a query sees (0: every earlier one)."""
    return tuple(0 if i in self.full_layers else self.sliding_window for i in range(self.n_layers))

  @property
  def expert_size(self) -> int:
    return self.moe_intermediate_size or self.intermediate_size

  @property
  def shared_width(self) -> int:
    return self.shared_expert_size or self.shared_experts * self.expert_size

  @property
  def resolved_kv_heads(self) -> int:
    return self.n_kv_heads or self.n_heads

  @property
  def resolved_head_dim(self) -> int:
    return self.head_dim or self.d_model // self.n_heads

  @property
  def rotary_dim(self) -> int:
    """The features of each q and k head RoPE rotates (the first ones), as transformers
    rounds it: ``int(head_dim · partial_rotary_factor)``."""
    return int(self.resolved_head_dim * self.partial_rotary_factor)

  @property
  def kv_cache_width(self) -> int:
    """Floats per token per block in each of the key and the value cache (``n_kv_heads``
    heads: grouped-query attention's saving)."""
    return self.resolved_kv_heads * self.resolved_head_dim

  @property
  def mlp_hidden(self) -> int:
    """Width of each block's MLP hidden layer (SwiGLU's gate and up outputs)."""
    return self.intermediate_size

  def matmul_params(self) -> int:
    """Weights that take part in a matmul per token (all blocks + the output head); an MoE
    layer counts its router, the ``experts_per_token`` experts a token goes through and the
    shared experts: the *active* parameters."""
    d, hd, kvd = (
      self.d_model,
      self.n_heads * self.resolved_head_dim,
      self.resolved_kv_heads * self.resolved_head_dim,
    )
    attention = 2 * d * hd + 2 * d * kvd  # q, o; k, v
    dense = 3 * d * self.intermediate_size
    routed = d * self.num_experts + 3 * d * self.experts_per_token * self.expert_size
    sparse = routed + 3 * d * self.shared_width + d * self.shared_expert_gate
    mlps = sum(sparse if is_moe else dense for is_moe in self.moe_layers)
    return self.n_layers * attention + mlps + d * self.vocab_size

  def flops_per_token(self, seq_len: int) -> float:
    """Training FLOPs per token (fwd + bwd): ``6·W + 12·L·H·Dh·S``.

    W = matmul weights (k and v count their ``n_kv_heads`` only); the attention term counts
    QKᵀ and PV for every query head over the full S×S score matrix (2·2·S·H·Dh per layer
    forward, ×3 for forward + backward), as for the GPT. Grouping the key/value heads saves
    projection weights, not attention FLOPs."""
    width = self.n_heads * self.resolved_head_dim
    return 6.0 * self.matmul_params() + 12.0 * self.n_layers * width * seq_len


def _check_kernels(cfg: LlamaConfig) -> None:
  """ConfigError for an unknown ``model.attention`` or ``model.remat`` (as the GPT's)."""
  if cfg.attention not in backends.ATTENTION_BACKENDS:
    raise ConfigError(
      f"model.attention must be one of {', '.join(backends.ATTENTION_BACKENDS)}, "
      f"got {cfg.attention!r}"
    )
  if cfg.remat not in layers.REMAT_POLICIES:
    raise ConfigError(
      f"model.remat must be one of {', '.join(layers.REMAT_POLICIES)}, got {cfg.remat!r}"
    )


class LlamaBlock(nnx.Module):
  """Pre-RMSNorm block: x + attn(norm(x)), then x + mlp(norm(x)); with ``block_norms``
  ``post`` (OLMo 2): x + norm(attn(x)), then x + norm(mlp(x)).

  The norms keep transformers' names, whose meaning depends on the placement:
  ``post_attention_layernorm`` normalizes the MLP's input in a pre-norm block and the
  attention's output in a post-norm one."""

  def __init__(
    self, cfg: LlamaConfig, *, rngs: nnx.Rngs, sparse: bool = False, rope=True, window: int = 0
  ):
    d, h, kv, dh = cfg.d_model, cfg.n_heads, cfg.resolved_kv_heads, cfg.resolved_head_dim
    dense, _ = platform_kernels()
    linear = functools.partial(lora.linear, cfg.lora, use_bias=False, **dense, rngs=rngs)
    self.cfg = cfg
    self.post_norms = cfg.block_norms == "post"
    norm = functools.partial(RMSNorm, eps=cfg.rms_norm_eps, round_last=self.post_norms)
    self.input_layernorm = None if self.post_norms else norm(d)
    self.q_proj = linear("q_proj", d, h * dh, use_bias=cfg.attention_bias)
    self.k_proj = linear("k_proj", d, kv * dh, use_bias=cfg.attention_bias)
    self.v_proj = linear("v_proj", d, kv * dh, use_bias=cfg.attention_bias)
    self.o_proj = linear("o_proj", h * dh, d)
    whole = cfg.qk_norm_scope == "projection"  # one norm over all heads (OLMoE)
    self.q_norm = norm(h * dh if whole else dh) if cfg.qk_norm else None
    self.k_norm = norm(kv * dh if whole else dh) if cfg.qk_norm else None
    self.post_attention_layernorm = norm(d)
    self.post_feedforward_layernorm = norm(d) if self.post_norms else None
    if sparse:
      self.mlp = moe.MoeMLP(cfg, linear, rngs=rngs)
    else:
      self.gate_proj = linear("gate_proj", d, cfg.intermediate_size)
      self.up_proj = linear("up_proj", d, cfg.intermediate_size)
      self.down_proj = linear("down_proj", cfg.intermediate_size, d)
    self.sparse = sparse
    self.rope = rope  # False: a NoPE layer (nope_layers), q and k as projected
    self.window = window  # > 0: sliding-window attention over this many keys
    self.dropout = nnx.Dropout(cfg.dropout)

  def qkv(self, x: jax.Array, positions: jax.Array):
    """Rotated ``q [B, S, H, Dh]``, rotated ``k`` and ``v`` ``[B, S, KV, Dh]`` for ``x`` at
    ``positions`` (``[S]`` or ``[B, S]``); q/k norms (if any) before the rotation, over
    each head or, with ``qk_norm_scope="projection"``, over the whole projection. A NoPE
    layer's q and k are not rotated; Granite's ``attention_multiplier`` scales q."""
    b, s, _ = x.shape
    cfg, dh = self.cfg, self.cfg.resolved_head_dim
    q, k = self.q_proj(x), self.k_proj(x)
    if self.q_norm is not None and cfg.qk_norm_scope == "projection":
      q, k = self.q_norm(q), self.k_norm(k)
    q = q.reshape(b, s, cfg.n_heads, dh)
    k = k.reshape(b, s, cfg.resolved_kv_heads, dh)
    v = self.v_proj(x).reshape(b, s, cfg.resolved_kv_heads, dh)
    if self.q_norm is not None and cfg.qk_norm_scope == "head":
      q, k = self.q_norm(q), self.k_norm(k)
    if self.rope:
      cos, sin = rotation(positions, cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, q.dtype)
      q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if cfg.attention_multiplier:  # every backend divides q·k by √dh: m·q·k in the end
      q = times(q, cfg.attention_multiplier * math.sqrt(dh))
    return q, k, v

  def attention(self, x: jax.Array, segment_ids=None, positions=None) -> jax.Array:
    """Self-attention of ``x [B, S, D]``, rotated at ``positions`` (``[B, S]``; None:
    ``0 … S-1``), within the documents of ``segment_ids`` (``[B, S]``; None: causal only)."""
    b, s, _ = x.shape
    q, k, v = self.qkv(x, jnp.arange(s) if positions is None else positions)
    out = backends.causal_attention(
      q, k, v, self.cfg.attention, segment_ids=segment_ids, window=self.window
    )
    return self.o_proj(out.reshape(b, s, -1))

  def feed_forward(self, x: jax.Array, route_weights=None):
    """The MLP of ``x [B, S, D]``: ``(out, routing sums)``; the sums are None in a dense
    model and zeros for a dense layer of an MoE model (``moe.dense_sums``)."""
    if self.sparse:
      return self.mlp(x, route_weights)
    out = self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
    return out, (moe.dense_sums(self.cfg.num_experts) if self.cfg.num_experts else None)

  def decode(self, x, cache, positions):
    """The block over a key/value cache: ``x [B, S, D]`` at ``positions [B, S]``; this
    step's (rotated) keys and values are written into ``cache = (kt [B, KV, Dh, T],
    v [B, KV, T, Dh])``, laid out as the GPT's (``gpt.Block.decode``)."""
    b, s, _ = x.shape
    q, k, v = self.qkv(self._attention_input(x), positions)
    heads = jnp.arange(self.cfg.resolved_kv_heads)[None, :, None]
    rows, at = jnp.arange(b)[:, None, None], positions[:, None]
    kt, vc = cache  # the index arrays select [B, KV, S] slots; each takes a [Dh] vector
    kt = kt.at[rows, heads, :, at].set(k.transpose(0, 2, 1, 3).astype(kt.dtype))
    vc = vc.at[rows, heads, at].set(v.transpose(0, 2, 1, 3).astype(vc.dtype))
    attn = grouped_attention_over_cache(q, kt, vc, positions, self.window)
    attn = self.o_proj(attn.reshape(b, s, -1))
    x = x + self._attention_output(attn)
    return x + self._mlp_output(self.feed_forward(self._mlp_input(x))[0]), (kt, vc)

  def _attention_input(self, x):
    return x if self.post_norms else self.input_layernorm(x)

  def _attention_output(self, out):
    return self._residual(self.post_attention_layernorm(out) if self.post_norms else out)

  def _mlp_input(self, x):
    return x if self.post_norms else self.post_attention_layernorm(x)

  def _mlp_output(self, out):
    return self._residual(self.post_feedforward_layernorm(out) if self.post_norms else out)

  def _residual(self, out):
    return times(out, self.cfg.residual_multiplier)

  def __call__(self, x, *, rng, train: bool, segment_ids=None, positions=None, route_weights=None):
    """``segment_ids``, ``positions`` ``[B, S]``: document masking
    (``DecoderStack.__call__``). An MoE model's block returns ``(x, routing sums)`` over
    the tokens weighted by ``route_weights`` (``[B, S]``; None: all)."""
    keys = jax.random.split(rng, 2) if rng is not None else (None, None)
    with lora.dropout_keys(lora.block_key(rng, train)):
      # sequence parallelism (layout): whole positions into each tensor-parallel layer
      h = layout.gather_sequence(self._attention_input(x))
      attn = self._attention_output(self.attention(h, segment_ids, positions))
      x = x + self.dropout(attn, deterministic=not train, rngs=keys[0])
      mlp, sums = self.feed_forward(layout.gather_sequence(self._mlp_input(x)), route_weights)
    x = x + self.dropout(self._mlp_output(mlp), deterministic=not train, rngs=keys[1])
    return x if sums is None else (x, sums)


class Llama(DecoderStack):
  """Token embeddings → blocks → final RMSNorm → logits ``[B, S, vocab]``."""

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    dense, _ = platform_kernels()
    self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.d_model, rngs=rngs)
    blocks = [
      LlamaBlock(cfg, rngs=rngs, sparse=sparse, rope=i not in cfg.nope_layers, window=window)
      for i, (sparse, window) in enumerate(zip(cfg.moe_layers, cfg.windows, strict=True))
    ]
    # Built one by one either way, so a seed gives the same model in both layouts.
    self.blocks = layers.stack_modules(blocks) if cfg.scan_layers else nnx.List(blocks)
    self.norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps, round_last=cfg.block_norms == "post")
    self.lm_head = (
      None
      if cfg.tie_embeddings
      else nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, **dense, rngs=rngs)
    )
    self.dropout = nnx.Dropout(cfg.dropout)

  def embed_inputs(self, inputs: jax.Array, positions: jax.Array) -> jax.Array:
    """What the first block reads: the token embeddings (``[B, S, d_model]``)."""
    del positions  # rotary: the blocks turn q and k by the positions
    return times(self.embed_tokens(inputs), self.cfg.embedding_multiplier)

  def _logits(self, x: jax.Array) -> jax.Array:
    x = self._final_norm(x)
    return self.embed_tokens.attend(x) if self.lm_head is None else self.lm_head(x)

  def _final_norm(self, x: jax.Array) -> jax.Array:
    """The final RMSNorm, divided by ``logits_scaling`` (Granite's logits ÷ s, applied to
    the hidden state so the chunked loss's ``h·W`` divides too)."""
    return times(self.norm(x), 1.0 / self.cfg.logits_scaling)

  def _hidden_and_head(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(norm(x), W)`` with ``norm(x)·W`` = ``_logits(x)`` (``W``: the tied embedding's
    transpose or the head's kernel)."""
    w = self.embed_tokens.embedding[...].T if self.lm_head is None else self.lm_head.kernel[...]
    return self._final_norm(x), w

  def _cache_heads(self) -> tuple[int, int]:
    """The cache holds ``n_kv_heads`` heads: grouped-query attention's saving carries over
    to generation (each group of query heads reads its key/value head)."""
    return self.cfg.resolved_kv_heads, self.cfg.resolved_head_dim
