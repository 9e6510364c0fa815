"""``python -m benchmarks.run [--quick] [--only NAME …]``: measure, write JSON + markdown.

Each suite writes ``benchmarks/results/<suite>.json`` (environment, config, raw per-round
numbers, ratios); ``summary.json`` collects the headline numbers and ``results.md`` the
table of every row (docs/performance.md links it).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import pathlib
import time

from benchmarks.chunked_loss_bench import suite_chunked_loss
from benchmarks.data_bench import suite_data
from benchmarks.eval_bench import suite_eval
from benchmarks.family_bench import suite_families
from benchmarks.generate_bench import suite_generate
from benchmarks.harness import RESULTS, environment, quick_compiles, write
from benchmarks.hf_bench import suite_hf
from benchmarks.loop_suites import (
  suite_checkpoint,
  suite_doc_mask,
  suite_fsdp_memory,
  suite_host_overhead,
)
from benchmarks.lora_bench import suite_lora
from benchmarks.moe_bench import suite_moe
from benchmarks.optim_bench import suite_optim
from benchmarks.preference_suite import suite_preference
from benchmarks.qlora_bench import suite_qlora
from benchmarks.rl_bench import suite_rl
from benchmarks.startup_bench import suite_startup
from benchmarks.step_suites import suite_compile, suite_depth, suite_step
from benchmarks.tensor_bench import suite_tensor

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
  "preference": suite_preference,
  "rl": suite_rl,
  "tensor": suite_tensor,
  "optim": suite_optim,
  "eval": suite_eval,
  "startup": suite_startup,
  "moe": suite_moe,
  "families": suite_families,
  "chunked_loss": suite_chunked_loss,
  "qlora": suite_qlora,
}


def markdown(out_dir: pathlib.Path) -> str:
  """One table from every suite's JSON in ``out_dir`` (suites can be re-run one at a time)."""
  suites = [json.loads(p.read_text()) for p in sorted(out_dir.glob("*.json")) if p.stem in SUITES]
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


# --quick, a smoke run whose numbers are not measurements: suites run four at a time, so
# that some keep the cores busy while others wait on a single process; the longest start
# first, each after those whose workers and compiled programs it reuses
QUICK_SUITES_AT_ONCE = 4
QUICK_ORDER = (
  "step",
  "data",
  "depth",
  "host_overhead",
  "hf",
  "preference",
  "checkpoint",
  "doc_mask",
  "lora",
  "rl",
  "tensor",
  "optim",
  "eval",
  "fsdp_memory",
  "compile",
  "generate",
  "startup",
  "moe",
  "families",
  "chunked_loss",
  "qlora",
)


def _timed(name: str, quick: bool) -> dict:
  t = time.perf_counter()
  result = SUITES[name](quick)
  result["seconds"] = time.perf_counter() - t
  return result


def _quick_order(name: str) -> int:
  return QUICK_ORDER.index(name) if name in QUICK_ORDER else len(QUICK_ORDER)


def _side_by_side(names: list[str], at_once: int):
  """``(name, result)`` of each suite in the order of ``names``, ``at_once`` of them running
  at a time in ``QUICK_ORDER`` (each in a thread, its workers in processes of their own)."""
  pool = concurrent.futures.ThreadPoolExecutor(at_once)
  try:
    futures = {name: pool.submit(_timed, name, True) for name in sorted(names, key=_quick_order)}
    for name in names:
      yield name, futures[name].result()
  finally:
    pool.shutdown(cancel_futures=True)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__)
  p.add_argument(
    "--quick",
    action="store_true",
    help="tiny sizes, one round, suites side by side sharing compiles and workers (the test "
    "suite's smoke run, not a measurement); writes results/quick/",
  )
  p.add_argument("--only", nargs="*", choices=sorted(SUITES), help="run only these suites")
  p.add_argument("--out", type=pathlib.Path, help="output folder (default: results[/quick])")
  args = p.parse_args(argv)
  out_dir = args.out or (RESULTS / "quick" if args.quick else RESULTS)
  summary_path = out_dir / "summary.json"
  summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
  with quick_compiles() if args.quick else contextlib.nullcontext():
    env = environment()
    names = list(args.only or SUITES)
    if args.quick:
      results = _side_by_side(names, QUICK_SUITES_AT_ONCE)
    else:
      results = ((name, _timed(name, quick=False)) for name in names)
    for name, result in results:
      result.update(environment=env, quick=args.quick, date=time.strftime("%Y-%m-%d"))
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
