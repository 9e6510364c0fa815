"""The dense families' own pieces (CPU): a Gemma-3-1B-shaped train step against
transformers, and sliding-window decoding against a full cache.

- ``gemma_tokens_vs_pytorch``: ``GEMMA_MODEL`` keeps Gemma 3 1B's proportions at a CPU
  width (d 256, 6 blocks — 5 local with a 128-key window and RoPE base 10,000, 1 global
  with base 1,000,000 —, 4 query heads on 1 key/value head of 64, q/k norms, GeGLU of
  1,024, the ``1 + w`` norms before and after each branch, √d-scaled tied embeddings,
  vocabulary 8,192, 256 tokens); global batch 16 × 256 in K = 4 micro-steps, AdamW, fp32.
  jaxstep's train step as ``python -m jaxstep.train`` builds it against transformers'
  ``Gemma3ForCausalLM`` of the same config (eager PyTorch on every core, SDPA attention,
  the same K micro-batches and AdamW: ``torch_bench``'s update loop).
- ``sliding_window_decode_over_full``: greedy decoding with the key/value cache of
  ``hf_bench``'s Llama shape (d 256, 4 blocks, 512 positions) to 4 × a 64-key window (64
  prompt ids, 192 new), windowed ÷ the same model attending to every key: new tokens/s.
  The window's cache is full-length and masked (not a rolling one), so the ratio is what
  the mask costs or saves at that length.
"""

from __future__ import annotations

GEMMA_MODEL = {
  "family": "llama",
  "vocab_size": 8192,
  "max_seq_len": 256,
  "d_model": 256,
  "n_layers": 6,
  "n_heads": 4,
  "n_kv_heads": 1,
  "head_dim": 64,
  "intermediate_size": 1024,
  "qk_norm": True,
  "block_norms": "both",
  "norm_offset": 1.0,
  "mlp_activation": "gelu_tanh",
  "scale_embeddings": True,
  "query_pre_attn_scalar": 64,
  "rope_theta": 1000000.0,
  "local_rope_theta": 10000.0,
  "sliding_window": 128,
  "full_layers": [5],
  "tie_embeddings": True,
}
QUICK_GEMMA_MODEL = {
  **GEMMA_MODEL,
  "vocab_size": 512,
  "max_seq_len": 32,
  "d_model": 32,
  "n_layers": 2,
  "n_heads": 2,
  "head_dim": 16,
  "intermediate_size": 64,
  "query_pre_attn_scalar": 16,
  "sliding_window": 8,
  "full_layers": [1],
}


def hf_gemma3_kwargs(model: dict) -> dict:
  """``transformers.Gemma3TextConfig`` keyword arguments of a jaxstep Gemma model dict."""
  n = model["n_layers"]
  types = ["full_attention" if i in model["full_layers"] else "sliding_attention" for i in range(n)]
  return {
    "vocab_size": model["vocab_size"],
    "hidden_size": model["d_model"],
    "intermediate_size": model["intermediate_size"],
    "num_hidden_layers": n,
    "num_attention_heads": model["n_heads"],
    "num_key_value_heads": model["n_kv_heads"],
    "head_dim": model["head_dim"],
    "query_pre_attn_scalar": model["query_pre_attn_scalar"],
    "sliding_window": model["sliding_window"],
    "layer_types": types,
    "rope_parameters": {
      "full_attention": {"rope_type": "default", "rope_theta": model["rope_theta"]},
      "sliding_attention": {"rope_type": "default", "rope_theta": model["local_rope_theta"]},
    },
    "max_position_embeddings": model["max_seq_len"],
    "tie_word_embeddings": model["tie_embeddings"],
    "rms_norm_eps": 1e-6,
    "attention_dropout": 0.0,
  }


def torch_gemma_contender(spec):
  """transformers' ``Gemma3ForCausalLM`` in ``torch_bench``'s update loop."""
  from transformers import Gemma3ForCausalLM, Gemma3TextConfig

  from benchmarks.torch_bench import transformers_contender

  return transformers_contender(
    spec, lambda: Gemma3ForCausalLM(Gemma3TextConfig(**hf_gemma3_kwargs(spec["model"])))
  )


CONTENDERS = {"torch_gemma": torch_gemma_contender}


def _jaxstep_model(model: dict) -> dict:
  """``model`` with its lists spelled as the config's command line reads them."""
  return {
    k: (f"[{', '.join(map(str, v))}]" if isinstance(v, list) else v) for k, v in model.items()
  }


def suite_families(quick: bool) -> dict:
  """``gemma_tokens_vs_pytorch`` and ``sliding_window_decode_over_full``."""
  import importlib.util

  from benchmarks.harness import fmt, measure, ratio_stats
  from benchmarks.hf_bench import QUICK_TRAIN_MODEL, TRAIN_MODEL

  model, g, k = (QUICK_GEMMA_MODEL, 8, 2) if quick else (GEMMA_MODEL, 16, 4)
  rounds = 1 if quick else 7
  window, prompt, new = (4, 4, 12) if quick else (64, 64, 192)
  decode_model = {**(QUICK_TRAIN_MODEL if quick else TRAIN_MODEL), "max_seq_len": 4 * window}
  decode = {"batch": 1, "new_tokens": new, "prompt_len": prompt, "kind": "llama_decode_jax"}
  specs = {
    "gemma_jaxstep": {"g": g, "k": k, "kind": "jaxstep", "model": _jaxstep_model(model)},
    "decode_window": {**decode, "model": {**decode_model, "sliding_window": window}},
    "decode_full": {**decode, "model": decode_model},
  }
  if importlib.util.find_spec("torch") and importlib.util.find_spec("transformers"):
    specs["gemma_torch"] = {"g": g, "k": k, "kind": "torch_gemma", "model": model}
  res, info, failed = measure(specs, rounds)
  out = {"model": model, "g": g, "k": k, "raw": res, "info": info, "failed": failed}
  rows, summary = [], {}
  sec = {n: [r["seconds"] for r in rounds_] for n, rounds_ in res.items()}
  if "gemma_torch" in sec and "gemma_jaxstep" in sec:
    out["gemma_tokens_vs_pytorch"] = ratio_stats(sec["gemma_torch"], sec["gemma_jaxstep"])
    shape = (
      f"d {model['d_model']}, {model['n_layers']} blocks, G={g} × {model['max_seq_len']}, K={k}"
    )
    rows.append(
      (f"Gemma-3-shaped step tokens/s ÷ transformers ({shape})",
       fmt(out["gemma_tokens_vs_pytorch"]), "≥ 1.2")
    )  # fmt: skip
    summary["gemma_tokens_vs_pytorch"] = out["gemma_tokens_vs_pytorch"]["median"]
  rate = {
    n: [r["new_tokens_per_s"] for r in res[n]] for n in ("decode_window", "decode_full") if n in res
  }
  if len(rate) == 2:
    out["sliding_window_decode_over_full"] = ratio_stats(rate["decode_window"], rate["decode_full"])
    rows.append(
      (f"decode to 4 × a {window}-key window: new tokens/s ÷ full attention",
       fmt(out["sliding_window_decode_over_full"]), "record")
    )  # fmt: skip
    summary["sliding_window_decode_over_full"] = out["sliding_window_decode_over_full"]["median"]
  return {**out, "rows": rows, "summary": summary}
