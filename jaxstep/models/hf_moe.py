"""Hugging Face's mixture-of-experts relatives of Llama as jaxstep's MoE Llama (``moe.py``):
their ``config.json`` fields in and out, and the tensor names of an MoE block.

What each adds to the Llama decoder with a softmax top-k router and SwiGLU experts:

- ``Qwen3MoeForCausalLM``: RMSNorm on each head's q and k; experts of
  ``moe_intermediate_size``; dense layers by ``decoder_sparse_step`` / ``mlp_only_layers``
  (of ``intermediate_size``).
- ``MixtralForCausalLM``: experts of ``intermediate_size`` in every layer; the top-k weights
  always renormalized; tensors under ``block_sparse_moe`` with experts' ``w1``/``w3``/``w2``.
- ``OlmoeForCausalLM``: RMSNorm over the whole q and the whole k projection (before the heads
  are split: ``qk_norm_scope="projection"``); experts of ``intermediate_size``.
- ``Qwen2MoeForCausalLM``: q/k/v biases (``qkv_bias``); a shared expert of
  ``shared_expert_intermediate_size`` every token goes through, times a sigmoid gate;
  dense layers as Qwen3-MoE's.

The expert count is read from ``num_local_experts`` or ``num_experts`` (transformers 5 writes
the first for Qwen3-MoE and Mixtral, older folders the second). ``norm_topk_prob`` is read
where the family has it (``False`` when absent, transformers' default); Mixtral always
renormalizes. The load-balancing weight ``router_aux_loss`` is the folder's
``router_aux_loss_coef`` (``router_z_loss`` its ``router_z_loss_coef`` where present) unless
the caller sets it. Refused by name: OLMoE's ``clip_qkv``, a Mixtral
``router_jitter_noise`` above 0, ``attention_bias`` where it would bias ``o_proj`` too.

Expert weights come in two layouts. Per expert, as ``save_pretrained`` writes them:
``mlp.experts.{e}.gate_proj.weight`` (``up_proj``) ``[f, d]`` and ``down_proj`` ``[d, f]``
(Mixtral: ``block_sparse_moe.experts.{e}.w1`` / ``w3`` / ``w2``), transposed and stacked
into the ``[E, …]`` leaves. Fused, as transformers 5 keeps them in memory:
``mlp.experts.gate_up_proj`` ``[E, 2f, d]`` (each expert's gate rows, then its up rows: the
modeling code's ``chunk(2, dim=-1)``) and ``mlp.experts.down_proj`` ``[E, d, f]``. Both are
read; an export writes per expert, which every transformers version loads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from jaxstep.errors import ConfigError
from jaxstep.models import hf_dense
from jaxstep.models.hf_fields import integer, real

EXPERT_KEYS = ("num_local_experts", "num_experts")
MIXTRAL = "MixtralForCausalLM"


@dataclasses.dataclass(frozen=True)
class Family:
  """What an MoE architecture's config and modeling code fix."""

  model_type: str
  experts_key: str  # the key transformers 5 writes the expert count under
  aux_loss: float  # transformers' router_aux_loss_coef default
  qk_norm: str = ""  # "" (none), "head" or "projection": jaxstep's qk_norm_scope
  sparse_steps: bool = False  # moe_intermediate_size, decoder_sparse_step, mlp_only_layers
  shared_expert: bool = False  # Qwen2-MoE's gated shared expert
  norm_topk_key: bool = True  # reads norm_topk_prob (Mixtral: always renormalized)
  bias_key: str = ""  # the key of q/k/v biases without an o_proj bias (Qwen2-MoE: qkv_bias)
  default_theta: float = 10000.0


ARCHITECTURES = {
  "Qwen3MoeForCausalLM": Family(
    "qwen3_moe", "num_local_experts", 0.001, qk_norm="head", sparse_steps=True
  ),
  MIXTRAL: Family(
    "mixtral", "num_local_experts", 0.001, norm_topk_key=False, default_theta=1_000_000.0
  ),
  "OlmoeForCausalLM": Family("olmoe", "num_experts", 0.01, qk_norm="projection"),
  "Qwen2MoeForCausalLM": Family(
    "qwen2_moe",
    "num_experts",
    0.001,
    sparse_steps=True,
    shared_expert=True,
    bias_key="qkv_bias",
  ),
}


def config_fields(hf: dict, name: str, where: str) -> dict:
  """The ``LlamaConfig`` fields of architecture ``name``'s ``config.json`` beyond the Llama
  shape: attention biases and q/k norms, and every mixture-of-experts field."""
  fam = ARCHITECTURES[name]
  _refuse(hf, name, where)
  experts = _expert_count(hf, where)
  fields = {
    "attention_bias": bool(hf.get(fam.bias_key, True)) if fam.bias_key else False,
    "qk_norm": bool(fam.qk_norm),
    "qk_norm_scope": fam.qk_norm or "head",
    "num_experts": experts,
    "experts_per_token": integer(hf, "num_experts_per_tok", where),
    "router_scores": "softmax",
    "norm_topk": bool(hf.get("norm_topk_prob", False)) if fam.norm_topk_key else True,
    "router_aux_loss": real(hf, "router_aux_loss_coef", where, fam.aux_loss),
  }
  if hf.get("router_z_loss_coef") is not None:
    fields["router_z_loss"] = real(hf, "router_z_loss_coef", where)
  if fam.sparse_steps:
    fields["moe_intermediate_size"] = integer(hf, "moe_intermediate_size", where)
    fields["moe_every"] = integer(hf, "decoder_sparse_step", where, 1)
    fields["dense_layers"] = _layer_list(hf, "mlp_only_layers", where)
  if fam.shared_expert:
    width = integer(hf, "shared_expert_intermediate_size", where)
    if width <= 0:
      raise ConfigError(f"{where}: shared_expert_intermediate_size must be > 0, got {width}")
    fields |= {"shared_experts": 1, "shared_expert_size": width, "shared_expert_gate": True}
  return fields


def _refuse(hf: dict, name: str, where: str) -> None:
  """``ConfigError`` for a setting of ``name``'s that this model does not compute."""
  fam = ARCHITECTURES[name]
  if not fam.bias_key and name != MIXTRAL and hf.get("attention_bias"):
    raise ConfigError(
      f"{where}: attention_bias=true is not supported for {name} (it biases o_proj too)"
    )
  if hf.get("clip_qkv") is not None:
    raise ConfigError(
      f"{where}: clip_qkv={hf['clip_qkv']} is not supported for {name} (q/k/v clipping)"
    )
  jitter = real(hf, "router_jitter_noise", where, 0.0)
  if jitter > 0:
    raise ConfigError(
      f"{where}: router_jitter_noise={jitter} is not supported for {name} (the router's "
      f"inputs are not jittered): set it to 0"
    )
  if fam.qk_norm == "projection":  # q_norm is hidden_size wide: heads must tile it
    d, h = integer(hf, "hidden_size", where), integer(hf, "num_attention_heads", where)
    head_dim = integer(hf, "head_dim", where, 0) or d // max(h, 1)
    if h <= 0 or d % h or head_dim * h != d:
      raise ConfigError(
        f"{where}: {name} needs head_dim × num_attention_heads = hidden_size "
        f"(its q norm is hidden_size wide), got head_dim {head_dim}, {h} heads, hidden {d}"
      )


def _expert_count(hf: dict, where: str) -> int:
  """``num_local_experts`` or ``num_experts``; both, unequal: ambiguous, refused."""
  given = {k: integer(hf, k, where) for k in EXPERT_KEYS if hf.get(k) is not None}
  if not given:
    raise ConfigError(f"{where} has no {' or '.join(map(repr, EXPERT_KEYS))}")
  if len(set(given.values())) > 1:
    raise ConfigError(
      f"{where}: num_local_experts {given['num_local_experts']} and num_experts "
      f"{given['num_experts']} disagree"
    )
  count = next(iter(given.values()))
  if count < 1:
    raise ConfigError(f"{where}: the expert count must be >= 1, got {count}")
  return count


def _layer_list(hf: dict, key: str, where: str) -> tuple[int, ...]:
  value = hf.get(key) or []
  if not isinstance(value, list) or not all(
    isinstance(i, int) and not isinstance(i, bool) for i in value
  ):
    raise ConfigError(f"{where}: {key!r} must be a list of layer indices, got {value!r}")
  return tuple(value)


def mlp_names(cfg, i: int, names=(), architecture: str | None = None) -> Iterator[tuple]:
  """``(params path, HF tensor name, transposed)`` for the MoE MLP of block ``i``.

  ``names``: the folder's tensor names, whose spelling is followed (``block_sparse_moe`` or
  ``mlp``; per-expert or fused experts); without them, the per-expert layout
  ``architecture`` saves (Mixtral's ``w1``/``w3``/``w2``, else ``gate_proj``/…). A per-expert
  tensor's path ends with the expert's index: it is that slice ``[e]`` of the stacked leaf.
  Entries that share one tensor name split it in equal parts along each expert's rows, in
  their order: a fused ``gate_up_proj`` gives ``gate_proj`` its first half, ``up_proj`` the
  second. ``transposed``: each expert's ``[out, in]`` matrix turned to ``[in, out]``."""
  layer, ours = f"model.layers.{i}.", ("blocks", i, "mlp")
  if names:
    sparse = f"{layer}block_sparse_moe.gate.weight" in names
  else:
    sparse = architecture == MIXTRAL
  hf = f"{layer}block_sparse_moe." if sparse else f"{layer}mlp."
  yield (*ours, "router", "kernel"), f"{hf}gate.weight", True
  if f"{hf}experts.gate_up_proj" in names:
    yield (*ours, "experts", "gate_proj"), f"{hf}experts.gate_up_proj", True
    yield (*ours, "experts", "up_proj"), f"{hf}experts.gate_up_proj", True
    yield (*ours, "experts", "down_proj"), f"{hf}experts.down_proj", True
  else:
    w_names = f"{hf}experts.0.w1.weight" in names if names else architecture == MIXTRAL
    spelled = dict(zip(("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"), strict=True))
    for leaf in ("gate_proj", "up_proj", "down_proj"):
      theirs = spelled[leaf] if w_names else leaf
      for e in range(cfg.num_experts):
        yield (*ours, "experts", leaf, e), f"{hf}experts.{e}.{theirs}.weight", True
  if cfg.shared_width:
    for p in ("gate_proj", "up_proj", "down_proj"):
      yield (*ours, "shared_expert", p, "kernel"), f"{hf}shared_expert.{p}.weight", True
  if cfg.shared_expert_gate:
    yield (*ours, "shared_expert_gate", "kernel"), f"{hf}shared_expert_gate.weight", True


def mlp_shape(cfg, path: tuple) -> tuple | None:
  """The shape of an MoE MLP's leaf at ``path`` (``mlp_names``' paths; an expert's slice
  without the leading expert axis); None for a path outside an MoE MLP."""
  if len(path) < 4 or path[2] != "mlp":
    return None
  d, e, f, s = cfg.d_model, cfg.num_experts, cfg.expert_size, cfg.shared_width
  part = path[3]
  if part == "router":
    return (d, e)
  if part == "shared_expert_gate":
    return (d, 1)
  if part == "shared_expert":
    return (s, d) if path[4] == "down_proj" else (d, s)
  one = (f, d) if path[4] == "down_proj" else (d, f)
  return one if len(path) > 5 else (e, *one)


def architecture_for(cfg) -> str:
  """The MoE architecture a model trained from scratch exports as: OLMoE for norms over the
  whole q/k projections, Qwen3-MoE for per-head ones, Qwen2-MoE for a shared expert or
  q/k/v biases, Mixtral otherwise (``check_export`` then says what does not fit)."""
  if cfg.qk_norm:
    return "OlmoeForCausalLM" if cfg.qk_norm_scope == "projection" else "Qwen3MoeForCausalLM"
  if cfg.shared_width or cfg.attention_bias:
    return "Qwen2MoeForCausalLM"
  return MIXTRAL


def needs_moe_architecture(cfg) -> bool:
  """Whether only one of these architectures holds ``cfg``'s model: it has experts, or q/k
  norms over the whole projection in pre-norm blocks (OLMoE's; OLMo 2's blocks norm their
  outputs)."""
  whole_qk = cfg.qk_norm and cfg.qk_norm_scope == "projection"
  return bool(cfg.num_experts) or (whole_qk and cfg.block_norms == "pre")


def check_export(cfg, architecture: str) -> None:
  """``ConfigError`` naming the first setting of ``cfg``'s model that ``architecture`` (one
  of these, or a dense one for a model that ``needs_moe_architecture``) cannot hold:
  transformers would build another model than the one written."""
  if architecture not in ARCHITECTURES:
    what = "experts" if cfg.num_experts else "q/k norms over the whole projection"
    raise ConfigError(
      f"{architecture} cannot hold this model's {what}: export it as one of "
      f"{', '.join(ARCHITECTURES)}"
    )
  fam = ARCHITECTURES[architecture]
  dense = [i for i, moe in enumerate(cfg.moe_layers) if not moe]
  problems = [
    (not cfg.num_experts, "it has no experts (model.num_experts=0)"),
    (cfg.router_scores != "softmax", f"router_scores={cfg.router_scores!r} (softmax only)"),
    (
      cfg.qk_norm != bool(fam.qk_norm) or (cfg.qk_norm and cfg.qk_norm_scope != fam.qk_norm),
      f"q/k norms {cfg.qk_norm_scope if cfg.qk_norm else 'none'} (it has {fam.qk_norm or 'none'})",
    ),
    (cfg.attention_bias and not fam.bias_key, "q/k/v biases (it has none)"),
    (cfg.block_norms != "pre", f"block_norms={cfg.block_norms} (it norms each branch's input)"),
    (bool(hf_dense.scaled(cfg)), f"multipliers {hf_dense.scaled(cfg)} (it has none)"),
    (bool(cfg.nope_layers), f"nope_layers {list(cfg.nope_layers)} (it rotates every layer)"),
    (cfg.partial_rotary_factor != 1, f"partial_rotary_factor {cfg.partial_rotary_factor}"),
    (bool(cfg.sliding_window), f"sliding_window {cfg.sliding_window}"),
    (bool(cfg.norm_offset), f"norm_offset {cfg.norm_offset} (Gemma's norms)"),
    (cfg.mlp_activation != "silu", f"mlp_activation {cfg.mlp_activation}"),
    (cfg.scale_embeddings, "scale_embeddings (Gemma's)"),
    (bool(cfg.query_pre_attn_scalar), f"query_pre_attn_scalar {cfg.query_pre_attn_scalar}"),
    (bool(cfg.local_rope_theta), f"local_rope_theta {cfg.local_rope_theta}"),
    (bool(cfg.attn_logit_softcapping or cfg.final_logit_softcapping), "soft-capping (Gemma 2's)"),
    (
      fam.shared_expert != bool(cfg.shared_width) or fam.shared_expert != cfg.shared_expert_gate,
      "a gated shared expert"
      + (" missing (it always has one)" if fam.shared_expert else " (it has none)"),
    ),
    (not fam.norm_topk_key and not cfg.norm_topk, "norm_topk=false (it always renormalizes)"),
    (not fam.sparse_steps and bool(dense), f"dense layers {dense} (every layer is MoE)"),
    (
      not fam.sparse_steps and cfg.expert_size != cfg.intermediate_size,
      f"experts {cfg.expert_size} wide, not intermediate_size {cfg.intermediate_size}",
    ),
    (
      fam.qk_norm == "projection" and cfg.n_heads * cfg.resolved_head_dim != cfg.d_model,
      "n_heads × head_dim other than d_model",
    ),
  ]
  for failed, what in problems:
    if failed:
      raise ConfigError(f"{architecture} cannot hold this model: {what}")


def export_fields(cfg, architecture: str, hf: dict, *, fresh: bool) -> dict:
  """The ``config.json`` fields of ``cfg``'s MoE layers for ``architecture`` (``hf``: the
  config being written, for the keys a base spells its own way)."""
  fam = ARCHITECTURES[architecture]
  out = {
    fam.experts_key: cfg.num_experts,
    "num_experts_per_tok": cfg.experts_per_token,
    "router_aux_loss_coef": float(cfg.router_aux_loss),
  }
  for key in EXPERT_KEYS:  # a base's other spelling, or both for older readers
    if key in hf or (fresh and fam.sparse_steps):
      out[key] = cfg.num_experts
  if fam.norm_topk_key:
    out["norm_topk_prob"] = bool(cfg.norm_topk)
  if fam.sparse_steps:
    out["moe_intermediate_size"] = cfg.expert_size
    out["decoder_sparse_step"] = cfg.moe_every
    out["mlp_only_layers"] = list(cfg.dense_layers)
  if fam.shared_expert:
    out["shared_expert_intermediate_size"] = cfg.shared_width
  if fam.bias_key:
    out[fam.bias_key] = bool(cfg.attention_bias)
  if "router_z_loss_coef" in hf:
    out["router_z_loss_coef"] = float(cfg.router_z_loss)
  if architecture == MIXTRAL:
    out["router_jitter_noise"] = 0.0
  if architecture == "OlmoeForCausalLM":
    out["clip_qkv"] = None
  return out
