"""Tensor parallelism on 8 virtual CPU devices: what the split saves in state, and what it
costs in speed on a CPU. Headline keys: ``tp8_state_bytes_over_tp1`` (goal ≤ 0.13) and
``tp_tokens_vs_dp`` (recorded to catch regressions, not a target: on one CPU the tensor
collectives are memory copies that data parallelism does not need).

- State (``STATE_MODEL``, a Llama-shaped model: d 1,024, 8 scanned blocks, 16 query / 8
  key-value heads, SwiGLU 2,816, vocabulary 32,000, untied): the per-device bytes of the
  persistent train state (params + AdamW moments + counters) as ``jaxstep train`` lays it
  out, from the abstract state's shardings (nothing allocated, nothing compiled), with
  ``mesh.tensor=8`` against ``mesh.data=8`` (every device a whole replica).
- Speed (``SPEED_MODEL``, ``hf_bench.TRAIN_MODEL`` with 8 query and key-value heads): train
  step tokens/s, ``step_bench``'s ``jaxstep`` contender on 8 virtual devices, tensor 8 ÷
  data 8, interleaved rounds.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from benchmarks.hf_bench import QUICK_TRAIN_MODEL, TRAIN_MODEL

STATE_MODEL = {
  "family": "llama",
  "vocab_size": 32000,
  "max_seq_len": 512,
  "d_model": 1024,
  "n_layers": 8,
  "n_heads": 16,
  "n_kv_heads": 8,
  "intermediate_size": 2816,
  "tie_embeddings": False,
  "scan_layers": True,
}
QUICK_STATE_MODEL = {**STATE_MODEL, "vocab_size": 512, "d_model": 64, "n_layers": 1}
QUICK_STATE_MODEL |= {"intermediate_size": 128, "max_seq_len": 32}
SPEED_MODEL = {**TRAIN_MODEL, "n_heads": 8, "n_kv_heads": 8}
QUICK_SPEED_MODEL = {**QUICK_TRAIN_MODEL, "n_heads": 8, "n_kv_heads": 8, "d_model": 64}
DEVICES = 8


def _overrides(model: dict, mesh: list[str]) -> list[str]:
  out = [f"model.{k}={v}" for k, v in model.items()]
  out += [f"train.seq_len={model['max_seq_len']}", "train.global_batch_size=8"]
  return [*out, "train.grad_accum_steps=1", *mesh]


def state_bytes(model: dict, tensor: int) -> int:
  """Per-device bytes of the train state on ``DEVICES`` devices (run in a fresh process)."""
  import jax

  from jaxstep.trainer.config import loading as config_lib
  from jaxstep.trainer.plan import steps
  from jaxstep.trainer.plan.numbers import configure_devices, make_plan

  mesh = [f"mesh.cpu_devices={DEVICES}", f"mesh.tensor={tensor}", f"mesh.data={DEVICES // tensor}"]
  cfg = config_lib.load("tiny", _overrides(model, mesh))
  configure_devices(cfg)
  plan = make_plan(cfg)
  _, state = steps.abstract_state(plan.cfg, plan.mesh, plan.schedule_steps)

  def shard(x) -> int:
    return x.dtype.itemsize * math.prod(x.sharding.shard_shape(x.shape))

  return sum(shard(x) for x in jax.tree.leaves(state))


def _state_bytes_in_a_process(model: dict, tensor: int) -> int:
  proc = subprocess.run(
    [sys.executable, "-m", "benchmarks.tensor_bench", json.dumps(model), str(tensor)],
    capture_output=True,
    text=True,
    timeout=600,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  if proc.returncode:
    raise RuntimeError(proc.stderr[-2000:])
  return int(proc.stdout.strip().splitlines()[-1])


def suite_tensor(quick: bool) -> dict:
  """Per-device state bytes, tensor 8 ÷ tensor 1, and train-step speed, tensor 8 ÷ data 8."""
  from benchmarks.harness import fmt, measure, ratio_stats

  state_model = QUICK_STATE_MODEL if quick else STATE_MODEL
  tp8, tp1 = (_state_bytes_in_a_process(state_model, t) for t in (DEVICES, 1))
  model = QUICK_SPEED_MODEL if quick else SPEED_MODEL
  g, k = (8, 1) if quick else (16, 2)
  base = {"kind": "jaxstep", "model": model, "g": g, "k": k}
  cpus = f"mesh.cpu_devices={DEVICES}"
  specs = {
    "data": {**base, "overrides": [cpus, f"mesh.data={DEVICES}"]},
    "tensor": {**base, "overrides": [cpus, "mesh.data=1", f"mesh.tensor={DEVICES}"]},
  }
  res, info, failed = measure(specs, rounds=1 if quick else 6)
  summary = {"tp8_state_bytes_over_tp1": tp8 / tp1}
  mib = lambda b: f"{b / 2**20:,.1f} MiB"  # noqa: E731
  rows = [
    (
      f"train state bytes per device, mesh.tensor=8 ÷ mesh.data=8 (Llama d "
      f"{state_model['d_model']}, {state_model['n_layers']} blocks, vocab "
      f"{state_model['vocab_size']:,}; {mib(tp8)} vs {mib(tp1)})",
      f"{tp8 / tp1:.3f}",
      "≤ 0.13",
    )
  ]
  out = {"state": {"model": state_model, "tp8_bytes": tp8, "tp1_bytes": tp1}}
  if not failed:
    speed = ratio_stats([r["seconds"] for r in res["data"]], [r["seconds"] for r in res["tensor"]])
    summary["tp_tokens_vs_dp"] = speed["median"]
    rows.append((
      f"train step tokens/s on {DEVICES} virtual CPU devices, tensor {DEVICES} ÷ data "
      f"{DEVICES} (Llama d {model['d_model']}, {model['n_layers']} layers, G={g} × "
      f"{model['max_seq_len']}, K={k}; a regression check, not a target: on a CPU the "
      f"tensor collectives are copies data parallelism does not make)",
      fmt(speed),
      "",
    ))  # fmt: skip
    out["speed"] = speed
  for name in failed:
    rows.append((f"tensor speed: {name}", "did not run here (see `failed` in tensor.json)", ""))
  return {**out, "train": base, "raw": res, "info": info, "failed": failed, "rows": rows,
          "summary": summary}  # fmt: skip


if __name__ == "__main__":
  print(state_bytes(json.loads(sys.argv[1]), int(sys.argv[2])))
