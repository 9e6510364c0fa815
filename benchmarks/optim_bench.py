"""The optimizers' state, from their own abstract states (nothing allocated, nothing run):
per-parameter bytes of each ``optim.name`` on a Llama-shaped model. Headline key:
``adafactor_state_over_adamw`` (goal ≤ 0.1).

``STATE_MODEL`` (``tensor_bench``'s: d 1,024, 8 blocks, 16 / 8 heads, SwiGLU 2,816,
vocabulary 32,000, untied). Each optimizer is ``jaxstep.core.optim.make_optimizer`` with the
defaults of ``OptimConfig`` and only its name changed, its state's shapes from
``jax.eval_shape`` of its ``init``.
"""

from __future__ import annotations

import math

from benchmarks.tensor_bench import QUICK_STATE_MODEL, STATE_MODEL


def state_bytes(model: dict) -> dict:
  import jax

  from jaxstep import models
  from jaxstep.core.optim import OPTIMIZERS, OptimConfig, make_optimizer

  keys = ("vocab_size", "max_seq_len", "d_model", "n_layers", "n_heads", "n_kv_heads")
  cfg = models.LlamaConfig(
    **{k: model[k] for k in keys}, intermediate_size=model["intermediate_size"]
  )
  _, params = models.build(cfg, 0, abstract=True)
  size = lambda tree: sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa: E731
  out = {"params": size(params)}
  for name in OPTIMIZERS:
    init = make_optimizer(OptimConfig(name=name), 100).init
    out[name] = size(jax.eval_shape(init, params))
  return out


def suite_optim(quick: bool) -> dict:
  model = QUICK_STATE_MODEL if quick else STATE_MODEL
  b = state_bytes(model)
  ratio = b["adafactor"] / b["adamw"]
  mib = lambda n: f"{n / 2**20:,.1f} MiB"  # noqa: E731
  per = ", ".join(
    f"{n} {b[n] / b['params']:.3f}" for n in ("adamw", "muon", "lion", "sgd", "adafactor")
  )
  rows = [
    (
      f"optimizer state bytes, Adafactor ÷ AdamW (Llama d {model['d_model']}, "
      f"{model['n_layers']} blocks, vocab {model['vocab_size']:,}; {mib(b['adafactor'])} vs "
      f"{mib(b['adamw'])}; state ÷ params: {per})",
      f"{ratio:.4f}",
      "≤ 0.1",
    )
  ]
  from benchmarks.optim_training import training_comparison

  trained = training_comparison(quick)
  best = trained["best_lr"]
  sweeps = "; ".join(f"{o} {', '.join(lrs)}" for o, lrs in trained["sweep_final_loss"].items())
  times, time_rows = step_times(quick)
  rows += [
    (
      f"update steps to held-out loss {trained['target_loss']:.3f}, Muon (lr {best['muon']}) ÷ "
      f"AdamW (lr {best['adamw']}) (small config, {trained['steps']} updates, median of 3 "
      f"seeds, lr the best of {sweeps})",
      f"{trained['muon_steps_to_loss_over_adamw']:.3f}",
      "≤ 0.8",
    ),
    (
      f"held-out loss after {trained['steps']} updates, WSD ÷ cosine (AdamW lr {best['adamw']},"
      f" median over 3 seeds)",
      f"{trained['wsd_final_loss_over_cosine']:.3f}",
      "≤ 1.0",
    ),
  ]
  rows += time_rows
  summary = {
    **{f"step_time_over_adamw_{n}": v["median"] for n, v in times.items()},
    "adafactor_state_over_adamw": ratio,
    "muon_steps_to_loss_over_adamw": trained["muon_steps_to_loss_over_adamw"],
    "wsd_final_loss_over_cosine": trained["wsd_final_loss_over_cosine"],
  }
  return {
    "model": model,
    "bytes": b,
    "training": trained,
    "step_time_over_adamw": times,
    "rows": rows,
    "summary": summary,
  }


def step_times(quick: bool) -> tuple[dict, list]:
  """Each optimizer's update step time ÷ AdamW's, the small config's run loop in
  interleaved rounds (``loop`` workers, one per optimizer)."""
  from benchmarks.harness import fmt, measure, ratio_stats
  from benchmarks.loop_suites import QUICK_TINY

  # the smoke run (--quick) times Muon's only: each optimizer is a worker process of its own,
  # and tests/test_optimizers.py trains every optimizer through jaxstep train anyway
  names = ("adamw", "muon") if quick else ("adamw", "muon", "adafactor", "lion", "sgd")
  base = {"kind": "loop", "config": "tiny" if quick else "small", "steps": 2 if quick else 6}
  extra = QUICK_TINY if quick else []
  specs = {n: {**base, "overrides": [*extra, f"optim.name={n}"]} for n in names}
  res, _, _ = measure(specs, rounds=1 if quick else 5)
  step = {n: [r["median_step"] for r in rounds] for n, rounds in res.items()}
  times = {n: ratio_stats(step[n], step["adamw"]) for n in names[1:]}
  rows = [
    (f"update step time, {n} ÷ AdamW (the small config's loop, G = 64 × 128, K = 8)", fmt(v), "")
    for n, v in times.items()
  ]
  return times, rows
