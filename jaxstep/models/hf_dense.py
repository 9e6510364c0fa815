"""The dense Llama-family architectures a folder may name, and what each fixes or adds to
the Llama decoder's settings, as ``config.json`` spells them.

Each architecture fixes four ``LlamaConfig`` fields whatever its ``config.json`` says
(``ARCHITECTURES``): q/k/v biases, q/k norms, their scope, and where the blocks' norms sit.
Granite adds four numbers the folder sets (``GRANITE_SCALES``): the embeddings times
``embedding_multiplier``, the attention logits scaled by ``attention_multiplier`` in place
of 1/√head_dim, each attention and MLP output times ``residual_multiplier`` before it is
added to the residual stream, and the logits divided by ``logits_scaling``. transformers'
Granite defaults each to 1 (an attention scale of 1, not 1/√head_dim). SmolLM3 leaves q and
k unrotated in the layers its ``no_rope_layers`` flags 0 (by default every fourth:
``no_rope_layer_interval``), jaxstep's ``nope_layers``. Phi-3 rotates the first
``partial_rotary_factor`` of each head only (Phi-4-mini: 0.75); its fused ``qkv_proj`` and
``gate_up_proj`` tensors are ``hf_weights``' concern, its LongRoPE ``hf_config``'s.
"""

from __future__ import annotations

import math

from jaxstep.errors import ConfigError
from jaxstep.models import hf_gemma
from jaxstep.models.hf_fields import integer, real
from jaxstep.models.hf_gemma import GEMMA2, GEMMA3
from jaxstep.models.llama import GRANITE_SCALES

GRANITE = "GraniteForCausalLM"
SMOLLM3 = "SmolLM3ForCausalLM"
PHI3 = "Phi3ForCausalLM"
LLAMA = {
  "attention_bias": False,
  "qk_norm": False,
  "qk_norm_scope": "head",
  "block_norms": "pre",
  "norm_offset": 0.0,
  "mlp_activation": "silu",
  "scale_embeddings": False,
}
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
  SMOLLM3: LLAMA,
  PHI3: LLAMA,
  GEMMA2: hf_gemma.GEMMA2_FIELDS,
  GEMMA3: hf_gemma.FIELDS,
}


def read_fields(hf: dict, architecture: str, where: str) -> dict:
  """The ``LlamaConfig`` fields ``architecture`` fixes, and Granite's multipliers as the
  folder sets them (1 where it names none, as transformers reads it)."""
  fields = dict(ARCHITECTURES[architecture])
  if architecture == GRANITE:
    fields |= {name: real(hf, name, where, 1.0) for name in GRANITE_SCALES}
    if bad := {k: fields[k] for k in GRANITE_SCALES if not fields[k] > 0}:
      raise ConfigError(f"{where}: Granite's multipliers must be > 0, got {bad}")
  if architecture == SMOLLM3:
    fields["nope_layers"] = _nope_layers(hf, where)
  if architecture in hf_gemma.GEMMAS:
    fields |= hf_gemma.read_fields(hf, where, architecture)
  if architecture == PHI3:  # rope_parameters' value wins, as transformers reads it
    rope = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    top = real(hf, "partial_rotary_factor", where, 1.0)
    fields["partial_rotary_factor"] = real(rope, "partial_rotary_factor", where, top)
  return fields


def _nope_layers(hf: dict, where: str) -> tuple[int, ...]:
  """The layers ``no_rope_layers`` flags 0, or transformers' default: every
  ``no_rope_layer_interval``-th (4)."""
  n = integer(hf, "num_hidden_layers", where)
  flags = hf.get("no_rope_layers")
  if flags is None:
    interval = integer(hf, "no_rope_layer_interval", where, 4)
    flags = [int((i + 1) % interval != 0) for i in range(n)]
  if not isinstance(flags, list) or len(flags) != n or any(f not in (0, 1) for f in flags):
    raise ConfigError(f"{where}: no_rope_layers must be {n} flags of 0 or 1, got {flags!r}")
  return tuple(i for i, rope in enumerate(flags) if not rope)


def scaled(cfg) -> dict:
  """``cfg``'s multipliers that change its model (Granite's), by name."""
  return {k: getattr(cfg, k) for k, neutral in GRANITE_SCALES.items() if getattr(cfg, k) != neutral}


def export_fields(cfg, architecture: str) -> dict:
  """Granite's four multipliers for its ``config.json`` (the attention's written out: 0
  here is 1/√head_dim), SmolLM3's rotary flags per layer; nothing for the others."""
  if architecture == SMOLLM3:
    flags = [int(i not in cfg.nope_layers) for i in range(cfg.n_layers)]
    return {"no_rope_layers": flags, "mlp_bias": False}
  if architecture == PHI3:
    original = getattr(cfg.rope_scaling, "original_max_position_embeddings", None)
    fields = {"partial_rotary_factor": cfg.partial_rotary_factor}
    return fields | ({"original_max_position_embeddings": original} if original else {})
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
  if cfg.partial_rotary_factor != 1 and architecture != PHI3:
    raise ConfigError(
      f"{architecture} rotates whole heads, and the model has partial_rotary_factor "
      f"{cfg.partial_rotary_factor}: use {PHI3}"
    )
  if architecture == PHI3:
    _check_phi3(cfg)
  gemma = ("query_pre_attn_scalar", "local_rope_theta", *CAPS)
  if architecture not in hf_gemma.GEMMAS and (names := _set(cfg, gemma)):
    raise ConfigError(f"{architecture} cannot hold the model's {names}: use {GEMMA2} or {GEMMA3}")
  if architecture in hf_gemma.GEMMAS:
    hf_gemma.check_export(cfg, architecture)
  _check_windows(cfg, architecture)
  if cfg.nope_layers and architecture != SMOLLM3:
    raise ConfigError(
      f"{architecture} rotates q and k in every layer, and the model has nope_layers "
      f"{list(cfg.nope_layers)}: use {SMOLLM3}"
    )


CAPS = ("attn_logit_softcapping", "final_logit_softcapping")


def _set(cfg, names) -> str:
  """``cfg``'s fields among ``names`` that are set, as ``name=value``."""
  return ", ".join(f"{k}={getattr(cfg, k)}" for k in names if getattr(cfg, k))


def _check_phi3(cfg) -> None:
  """What transformers' Phi-3 config refuses: RoPE scaling other than LongRoPE, and a
  ``head_dim`` other than ``hidden_size / num_attention_heads`` (it sizes the factor lists
  from that quotient)."""
  kind = getattr(cfg.rope_scaling, "rope_type", "longrope")
  if kind != "longrope":
    raise ConfigError(f"{PHI3} takes LongRoPE or no RoPE scaling, and the model has {kind}")
  if cfg.resolved_head_dim * cfg.n_heads != cfg.d_model:
    raise ConfigError(
      f"{PHI3} has head_dim = d_model / n_heads ({cfg.d_model} / {cfg.n_heads}), and the "
      f"model has head_dim {cfg.resolved_head_dim}"
    )


WINDOWED = ("MistralForCausalLM", PHI3)  # a sliding_window there windows every layer
LAYERED = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", SMOLLM3)  # use_sliding_window, layer_types
SLIDING, FULL = "sliding_attention", "full_attention"
READS_WINDOWS = (
  *WINDOWED,
  *LAYERED,
  *hf_gemma.GEMMAS,
)  # the architectures whose windows are the model's


def read_windows(hf: dict, architecture: str, where: str) -> dict:
  """``sliding_window`` and ``full_layers`` as transformers builds the layers: Mistral and
  Phi-3 window every layer when the folder names a window; Qwen2, Qwen3 and SmolLM3 only
  with ``use_sliding_window``, the layers ``layer_types`` calls ``sliding_attention`` (where
  it is absent: Qwen's layers from ``max_window_layers`` (28) on, SmolLM3's NoPE layers)."""
  qwen = architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM")  # their class's 4,096
  window = hf.get("sliding_window", 4096 if qwen else None)
  # SmolLM3's layers take the window from layer_types alone, whatever the flag says
  explicit = architecture == SMOLLM3 and hf.get("layer_types") is not None
  if architecture in LAYERED and not (hf.get("use_sliding_window", False) or explicit):
    window = None
  if architecture not in WINDOWED + LAYERED or window is None:
    return {}
  window = integer(hf, "sliding_window", where, window)
  n = integer(hf, "num_hidden_layers", where)
  types = hf.get("layer_types")
  if architecture in WINDOWED:
    sliding = set(range(n))
  elif types is not None:
    if not isinstance(types, list) or len(types) != n or set(types) - {SLIDING, FULL}:
      raise ConfigError(f"{where}: layer_types must be {n} of {SLIDING!r}, {FULL!r}: {types!r}")
    sliding = {i for i, kind in enumerate(types) if kind == SLIDING}
  elif architecture == SMOLLM3:
    sliding = set(_nope_layers(hf, where))
  else:
    first = integer(hf, "max_window_layers", where, 28)
    sliding = set(range(first, n))
  if window <= 0 or not sliding:
    return {}
  return {"sliding_window": window, "full_layers": tuple(i for i in range(n) if i not in sliding)}


def window_fields(cfg, architecture: str) -> dict:
  """The sliding-window fields of ``architecture``'s ``config.json`` for ``cfg``'s windows
  (``layer_types`` spelled out where the architecture reads it)."""
  window = cfg.sliding_window or None
  if architecture in WINDOWED:
    return {"sliding_window": window}
  if architecture not in LAYERED:
    return {}
  types = [SLIDING if w else FULL for w in cfg.windows]
  return {"use_sliding_window": window is not None, "sliding_window": window, "layer_types": types}


def _check_windows(cfg, architecture: str) -> None:
  """``ConfigError`` unless ``architecture`` can window the layers ``cfg`` windows."""
  if not cfg.sliding_window or architecture in LAYERED + hf_gemma.GEMMAS:
    return
  if architecture not in WINDOWED:
    raise ConfigError(
      f"{architecture} has no sliding-window attention, and the model has sliding_window "
      f"{cfg.sliding_window} (Mistral and Phi-3 window every layer; Qwen2, Qwen3, SmolLM3 "
      "and Gemma 3 the layers their layer_types name)"
    )
  if any(w == 0 for w in cfg.windows):
    raise ConfigError(
      f"{architecture} windows every layer, and the model's full_layers are "
      f"{list(cfg.full_layers)} (Qwen2, Qwen3, SmolLM3 and Gemma 3 window the layers their "
      "layer_types name)"
    )
