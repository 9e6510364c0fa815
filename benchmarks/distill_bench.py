"""On-policy distillation's update against a GRPO update of the same rollout: headline key
``distill_step_over_grpo`` (goal ≤ 1.3), in the rl suite.

Both are whole ``jaxstep train`` runs (``rl_bench.rl_run``, in a worker, interleaved rounds)
of ``grpo-arith``'s settings (32 prompts × 8 completions of ``bundled:sums``, 5 new tokens,
K = 4) on the ``tiny`` config's GPT with random weights; the distillation run adds
``distill.teacher``: a run directory of the same model (trained one update on
``bundled:sum-docs``, the same byte vocabulary), so the extra is the teacher's forward over
each micro-batch in the step. A round's ratio is the two runs' median update wall times
(updates ``rl_bench.SKIP`` … , compiles left out).
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import tempfile


def make_teacher(root: pathlib.Path, overrides: list[str]) -> pathlib.Path:
  """A run directory of the ``tiny`` config (with ``overrides``: the student's shape),
  trained one update on the bundled sums' documents."""
  run_dir = root / "teacher"
  args = ["train", "--config", "tiny", "data.path=bundled:sum-docs", "train.max_steps=1",
          "train.progress=false", "train.eval_every=0", "train.sample_every=0",
          f"run_dir={run_dir}", *overrides]  # fmt: skip
  done = subprocess.run([sys.executable, "-m", "jaxstep", *args], capture_output=True, text=True)
  if done.returncode:
    raise RuntimeError(f"the teacher did not train: {done.stderr[-2000:]}")
  return run_dir


def distill_rows(quick: bool) -> tuple[dict, list, dict]:
  """``distill_step_over_grpo``: an on-policy distillation update ÷ a GRPO update."""
  from benchmarks.harness import fmt, measure, ratio_stats
  from benchmarks.rl_bench import QUICK_RUN, RUN, RUN_ROUNDS, SKIP, UPDATES

  shape = QUICK_RUN if quick else []
  updates = SKIP + 2 if quick else UPDATES
  with tempfile.TemporaryDirectory(prefix="jaxstep-bench-distill-") as tmp:
    teacher = make_teacher(pathlib.Path(tmp), shape)
    taught = [*shape, f"distill.teacher={teacher}", "distill.mode=on_policy"]
    specs = {
      "grpo": {"kind": "rl_run", "overrides": shape, "updates": updates},
      "distill": {"kind": "rl_run", "overrides": taught, "updates": updates},
    }
    res, info, failed = measure(specs, rounds=1 if quick else RUN_ROUNDS)
  out = {"config": {"run": RUN, "grpo": shape, "distill": taught, "updates": updates}}
  out |= {"raw": res, "info": info, "failed": failed}
  if failed:
    return out, [("on-policy distillation update", "did not run here (see rl.json)", "")], {}
  wall = {n: [r["median"]["wall"] for r in rs] for n, rs in res.items()}
  stats = ratio_stats(wall["distill"], wall["grpo"])
  out["distill_step_over_grpo"] = stats
  ms = lambda n: f"{ratio_stats(wall[n], 1)['median'] * 1000:.1f} ms"  # noqa: E731
  row = (
    "on-policy distillation update ÷ GRPO update, whole `jaxstep train` updates of "
    "grpo-arith's settings on the tiny GPT, a teacher of the same shape "
    f"({ms('distill')} vs {ms('grpo')} per update)",
    fmt(stats),
    "≤ 1.3",
  )
  return out, [row], {"distill_step_over_grpo": stats["median"]}
