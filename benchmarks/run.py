"""``python -m benchmarks.run [--quick] [--only NAME …]``: measure, write JSON + markdown.

Each suite writes ``benchmarks/results/<suite>.json`` (environment, config, raw per-round
numbers, ratios); ``summary.json`` collects the headline numbers and ``results.md`` the
table the README embeds.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

from benchmarks.harness import RESULTS, Worker, environment, fmt, interleaved, ratio_stats, write


def suite_host_overhead(quick: bool) -> dict:
  """Host-side data + logging overhead per update step on the tiny config (issue 3)."""
  spec = {"kind": "loop", "config": "tiny", "steps": 8 if quick else 30}
  workers = {"real": Worker(spec), "noop": Worker({**spec, "noop": True})}
  try:
    res = interleaved(workers, rounds=3 if quick else 10)
  finally:
    for w in workers.values():
      w.close()
  real = [r["median_step"] for r in res["real"]]
  noop = [r["median_step"] for r in res["noop"]]
  stats = ratio_stats(noop, real)
  return {
    "spec": spec,
    "raw": res,
    "host_overhead_over_step": stats,
    "summary": {"host_overhead_over_step": stats["median"]},
    "rows": [("host overhead per update step ÷ step time (tiny)", fmt(stats), "≤ 0.05")],
  }


def suite_checkpoint(quick: bool) -> dict:
  """Loop stall per checkpoint save, async vs sync, and save/restore MB/s (issue 4)."""
  config = "tiny" if quick else "small"
  steps, every = (8, 4) if quick else (12, 4)
  base = {"kind": "loop", "config": config, "steps": steps}
  workers = {
    "none": Worker({**base, "rates": True}),
    "async": Worker({**base, "save_every": every, "async_save": True}),
    "sync": Worker({**base, "save_every": every, "async_save": False}),
  }
  try:
    res = interleaved(workers, rounds=3 if quick else 6)
  finally:
    for w in workers.values():
      w.close()
  step = [r["median_step"] for r in res["none"]]
  out = {"spec": base, "every": every, "raw": res, "rates": workers["none"].info}
  rows = []
  for mode in ("async", "sync"):
    stall = [
      (x["total"] - n["total"]) / x["saves"] for x, n in zip(res[mode], res["none"], strict=True)
    ]
    out[f"stall_{mode}"] = ratio_stats(stall, step)
    rows.append(
      (
        f"loop stall per {mode} save ÷ step time ({config})",
        fmt(out[f"stall_{mode}"]),
        "≤ 0.10" if mode == "async" else "",
      )
    )
  rates = workers["none"].info
  rows.append(
    (
      f"save / restore MB/s ({rates['state_mb']:.1f} MB state)",
      f"{rates['save_mb_per_s']:.0f} / {rates['restore_mb_per_s']:.0f}",
      "",
    )
  )
  out["summary"] = {
    "ckpt_stall_over_step": out["stall_async"]["median"],
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
  w.close()
  rows = w.info["rows"]
  table = [
    (
      f"params + optimizer state per device, fsdp={r['fsdp']} ({w.info['num_params']:,} params)",
      f"{r['state_bytes_per_device'] / 2**20:.2f} MiB "
      f"(×{r['state_ratio_vs_fsdp1']:.3f}; compiled args "
      f"{r['argument_bytes'] / 2**20:.2f} MiB)",
      f"≈ {1 / r['fsdp']:.3f}",
    )
    for r in rows
  ]
  return {
    "model": model,
    **w.info,
    "rows": table,
    "fsdp_rows": rows,
    "summary": {f"fsdp{r['fsdp']}_state_ratio": r["state_ratio_vs_fsdp1"] for r in rows},
  }


SUITES = {
  "host_overhead": suite_host_overhead,
  "checkpoint": suite_checkpoint,
  "fsdp_memory": suite_fsdp_memory,
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


def embed_in_readme(table: str) -> None:
  """Replaces the README block between the benchmark markers with ``table``."""
  readme = RESULTS.parent.parent / "README.md"
  text = readme.read_text()
  start, end = "<!-- benchmarks:start -->\n", "<!-- benchmarks:end -->"
  if start in text and end in text:
    head, rest = text.split(start, 1)
    readme.write_text(head + start + table + end + rest.split(end, 1)[1])


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__)
  p.add_argument(
    "--quick",
    action="store_true",
    help="tiny sizes, few rounds (CI smoke); writes results/quick/, not the README",
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
  if out_dir == RESULTS:
    embed_in_readme(table)
  print(table)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
