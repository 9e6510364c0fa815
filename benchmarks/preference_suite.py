"""The ``preference`` suite: DPO's state, speed and peak RSS (``preference_bench`` says what
each contender times, ``preference_rss`` what each run is), its rows and headline keys.

Headline keys (goals in the rows): ``dpo_lora_state_over_sft_lora`` (≤ 1.05),
``dpo_tokens_vs_trl`` (≥ 1.3), ``dpo_precompute_step_over_sft`` (≤ 1.1),
``lora_sft_rss_vs_peft``, ``dpo_lora_rss_vs_trl`` and ``dpo_full_rss_vs_trl`` (≤ 1.0).
"""

from __future__ import annotations

import importlib.util
import json
import time

from benchmarks.preference_bench import (
  PAIR_MODEL,
  QUICK_PAIR_MODEL,
  pair_layout,
  pair_tokens,
  state_bytes,
)

LORA = ["model.lora.rank=8"]
DPO = ["preference.loss=dpo", "data.path=bundled:pairs"]


def _state_rows(quick: bool) -> tuple[dict, list, dict]:
  """LoRA DPO's state ÷ LoRA SFT's, and full fine-tuning DPO's (a frozen copy) ÷ SFT's."""
  states = {
    "sft_lora": state_bytes(LORA, quick),
    "dpo_lora": state_bytes([*LORA, *DPO], quick),
    "sft_full": state_bytes([], quick),
    "dpo_full": state_bytes(DPO, quick),
    "dpo_full_bf16_reference": state_bytes([*DPO, "preference.reference_dtype=bf16"], quick),
  }
  ratio = lambda a, b: states[a]["total"] / states[b]["total"]  # noqa: E731
  summary = {"dpo_lora_state_over_sft_lora": ratio("dpo_lora", "sft_lora")}
  mib = lambda name: f"{states[name]['total'] / 2**20:.1f} MiB"  # noqa: E731
  rows = [
    (
      "persistent state (params + Adam + model_state), LoRA DPO ÷ LoRA SFT (lora_bench's "
      f"124 M-param Llama, r=8, fp32 base; {mib('dpo_lora')} vs {mib('sft_lora')}: the "
      "reference is the base with the adapters off)",
      f"{summary['dpo_lora_state_over_sft_lora']:.3f}",
      "≤ 1.05",
    ),
    (
      f"the same, full fine-tuning DPO ÷ SFT (a frozen fp32 copy as the reference: "
      f"{mib('dpo_full')} vs {mib('sft_full')}) · its bf16 copy",
      f"{ratio('dpo_full', 'sft_full'):.3f} · {ratio('dpo_full_bf16_reference', 'sft_full'):.3f}",
      "",
    ),
  ]
  return states, rows, summary


def _speed_rows(quick: bool, with_trl: bool) -> tuple[dict, list, dict]:
  """DPO tokens/s against TRL's DPOTrainer, and DPO with precomputed reference log-probs
  against SFT on the same tokens, interleaved in one set of rounds."""
  from benchmarks.harness import fmt, measure, ratio_stats

  model, g, k = (QUICK_PAIR_MODEL, 4, 2) if quick else (PAIR_MODEL, 16, 2)
  base = {"model": model, "g": g, "k": k}
  specs = {
    "dpo_jaxstep": {**base, "kind": "dpo_jaxstep"},
    "dpo_precomputed": {**base, "kind": "core_step", "loss": "dpo_precomputed"},
    "sft": {**base, "kind": "core_step", "loss": "sft"},
  }
  if with_trl:
    specs["dpo_trl"] = {**base, "kind": "dpo_trl"}
  res, info, failed = measure(specs, rounds=1 if quick else 6)
  sec = {n: [r["seconds"] for r in runs] for n, runs in res.items()}
  seq = model["max_seq_len"]
  prompt, completion = pair_layout(seq)
  tokens = pair_tokens(g, seq)
  out = {"config": {**base, "prompt": prompt, "completion": completion, "pair_tokens": tokens}}
  out |= {"raw": res, "info": info, "failed": failed}
  rows, summary = [], {}
  shape = (
    f"d {model['d_model']}, {model['n_layers']} layers, vocab {model['vocab_size']}, fp32; "
    f"G={g} pairs of a {prompt}-token prompt and two {completion}-token completions, K={k}"
  )
  if "dpo_jaxstep" in sec and "dpo_trl" in sec:
    vs = ratio_stats(sec["dpo_trl"], sec["dpo_jaxstep"])
    rate = {n: ratio_stats([tokens / s for s in sec[n]], 1)["median"] for n in sec}
    out["dpo_tokens_vs_trl"] = vs
    summary["dpo_tokens_vs_trl"] = vs["median"]
    rows.append(
      (
        f"DPO tokens/s (prompt + chosen + rejected tokens), jaxstep's train step ÷ TRL "
        f"DPOTrainer training_step ×K + clip + AdamW, full fine-tuning with a separate frozen "
        f"reference ({shape}; {rate['dpo_jaxstep']:,.0f} vs {rate['dpo_trl']:,.0f} tokens/s)",
        fmt(vs),
        "≥ 1.3",
      )
    )
  if "dpo_precomputed" in sec and "sft" in sec:
    over = ratio_stats(sec["dpo_precomputed"], sec["sft"])
    out["dpo_precompute_step_over_sft"] = over
    summary["dpo_precompute_step_over_sft"] = over["median"]
    rows.append(
      (
        f"DPO step time with precomputed reference log-probs ÷ SFT step on the same tokens "
        f"({g} pairs vs {2 * g} sequences of {seq}, K={k}, one CPU device, full fine-tuning)",
        fmt(over),
        "≤ 1.1",
      )
    )
  for name in failed:
    rows.append((name, "did not run here (see `failed` in preference.json)", ""))
  return out, rows, summary


def _rss_rows(quick: bool) -> tuple[dict, list, dict]:
  """Peak RSS of whole LoRA runs (``preference_rss``), jaxstep ÷ PEFT and ÷ TRL."""
  from benchmarks.harness import ratio_stats
  from benchmarks.hf_load import folder_info, folder_path, in_fresh_process
  from benchmarks.preference_rss import FOLDER, JAX_VARIANTS, QUICK_FOLDER, STEPS, run_all

  shape = QUICK_FOLDER if quick else FOLDER
  kept = folder_path(shape)
  if (kept / "complete").is_file():
    folder = folder_info(kept)
  else:  # torch is imported only in processes of its own
    folder = in_fresh_process("folder", json.dumps(shape))
  names = ["jax_dpo", "trl_dpo"]  # quick: one pair of runs, the smoke of both paths
  if not quick:  # and where jaxstep's memory goes: the CPU split, remat, scanned layers
    names += ["jax_sft", "peft_sft"]
    names += [f"jax_{job}_{v}" for job in ("sft", "dpo") for v in JAX_VARIANTS]
    names += ["jax_dpo_full", "trl_dpo_full"]  # every weight trained; TRL's run is long
  steps = 1 if quick else STEPS
  runs = run_all(folder["path"], names, rounds=1, steps=steps)
  peak = {n: [r["peak_bytes"] for r in rs] for n, rs in runs.items()}
  gib = lambda n: f"{ratio_stats(peak[n], 1)['median'] / 2**30:.2f} GiB"  # noqa: E731
  vs = lambda a, b: ratio_stats(peak[a], peak[b])["median"]  # noqa: E731
  summary = {"dpo_lora_rss_vs_trl": vs("jax_dpo", "trl_dpo")}
  job = (
    f"{folder['params'] / 1e6:.0f} M-param Llama folder (SmolLM2-135M's shape), LoRA r=8 on "
    f"every projection, fp32, 8 × 128 tokens, {steps} steps, a fresh process each"
  )
  rows = []
  if "jax_sft" in peak:
    summary["lora_sft_rss_vs_peft"] = vs("jax_sft", "peft_sft")
    rows.append(
      (
        f"peak RSS of a whole LoRA SFT run, `jaxstep train` ÷ transformers Trainer + PEFT "
        f"({job}; {gib('jax_sft')} vs {gib('peft_sft')})",
        f"{summary['lora_sft_rss_vs_peft']:.3f}",
        "≤ 1.0",
      )
    )
  rows.append(
    (
      f"peak RSS of a whole LoRA DPO run, `jaxstep train` ÷ TRL DPOTrainer + PEFT ({job}, "
      f"8 pairs; {gib('jax_dpo')} vs {gib('trl_dpo')})",
      f"{summary['dpo_lora_rss_vs_trl']:.3f}",
      "≤ 1.0",
    )
  )
  if "jax_dpo_full" in peak:
    summary["dpo_full_rss_vs_trl"] = vs("jax_dpo_full", "trl_dpo_full")
    rows.append(
      (
        f"peak RSS of a whole full fine-tuning DPO run (the same folder, every weight "
        f"trained, a frozen copy of the start as the reference on both sides, fp32, 8 pairs "
        f"of 128 tokens, {steps} steps), `jaxstep train` with its defaults ÷ TRL "
        f"DPOTrainer with its own ({gib('jax_dpo_full')} vs {gib('trl_dpo_full')})",
        f"{summary['dpo_full_rss_vs_trl']:.3f}",
        "≤ 1.0",
      )
    )
  for job, other in (("sft", "peft_sft"), ("dpo", "trl_dpo")):
    for variant, settings in JAX_VARIANTS.items():
      name = f"jax_{job}_{variant}"
      if name in peak:
        key = f"{job}_lora_{variant}_rss_vs_{other.split('_')[0]}"
        summary[key] = vs(name, other)
        what = f"the same {job.upper()} run with {' '.join(settings)} ({gib(name)})"
        rows.append((what, f"{summary[key]:.3f}", ""))
  out = {"folder": {**folder, "shape": shape}, "runs": runs}
  return out, rows, summary


def suite_preference(quick: bool) -> dict:
  """DPO's persistent state, tokens/s against TRL, precomputed-reference step against SFT,
  and whole-run peak RSS against PEFT and TRL."""
  phase_s, t = {}, time.perf_counter()
  states, rows, summary = _state_rows(quick)
  phase_s["state"] = time.perf_counter() - t
  out = {"state_bytes": states}
  with_torch = all(importlib.util.find_spec(m) for m in ("torch", "transformers", "peft", "trl"))
  speed, speed_rows, speed_summary = _speed_rows(quick, with_torch)
  phase_s["speed"] = time.perf_counter() - t - sum(phase_s.values())
  out["speed"], rows, summary = speed, rows + speed_rows, summary | speed_summary
  if with_torch:
    rss, rss_rows, rss_summary = _rss_rows(quick)
    out["rss"], rows, summary = rss, rows + rss_rows, summary | rss_summary
  else:
    rows.append(("peak RSS against PEFT and TRL", "skipped: torch, peft or trl missing", ""))
  phase_s["rss"] = time.perf_counter() - t - sum(phase_s.values())
  return {**out, "phase_s": phase_s, "rows": rows, "summary": summary}
