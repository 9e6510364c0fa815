"""``python -m benchmarks.run [--quick] [--only NAME …]``: measure, write JSON + markdown.

Each suite writes ``benchmarks/results/<suite>.json`` (environment, config, raw per-round
numbers, ratios); ``summary.json`` collects the headline numbers and ``results.md`` the
table of every row (docs/performance.md links it).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import time

from benchmarks.generate_bench import suite_generate
from benchmarks.harness import (
  RESULTS,
  Worker,
  environment,
  fmt,
  measure,
  ratio_stats,
  write,
)
from benchmarks.hf_bench import suite_hf
from benchmarks.lora_bench import suite_lora


def suite_host_overhead(quick: bool) -> dict:
  """Host-side overhead per update step on the tiny config (data, dispatch, read-back and
  the loop's hooks), without and with an MLflow tracker logging every update step."""
  spec = {"kind": "loop", "config": "tiny", "steps": 6 if quick else 30}
  tracked = {
    **spec,
    "overrides": ["train.trackers=[jsonl, tensorboard, mlflow]", "train.log_every=1"],
  }
  specs = {
    "real": spec,
    "noop": {**spec, "noop": True},
    "real_mlflow": tracked,
    "noop_mlflow": {**tracked, "noop": True},
  }
  res, _, _ = measure(specs, rounds=2 if quick else 10)

  def overhead(suffix: str) -> dict:
    real = [r["median_step"] for r in res[f"real{suffix}"]]
    return ratio_stats([r["median_step"] for r in res[f"noop{suffix}"]], real)

  stats, mlflow = overhead(""), overhead("_mlflow")
  return {
    "spec": spec,
    "raw": res,
    "host_overhead_over_step": stats,
    "host_overhead_mlflow_over_step": mlflow,
    "summary": {
      "host_overhead_over_step": stats["median"],
      "host_overhead_mlflow_over_step": mlflow["median"],
    },
    "rows": [
      ("host overhead per update step ÷ step time (tiny)", fmt(stats), "≤ 0.02"),
      ("the same with MLflow logging every update step", fmt(mlflow), "≤ 0.03"),
    ],
  }


def suite_doc_mask(quick: bool) -> dict:
  """Step time with document masking ÷ without: the small config on packed text, blocked
  CPU attention (the segment-id compare inside its blocks and the two extra batch fields)."""
  spec = {"kind": "loop", "config": "tiny" if quick else "small", "steps": 4 if quick else 12}
  specs = {
    "plain": {**spec, "overrides": ["data.document_mask=false"]},
    "masked": {**spec, "overrides": ["data.document_mask=true"]},
  }
  res, _, _ = measure(specs, rounds=2 if quick else 8)
  stats = ratio_stats(
    [r["median_step"] for r in res["masked"]], [r["median_step"] for r in res["plain"]]
  )
  return {
    "spec": spec,
    "raw": res,
    "doc_mask_step_over_plain": stats,
    "summary": {"doc_mask_step_over_plain": stats["median"]},
    "rows": [
      (
        f"step time with document masking ÷ without ({spec['config']}, blocked)",
        fmt(stats),
        "≤ 1.15",
      )
    ],
  }


def suite_checkpoint(quick: bool) -> dict:
  """Loop stall per checkpoint save, async vs sync, and save/restore MB/s."""
  config = "tiny" if quick else "small"
  steps, every = (6, 3) if quick else (12, 4)
  base = {"kind": "loop", "config": config, "steps": steps}
  specs = {
    "none": {**base, "rates": True},
    "async": {**base, "save_every": every, "async_save": True},
    "sync": {**base, "save_every": every, "async_save": False},
  }
  res, info, _ = measure(specs, rounds=2 if quick else 6)
  step = [r["median_step"] for r in res["none"]]
  out = {"spec": base, "every": every, "raw": res, "rates": info["none"]}
  rows = []
  for mode in ("async", "sync"):
    stall = [
      (x["total"] - n["total"]) / x["saves"] for x, n in zip(res[mode], res["none"], strict=True)
    ]
    out[f"stall_{mode}"] = ratio_stats(stall, step)
    blocking = [x["blocking_per_save"] for x in res[mode]]
    out[f"blocking_{mode}"] = ratio_stats(blocking, [x["median_step"] for x in res[mode]])
    rows.append(
      (
        f"loop stall per {mode} save ÷ step time ({config}), across runs",
        fmt(out[f"stall_{mode}"]),
        "",
      )
    )
    rows.append(
      (
        f"step blocked per {mode} save ÷ step time ({config}), within a run",
        fmt(out[f"blocking_{mode}"]),
        "≤ 0.10" if mode == "async" else "",
      )
    )
  rates = info["none"]
  rows.append(
    (
      f"save / restore MB/s ({rates['state_mb']:.1f} MB state)",
      f"{rates['save_mb_per_s']:.0f} / {rates['restore_mb_per_s']:.0f}",
      "",
    )
  )
  out["summary"] = {
    "ckpt_stall_over_step": out["blocking_async"]["median"],
    "ckpt_stall_across_runs_over_step": out["stall_async"]["median"],
    "ckpt_save_mb_per_s": rates["save_mb_per_s"],
    "ckpt_restore_mb_per_s": rates["restore_mb_per_s"],
  }
  out["rows"] = rows
  return out


def suite_fsdp_memory(quick: bool) -> dict:
  """Per-device params + optimizer state bytes for fsdp = 1, 2, 4, 8 on 8 CPU devices."""
  model = (
    {"d_model": 64, "n_heads": 4, "max_seq_len": 32}
    if quick
    else {"d_model": 256, "n_layers": 4, "n_heads": 8, "max_seq_len": 128}
  )
  w = Worker(
    {"kind": "fsdp_memory", "model": model},
    env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
  )
  info = w.info  # the worker measures while it builds; read before closing it
  w.close()
  rows = info["rows"]
  table = [
    (
      f"params + optimizer state per device, fsdp={r['fsdp']} ({info['num_params']:,} params)",
      f"{r['state_bytes_per_device'] / 2**20:.2f} MiB "
      f"(×{r['state_ratio_vs_fsdp1']:.3f}; compiled args "
      f"{r['argument_bytes'] / 2**20:.2f} MiB)",
      f"≈ {1 / r['fsdp']:.3f}",
    )
    for r in rows
  ]
  return {
    "model": model,
    **info,
    "rows": table,
    "fsdp_rows": rows,
    "summary": {f"fsdp{r['fsdp']}_state_ratio": r["state_ratio_vs_fsdp1"] for r in rows},
  }


def suite_step(quick: bool) -> dict:
  """jaxstep's step vs the compute floor, unrolled, MultiSteps, PyTorch; MFU."""
  import importlib.util

  from benchmarks.step_bench import MODEL, QUICK_MODEL
  from jaxstep.models import GPTConfig
  from jaxstep.parallel.cpu_devices import ONE_THREAD

  model, g, k = (QUICK_MODEL, 16, 4) if quick else (MODEL, 64, 16)
  base = {"model": model, "g": g, "k": k}
  specs = {n: {**base, "kind": n} for n in ("jaxstep", "floor", "multisteps", "unrolled")}
  specs["matmul"] = {
    "kind": "matmul",
    "n": 256 if quick else 1024,
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
  res, info, failed = measure(specs, rounds=2 if quick else 20)
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
    }
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
    "deep": 8 if quick else 24,
    "k": 2,
    "micro": 4,
    "remats": ["none"] if quick else ["none", "block", "dots"],
    "repeats": 1 if quick else 3,
  }
  w = Worker(spec)
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


def suite_data(quick: bool) -> dict:
  """Start-up and peak RSS against corpus size, prepare against its tokenizer, the loader."""
  import tempfile

  from benchmarks.data_bench import make_corpus, scale_suite
  from jaxstep.data import prepare, train_bpe
  from jaxstep.data.readers import read_documents

  root = pathlib.Path(tempfile.mkdtemp(prefix="jaxstep-data-bench-"))
  sizes = (
    {"small": 300_000, "big": 1_200_000} if quick else {"small": 10_000_000, "big": 200_000_000}
  )
  folders = {}
  for name, size in sizes.items():
    make_corpus(root / f"{name}.txt", size)
    folders[name] = str(root / name)
    prepare([str(root / f"{name}.txt")], folders[name], workers=os.cpu_count(), progress=False)
  docs = read_documents(str(root / "small.txt"))[0]
  train_bpe(docs[:2000], 4096, root / "tokenizer.json")
  text, tok = str(root / "small.txt"), str(root / "tokenizer.json")
  specs = {
    "startup_small": {"kind": "startup", "data": folders["small"]},
    "startup_big": {"kind": "startup", "data": folders["big"]},
    "tokenize_raw": {"kind": "tokenize_raw", "text": text, "tokenizer": tok},
    "prepare": {"kind": "prepare", "text": text, "tokenizer": tok},
  }
  res, _, _ = measure(specs, rounds=1 if quick else 5)
  small, big = res["startup_small"], res["startup_big"]
  startup = ratio_stats([b["seconds"] - a["seconds"] for a, b in zip(small, big, strict=True)], 1)
  rss = ratio_stats([b["rss_mib"] - a["rss_mib"] for a, b in zip(small, big, strict=True)], 1)
  prep = ratio_stats(
    [r["tokens_per_s"] for r in res["prepare"]], [r["tokens_per_s"] for r in res["tokenize_raw"]]
  )
  g, s, n = (64, 256, 4) if quick else (256, 1024, 8)
  loader_spec = {"kind": "loader", "data": folders["big"], "g": g, "s": s, "batches": n}
  loader_res, _, _ = measure({"loader": loader_spec}, rounds=1 if quick else 5)
  loader = ratio_stats([r["tokens_per_s"] for r in loader_res["loader"]], 1)
  big_mt, small_mt = sizes["big"] // 10**6, sizes["small"] // 10**6
  shutil.rmtree(root, ignore_errors=True)
  scale = scale_suite(quick)  # per-batch and start-up costs at 10^8 windows / 2 G tokens
  return {
    "sizes_bytes": sizes,
    "raw": {**res, **loader_res, **scale["raw"]},
    "startup_delta_s": startup,
    "rss_delta_mib": rss,
    "prepare_over_tokenizers": prep,
    "loader_tokens_per_s": loader,
    "summary": {
      "data_startup_delta_s_200m_10m": startup["median"],
      "data_rss_delta_mib_200m_10m": rss["median"],
      "prepare_over_tokenizers": prep["median"],
      "loader_tokens_per_s": loader["median"],
      **scale["summary"],
    },
    "rows": [
      *scale["rows"],
      (
        f"start-up to the first update: {big_mt} M − {small_mt} M prepared tokens (s)",
        fmt(startup),
        "≤ +5",
      ),
      (f"peak RSS: {big_mt} M − {small_mt} M prepared tokens (MiB)", fmt(rss), "≤ +200"),
      (
        "prepare tokens/s ÷ its tokenizer's encode_batch tokens/s (BPE 4096, 1 worker)",
        fmt(prep),
        "≥ 0.8",
      ),
      (
        f"loader alone, global batches of {g} × {s} (tokens/s)",
        f"{loader['median']:,.0f} ({loader['q1']:,.0f}–{loader['q3']:,.0f})",
        "≫ 262,144 per update",
      ),
    ],
  }


SUITES = {
  "step": suite_step,
  "compile": suite_compile,
  "depth": suite_depth,
  "host_overhead": suite_host_overhead,
  "doc_mask": suite_doc_mask,
  "checkpoint": suite_checkpoint,
  "fsdp_memory": suite_fsdp_memory,
  "data": suite_data,
  "generate": suite_generate,
  "hf": suite_hf,
  "lora": suite_lora,
}


def markdown(out_dir: pathlib.Path) -> str:
  """One table from every suite's JSON in ``out_dir`` (suites can be re-run one at a time)."""
  suites = [
    json.loads(p.read_text()) for p in sorted(out_dir.glob("*.json")) if p.stem not in ("summary",)
  ]
  if not suites:
    return ""
  env = suites[0]["environment"]
  lines = [
    f"`python -m benchmarks.run{' --quick' if suites[0]['quick'] else ''}` on "
    f"{env['cpu_count']} CPU cores, jax {env['jax']}, {env['device_kind']}. Ratios are "
    f"medians of per-round ratios (IQR in brackets); each suite's JSON in "
    f"`benchmarks/results/` has the raw rounds, versions, flags and config.",
    "",
    "| measurement | result | target | measured |",
    "|---|---|---|---|",
  ]
  for suite in suites:
    for name, value, target in suite["rows"]:
      lines.append(f"| {name} | {value} | {target} | {suite['date']} |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__)
  p.add_argument(
    "--quick",
    action="store_true",
    help="tiny sizes, few rounds (the test suite's smoke run); writes results/quick/",
  )
  p.add_argument("--only", nargs="*", choices=sorted(SUITES), help="run only these suites")
  p.add_argument("--out", type=pathlib.Path, help="output folder (default: results[/quick])")
  args = p.parse_args(argv)
  out_dir = args.out or (RESULTS / "quick" if args.quick else RESULTS)
  env = environment()
  summary_path = out_dir / "summary.json"
  summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
  for name in args.only or SUITES:
    t = time.perf_counter()
    result = SUITES[name](args.quick)
    result.update(
      environment=env,
      quick=args.quick,
      date=time.strftime("%Y-%m-%d"),
      seconds=time.perf_counter() - t,
    )
    write(name, result, out_dir)
    summary.update(result["summary"])
    print(f"{name}: {json.dumps(result['summary'])}", flush=True)
  write("summary", summary, out_dir)
  table = markdown(out_dir)
  (out_dir / "results.md").write_text(table)
  print(table)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
