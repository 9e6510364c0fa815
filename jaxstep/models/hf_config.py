"""A Hugging Face model folder's ``config.json`` as a jaxstep model config.

Supported architectures (``config.json``'s ``architectures[0]``) and what each adds to the
Llama decoder (RMSNorm, SwiGLU, rotary positions, grouped-query attention):

- ``LlamaForCausalLM`` (Llama 2/3, SmolLM2): RoPE scaling type ``llama3`` or none; no
  ``attention_bias`` / ``mlp_bias`` (refused: they would add biases this model lacks).
- ``MistralForCausalLM``: sliding-window attention in every layer when ``sliding_window``
  is set (Phi-3 too; Qwen2, Qwen3 and SmolLM3 in their ``layer_types``' sliding layers:
  ``hf_dense.read_windows``).
- ``Qwen2ForCausalLM``: biases on the q/k/v projections.
- ``Qwen3ForCausalLM``: RMSNorm on each head's q and k, an explicit ``head_dim``.
- ``Olmo2ForCausalLM``: RMSNorm on the attention's and the MLP's outputs instead of their
  inputs, and on the whole q and k projections.
- ``GraniteForCausalLM``: multipliers on the embeddings, the attention logits, the
  residual branches and the logits (``hf_dense.py``).
- ``SmolLM3ForCausalLM``: no rotary embedding in the layers ``no_rope_layers`` flags 0.
- ``Gemma2ForCausalLM``, ``Gemma3ForCausalLM`` (Gemma 3 270M, 1B): ``hf_gemma.py``.
- ``Phi3ForCausalLM`` (Phi-3, Phi-4-mini): fused ``qkv_proj`` and ``gate_up_proj`` tensors
  (split as they are read), RoPE over the first ``partial_rotary_factor`` of each head, and
  LongRoPE (``rope_type: longrope``, older folders' ``su``).
- ``Qwen3MoeForCausalLM``, ``MixtralForCausalLM``, ``OlmoeForCausalLM``,
  ``Qwen2MoeForCausalLM``: mixtures of experts (``hf_moe.py`` says what each adds).
- ``GPT2LMHeadModel``: the bundled GPT itself (``hf_gpt2.py``).

Both folder layouts found in the wild are read: the older one keeps ``rope_theta`` and
``rope_scaling`` at the top level, the one transformers 5 writes keeps them in
``rope_parameters``. Anything the Llama math here does not compute (another RoPE scaling,
another activation) is refused by name rather than approximated.
"""

from __future__ import annotations

import json
import pathlib

from jaxstep.errors import ConfigError
from jaxstep.models import hf_gemma, hf_gpt2, hf_moe
from jaxstep.models.gpt import GPTConfig
from jaxstep.models.hf_dense import ARCHITECTURES, PHI3, READS_WINDOWS, read_fields, read_windows
from jaxstep.models.hf_fields import integer, real
from jaxstep.models.llama import LlamaConfig
from jaxstep.models.rope import LongRope, rope_scaling_of

CONFIG = "config.json"
# transformers' rms_norm_eps where a config.json names none (1e-6 for the rest)
DEFAULT_EPS = {
  "Olmo2ForCausalLM": 1e-5,
  "MixtralForCausalLM": 1e-5,
  "OlmoeForCausalLM": 1e-5,
  PHI3: 1e-5,
}
ROPE_TYPES = ("default", "llama3", "longrope", "su")
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# GPT-2: the bundled GPT (hf_gpt2.py); the mixtures of experts: hf_moe.py
SUPPORTED = (*ARCHITECTURES, *hf_moe.ARCHITECTURES, hf_gpt2.ARCHITECTURE)


def read_config(folder: str | pathlib.Path) -> dict:
  """``config.json`` of a local model folder, as a dict; ``ConfigError`` when it is missing
  or not a JSON object."""
  path = pathlib.Path(folder) / CONFIG
  if not path.is_file():
    raise ConfigError(
      f"{folder} has no {CONFIG}: give a local Hugging Face model folder (config.json, "
      f"model.safetensors, tokenizer files)"
    )
  return json_object(path)


def json_object(path: pathlib.Path) -> dict:
  """The JSON object in the file at ``path`` (a folder's ``config.json``,
  ``generation_config.json``); ``ConfigError`` naming the file when it is not one."""
  try:
    value = json.loads(path.read_text())
  except (OSError, UnicodeDecodeError, ValueError) as e:
    raise ConfigError(f"{path} cannot be read as JSON ({e})") from None
  if not isinstance(value, dict):
    raise ConfigError(f"{path} must hold a JSON object, got {type(value).__name__}")
  return value


def architecture(hf: dict, where: str = CONFIG) -> str:
  """The supported architecture ``hf`` names, else ``ConfigError`` listing the supported."""
  names = hf.get("architectures") or []
  name = names[0] if isinstance(names, list) and names else None
  if name not in SUPPORTED:
    raise ConfigError(
      f"{where}: architecture {name!r} is not supported; supported: {', '.join(SUPPORTED)}"
    )
  return name


def rope_settings(
  hf: dict, where: str = CONFIG, default_theta: float = 10000.0
) -> tuple[float, tuple | None]:
  """``(theta, llama3 or LongRoPE scaling as ``(key, value)`` pairs, or None)`` from either
  layout: ``rope_parameters`` (current transformers) or ``rope_theta`` + ``rope_scaling``
  (older folders); ``default_theta`` where neither names a theta (the architecture's:
  Mixtral's is 1e6)."""
  params = hf.get("rope_parameters")
  theta = real(hf, "rope_theta", where, default_theta)
  if isinstance(params, dict):
    theta, scaling = real(params, "rope_theta", f"{where} rope_parameters", theta), params
  else:
    scaling = hf.get("rope_scaling")
  if not scaling:
    return theta, None
  if not isinstance(scaling, dict):
    raise ConfigError(f"{where}: rope_scaling must be an object, got {scaling!r}")
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  if kind not in ROPE_TYPES:
    raise ConfigError(
      f"{where}: rope scaling type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
    )
  if kind == "default":
    return theta, None
  if kind in ("longrope", "su"):
    return theta, _longrope(hf, scaling, where)
  missing = [k for k in LLAMA3_KEYS if k not in scaling]
  if missing:
    raise ConfigError(f"{where}: llama3 rope scaling lacks {', '.join(missing)}")
  return theta, tuple((k, real(scaling, k, f"{where} rope scaling")) for k in LLAMA3_KEYS)


def _longrope(hf: dict, scaling: dict, where: str) -> tuple:
  """LongRoPE's settings as transformers reads them: the top-level
  ``original_max_position_embeddings`` wins over the scaling's own (and Phi-3's config
  class defaults it to 4096, so a Phi-3 folder's scaling never names it); an attention
  factor the folder does not give is derived from ``factor``, else from
  ``max_position_embeddings`` over that length."""
  at = f"{where} rope scaling"
  original = integer(hf, "original_max_position_embeddings", where, 0)
  if not original and architecture(hf, where) == PHI3:  # a field of its config class
    original = 4096
  if not original:
    original = integer(scaling, "original_max_position_embeddings", at)
  for key in ("short_factor", "long_factor"):
    if not isinstance(scaling.get(key), list):
      raise ConfigError(f"{at}: {key} must be a list of numbers, got {scaling.get(key)!r}")
  attention = real(scaling, "attention_factor", at, 0.0)
  if not attention:
    longest = integer(hf, "max_position_embeddings", where, original)
    factor = real(scaling, "factor", at, 0.0) or longest / original
    attention = LongRope.attention_factor_of(factor, original)
  return (
    ("rope_type", "longrope"),
    ("short_factor", tuple(float(v) for v in scaling["short_factor"])),
    ("long_factor", tuple(float(v) for v in scaling["long_factor"])),
    ("original_max_position_embeddings", original),
    ("attention_factor", attention),
  )


def _rope_spelled(cfg: LlamaConfig) -> dict | None:
  """``cfg``'s RoPE scaling as a ``rope_scaling`` / ``rope_parameters`` entry spells it."""
  scaling = cfg.rope_scaling
  if scaling is None:
    return None
  if isinstance(scaling, LongRope):  # the attention factor written out: no length changes it
    return {
      "rope_type": "longrope",
      "short_factor": list(scaling.short_factor),
      "long_factor": list(scaling.long_factor),
      "original_max_position_embeddings": int(scaling.original_max_position_embeddings),
      "attention_factor": float(scaling.attention_factor),
    }
  spelled = {"rope_type": "llama3", **{k: float(getattr(scaling, k)) for k in LLAMA3_KEYS}}
  return spelled | {
    "original_max_position_embeddings": int(scaling.original_max_position_embeddings)
  }


def set_rope(hf: dict, cfg: LlamaConfig, *, fresh: bool) -> None:
  """Writes ``cfg``'s RoPE into ``hf`` unless it already says the same (then the base's own
  spelling is kept)."""
  theta = float(cfg.rope_theta)
  if (
    isinstance(hf.get("rope_parameters"), dict) and "partial_rotary_factor" in hf["rope_parameters"]
  ):
    hf["rope_parameters"]["partial_rotary_factor"] = cfg.partial_rotary_factor  # wins on reading
  if not fresh:
    try:
      base_theta, base = rope_settings(hf)
      if (base_theta, rope_scaling_of(base)) == (theta, cfg.rope_scaling):
        return
    except ConfigError:  # a RoPE the base names but jaxstep does not compute: replaced
      pass
  old = _rope_spelled(cfg)
  new_layout = fresh or isinstance(hf.get("rope_parameters"), dict)
  if new_layout:
    hf["rope_parameters"] = {"rope_type": "default", **(old or {}), "rope_theta": theta}
    if cfg.partial_rotary_factor != 1:
      hf["rope_parameters"]["partial_rotary_factor"] = cfg.partial_rotary_factor
  if fresh or not new_layout or "rope_theta" in hf or hf.get("rope_scaling"):
    hf["rope_theta"], hf["rope_scaling"] = theta, old


def model_config(hf: dict, where: str = CONFIG, **options) -> LlamaConfig | GPTConfig:
  """The model config of a supported ``config.json`` (``GPTConfig`` for GPT-2, else a
  ``LlamaConfig``); ``options`` set what the folder does not decide (``attention``,
  ``remat``, ``scan_layers``, ``max_seq_len``, ``dropout``, ``init_from``, a mixture of
  experts' ``capacity_factor``, ``moe_matmul``, ``lbl_scope``) and win over what it does
  (``router_aux_loss`` and ``router_z_loss``, which default to the folder's coefficients)."""
  name = architecture(hf, where)
  if name == hf_gpt2.ARCHITECTURE:
    return hf_gpt2.model_config(hf, where, **options)
  act = hf.get("hidden_act", "silu")
  if act != "silu" and name not in hf_gemma.GEMMAS:  # Gemma's is hidden_activation
    raise ConfigError(f"{where}: hidden_act {act!r} is not supported (the Llama MLP is SwiGLU)")
  if name in hf_moe.ARCHITECTURES:
    family = hf_moe.config_fields(hf, name, where)
    default_theta = hf_moe.ARCHITECTURES[name].default_theta
  else:
    family, default_theta = read_fields(hf, name, where), 10000.0
    for key in ("mlp_bias", "attention_bias") if not family["attention_bias"] else ("mlp_bias",):
      if hf.get(key):  # Llama's attention_bias also biases o_proj, which this model has not
        raise ConfigError(f"{where}: {key}=true is not supported for {name}")
  d_model = integer(hf, "hidden_size", where)
  n_heads = integer(hf, "num_attention_heads", where)
  theta, scaling = rope_settings(hf, where, default_theta)
  fields = {
    "vocab_size": integer(hf, "vocab_size", where),
    "max_seq_len": integer(hf, "max_position_embeddings", where, 2048) or 2048,
    "d_model": d_model,
    "n_layers": integer(hf, "num_hidden_layers", where),
    "n_heads": n_heads,
    "n_kv_heads": integer(hf, "num_key_value_heads", where, 0) or n_heads,
    "head_dim": integer(hf, "head_dim", where, 0) or d_model // max(n_heads, 1),
    "intermediate_size": integer(hf, "intermediate_size", where),
    "rms_norm_eps": real(hf, "rms_norm_eps", where, DEFAULT_EPS.get(name, 1e-6)),
    "rope_theta": theta,
    "rope_scaling": scaling,
    "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    **family,
    **read_windows(hf, name, where),
  }
  return LlamaConfig(**{**fields, **options})


def check_sliding_window(hf: dict, seq_len: int, where: str = CONFIG) -> None:
  """A sliding window shorter than the sequences, in an architecture whose windows jaxstep
  does not read (the mixtures of experts), would mask what this attention sees: refused
  rather than ignored (a window at least ``seq_len`` long changes nothing)."""
  if architecture(hf, where) in READS_WINDOWS:
    return  # the model computes it (read_windows, hf_gemma)
  window = hf.get("sliding_window")
  uses = hf.get("use_sliding_window", window is not None)
  if window is not None and uses and int(window) < seq_len:
    raise ConfigError(
      f"{where}: sliding_window {window} is shorter than the sequence length {seq_len}; "
      f"{architecture(hf, where)}'s sliding window is not read here: use train.seq_len <= "
      f"{window}"
    )
