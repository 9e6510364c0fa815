"""Mixture-of-experts train steps (CPU): against transformers' Qwen3-MoE, against a dense
model with the same active parameters, and the exact global load-balancing loss against the
per-micro-batch one.

``MOE_MODEL`` is Qwen3-MoE-shaped (per-head q/k norms, 16 experts of width 128, top-4,
renormalized, every layer sparse): d 256, 4 layers, vocabulary 8,192, 256 tokens; global
batch 16 × 256 in K = 4 micro-steps, AdamW, fp32. Contenders, interleaved round by round:

- ``moe_global``: jaxstep's train step as ``python -m jaxstep.train`` builds it, with the
  default ``lbl_scope: global`` (a forward-only routing pass first, since K > 1);
- ``moe_micro``: the same with ``lbl_scope: micro_batch`` (no routing pass);
- ``dense_active``: the same model with a dense SwiGLU of width k × 128 in place of each MoE
  layer: the same active parameters per token, no routing, sorting or router;
- ``torch_moe``: transformers' ``Qwen3MoeForCausalLM`` of the same config (its expert loop
  over the experts hit), eager PyTorch on every core, the same K micro-batches and AdamW.
  transformers adds no router loss unless ``output_router_logits``; jaxstep's step computes
  its LBL and z-loss, so the comparison charges jaxstep for them.
"""

from __future__ import annotations

MOE_MODEL = {
  "family": "llama",
  "vocab_size": 8192,
  "max_seq_len": 256,
  "d_model": 256,
  "n_layers": 4,
  "n_heads": 4,
  "n_kv_heads": 2,
  "head_dim": 64,
  "qk_norm": True,
  "intermediate_size": 688,
  "num_experts": 16,
  "experts_per_token": 4,
  "moe_intermediate_size": 128,
  "tie_embeddings": False,
}
QUICK_MOE_MODEL = {
  **MOE_MODEL,
  "vocab_size": 512,
  "max_seq_len": 32,
  "d_model": 32,
  "n_layers": 1,
  "n_heads": 2,
  "n_kv_heads": 1,
  "head_dim": 16,
  "intermediate_size": 64,
  "num_experts": 4,
  "experts_per_token": 2,
  "moe_intermediate_size": 16,
}


def dense_active(model: dict) -> dict:
  """The dense model with ``model``'s active parameters: each MoE layer's top-k experts as
  one SwiGLU of their total width."""
  dense = {k: v for k, v in model.items() if k not in ("num_experts", "experts_per_token")}
  dense["intermediate_size"] = model["experts_per_token"] * model["moe_intermediate_size"]
  dense.pop("moe_intermediate_size")
  return dense


def hf_qwen3_moe_kwargs(model: dict) -> dict:
  """``transformers.Qwen3MoeConfig`` keyword arguments of a jaxstep MoE model dict."""
  return {
    "vocab_size": model["vocab_size"],
    "hidden_size": model["d_model"],
    "intermediate_size": model["intermediate_size"],
    "moe_intermediate_size": model["moe_intermediate_size"],
    "num_experts": model["num_experts"],
    "num_experts_per_tok": model["experts_per_token"],
    "norm_topk_prob": True,
    "num_hidden_layers": model["n_layers"],
    "num_attention_heads": model["n_heads"],
    "num_key_value_heads": model["n_kv_heads"],
    "head_dim": model["head_dim"],
    "max_position_embeddings": model["max_seq_len"],
    "tie_word_embeddings": model["tie_embeddings"],
    "rms_norm_eps": 1e-6,
    "attention_dropout": 0.0,
  }


def torch_moe_contender(spec):
  """transformers' ``Qwen3MoeForCausalLM`` in ``torch_bench``'s update loop."""
  from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

  from benchmarks.torch_bench import transformers_contender

  return transformers_contender(
    spec, lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(**hf_qwen3_moe_kwargs(spec["model"])))
  )


CONTENDERS = {"torch_moe": torch_moe_contender}


def suite_moe(quick: bool) -> dict:
  """Step time of an MoE model against transformers, against its dense-active twin, and
  with the global against the micro-batch LBL (``moe_*`` summary keys)."""
  import importlib.util

  from benchmarks.harness import fmt, measure, ratio_stats

  model, g, k = (QUICK_MOE_MODEL, 8, 2) if quick else (MOE_MODEL, 16, 4)
  rounds = 1 if quick else 10
  base = {"g": g, "k": k, "kind": "jaxstep"}
  specs = {
    "moe_global": {**base, "model": model},
    "moe_micro": {**base, "model": model, "overrides": ["model.lbl_scope=micro_batch"]},
    "dense_active": {**base, "model": dense_active(model)},
  }
  torch_ok = importlib.util.find_spec("torch") and importlib.util.find_spec("transformers")
  if torch_ok:
    specs["torch_moe"] = {"g": g, "k": k, "kind": "torch_moe", "model": model}
  res, info, failed = measure(specs, rounds)
  sec = {n: [r["seconds"] for r in rounds_] for n, rounds_ in res.items()}
  out = {"model": model, "g": g, "k": k, "raw": res, "info": info, "failed": failed}
  rows, summary = [], {}
  shape = (
    f"d {model['d_model']}, {model['n_layers']} layers, {model['num_experts']} experts "
    f"top-{model['experts_per_token']}, G={g} × {model['max_seq_len']}, K={k}"
  )
  pairs = {
    "moe_tokens_vs_pytorch": ("torch_moe", "moe_global", "≥ 1.3", "tokens/s ÷ transformers"),
    "moe_step_over_dense_active": ("moe_global", "dense_active", "≤ 1.5", "step ÷ dense-active"),
    "moe_global_lbl_step_over_micro": ("moe_global", "moe_micro", "≤ 1.35", "global ÷ micro LBL"),
  }
  for key, (num, den, target, what) in pairs.items():
    if num in sec and den in sec:
      out[key] = ratio_stats(sec[num], sec[den])
      rows.append((f"MoE step {what} ({shape})", fmt(out[key]), target))
      summary[key] = out[key]["median"]
  return {**out, "rows": rows, "summary": summary}
