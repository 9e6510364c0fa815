"""Suites of the step itself (``step_bench``'s and ``memory_bench``'s workers): against its
compute floor and other ways to accumulate, compile time and memory against K, and against
depth."""

from __future__ import annotations

import os

from benchmarks.harness import OWN_COMPILES, Worker, fmt, measure, ratio_stats


def suite_step(quick: bool) -> dict:
  """jaxstep's step vs the compute floor, unrolled, MultiSteps, PyTorch; MFU."""
  import importlib.util

  from benchmarks.step_bench import MODEL, QUICK_MODEL
  from jaxstep.models import GPTConfig
  from jaxstep.parallel.cpu_devices import ONE_THREAD

  model, g, k = (QUICK_MODEL, 8, 2) if quick else (MODEL, 64, 16)
  base = {"model": model, "g": g, "k": k}
  if quick:  # one timed update per round
    base["repeats"] = 1
  specs = {n: {**base, "kind": n} for n in ("jaxstep", "floor", "multisteps", "unrolled")}
  specs["matmul"] = {
    "kind": "matmul",
    "n": 128 if quick else 1024,
    "model": model,
    "rows": g // k * model["max_seq_len"],
  }
  if not quick:
    for kk in (1, 4, 64):
      specs[f"jaxstep_k{kk}"] = {**base, "k": kk, "kind": "jaxstep"}
      specs[f"floor_k{kk}"] = {**base, "k": kk, "kind": "floor"}
  cores = os.cpu_count() or 1
  if cores > 1 and g % (cores * k) == 0:  # how much the busy cores slow each other down
    alone = {**base, "g": g // cores, "kind": "jaxstep", "cpu_defaults": False}
    alone["env"] = {"XLA_FLAGS": ONE_THREAD}  # one device, one thread
    specs["core_alone"] = alone
    specs["cores_together"] = {**alone, "copies": cores}
  torch_names = []
  if importlib.util.find_spec("torch"):  # quick: eager only (compile and DDP start slowly)
    torch_names = ["torch_eager"] if quick else ["torch_eager", "torch_compile", "torch_ddp"]
    specs["torch_eager"] = {**base, "kind": "torch"}
    if not quick:
      specs["torch_compile"] = {**base, "kind": "torch", "compile": True}
      specs["torch_ddp"] = {**base, "kind": "torch_ddp"}
  res, info, failed = measure(specs, rounds=1 if quick else 20)
  sec = {n: [r["seconds"] for r in rounds] for n, rounds in res.items() if n != "matmul"}
  out = {
    "spec": base,
    "raw": res,
    "failed": failed,
    "info": info,
  }
  out["scan_over_floor"] = ratio_stats(sec["jaxstep"], sec["floor"])
  out["tokens_vs_multisteps"] = ratio_stats(sec["multisteps"], sec["jaxstep"])
  out["tokens_vs_unrolled"] = ratio_stats(sec["unrolled"], sec["jaxstep"])
  flops = GPTConfig(**model).flops_per_token(model["max_seq_len"]) * g * model["max_seq_len"]
  out["cpu_mfu"] = ratio_stats(
    [flops / s for s in sec["jaxstep"]], [r["flops"] for r in res["matmul"]]
  )
  out["cpu_mfu_model_shapes"] = ratio_stats(
    [flops / s for s in sec["jaxstep"]], [r["model_shape_flops"] for r in res["matmul"]]
  )
  rows = [
    (f"time per global batch ÷ compute floor (K={k})", fmt(out["scan_over_floor"]), "≤ 0.80"),
    ("tokens/s ÷ optax.MultiSteps host loop", fmt(out["tokens_vs_multisteps"]), "≥ 1.5"),
    ("tokens/s ÷ Python-unrolled in one jit", fmt(out["tokens_vs_unrolled"]), ""),
    ("MFU: model FLOP/s ÷ fp32 1024² matmul FLOP/s, same round", fmt(out["cpu_mfu"]), "≥ 0.60"),
    ("model FLOP/s ÷ the model's own matmul shapes' FLOP/s", fmt(out["cpu_mfu_model_shapes"]), ""),
  ]
  summary = {
    "scan_over_floor": out["scan_over_floor"]["median"],
    "tokens_vs_multisteps": out["tokens_vs_multisteps"]["median"],
    "cpu_mfu": out["cpu_mfu"]["median"],
  }
  if "cores_together" in sec:
    out["cores_together_over_alone"] = ratio_stats(sec["cores_together"], sec["core_alone"])
    out["scan_over_cores_together"] = ratio_stats(sec["jaxstep"], sec["cores_together"])
    rows.append(
      (
        f"{cores} one-thread processes, each 1/{cores} of the batch, all at once ÷ one alone "
        "(1.00: busy cores do not slow each other)",
        fmt(out["cores_together_over_alone"]),
        "",
      )
    )
    rows.append(
      (
        f"time per global batch ÷ those {cores} processes at once",
        fmt(out["scan_over_cores_together"]),
        "",
      )
    )
    summary["cores_together_over_alone"] = out["cores_together_over_alone"]["median"]
  live_torch = [n for n in torch_names if n in sec]
  if live_torch:
    best = [min(vals) for vals in zip(*(sec[n] for n in live_torch), strict=True)]
    out["tokens_vs_pytorch"] = ratio_stats(best, sec["jaxstep"])
    for n in live_torch:
      out[f"tokens_vs_{n}"] = ratio_stats(sec[n], sec["jaxstep"])
      rows.append((f"tokens/s ÷ PyTorch {n[6:]}", fmt(out[f"tokens_vs_{n}"]), ""))
    rows.append(("tokens/s ÷ fastest PyTorch each round", fmt(out["tokens_vs_pytorch"]), "≥ 1.3"))
    summary["tokens_vs_pytorch"] = out["tokens_vs_pytorch"]["median"]
  for name in failed:
    rows.append((name, "did not run here (see `failed` in step.json)", ""))
  for kk in (1, 4, 64):
    if f"jaxstep_k{kk}" in sec:
      stats = ratio_stats(sec[f"jaxstep_k{kk}"], sec[f"floor_k{kk}"])
      out[f"scan_over_floor_k{kk}"] = stats
      rows.append((f"time per global batch ÷ compute floor (K={kk})", fmt(stats), ""))
  out["rows"], out["summary"] = rows, summary
  return out


def suite_compile(quick: bool) -> dict:
  """Compile time and temp memory vs K at a fixed micro-batch of 4 sequences (G = 4K): the
  scan stays flat, Python unrolling grows with K."""
  from benchmarks.step_bench import MODEL, QUICK_MODEL

  model, ks = (QUICK_MODEL, [1, 64]) if quick else (MODEL, [1, 4, 16, 64])
  w = Worker(
    {
      "kind": "compile_vs_k",
      "model": model,
      "micro": 4,
      "ks": ks,
      "max_unrolled_k": 4 if quick else 64,
      "compile_repeats": 1 if quick else 3,
    },
    OWN_COMPILES if quick else None,
  )
  by_k = w.info["rows"]  # the worker measures while it builds; read before closing it
  w.close()
  first, last = by_k[0], by_k[-1]
  out = {
    "rows_by_k": by_k,
    "model": model,
    "compile_ratio": last["scan_compile_s"] / first["scan_compile_s"],
    "temp_ratio": last["scan_temp_bytes"] / first["scan_temp_bytes"],
  }
  mib = 2**20
  rows = [
    (
      f"compile / temp memory at K={r['k']} (micro-batch 4): scan vs Python-unrolled",
      f"{r['scan_compile_s']:.2f} s vs {r.get('unrolled_compile_s', float('nan')):.2f} s; "
      f"{r['scan_temp_bytes'] / mib:.1f} vs "
      f"{r.get('unrolled_temp_bytes', float('nan')) / mib:.1f} MiB",
      "",
    )
    for r in by_k
  ]
  rows.append(
    (f"scan compile(K={last['k']}) ÷ compile(K=1)", f"{out['compile_ratio']:.2f}", "≤ 1.3")
  )
  rows.append((f"scan temp memory(K={last['k']}) ÷ (K=1)", f"{out['temp_ratio']:.2f}", "≤ 1.1"))
  out["rows"] = rows
  suffix = f"k{last['k']}_k1"
  out["summary"] = {
    f"compile_ratio_{suffix}": out["compile_ratio"],
    f"temp_mem_ratio_{suffix}": out["temp_ratio"],
  }
  return out


def suite_depth(quick: bool) -> dict:
  """Compile time 24 blocks ÷ 2 blocks, scanned (``model.scan_layers``) vs unrolled, and the
  compiled temporaries of 24 blocks per ``model.remat`` policy."""
  from benchmarks.step_bench import MODEL, QUICK_MODEL

  model = QUICK_MODEL if quick else MODEL
  spec = {
    "kind": "depth",
    "model": model,
    "shallow": 2,
    "deep": 4 if quick else 24,
    "k": 2,
    "micro": 4,
    "remats": ["none"] if quick else ["none", "block", "dots"],
    "repeats": 1 if quick else 3,
  }
  w = Worker(spec, OWN_COMPILES if quick else None)
  found = w.info["rows"]
  w.close()
  mib, deep = 2**20, spec["deep"]
  by = {(r["scan_layers"], r["remat"]): r for r in found}
  scanned, unrolled = by[(True, "none")], by[(False, "none")]
  rows = [
    (
      f"compile {deep} blocks ÷ 2 blocks, {'scanned' if r['scan_layers'] else 'unrolled'}, "
      f"remat {r['remat']} ({r['shallow_compile_s']:.2f} s → {r['deep_compile_s']:.2f} s; "
      f"temporaries at {deep}: {r['deep_temp_bytes'] / mib:.1f} MiB)",
      f"{r['compile_ratio']:.2f}",
      "≤ 1.5" if r["scan_layers"] else "",
    )
    for r in found
  ]
  return {
    "rows_by_variant": found,
    "model": model,
    "rows": rows,
    "summary": {
      "depth_compile_ratio_scanned": scanned["compile_ratio"],
      "depth_compile_ratio_unrolled": unrolled["compile_ratio"],
    },
  }
