"""``LlamaConfig``: the Llama-family decoder's shape and settings, checked as they are set
(``llama.py`` builds the model; Hugging Face folders set these fields: ``hf_config.py``)."""

from __future__ import annotations

import dataclasses

from jaxstep.core import chunked_loss
from jaxstep.errors import ConfigError
from jaxstep.models import lora, moe, rope
from jaxstep.models.gpt import check_kernels
from jaxstep.models.lora import LoraConfig
from jaxstep.models.rope import LongRope, RopeScaling, rope_scaling_of

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QK_NORM_SCOPES = ("head", "projection")
GRANITE_SCALES = {
  "embedding_multiplier": 1.0,
  "attention_multiplier": 0.0,
  "residual_multiplier": 1.0,
  "logits_scaling": 1.0,
}
BLOCK_NORMS = ("pre", "post", "both")
ACTIVATIONS = ("silu", "gelu_tanh")


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
  block_norms: str = "pre"  # pre: norm each branch's input | post: its output (OLMo 2) | both
  norm_offset: float = 0.0  # every RMSNorm scales by (offset + w), w starting at 1 - offset
  mlp_activation: str = "silu"  # silu: SwiGLU | gelu_tanh: GeGLU (Gemma)
  scale_embeddings: bool = False  # the embeddings times √d_model, rounded to their dtype
  query_pre_attn_scalar: float = 0.0  # the attention logits' scale is its -1/2 power; 0: head_dim
  local_rope_theta: float = 0.0  # RoPE base of the layers not in full_layers; 0: rope_theta
  attn_logit_softcapping: float = 0.0  # > 0: scores s become c·tanh(s / c) (Gemma 2)
  final_logit_softcapping: float = 0.0  # > 0: logits z become c·tanh(z / c) (Gemma 2)
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
        "and full attention, or local and global RoPE bases: full_layers): set "
        "model.scan_layers=false"
      )
    rope.check_config(self)
    scales = [name for name, neutral in GRANITE_SCALES.items() if neutral]  # 0 means "none"
    for name in ("rms_norm_eps", "rope_theta", *scales):
      if getattr(self, name) <= 0:
        raise ConfigError(f"model.{name} must be > 0, got {getattr(self, name)}")
    for name in (
      "attention_multiplier",
      "norm_offset",
      "query_pre_attn_scalar",
      "local_rope_theta",
      "attn_logit_softcapping",
      "final_logit_softcapping",
    ):
      if getattr(self, name) < 0:
        raise ConfigError(f"model.{name} must be >= 0, got {getattr(self, name)}")
    if self.attention_multiplier and self.query_pre_attn_scalar:
      raise ConfigError(
        "model.attention_multiplier and model.query_pre_attn_scalar both set the attention "
        "scale: set one of them"
      )
    for name, allowed in (
      ("qk_norm_scope", QK_NORM_SCOPES),
      ("block_norms", BLOCK_NORMS),
      ("mlp_activation", ACTIVATIONS),
    ):
      if getattr(self, name) not in allowed:
        raise ConfigError(
          f"model.{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}"
        )
    if not 0.0 <= self.dropout < 1.0:
      raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")
    check_kernels(self)

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
    attention, windowed and full attention, local and global RoPE bases): they cannot be
    one stack walked by ``lax.scan``."""
    return (
      len(set(self.moe_layers)) > 1
      or len(set(self.windows)) > 1
      or len(set(self.rope_bases)) > 1
      or 0 < len(set(self.nope_layers)) < self.n_layers
    )

  @property
  def rope_bases(self) -> tuple[tuple, ...]:
    """Per layer, ``(theta, scaling)`` of its RoPE: ``local_rope_theta`` unscaled in the
    layers not in ``full_layers`` (Gemma 3's local layers), else ``rope_theta`` and
    ``rope_scaling``."""
    full = (self.rope_theta, self.rope_scaling)
    local = (self.local_rope_theta, None) if self.local_rope_theta else full
    return tuple(full if i in self.full_layers else local for i in range(self.n_layers))

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
