"""``python -m benchmarks.run [--quick] [--only NAME …]``: measure, write JSON + markdown.

Each suite writes ``benchmarks/results/<suite>.json`` (environment, config, raw per-round
numbers, ratios); ``summary.json`` collects the headline numbers and ``results.md`` the
table the README embeds.
"""

from __future__ import annotations

import argparse
import json
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


SUITES = {"host_overhead": suite_host_overhead, "checkpoint": suite_checkpoint}


def markdown(results: dict, env: dict, quick: bool) -> str:
  lines = [
    f"Measured {time.strftime('%Y-%m-%d')} with `python -m benchmarks.run"
    f"{' --quick' if quick else ''}` on {env['cpu_count']} CPU cores "
    f"({env['device_kind']} ×{env['device_count']}), jax {env['jax']}. Ratios are "
    f"medians of per-round ratios (IQR in brackets).",
    "",
    "| measurement | result | target |",
    "|---|---|---|",
  ]
  for suite in results.values():
    for name, value, target in suite["rows"]:
      lines.append(f"| {name} | {value} | {target} |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__)
  p.add_argument("--quick", action="store_true", help="tiny sizes, few rounds (CI smoke)")
  p.add_argument("--only", nargs="*", choices=sorted(SUITES), help="run only these suites")
  args = p.parse_args(argv)
  env = environment()
  results = {}
  for name in args.only or SUITES:
    t = time.perf_counter()
    results[name] = SUITES[name](args.quick)
    results[name].update(environment=env, quick=args.quick, seconds=time.perf_counter() - t)
    write(name, results[name])
    print(f"{name}: {json.dumps(results[name]['summary'])}", flush=True)
  summary_path = RESULTS / "summary.json"
  summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
  for r in results.values():
    summary.update(r["summary"])
  write("summary", summary)
  (RESULTS / "results.md").write_text(markdown(results, env, args.quick))
  print((RESULTS / "results.md").read_text())
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
