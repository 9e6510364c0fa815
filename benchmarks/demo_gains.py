"""The post-training demo's recorded numbers, from run directories a user trains with the
commands of ``docs/distill.md`` (the weak supervised start of ``sft-sums`` with
``train.seed=1``, exported; ``grpo-arith``, ``grpo-arith rl.filter_groups=true`` and
``distill-arith`` from it):

``python -m benchmarks.demo_gains --grpo runs/grpo1 --filter runs/filter1 --distill runs/distill1``

- ``distill_accuracy_gain_100``, ``grpo_accuracy_gain_100``: held-out exact answers gained
  in the first 100 updates (``eval_rewards/exact_answer`` at update 100 − at 0), and
  ``distill_vs_grpo_accuracy_gain_100``, their ratio, where GRPO's gain is > 0 (from a weak
  start it often is not: then the ratio is not recorded, and the two gains say why);
- ``rl_filter_overhead``: dynamic sampling's sampling seconds per update ÷ plain GRPO's
  (medians of ``rollout_s`` over each run's updates, compiles included in neither: the
  first 5 updates are left out).

Writes ``results/demo_gains.json`` and merges the keys into ``results/summary.json``.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np

from benchmarks.harness import RESULTS, write

SKIP = 5


def _records(run_dir: pathlib.Path, name: str) -> list[dict]:
  lines = (run_dir / name).read_text().splitlines()
  return [json.loads(x) for x in lines if x.strip()]


def exact_at(run_dir: pathlib.Path) -> dict[int, float]:
  """``{update: held-out exact answers}`` of a run's evaluations."""
  return {r["step"]: r["eval_rewards/exact_answer"] for r in _records(run_dir, "eval.jsonl")}


def sampling_seconds(run_dir: pathlib.Path) -> float:
  """Median ``rollout_s`` (seconds sampling an update) past the first ``SKIP`` records."""
  values = [r["rollout_s"] for r in _records(run_dir, "metrics.jsonl") if "rollout_s" in r]
  return float(np.median(values[SKIP:] if len(values) > SKIP else values))


def gains(grpo: pathlib.Path, filtered: pathlib.Path, distill: pathlib.Path) -> dict:
  g, d = exact_at(grpo), exact_at(distill)
  out = {
    "grpo_accuracy_gain_100": g[100] - g[0],
    "distill_accuracy_gain_100": d[100] - d[0],
    "rl_filter_overhead": sampling_seconds(filtered) / sampling_seconds(grpo),
  }
  if out["grpo_accuracy_gain_100"] > 0:
    out["distill_vs_grpo_accuracy_gain_100"] = (
      out["distill_accuracy_gain_100"] / out["grpo_accuracy_gain_100"]
    )
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m benchmarks.demo_gains", description=__doc__)
  for name in ("grpo", "filter", "distill"):
    p.add_argument(f"--{name}", type=pathlib.Path, required=True, help="a run directory")
  p.add_argument("--out", type=pathlib.Path, default=RESULTS)
  args = p.parse_args(argv)
  found = gains(args.grpo, args.filter, args.distill)
  curves = {n: exact_at(getattr(args, n)) for n in ("grpo", "filter", "distill")}
  write("demo_gains", {"summary": found, "held_out_exact": curves}, args.out)
  summary_path = args.out / "summary.json"
  summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
  write("summary", {**summary, **found}, args.out)
  print(json.dumps(found, indent=1))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
