"""Gemma 2 and Gemma 3 text folders (``Gemma2ForCausalLM``; ``Gemma3ForCausalLM``: Gemma 3
270M and 1B) as ``LlamaConfig`` fields, and back.

What Gemma 3 adds to the Llama decoder: RMSNorm as ``x̂ · (1 + w)`` in fp32 (``norm_offset``
1) on each branch's input *and* output (``block_norms: both``: ``input_layernorm``,
``post_attention_layernorm``, ``pre_feedforward_layernorm``, ``post_feedforward_layernorm``)
and on each head's q and k; a GeGLU MLP (``gelu_pytorch_tanh``); embeddings times √d rounded
to their dtype; attention logits scaled by ``query_pre_attn_scalar^-1/2``; and two kinds of
layers (``layer_types``, else every ``sliding_window_pattern``-th (6) layer full): local
ones with a sliding window and RoPE base ``rope_local_base_freq`` (10,000), global ones
with full attention and ``rope_theta`` (1,000,000) — ``model.full_layers``,
``model.local_rope_theta``. Read as transformers 5 reads a folder: ``rope_parameters``
keyed by layer type, or the older top-level ``rope_theta`` / ``rope_local_base_freq``.

Gemma 2 is the same but for three things: no q/k norms, one RoPE base for every layer, and
soft-capped attention scores and logits, ``c · tanh(s / c)`` (``attn_logit_softcapping``
50, ``final_logit_softcapping`` 30 by default: ``model.attn_logit_softcapping``,
``model.final_logit_softcapping``; its local layers every other one, from the first).

Not read, and refused by name: the larger models' linear RoPE scaling of the global layers
(``Gemma3ForConditionalGeneration`` folders, whose text tower sits beside a vision tower,
are another architecture), Gemma 3's ``final_logit_softcapping`` (null in its models) and
``use_bidirectional_attention`` (EmbeddingGemma). transformers ignores
``attn_logit_softcapping`` in Gemma 3, and so does jaxstep.
"""

from __future__ import annotations

from jaxstep.errors import ConfigError
from jaxstep.models.hf_fields import integer, real

GEMMA2 = "Gemma2ForCausalLM"
GEMMA3 = "Gemma3ForCausalLM"
GEMMAS = (GEMMA2, GEMMA3)
FIELDS = {
  "attention_bias": False,
  "qk_norm": True,
  "qk_norm_scope": "head",
  "block_norms": "both",
  "norm_offset": 1.0,
  "mlp_activation": "gelu_tanh",
  "scale_embeddings": True,
}
GEMMA2_FIELDS = {**FIELDS, "qk_norm": False}
SLIDING, FULL = "sliding_attention", "full_attention"


def read_fields(hf: dict, where: str, architecture: str = GEMMA3) -> dict:
  """The ``LlamaConfig`` fields of a Gemma 2 or 3 text folder beyond its shape
  (transformers' class defaults where it names none: head_dim 256, tied embeddings, a
  4,096-key window, Gemma 2's soft-caps of 50 and 30)."""
  activation = hf.get("hidden_activation", "gelu_pytorch_tanh")
  if activation != "gelu_pytorch_tanh":
    raise ConfigError(
      f"{where}: hidden_activation {activation!r} is not supported for {architecture}"
    )
  refused = ("use_bidirectional_attention",)
  if architecture == GEMMA3:
    refused += ("final_logit_softcapping",)
  for key in refused:
    if hf.get(key):
      raise ConfigError(f"{where}: {key}={hf[key]} is not supported for {architecture}")
  if architecture == GEMMA2:
    return {
      **GEMMA2_FIELDS,
      **_common(hf, where, every=2),
      "attn_logit_softcapping": _cap(hf, "attn_logit_softcapping", where, 50.0),
      "final_logit_softcapping": _cap(hf, "final_logit_softcapping", where, 30.0),
    }
  theta, local = _rope(hf, where)
  return {
    **FIELDS,
    **_common(hf, where, every=6),
    "rope_theta": theta,
    "rope_scaling": None,
    "local_rope_theta": local,
  }


def _cap(hf: dict, key: str, where: str, default: float) -> float:
  """A soft-cap: the class default where the key is absent, none (0) where it is null."""
  return 0.0 if key in hf and hf[key] is None else real(hf, key, where, default)


def _common(hf: dict, where: str, every: int) -> dict:
  """What both Gemmas read alike; ``every``: the default period of their full layers."""
  return {
    "head_dim": integer(hf, "head_dim", where, 256),
    "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
    "query_pre_attn_scalar": real(hf, "query_pre_attn_scalar", where, 256.0),
    **_windows(hf, where, every),
  }


def _rope(hf: dict, where: str) -> tuple[float, float]:
  """``(global theta, local theta)``; ``ConfigError`` for a scaled RoPE."""
  params = hf.get("rope_parameters")
  at = f"{where} rope_parameters"
  if isinstance(params, dict) and {FULL, SLIDING} & set(params):
    full, local = params.get(FULL) or {}, params.get(SLIDING) or {}
    thetas = real(full, "rope_theta", at, 1e6), real(local, "rope_theta", at, 1e4)
    kinds = [p.get("rope_type", "default") for p in (full, local)]
  else:
    thetas = real(hf, "rope_theta", where, 1e6), real(hf, "rope_local_base_freq", where, 1e4)
    scaling = hf.get("rope_scaling") or {}
    kinds = [scaling.get("rope_type", scaling.get("type", "default"))]
  if bad := [k for k in kinds if k != "default"]:
    raise ConfigError(
      f"{where}: {GEMMA3}'s {bad[0]} RoPE scaling (the larger models' global layers) is not "
      "computed here"
    )
  return thetas


def _windows(hf: dict, where: str, every: int) -> dict:
  """``sliding_window`` and ``full_layers``: ``layer_types``, else every
  ``sliding_window_pattern``-th layer full (Gemma 2: every other; transformers ignores
  ``_sliding_window_pattern``)."""
  n = integer(hf, "num_hidden_layers", where)
  types = hf.get("layer_types")
  if types is None:
    every = integer(hf, "sliding_window_pattern", where, every)
    if every < 1:
      raise ConfigError(f"{where}: sliding_window_pattern must be >= 1, got {every}")
    types = [SLIDING if (i + 1) % every else FULL for i in range(n)]
  if not isinstance(types, list) or len(types) != n or set(types) - {SLIDING, FULL}:
    raise ConfigError(f"{where}: layer_types must be {n} of {SLIDING!r}, {FULL!r}: {types!r}")
  full = tuple(i for i, kind in enumerate(types) if kind == FULL)
  return {"sliding_window": integer(hf, "sliding_window", where, 4096), "full_layers": full}


def export_fields(cfg, longest: int, architecture: str = GEMMA3) -> dict:
  """Gemma 3's own ``config.json`` fields for ``cfg`` (``longest``: the export's
  ``max_position_embeddings``; a model without a window gets one that long, which masks
  nothing, since transformers needs a number). Gemma 3's older top-level RoPE keys are
  written too, in step with its ``rope_parameters``; Gemma 2's RoPE is the Llama family's."""
  common = {
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": _number(cfg.query_pre_attn_scalar or cfg.resolved_head_dim),
    "sliding_window": cfg.sliding_window or longest,
    "layer_types": [FULL if i in cfg.full_layers else SLIDING for i in range(cfg.n_layers)],
    "use_bidirectional_attention": False,
  }
  if architecture == GEMMA2:
    caps = (cfg.attn_logit_softcapping, cfg.final_logit_softcapping)
    attn, final = (float(c) if c else None for c in caps)
    return {**common, "attn_logit_softcapping": attn, "final_logit_softcapping": final}
  local = cfg.local_rope_theta or cfg.rope_theta
  return {
    **common,
    "rope_theta": float(cfg.rope_theta),
    "rope_local_base_freq": float(local),
    "rope_scaling": None,
    "rope_parameters": {
      FULL: {"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
      SLIDING: {"rope_type": "default", "rope_theta": float(local)},
    },
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
  }


def check_export(cfg, architecture: str) -> None:
  """``ConfigError`` for what a Gemma config cannot hold: a RoPE scaling; in Gemma 3,
  soft-capping; in Gemma 2, a local RoPE base."""
  if cfg.rope_scaling is not None:
    raise ConfigError(
      f"{architecture} has no RoPE scaling here, and the model has {cfg.rope_scaling}"
    )
  caps = {k: getattr(cfg, k) for k in ("attn_logit_softcapping", "final_logit_softcapping")}
  if architecture == GEMMA3 and any(caps.values()):
    raise ConfigError(f"{GEMMA3} does not soft-cap, and the model has {caps}: use {GEMMA2}")
  if architecture == GEMMA2 and cfg.local_rope_theta:
    raise ConfigError(
      f"{GEMMA2} has one RoPE base, and the model has local_rope_theta "
      f"{cfg.local_rope_theta}: use {GEMMA3}"
    )


def _number(value: float) -> int | float:
  """``value`` as transformers' config class types it: an int where it is whole."""
  return int(value) if float(value).is_integer() else float(value)
