"""Optimizers and schedules in training: update steps to a held-out loss, Muon against AdamW,
and the final held-out loss of warmup-stable-decay against cosine.

Every run is ``python -m jaxstep.train --config small`` (3.3 M parameters, G = 64 sequences
of 128 tokens, ``TRAINING_STEPS`` updates, warmup 40) with the held-out loss every
``EVAL_EVERY`` updates, in a subprocess of its own. Protocol:

1. lr sweep on seed 0: AdamW at ``ADAMW_LRS``, Muon at ``MUON_LRS`` (its AdamW part, on the
   embeddings, head and norms, at the config's lr 2e-3), doubled while the best is the
   largest tried (at most ``MAX_DOUBLINGS`` times), so that a best lr is inside the sweep;
   each optimizer's best lr is the one with the lowest final held-out loss.
2. Seeds 1 and 2 at each best lr.
3. The target loss is the higher of the two optimizers' median final losses (both reach
   it); a run's steps to it are interpolated linearly between evaluations.
   ``muon_steps_to_loss_over_adamw`` = median Muon steps ÷ median AdamW steps.
4. WSD (``optim.schedule=wsd``, the last 20 % a linear decay) at AdamW's best lr, seeds 0–2:
   ``wsd_final_loss_over_cosine`` = the median over seeds of its final held-out loss ÷
   cosine's with the same seed.

Steps, not seconds, are compared, so other work on the machine does not change the result.
``JAXSTEP_BENCH_RUNS=DIR`` keeps the runs in ``DIR`` and reuses the finished ones there.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys

from benchmarks.harness import scratch_dir

TRAINING_STEPS = 150
EVAL_EVERY = 10
ADAMW_LRS = (1e-3, 2e-3, 4e-3)
MUON_LRS = (0.01, 0.02, 0.04)
SEEDS = (0, 1, 2)
MAX_DOUBLINGS = 2
QUICK = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.max_seq_len=32",
         "train.seq_len=32", "train.global_batch_size=8", "train.grad_accum_steps=2",
         "optim.warmup_steps=0"]  # fmt: skip


def train_evals(overrides: list[str], run_dir: pathlib.Path, steps: int) -> list[tuple[int, float]]:
  """``(update step, held-out loss)`` of one run of the small config with ``overrides`` (a
  finished run of ``steps`` updates already in ``run_dir``: read back)."""
  if (run_dir / "eval.jsonl").is_file():
    done = _heldout(run_dir)
    if done and done[-1][0] == steps:
      return done
    import shutil

    shutil.rmtree(run_dir)
  args = [sys.executable, "-m", "jaxstep.train", "--config", "small", *overrides,
          f"run_dir={run_dir}", "train.progress=false", "checkpoint.every=0"]  # fmt: skip
  proc = subprocess.run(args, capture_output=True, text=True, timeout=3600)
  if proc.returncode != 0:
    raise RuntimeError(f"{' '.join(overrides)}: {proc.stderr[-2000:]}")
  return _heldout(run_dir)


def _heldout(run_dir: pathlib.Path) -> list[tuple[int, float]]:
  lines = [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines()]
  return [(r["step"], r["eval_loss"]) for r in lines if r.get("set", "heldout") == "heldout"]


def steps_to(evals: list[tuple[int, float]], target: float) -> float:
  """The update step at which the held-out loss first reaches ``target``, interpolated
  linearly between two evaluations (inf: never)."""
  previous = None
  for step, loss in evals:
    if loss <= target:
      if previous is None or previous[1] == loss:
        return float(step)
      (s0, l0) = previous
      return s0 + (step - s0) * (l0 - target) / (l0 - loss)
    previous = (step, loss)
  return float("inf")


def training_comparison(quick: bool) -> dict:
  """The protocol of the module docstring (``quick``: a one-block model, 6 updates, one lr
  and one seed each: the code path, not a measurement)."""
  steps = 6 if quick else TRAINING_STEPS
  base = [f"train.max_steps={steps}", f"train.eval_every={2 if quick else EVAL_EVERY}"]
  base += QUICK if quick else []
  lrs = {"adamw": ADAMW_LRS[1:2] if quick else ADAMW_LRS,
         "muon": MUON_LRS[1:2] if quick else MUON_LRS}  # fmt: skip
  seeds = SEEDS[:1] if quick else SEEDS
  kept = os.environ.get("JAXSTEP_BENCH_RUNS")
  root = pathlib.Path(kept) if kept else scratch_dir("jaxstep-optim-")
  runs: dict[str, list] = {}

  def run(name: str, extra: list[str]) -> list:
    if name not in runs:
      runs[name] = train_evals(base + extra, root / name, steps)
    return runs[name]

  def final(opt: str, lr: float) -> float:
    return run(f"{opt}_lr{lr:g}_s0", [f"optim.name={opt}", f"optim.lr={lr:g}"])[-1][1]

  sweep, best = {}, {}
  for opt, grid in lrs.items():
    sweep[opt] = {lr: final(opt, lr) for lr in grid}
    for _ in range(0 if quick else MAX_DOUBLINGS):
      top = max(sweep[opt])
      if min(sweep[opt], key=sweep[opt].get) != top:
        break
      sweep[opt][2 * top] = final(opt, 2 * top)
    best[opt] = min(sweep[opt], key=sweep[opt].get)
  finals, curves = {}, {}
  for opt in ("adamw", "muon"):
    extra = [f"optim.name={opt}", f"optim.lr={best[opt]:g}"]
    curves[opt] = [run(f"{opt}_lr{best[opt]:g}_s{s}", [*extra, f"train.seed={s}"] if s else extra)
                   for s in seeds]  # fmt: skip
    finals[opt] = statistics.median(c[-1][1] for c in curves[opt])
  target = max(finals.values())
  to_target = {o: [steps_to(c, target) for c in curves[o]] for o in curves}
  ratio = statistics.median(to_target["muon"]) / statistics.median(to_target["adamw"])
  wsd = [run(f"wsd_s{s}", [f"optim.lr={best['adamw']:g}", "optim.schedule=wsd", f"train.seed={s}"])
         for s in seeds]  # fmt: skip
  wsd_over_cosine = statistics.median(
    w[-1][1] / c[-1][1] for w, c in zip(wsd, curves["adamw"], strict=True)
  )
  return {
    "steps": steps,
    "sweep_final_loss": {o: {str(lr): v for lr, v in s.items()} for o, s in sweep.items()},
    "best_lr": best,
    "target_loss": target,
    "steps_to_target": to_target,
    "final_loss": {
      "adamw": [c[-1][1] for c in curves["adamw"]],
      "muon": [c[-1][1] for c in curves["muon"]],
      "wsd": [w[-1][1] for w in wsd],
    },  # fmt: skip
    "curves": runs,
    "muon_steps_to_loss_over_adamw": ratio,
    "wsd_final_loss_over_cosine": wsd_over_cosine,
  }
