"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, OLMo 2, Granite, SmolLM3,
Phi-3, Gemma 3) in Flax NNX.

Pre-RMSNorm blocks (or, for OLMo 2, RMSNorm on the attention's and the MLP's outputs
instead; for Gemma 3 on both, each norm scaling by ``1 + w``, with a GeGLU MLP and
embeddings times √d); separate q/k/v projections with grouped-query attention (``n_kv_heads``
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

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxstep.core import layout
from jaxstep.errors import ConfigError
from jaxstep.models import backends, layers, lora, moe
from jaxstep.models.gpt import platform_kernels
from jaxstep.models.llama_config import (  # noqa: F401 - the model's names, here too
  BLOCK_NORMS,
  GRANITE_SCALES,
  PROJECTIONS,
  QK_NORM_SCOPES,
  LlamaConfig,
)
from jaxstep.models.llama_parts import RMSNorm, grouped_attention_over_cache, times
from jaxstep.models.rope import apply_rope, rotation
from jaxstep.models.stack import DecoderStack


def norm_of(cfg: LlamaConfig, dim: int) -> RMSNorm:
  """An RMSNorm of ``cfg``'s model over ``dim`` features: OLMo 2's and Gemma's round once at
  the end, Gemma's scale by ``1 + w``."""
  late = cfg.block_norms != "pre" or bool(cfg.norm_offset)
  return RMSNorm(dim, cfg.rms_norm_eps, round_last=late, offset=cfg.norm_offset)


def activation(cfg: LlamaConfig, gate: jax.Array) -> jax.Array:
  """The MLP's gate activation: SiLU (SwiGLU), or GELU's tanh form computed in fp32 and
  rounded once, as torch's ``gelu_pytorch_tanh`` (Gemma's GeGLU)."""
  if cfg.mlp_activation == "silu":
    return jax.nn.silu(gate)
  return jax.nn.gelu(gate.astype(jnp.float32), approximate=True).astype(gate.dtype)


class LlamaBlock(nnx.Module):
  """Pre-RMSNorm block: x + attn(norm(x)), then x + mlp(norm(x)); with ``block_norms``
  ``post`` (OLMo 2): x + norm(attn(x)), then x + norm(mlp(x)); ``both`` (Gemma 3):
  x + norm(attn(norm(x))), then x + norm(mlp(norm(x))).

  The norms keep transformers' names, whose meaning depends on the placement:
  ``post_attention_layernorm`` normalizes the MLP's input in a pre-norm block and the
  attention's output in a post-norm one."""

  def __init__(
    self,
    cfg: LlamaConfig,
    *,
    rngs: nnx.Rngs,
    sparse: bool = False,
    rope=True,
    window: int = 0,
    rope_base: tuple | None = None,
  ):
    d, h, kv, dh = cfg.d_model, cfg.n_heads, cfg.resolved_kv_heads, cfg.resolved_head_dim
    dense, _ = platform_kernels()
    linear = functools.partial(lora.linear, cfg.lora, use_bias=False, **dense, rngs=rngs)
    self.cfg = cfg
    self.post_norms = cfg.block_norms == "post"
    self.outputs_normed = cfg.block_norms != "pre"  # post, both: norms on the outputs
    norm = functools.partial(norm_of, cfg)
    self.input_layernorm = None if self.post_norms else norm(d)
    self.q_proj = linear("q_proj", d, h * dh, use_bias=cfg.attention_bias)
    self.k_proj = linear("k_proj", d, kv * dh, use_bias=cfg.attention_bias)
    self.v_proj = linear("v_proj", d, kv * dh, use_bias=cfg.attention_bias)
    self.o_proj = linear("o_proj", h * dh, d)
    whole = cfg.qk_norm_scope == "projection"  # one norm over all heads (OLMoE)
    self.q_norm = norm(h * dh if whole else dh) if cfg.qk_norm else None
    self.k_norm = norm(kv * dh if whole else dh) if cfg.qk_norm else None
    self.post_attention_layernorm = norm(d)
    self.pre_feedforward_layernorm = norm(d) if cfg.block_norms == "both" else None
    self.post_feedforward_layernorm = norm(d) if self.outputs_normed else None
    if sparse:
      self.mlp = moe.MoeMLP(cfg, linear, rngs=rngs)
    else:
      self.gate_proj = linear("gate_proj", d, cfg.intermediate_size)
      self.up_proj = linear("up_proj", d, cfg.intermediate_size)
      self.down_proj = linear("down_proj", cfg.intermediate_size, d)
    self.sparse = sparse
    self.rope = rope  # False: a NoPE layer (nope_layers), q and k as projected
    self.window = window  # > 0: sliding-window attention over this many keys
    self.rope_base = rope_base or (cfg.rope_theta, cfg.rope_scaling)  # (theta, scaling)
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
      cos, sin = rotation(positions, cfg.rotary_dim, *self.rope_base, q.dtype)
      q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if cfg.attention_multiplier:  # every backend divides q·k by √dh: m·q·k in the end
      q = times(q, cfg.attention_multiplier * math.sqrt(dh))
    if cfg.query_pre_attn_scalar:  # Gemma: q·k / √scalar in the end
      q = times(q, math.sqrt(dh / cfg.query_pre_attn_scalar))
    return q, k, v

  def attention(self, x: jax.Array, segment_ids=None, positions=None) -> jax.Array:
    """Self-attention of ``x [B, S, D]``, rotated at ``positions`` (``[B, S]``; None:
    ``0 … S-1``), within the documents of ``segment_ids`` (``[B, S]``; None: causal only)."""
    b, s, _ = x.shape
    q, k, v = self.qkv(x, jnp.arange(s) if positions is None else positions)
    out = backends.causal_attention(
      q, k, v, self.cfg.attention, segment_ids, self.window, self.cfg.attn_logit_softcapping
    )
    return self.o_proj(out.reshape(b, s, -1))

  def feed_forward(self, x: jax.Array, route_weights=None):
    """The MLP of ``x [B, S, D]``: ``(out, routing sums)``; the sums are None in a dense
    model and zeros for a dense layer of an MoE model (``moe.dense_sums``)."""
    if self.sparse:
      return self.mlp(x, route_weights)
    out = self.down_proj(activation(self.cfg, self.gate_proj(x)) * self.up_proj(x))
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
    cap = self.cfg.attn_logit_softcapping
    attn = grouped_attention_over_cache(q, kt, vc, positions, self.window, cap)
    attn = self.o_proj(attn.reshape(b, s, -1))
    x = x + self._attention_output(attn)
    return x + self._mlp_output(self.feed_forward(self._mlp_input(x))[0]), (kt, vc)

  def _attention_input(self, x):
    return x if self.post_norms else self.input_layernorm(x)  # pre, both

  def _attention_output(self, out):
    return self._residual(self.post_attention_layernorm(out) if self.outputs_normed else out)

  def _mlp_input(self, x):
    if self.pre_feedforward_layernorm is not None:  # both
      return self.pre_feedforward_layernorm(x)
    return x if self.post_norms else self.post_attention_layernorm(x)

  def _mlp_output(self, out):
    return self._residual(self.post_feedforward_layernorm(out) if self.outputs_normed else out)

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
    layer = zip(cfg.moe_layers, cfg.windows, cfg.rope_bases, strict=True)
    blocks = [
      LlamaBlock(cfg, rngs=rngs, sparse=sparse, rope=i not in cfg.nope_layers, window=window,
                 rope_base=base)
      for i, (sparse, window, base) in enumerate(layer)
    ]  # fmt: skip
    # Built one by one either way, so a seed gives the same model in both layouts.
    self.blocks = layers.stack_modules(blocks) if cfg.scan_layers else nnx.List(blocks)
    self.norm = norm_of(cfg, cfg.d_model)
    self.lm_head = (
      None
      if cfg.tie_embeddings
      else nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, **dense, rngs=rngs)
    )
    self.dropout = nnx.Dropout(cfg.dropout)

  def embed_inputs(self, inputs: jax.Array, positions: jax.Array) -> jax.Array:
    """What the first block reads: the token embeddings (``[B, S, d_model]``)."""
    del positions  # rotary: the blocks turn q and k by the positions
    x = times(self.embed_tokens(inputs), self.cfg.embedding_multiplier)
    if self.cfg.scale_embeddings:  # Gemma: √d rounded to the embeddings' dtype first
      x = x * jnp.asarray(math.sqrt(self.cfg.d_model), x.dtype)
    return x

  def _logits(self, x: jax.Array) -> jax.Array:
    x = self._final_norm(x)
    logits = self.embed_tokens.attend(x) if self.lm_head is None else self.lm_head(x)
    if cap := self.cfg.final_logit_softcapping:  # Gemma 2 (no chunked loss: emits_hidden)
      logits = (cap * jnp.tanh(logits.astype(jnp.float32) / cap)).astype(logits.dtype)
    return logits

  def _final_norm(self, x: jax.Array) -> jax.Array:
    """The final RMSNorm, divided by ``logits_scaling`` (Granite's logits ÷ s, applied to
    the hidden state so the chunked loss's ``h·W`` divides too)."""
    return times(self.norm(x), 1.0 / self.cfg.logits_scaling)

  def _hidden_and_head(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(norm(x), W)`` with ``norm(x)·W`` = ``_logits(x)`` (``W``: the tied embedding's
    transpose or the head's kernel); refused for logits soft-capped after the head."""
    if self.cfg.final_logit_softcapping:
      raise ConfigError(
        "the logits are soft-capped after the head (final_logit_softcapping): they are "
        "computed whole, never from the hidden states in chunks"
      )
    w = self.embed_tokens.embedding[...].T if self.lm_head is None else self.lm_head.kernel[...]
    return self._final_norm(x), w

  def _cache_heads(self) -> tuple[int, int]:
    """The cache holds ``n_kv_heads`` heads: grouped-query attention's saving carries over
    to generation (each group of query heads reads its key/value head)."""
    return self.cfg.resolved_kv_heads, self.cfg.resolved_head_dim
