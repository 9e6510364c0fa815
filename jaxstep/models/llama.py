"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) in Flax NNX.

Pre-RMSNorm blocks; separate q/k/v projections with grouped-query attention (``n_kv_heads``
key/value heads shared by groups of query heads); rotary position embeddings, optionally
with Llama 3.1's frequency scaling (``llama_parts.py``); optional q/k/v biases (Qwen2) and
per-head RMSNorm of q and k before the rotation (Qwen3); a SwiGLU MLP
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

import jax
import jax.numpy as jnp
from flax import nnx

from jaxstep.core import layout
from jaxstep.errors import ConfigError
from jaxstep.models import backends, layers, lora
from jaxstep.models.gpt import platform_kernels
from jaxstep.models.llama_parts import (
  RMSNorm,
  RopeScaling,
  apply_rope,
  grouped_attention_over_cache,
  inv_freq,
  rope_scaling_of,
  rope_tables,
)
from jaxstep.models.lora import LoraConfig
from jaxstep.models.stack import DecoderStack

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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
  rope_scaling: RopeScaling | None = None  # None, or llama3 scaling (mapping or RopeScaling)
  tie_embeddings: bool = False  # tie_word_embeddings
  attention_bias: bool = False  # q/k/v biases (Qwen2); o_proj never has one
  qk_norm: bool = False  # RMSNorm of each q and k head before RoPE (Qwen3)
  dropout: float = 0.0  # on the embeddings, attention output and MLP output
  attention: str = "auto"  # auto | blocked | xla | cudnn (see backends.py)
  remat: str = "none"  # none | block | dots: recompute activations in the backward pass
  scan_layers: bool = False  # stacked block params walked by lax.scan (compile once)
  init_from: str = ""  # a Hugging Face model folder: its config and weights ("" = random)
  lora: LoraConfig = LoraConfig()  # low-rank adapters on PROJECTIONS (the rest frozen)

  def __post_init__(self):
    self.lora.check_targets(PROJECTIONS)
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
    if self.resolved_head_dim % 2:
      raise ConfigError(f"model.head_dim must be even for RoPE, got {self.resolved_head_dim}")
    for name in ("rms_norm_eps", "rope_theta"):
      if getattr(self, name) <= 0:
        raise ConfigError(f"model.{name} must be > 0, got {getattr(self, name)}")
    if not 0.0 <= self.dropout < 1.0:
      raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")
    _check_kernels(self)

  @property
  def resolved_kv_heads(self) -> int:
    return self.n_kv_heads or self.n_heads

  @property
  def resolved_head_dim(self) -> int:
    return self.head_dim or self.d_model // self.n_heads

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
    """Weights that take part in a matmul per token (all blocks + the output head)."""
    d, hd, kvd = (
      self.d_model,
      self.n_heads * self.resolved_head_dim,
      self.resolved_kv_heads * self.resolved_head_dim,
    )
    per_block = 2 * d * hd + 2 * d * kvd + 3 * d * self.intermediate_size  # q, o; k, v; MLP
    return self.n_layers * per_block + d * self.vocab_size

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
  """Pre-RMSNorm block: x + attn(norm(x)), then x + mlp(norm(x))."""

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
    d, h, kv, dh = cfg.d_model, cfg.n_heads, cfg.resolved_kv_heads, cfg.resolved_head_dim
    dense, _ = platform_kernels()
    linear = functools.partial(lora.linear, cfg.lora, use_bias=False, **dense, rngs=rngs)
    self.cfg = cfg
    self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
    self.q_proj = linear("q_proj", d, h * dh, use_bias=cfg.attention_bias)
    self.k_proj = linear("k_proj", d, kv * dh, use_bias=cfg.attention_bias)
    self.v_proj = linear("v_proj", d, kv * dh, use_bias=cfg.attention_bias)
    self.o_proj = linear("o_proj", h * dh, d)
    self.q_norm = RMSNorm(dh, cfg.rms_norm_eps) if cfg.qk_norm else None
    self.k_norm = RMSNorm(dh, cfg.rms_norm_eps) if cfg.qk_norm else None
    self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)
    self.gate_proj = linear("gate_proj", d, cfg.intermediate_size)
    self.up_proj = linear("up_proj", d, cfg.intermediate_size)
    self.down_proj = linear("down_proj", cfg.intermediate_size, d)
    self.dropout = nnx.Dropout(cfg.dropout)

  def qkv(self, x: jax.Array, positions: jax.Array):
    """Rotated ``q [B, S, H, Dh]``, rotated ``k`` and ``v`` ``[B, S, KV, Dh]`` for ``x`` at
    ``positions`` (``[S]`` or ``[B, S]``); q/k norms (if any) before the rotation."""
    b, s, _ = x.shape
    cfg, dh = self.cfg, self.cfg.resolved_head_dim
    q = self.q_proj(x).reshape(b, s, cfg.n_heads, dh)
    k = self.k_proj(x).reshape(b, s, cfg.resolved_kv_heads, dh)
    v = self.v_proj(x).reshape(b, s, cfg.resolved_kv_heads, dh)
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    freq = inv_freq(dh, cfg.rope_theta, cfg.rope_scaling)
    cos, sin = rope_tables(positions, freq, q.dtype)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

  def attention(self, x: jax.Array, segment_ids=None, positions=None) -> jax.Array:
    """Self-attention of ``x [B, S, D]``, rotated at ``positions`` (``[B, S]``; None:
    ``0 … S-1``), within the documents of ``segment_ids`` (``[B, S]``; None: causal only)."""
    b, s, _ = x.shape
    q, k, v = self.qkv(x, jnp.arange(s) if positions is None else positions)
    out = backends.causal_attention(q, k, v, self.cfg.attention, segment_ids=segment_ids)
    return self.o_proj(out.reshape(b, s, -1))

  def mlp(self, x: jax.Array) -> jax.Array:
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))

  def decode(self, x, cache, positions):
    """The block over a key/value cache: ``x [B, S, D]`` at ``positions [B, S]``; this
    step's (rotated) keys and values are written into ``cache = (kt [B, KV, Dh, T],
    v [B, KV, T, Dh])``, laid out as the GPT's (``gpt.Block.decode``)."""
    b, s, _ = x.shape
    q, k, v = self.qkv(self.input_layernorm(x), positions)
    heads = jnp.arange(self.cfg.resolved_kv_heads)[None, :, None]
    rows, at = jnp.arange(b)[:, None, None], positions[:, None]
    kt, vc = cache  # the index arrays select [B, KV, S] slots; each takes a [Dh] vector
    kt = kt.at[rows, heads, :, at].set(k.transpose(0, 2, 1, 3).astype(kt.dtype))
    vc = vc.at[rows, heads, at].set(v.transpose(0, 2, 1, 3).astype(vc.dtype))
    x = x + self.o_proj(grouped_attention_over_cache(q, kt, vc, positions).reshape(b, s, -1))
    return x + self.mlp(self.post_attention_layernorm(x)), (kt, vc)

  def __call__(self, x, *, rng, train: bool, segment_ids=None, positions=None):
    """``segment_ids``, ``positions`` ``[B, S]``: document masking
    (``DecoderStack.__call__``)."""
    keys = jax.random.split(rng, 2) if rng is not None else (None, None)
    with lora.dropout_keys(lora.block_key(rng, train)):
      # sequence parallelism (layout): whole positions into each tensor-parallel layer
      h = layout.gather_sequence(self.input_layernorm(x))
      attn = self.attention(h, segment_ids, positions)
      x = x + self.dropout(attn, deterministic=not train, rngs=keys[0])
      mlp = self.mlp(layout.gather_sequence(self.post_attention_layernorm(x)))
    return x + self.dropout(mlp, deterministic=not train, rngs=keys[1])


class Llama(DecoderStack):
  """Token embeddings → blocks → final RMSNorm → logits ``[B, S, vocab]``."""

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    dense, _ = platform_kernels()
    self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.d_model, rngs=rngs)
    blocks = [LlamaBlock(cfg, rngs=rngs) for _ in range(cfg.n_layers)]
    # Built one by one either way, so a seed gives the same model in both layouts.
    self.blocks = layers.stack_modules(blocks) if cfg.scan_layers else nnx.List(blocks)
    self.norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
    self.lm_head = (
      None
      if cfg.tie_embeddings
      else nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, **dense, rngs=rngs)
    )
    self.dropout = nnx.Dropout(cfg.dropout)

  def embed_inputs(self, inputs: jax.Array, positions: jax.Array) -> jax.Array:
    """What the first block reads: the token embeddings (``[B, S, d_model]``)."""
    del positions  # rotary: the blocks turn q and k by the positions
    return self.embed_tokens(inputs)

  def _logits(self, x: jax.Array) -> jax.Array:
    x = self.norm(x)
    return self.embed_tokens.attend(x) if self.lm_head is None else self.lm_head(x)

  def _cache_heads(self) -> tuple[int, int]:
    """The cache holds ``n_kv_heads`` heads: grouped-query attention's saving carries over
    to generation (each group of query heads reads its key/value head)."""
    return self.cfg.resolved_kv_heads, self.cfg.resolved_head_dim
