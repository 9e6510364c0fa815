"""The dense Llama-family architectures a folder may name, and what each fixes or adds to
the Llama decoder's settings, as ``config.json`` spells them.

Each architecture fixes four ``LlamaConfig`` fields whatever its ``config.json`` says
(``ARCHITECTURES``): q/k/v biases, q/k norms, their scope, and where the blocks' norms sit.
Granite adds four numbers the folder sets (``GRANITE_SCALES``): the embeddings times
``embedding_multiplier``, the attention logits scaled by ``attention_multiplier`` in place
of 1/√head_dim, each attention and MLP output times ``residual_multiplier`` before it is
added to the residual stream, and the logits divided by ``logits_scaling``. transformers'
Granite defaults each to 1 (an attention scale of 1, not 1/√head_dim).
"""

from __future__ import annotations

import math

from jaxstep.errors import ConfigError
from jaxstep.models.hf_fields import real
from jaxstep.models.llama import GRANITE_SCALES

GRANITE = "GraniteForCausalLM"
LLAMA = {"attention_bias": False, "qk_norm": False, "qk_norm_scope": "head", "block_norms": "pre"}
ARCHITECTURES = {
  "LlamaForCausalLM": LLAMA,
  "MistralForCausalLM": LLAMA,
  "Qwen2ForCausalLM": {**LLAMA, "attention_bias": True},
  "Qwen3ForCausalLM": {**LLAMA, "qk_norm": True},
  "Olmo2ForCausalLM": {
    **LLAMA,
    "qk_norm": True,
    "qk_norm_scope": "projection",
    "block_norms": "post",
  },
  GRANITE: LLAMA,
}


def read_fields(hf: dict, architecture: str, where: str) -> dict:
  """The ``LlamaConfig`` fields ``architecture`` fixes, and Granite's multipliers as the
  folder sets them (1 where it names none, as transformers reads it)."""
  fields = dict(ARCHITECTURES[architecture])
  if architecture == GRANITE:
    fields |= {name: real(hf, name, where, 1.0) for name in GRANITE_SCALES}
  return fields


def scaled(cfg) -> dict:
  """``cfg``'s multipliers that change its model (Granite's), by name."""
  return {k: getattr(cfg, k) for k, neutral in GRANITE_SCALES.items() if getattr(cfg, k) != neutral}


def export_fields(cfg, architecture: str) -> dict:
  """Granite's four multipliers for its ``config.json`` (the attention's written out: 0
  here is 1/√head_dim); nothing for the other architectures."""
  if architecture != GRANITE:
    return {}
  fields = {name: float(getattr(cfg, name)) for name in GRANITE_SCALES}
  if not cfg.attention_multiplier:
    fields["attention_multiplier"] = 1.0 / math.sqrt(cfg.resolved_head_dim)
  return {**fields, "mlp_bias": False}


def check_export(cfg, architecture: str) -> None:
  """``ConfigError`` unless ``architecture`` fixes exactly ``cfg``'s fields (the scope of
  q/k norms a model has not: any) and can hold its multipliers: transformers would build
  other tensors than those written, or compute another model."""
  fixed = ARCHITECTURES[architecture]
  ours = {
    k: getattr(cfg, k) if cfg.qk_norm or k != "qk_norm_scope" else v for k, v in fixed.items()
  }
  if ours != fixed:
    spelled = [", ".join(f"{k}={v}" for k, v in d.items()) for d in (fixed, ours)]
    raise ConfigError(
      f"{architecture} has {spelled[0]}; the model has {spelled[1]}: pick the architecture "
      "it was built as"
    )
  if (multipliers := scaled(cfg)) and architecture != GRANITE:
    names = ", ".join(f"{k}={v}" for k, v in multipliers.items())
    raise ConfigError(
      f"{architecture} has no multipliers, and the model has {names}: use {GRANITE}"
    )
