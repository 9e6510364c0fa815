"""Hugging Face interop against ``transformers`` + PyTorch (CPU, benchmark-only): loading a
model folder (``hf_load``), fine-tuning a Llama, decoding a Llama.

- Fine-tuning: ``TRAIN_MODEL`` (d 256, 4 layers, 4 / 2 heads, SwiGLU 688, vocabulary 8,192,
  256 tokens), global batch 32 × 256 in K=8 micro-steps, AdamW + clip 1.0, fp32: jaxstep's
  train step (``step_bench``'s ``jaxstep`` contender, CPU defaults) against transformers'
  ``LlamaForCausalLM`` with the same math (``torch_bench``'s ``torch_llama``: eager and
  ``torch.compile``).
- Decode: the same Llama shape (512 positions), prompts of 64 random ids, 256 new tokens
  greedily, EOS never chosen: ``jaxstep.Generator`` (key/value cache, one CPU device) against
  ``LlamaForCausalLM.generate(use_cache=True)`` (all cores), 1 and 8 prompts.
"""

from __future__ import annotations

import json
import os
import time

from benchmarks.hf_load import (
  FOLDER,
  QUICK_FOLDER,
  folder_info,
  folder_path,
  fresh_rounds,
  in_fresh_process,
  load_results,
)

# jaxstep model keys (``model.family=llama``) of the fine-tuning and decode comparisons
TRAIN_MODEL = {
  "family": "llama",
  "vocab_size": 8192,
  "max_seq_len": 256,
  "d_model": 256,
  "n_layers": 4,
  "n_heads": 4,
  "n_kv_heads": 2,
  "intermediate_size": 688,
  "tie_embeddings": False,
}
QUICK_TRAIN_MODEL = {
  **TRAIN_MODEL,
  "vocab_size": 512,
  "max_seq_len": 32,
  "d_model": 32,
  "n_layers": 1,
  "n_heads": 2,
  "n_kv_heads": 1,
  "intermediate_size": 64,
}


def hf_llama_kwargs(model: dict) -> dict:
  """``transformers.LlamaConfig`` keyword arguments of a jaxstep Llama model dict."""
  return {
    "vocab_size": model["vocab_size"],
    "hidden_size": model["d_model"],
    "intermediate_size": model["intermediate_size"],
    "num_hidden_layers": model["n_layers"],
    "num_attention_heads": model["n_heads"],
    "num_key_value_heads": model.get("n_kv_heads") or model["n_heads"],
    "max_position_embeddings": model["max_seq_len"],
    "tie_word_embeddings": model["tie_embeddings"],
    "rms_norm_eps": 1e-6,
    "attention_dropout": 0.0,
  }


def jax_llama_config(model: dict):
  from jaxstep import models

  return models.LlamaConfig(**{k: v for k, v in model.items() if k != "family"})


# ---------------------------------------------------------------------------- decoding


def decode_jax(spec: dict):
  """Worker: ``jaxstep.Generator`` with the key/value cache, greedy, EOS never chosen."""
  from benchmarks.generate_bench import timed_jax_decode

  cfg = jax_llama_config(spec["model"])
  # every id of the model may be chosen, as in transformers
  return timed_jax_decode(cfg, spec, vocab_size=cfg.vocab_size)


def decode_hf(spec: dict):
  """Worker: ``LlamaForCausalLM.generate(use_cache=True)``, greedy, the same shapes."""
  import torch
  from transformers import LlamaConfig, LlamaForCausalLM

  from benchmarks.generate_bench import timed_hf_generate

  torch.manual_seed(0)
  config = LlamaConfig(**hf_llama_kwargs(spec["model"]), bos_token_id=257, eos_token_id=258)
  return timed_hf_generate(LlamaForCausalLM(config).eval(), spec)


CONTENDERS = {
  "llama_decode_jax": decode_jax,
  "llama_decode_hf": decode_hf,
}


# ---------------------------------------------------------------------------- the suite


def _load_then_measure(path: str, load_rounds: int, specs: dict, rounds: int, overlap: bool):
  """``fresh_rounds`` of the loads, then ``harness.measure`` of ``specs``; ``overlap``: the
  loads run while the workers of ``specs`` build."""
  from benchmarks.harness import measure

  loads = {}

  def load():
    loads["load"] = fresh_rounds(path, load_rounds)

  if not overlap:
    load()
  res, info, failed = measure(specs, rounds, while_building=load if overlap else None)
  return loads["load"], res, info, failed


def _skipped(why: str) -> dict:
  return {"skipped": why, "summary": {}, "rows": [("hf suite", f"skipped: {why}", "")]}


def suite_hf(quick: bool) -> dict:
  """Load time and peak RSS of a Hugging Face Llama folder, fine-tuning tokens/s and decode
  tokens/s, each against transformers + PyTorch on the same shapes."""
  import importlib.util

  from benchmarks.harness import fmt, ratio_stats

  if not (importlib.util.find_spec("torch") and importlib.util.find_spec("transformers")):
    return _skipped("torch and transformers are not installed")
  shape = QUICK_FOLDER if quick else FOLDER
  model, g, k = (QUICK_TRAIN_MODEL, 8, 2) if quick else (TRAIN_MODEL, 32, 8)
  new, prompt_len = (8, 8) if quick else (256, 64)
  batches = (8,) if quick else (1, 8)
  load_rounds, rounds = (1, 1) if quick else (5, 10)

  phase_s, t, loadavg = {}, time.perf_counter(), [os.getloadavg()]
  kept = folder_path(shape)
  if (kept / "complete").is_file():
    folder = folder_info(kept)
  else:  # torch is imported only in processes of its own
    folder = in_fresh_process("folder", json.dumps(shape))
  phase_s["folder"] = time.perf_counter() - t

  base = {"model": model, "g": g, "k": k}
  specs = {"jaxstep": {**base, "kind": "jaxstep"}, "torch_eager": {**base, "kind": "torch_llama"}}
  if not quick:  # compile starts slowly
    specs["torch_compile"] = {**base, "kind": "torch_llama", "compile": True}
  torch_names = [n for n in specs if n.startswith("torch")]
  decode_model = {**model, "max_seq_len": 512 if not quick else 64}
  for b in batches:
    spec = {"model": decode_model, "batch": b, "new_tokens": new, "prompt_len": prompt_len}
    specs[f"decode_jax_b{b}"] = {**spec, "kind": "llama_decode_jax"}
    specs[f"decode_hf_b{b}"] = {**spec, "kind": "llama_decode_hf"}
  # The loads run alone; quick (a smoke run, whose numbers are not measurements) runs them
  # while the other workers build, to be done sooner.
  load, res, info, failed = _load_then_measure(folder["path"], load_rounds, specs, rounds, quick)
  phase_s["load_train_decode"] = time.perf_counter() - phase_s["folder"] - t
  loadavg.append(os.getloadavg())  # others' work on these cores, before and after

  out = {
    "folder": {**folder, "shape": shape},
    "train": {**base, "seq_len": model["max_seq_len"]},
    "decode": {"model": decode_model, "new_tokens": new, "prompt_len": prompt_len},
    "raw": {"load": load, **res},
    "info": info,
    "failed": failed,
    "phase_s": phase_s,
    "loadavg_before_after": loadavg,
  }
  # loading
  load_out, rows, summary = load_results(load, folder)
  out.update(load_out)

  # fine-tuning
  sec = {n: [r["seconds"] for r in rounds_] for n, rounds_ in res.items()}
  live_torch = [n for n in torch_names if n in sec]
  tokens = g * model["max_seq_len"]
  shape_txt = (
    f"d {model['d_model']}, {model['n_layers']} layers, vocab {model['vocab_size']}, "
    f"G={g} × {model['max_seq_len']}, K={k}"
  )
  if "jaxstep" in sec and live_torch:
    best = [min(vals) for vals in zip(*(sec[n] for n in live_torch), strict=True)]
    out["llama_tokens_vs_pytorch"] = ratio_stats(best, sec["jaxstep"])
    out["llama_tokens_per_s"] = ratio_stats([tokens / s for s in sec["jaxstep"]], 1)
    for n in live_torch:
      out[f"llama_tokens_vs_{n}"] = ratio_stats(sec[n], sec["jaxstep"])
      rows.append(
        (
          f"Llama fine-tuning tokens/s ÷ transformers LlamaForCausalLM, {n[6:]}",
          fmt(out[f"llama_tokens_vs_{n}"]),
          "",
        )
      )
    rows.append(
      (
        f"Llama fine-tuning tokens/s ÷ fastest PyTorch each round ({shape_txt}; jaxstep "
        f"{out['llama_tokens_per_s']['median']:,.0f} tokens/s)",
        fmt(out["llama_tokens_vs_pytorch"]),
        "≥ 1.3",
      )
    )
    summary["llama_tokens_vs_pytorch"] = out["llama_tokens_vs_pytorch"]["median"]

  # decoding
  rate = {
    n: [r["new_tokens_per_s"] for r in rounds_]
    for n, rounds_ in res.items()
    if n.startswith("decode")
  }
  for b in batches:
    jax_name, hf_name = f"decode_jax_b{b}", f"decode_hf_b{b}"
    if jax_name in rate and hf_name in rate:
      vs = ratio_stats(rate[jax_name], rate[hf_name])
      out[f"llama_decode_vs_hf_b{b}"] = vs
      summary[f"llama_decode_vs_hf_b{b}"] = vs["median"]
      tps = {n: ratio_stats(rate[n], 1)["median"] for n in (jax_name, hf_name)}
      rows.append(
        (
          f"Llama new tokens/s ÷ transformers generate ({b} prompt(s) of {prompt_len}, {new} new; "
          f"{tps[jax_name]:,.0f} vs {tps[hf_name]:,.0f} tokens/s)",
          fmt(vs),
          "≥ 1.5",
        )
      )
  per_b = [
    summary[f"llama_decode_vs_hf_b{b}"] for b in batches if f"llama_decode_vs_hf_b{b}" in summary
  ]
  if per_b:
    summary["llama_decode_vs_hf"] = min(per_b)
  for name in failed:
    rows.append((name, "did not run here (see `failed` in hf.json)", ""))
  return {**out, "summary": summary, "rows": rows}
