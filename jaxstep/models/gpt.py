"""A decoder-only transformer (GPT) in Flax NNX.

Pre-LayerNorm blocks; one fused QKV projection whose output columns are head-major,
``[heads, 3, head_dim]`` (``head_major``: GPT-2 checkpoints store ``[q | k | v]`` and are
permuted on the way in and out), so a tensor-parallel split of the columns hands each
device whole heads with their q, k and v together; causal attention by the kernel
``model.attention`` selects (``backends.py``: on CPU a blocked kernel with a hand-written
backward, on a GPU cuDNN's flash attention); on CPU every projection and LayerNorm uses a
backward ordered for XLA:CPU (``cpu_kernels.py``); learned position embeddings; tied or
untied output head. What each kernel is worth: docs/performance.md.

Depth: ``model.remat`` recomputes each block's activations in the backward pass instead of
keeping them (``block``: everything but the block's input; ``dots``: keeps the
projections' matmul outputs, recomputes the rest); ``model.scan_layers`` stacks the
blocks' parameters along a leading layer axis and walks them with ``lax.scan``, so the
step compiles one block however deep the model. Both change memory and compile time, never
the numbers: the same parameters give the same loss and gradients (``layers.py`` converts
parameters between the stacked and the per-block layout).

``GPT.decode`` is the same network over a key/value cache, for generation: it reads and
writes ``cache`` at each row's own positions, so a batch of prompts of different lengths
decodes together (``docs/generation.md``).
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
from jaxstep.models import backends, layers, lora
from jaxstep.models.cpu_kernels import LayerNorm, dense_dot_general
from jaxstep.models.lora import LoraConfig
from jaxstep.models.stack import DecoderStack

PROJECTIONS = ("qkv", "proj", "fc", "out")  # each block's, by attribute name


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """Model shape. Defaults are a tiny CPU model (~0.46 M parameters)."""

  vocab_size: int = 264  # ≥ tokenizer size (bytes: 259, padded to 8); 0: set by the data
  max_seq_len: int = 128  # longest input sequence (position-embedding rows)
  d_model: int = 128  # residual width
  n_layers: int = 2  # transformer blocks
  n_heads: int = 4  # attention heads; must divide d_model
  mlp_ratio: int = 4  # MLP hidden width = mlp_ratio * d_model
  dropout: float = 0.0  # dropout rate on attention output, MLP output and embeddings
  tie_embeddings: bool = True  # output head reuses the token embedding table
  layer_norm_eps: float = 1e-6  # LayerNorm epsilon (GPT-2 checkpoints: 1e-5)
  attention: str = "auto"  # auto | blocked | xla | cudnn (see backends.py)
  remat: str = "none"  # none | block | dots: recompute activations in the backward pass
  scan_layers: bool = False  # stacked block params walked by lax.scan (compile once)
  init_from: str = ""  # a Hugging Face model folder: its config and weights ("" = random)
  lora: LoraConfig = LoraConfig()  # low-rank adapters on PROJECTIONS (the rest frozen)
  loss_chunk: int | str = "auto"  # tokens per chunk of the loss's logits; auto; 0: whole

  def __post_init__(self):
    chunked_loss.check_setting(self.loss_chunk)
    self.lora.check_targets(PROJECTIONS)
    for name in ("max_seq_len", "d_model", "n_layers", "n_heads", "mlp_ratio"):
      if getattr(self, name) <= 0:
        raise ConfigError(f"model.{name} must be > 0, got {getattr(self, name)}")
    if self.vocab_size < 0:
      raise ConfigError(
        f"model.vocab_size must be >= 0 (0: the tokenizer's), got {self.vocab_size}"
      )
    if self.d_model % self.n_heads:
      raise ConfigError(
        f"model.d_model {self.d_model} is not divisible by model.n_heads {self.n_heads}"
      )
    if not 0.0 <= self.dropout < 1.0:
      raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")
    if not self.layer_norm_eps > 0:
      raise ConfigError(f"model.layer_norm_eps must be > 0, got {self.layer_norm_eps}")
    check_kernels(self)

  @property
  def kv_cache_width(self) -> int:
    """Floats per token per block in each of the key and the value cache."""
    return self.d_model

  @property
  def mlp_hidden(self) -> int:
    """Width of each block's MLP hidden layer."""
    return self.mlp_ratio * self.d_model

  def matmul_params(self) -> int:
    """Weights that take part in a matmul per token (all blocks + the output head)."""
    d, r = self.d_model, self.mlp_ratio
    return self.n_layers * (3 * d * d + d * d + 2 * r * d * d) + d * self.vocab_size

  def flops_per_token(self, seq_len: int) -> float:
    """Training FLOPs per token (fwd + bwd): ``6·W + 12·L·d·S``.

    W = matmul weights; the attention term counts QKᵀ and PV over the full S×S score
    matrix (2·2·S·d per layer forward, ×3 for forward + backward), as MFU conventions do.
    """
    return 6.0 * self.matmul_params() + 12.0 * self.n_layers * self.d_model * seq_len


def check_kernels(cfg) -> None:
  """ConfigError for an unknown ``model.attention`` or ``model.remat`` (the GPT's and the
  Llama family's configs alike)."""
  if cfg.attention not in backends.ATTENTION_BACKENDS:
    raise ConfigError(
      f"model.attention must be one of {', '.join(backends.ATTENTION_BACKENDS)}, "
      f"got {cfg.attention!r}"
    )
  if cfg.remat not in layers.REMAT_POLICIES:
    raise ConfigError(
      f"model.remat must be one of {', '.join(layers.REMAT_POLICIES)}, got {cfg.remat!r}"
    )


def platform_kernels() -> tuple[dict, type]:
  """``nnx.Linear`` keyword arguments and the LayerNorm class for this platform: the
  CPU-ordered backward passes on CPU, flax's own elsewhere (same params, same math)."""
  if backends.use_cpu_kernels():
    return {"dot_general": dense_dot_general}, LayerNorm
  return {}, nnx.LayerNorm


class Block(nnx.Module):
  """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
    d, (dense, layer_norm) = cfg.d_model, platform_kernels()
    self.n_heads, self.attention_kernel = cfg.n_heads, cfg.attention
    self.ln1 = layer_norm(d, epsilon=cfg.layer_norm_eps, rngs=rngs)
    linear = functools.partial(lora.linear, cfg.lora, **dense, rngs=rngs)
    self.qkv = linear("qkv", d, 3 * d)
    # drawn in GPT-2's column order, then laid head-major: a seed gives the same function
    # it gave when the columns were [q | k | v] (the bias starts at zero either way)
    self.qkv.kernel[...] = head_major(self.qkv.kernel[...], cfg.n_heads)
    self.proj = linear("proj", d, d)
    self.ln2 = layer_norm(d, epsilon=cfg.layer_norm_eps, rngs=rngs)
    self.fc = linear("fc", d, cfg.mlp_ratio * d)
    self.out = linear("out", cfg.mlp_ratio * d, d)
    self.dropout = nnx.Dropout(cfg.dropout)

  def attention(self, x: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    b, s, d = x.shape  # [B, S, D]
    q, k, v = split_heads(self.qkv(x), self.n_heads)  # [B, S, H, Dh] each
    out = backends.causal_attention(q, k, v, self.attention_kernel, segment_ids=segment_ids)
    return self.proj(out.reshape(b, s, d))

  def decode(self, x, cache, positions):
    """The block over a key/value cache: ``x [B, S, D]`` at ``positions [B, S]``; this
    step's keys and values are written into ``cache = (kt [B, H, Dh, T], v [B, H, T, Dh])``
    (keys transposed, so both attention dots read the cache as it lies)."""
    b, s, d = x.shape
    h = self.n_heads
    q, k, v = split_heads(self.qkv(self.ln1(x)), h)
    rows, heads, at = jnp.arange(b)[:, None, None], jnp.arange(h)[None, :, None], positions[:, None]
    kt, vc = cache  # the index arrays select [B, H, S] slots; each takes a [Dh] vector
    kt = kt.at[rows, heads, :, at].set(k.transpose(0, 2, 1, 3).astype(kt.dtype))
    vc = vc.at[rows, heads, at].set(v.transpose(0, 2, 1, 3).astype(vc.dtype))
    cache = (kt, vc)
    x = x + self.proj(attention_over_cache(q, kt, vc, positions).reshape(b, s, d))
    return x + self.out(jax.nn.gelu(self.fc(self.ln2(x)))), cache

  def __call__(self, x, *, rng, train: bool, segment_ids=None, positions=None):
    """``segment_ids`` ``[B, S]``: document masking (``DecoderStack.__call__``).
    ``positions``: unused, the GPT's positions are embedded before the blocks."""
    del positions
    keys = jax.random.split(rng, 2) if rng is not None else (None, None)
    with lora.dropout_keys(lora.block_key(rng, train)):
      # sequence parallelism (layout): whole positions into each tensor-parallel layer
      attn = self.attention(layout.gather_sequence(self.ln1(x)), segment_ids)
      x = x + self.dropout(attn, deterministic=not train, rngs=keys[0])
      mlp = self.out(jax.nn.gelu(self.fc(layout.gather_sequence(self.ln2(x)))))
    return x + self.dropout(mlp, deterministic=not train, rngs=keys[1])


class GPT(DecoderStack):
  """Token + position embeddings → blocks → final LN → logits ``[B, S, vocab]``."""

  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    dense, layer_norm = platform_kernels()
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, rngs=rngs)
    self.pos_embed = nnx.Embed(cfg.max_seq_len, cfg.d_model, rngs=rngs)
    blocks = [Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)]
    # Built one by one either way, so a seed gives the same model in both layouts.
    self.blocks = layers.stack_modules(blocks) if cfg.scan_layers else nnx.List(blocks)
    self.ln_f = layer_norm(cfg.d_model, epsilon=cfg.layer_norm_eps, rngs=rngs)
    self.head = (
      None
      if cfg.tie_embeddings
      else nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, **dense, rngs=rngs)
    )
    self.dropout = nnx.Dropout(cfg.dropout)

  def embed_inputs(self, inputs: jax.Array, positions: jax.Array) -> jax.Array:
    """What the first block reads: token embeddings plus the ``positions``' embeddings
    (``[B, S, d_model]``)."""
    return self.embed(inputs) + self.pos_embed(positions)

  def _logits(self, x: jax.Array) -> jax.Array:
    x = self.ln_f(x)
    return self.embed.attend(x) if self.head is None else self.head(x)

  def _hidden_and_head(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(ln_f(x), W)`` with ``ln_f(x)·W`` = ``_logits(x)`` (the head has no bias)."""
    w = self.embed.embedding[...].T if self.head is None else self.head.kernel[...]
    return self.ln_f(x), w

  def _cache_heads(self) -> tuple[int, int]:
    return self.cfg.n_heads, self.cfg.d_model // self.cfg.n_heads


def split_heads(qkv: jax.Array, n_heads: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The fused projection's output ``[B, S, 3·D]`` (head-major columns) as ``q, k, v``,
  each ``[B, S, H, Dh]``."""
  b, s, width = qkv.shape
  heads = qkv.reshape(b, s, n_heads, 3, width // (3 * n_heads))
  return heads[:, :, :, 0], heads[:, :, :, 1], heads[:, :, :, 2]


def head_major(x, n_heads: int):
  """Columns ``[q | k | v]`` (GPT-2's ``c_attn``: the last axis is ``3·H·Dh``, heads
  contiguous inside each of q, k, v) in the fused projection's order ``[H, 3, Dh]``. Works
  on numpy and jax arrays of any leading shape (a kernel, a bias, a LoRA ``B``, a stacked
  layer axis); ``qkv_major`` is its inverse."""
  *lead, width = x.shape
  split = x.reshape(*lead, 3, n_heads, width // (3 * n_heads))
  return split.swapaxes(-3, -2).reshape(*lead, width)


def qkv_major(x, n_heads: int):
  """Head-major columns ``[H, 3, Dh]`` back in GPT-2's order ``[q | k | v]``."""
  *lead, width = x.shape
  split = x.reshape(*lead, n_heads, 3, width // (3 * n_heads))
  return split.swapaxes(-3, -2).reshape(*lead, width)


def attention_over_cache(q, kt, v, positions):
  """``q [B, S, H, Dh]`` at ``positions [B, S]`` against a cache of keys ``kt [B, H, Dh, T]``
  and values ``v [B, H, T, Dh]``: cached position ``t`` is visible to a query at position
  ``p`` iff ``t <= p``. The same arithmetic as ``causal_attention``'s forward (the same
  operand layouts, scores in the compute dtype, softmax in fp32, masked scores at the fp32
  minimum), so cached logits match a full forward pass. Returns ``[B, S, H, Dh]``."""
  qh = q.transpose(0, 2, 1, 3)  # [B, H, S, Dh]
  scores = jnp.einsum("bhqd,bhdk->bhqk", qh, kt).astype(jnp.float32) / math.sqrt(q.shape[-1])
  visible = jnp.arange(kt.shape[-1])[None, None, :] <= positions[:, :, None]  # [B, S, T]
  scores = jnp.where(visible[:, None], scores, jnp.finfo(jnp.float32).min)
  p = jax.nn.softmax(scores, axis=-1)
  return jnp.einsum("bhqk,bhkd->bhqd", p.astype(v.dtype), v).transpose(0, 2, 1, 3)
