"""Hugging Face's ``GPT2LMHeadModel`` as the bundled GPT, both ways.

The bundled GPT is GPT-2's network: learned position embeddings, pre-LayerNorm blocks with
one fused q/k/v projection (GPT-2 lays its columns out ``[q | k | v]``, heads contiguous
inside each; the GPT holds them head-major, ``[heads, 3, head_dim]``, so ``columns``
permutes the columns of ``c_attn``'s weight, bias and LoRA ``B``), the
tanh-approximated GELU (GPT-2's ``gelu_new``), biases on every projection and LayerNorm, a
final LayerNorm and a head tied to the token embeddings. GPT-2's ``Conv1D`` stores its
weights ``[in, out]`` as flax does, so no kernel is transposed; only an untied
``lm_head.weight`` (a PyTorch ``Linear``) is. ``layer_norm_epsilon`` becomes
``model.layer_norm_eps``, ``n_positions`` ``model.max_seq_len`` (the position embedding's
rows); the vocabulary is exactly the checkpoint's.

Checkpoints name their tensors with a ``transformer.`` prefix (what ``save_pretrained``
writes) or without one (the original OpenAI conversion); both are read, the prefix is
written. Settings this network does not compute (another activation,
``scale_attn_by_inverse_layer_idx``, cross-attention) are refused by name.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

from jaxstep.errors import ConfigError
from jaxstep.models.gpt import GPTConfig, head_major, qkv_major
from jaxstep.models.hf_fields import integer, real

ARCHITECTURE = "GPT2LMHeadModel"
PREFIX = "transformer."
ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # both are GELU's tanh approximation
# Causal-mask buffers older GPT-2 checkpoints carry beside the parameters.
BUFFERS = (".attn.bias", ".attn.masked_bias")


def model_config(hf: dict, where: str, **options) -> GPTConfig:
  """The ``GPTConfig`` of a GPT-2 ``config.json``; ``options`` as ``hf_config.model_config``'s."""
  act = hf.get("activation_function", "gelu_new")
  if act not in ACTIVATIONS:
    raise ConfigError(f"{where}: activation_function {act!r} is not supported (gelu_new only)")
  for key in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
    if hf.get(key):
      raise ConfigError(f"{where}: {key}=true is not supported for {ARCHITECTURE}")
  if hf.get("scale_attn_weights") is False:
    raise ConfigError(f"{where}: scale_attn_weights=false is not supported for {ARCHITECTURE}")
  d_model = integer(hf, "n_embd", where, 768)
  inner = integer(hf, "n_inner", where, 0) or 4 * d_model
  if d_model <= 0:
    raise ConfigError(f"{where}: n_embd must be > 0, got {d_model}")
  if inner % d_model:
    raise ConfigError(f"{where}: n_inner {inner} is not a multiple of n_embd {d_model}")
  fields = {
    "vocab_size": integer(hf, "vocab_size", where, 50257),
    "max_seq_len": integer(hf, "n_positions", where, 1024),
    "d_model": d_model,
    "n_layers": integer(hf, "n_layer", where, 12),
    "n_heads": integer(hf, "n_head", where, 12),
    "mlp_ratio": inner // d_model,
    "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
    "layer_norm_eps": real(hf, "layer_norm_epsilon", where, 1e-5),
  }
  return GPTConfig(**{**fields, **options})


def hf_names(cfg: GPTConfig, prefix: str = PREFIX) -> Iterator[tuple[tuple, str, bool]]:
  """``(params path, HF tensor name, transposed)`` for every parameter of the GPT in the
  per-block layout; ``prefix``: the checkpoint's (``transformer.`` or none)."""
  yield ("embed", "embedding"), f"{prefix}wte.weight", False
  yield ("pos_embed", "embedding"), f"{prefix}wpe.weight", False
  for i in range(cfg.n_layers):
    hf, ours = f"{prefix}h.{i}.", ("blocks", i)
    for mine, theirs in (
      ("ln1", "ln_1"),
      ("qkv", "attn.c_attn"),
      ("proj", "attn.c_proj"),
      ("ln2", "ln_2"),
      ("fc", "mlp.c_fc"),
      ("out", "mlp.c_proj"),
    ):
      weight = "scale" if mine.startswith("ln") else "kernel"
      yield (*ours, mine, weight), f"{hf}{theirs}.weight", False
      yield (*ours, mine, "bias"), f"{hf}{theirs}.bias", False
  yield ("ln_f", "scale"), f"{prefix}ln_f.weight", False
  yield ("ln_f", "bias"), f"{prefix}ln_f.bias", False
  if not cfg.tie_embeddings:
    yield ("head", "kernel"), "lm_head.weight", True


def permuted(path: tuple) -> bool:
  """Whether the leaf at params ``path`` has the fused projection's columns on its last
  axis: ``c_attn``'s kernel, its bias and its LoRA ``B``."""
  return "qkv" in path and path[-1] in ("kernel", "bias", "lora_b")


def columns(cfg, path: tuple, *, to_hf: bool) -> Callable | None:
  """How the leaf at params ``path`` of ``cfg``'s model reorders its last axis between
  GPT-2's file and the GPT: ``head_major`` on the way in, ``qkv_major`` on the way out
  (``to_hf``); None for every other leaf and every other model."""
  if not isinstance(cfg, GPTConfig) or not permuted(path):
    return None
  return functools.partial(qkv_major if to_hf else head_major, n_heads=cfg.n_heads)


def prefix_of(names) -> str:
  """The prefix a checkpoint's tensor names use."""
  return PREFIX if any(n.startswith(PREFIX) for n in names) else ""


def is_ignored(name: str, cfg: GPTConfig) -> bool:
  """A tensor that is not a parameter here: a mask buffer, or a tied head's copy."""
  return name.endswith(BUFFERS) or (cfg.tie_embeddings and name == "lm_head.weight")


def export_config(cfg: GPTConfig, *, dtype: str, base_config: dict | None) -> dict:
  """``config.json`` of the GPT as ``GPT2LMHeadModel``: ``base_config`` updated, or fresh."""
  hf = dict(base_config or {})
  hf.update(
    architectures=[ARCHITECTURE],
    model_type="gpt2",
    vocab_size=cfg.vocab_size,
    n_positions=cfg.max_seq_len,  # the rows of the position embedding
    n_embd=cfg.d_model,
    n_layer=cfg.n_layers,
    n_head=cfg.n_heads,
    n_inner=cfg.mlp_ratio * cfg.d_model,
    activation_function="gelu_new",
    layer_norm_epsilon=cfg.layer_norm_eps,
    tie_word_embeddings=cfg.tie_embeddings,
    scale_attn_weights=True,
    scale_attn_by_inverse_layer_idx=False,
  )
  for key in [k for k in ("torch_dtype", "dtype") if k in hf] or ["torch_dtype", "dtype"]:
    hf[key] = dtype
  return hf
