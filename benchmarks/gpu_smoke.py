"""The GPU check in one process, one JSON line: ``bash benchmarks/gpu_smoke.sh`` (GPU) or
``python -m benchmarks.gpu_smoke --tiny`` (any host, tiny shapes; what the tests run).

For gpt2-124m and gpt-1.3b in bf16, for each attention kernel (``cudnn`` and ``xla`` on a
GPU; ``blocked`` and ``xla`` elsewhere) and remat (``none`` and ``block``), and for a 1.08 B
Llama (``model.family=llama``: Llama 3.2 1B's blocks on gpt-1.3b's vocabulary, sequence and
scanned layers) in one case, the first kernel (``cudnn`` on a GPU) with remat ``block``:
tokens/s, MFU (``flops_per_token``: 6·W + attention, against 989 TFLOP/s on a GPU), peak
device memory, and the K that ``grad_accum_steps: auto`` chose. Then the checkpoint round
trip: the session state saved by orbax from the device, restored onto the device (bitwise
equal, and one more step from it equal to the same step from the original), and restored
onto the CPU (bitwise equal). Batches are random tokens: this measures the step, not data.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import jax
import numpy as np

from jaxstep.trainer.config import loading as config_lib
from jaxstep.trainer.plan.auto_accum import GIB
from jaxstep.trainer.plan.build import build
from jaxstep.trainer.store.checkpoint import Checkpointer
from jaxstep.trainer.tracking.mfu import mfu, peak_flops_per_device

GPU_PEAK_TFLOPS = 989.0  # H100/H200 SXM dense bf16
# Llama 3.2 1B's blocks (16 × d 2048, 32 query / 8 key-value heads, SwiGLU 8192, tied head)
# on gpt-1.3b's 50,304 ids and 2,048 tokens, remat block, scanned: 1.08 B parameters
LLAMA_1B = [
  "model.family=llama",
  "model.n_layers=16",
  "model.n_heads=32",
  "model.n_kv_heads=8",
  "model.intermediate_size=8192",
  "model.tie_embeddings=true",
]
TINY = [
  "model.d_model=32",
  "model.n_layers=2",
  "model.n_heads=2",
  "model.max_seq_len=32",
  "model.vocab_size=264",
  "train.seq_len=32",
  "train.memory_budget_gb=0.05",
]
# one sequence per update: auto K has one candidate to compile, so the Llama adds little time
TINY_LLAMA = [
  *TINY,
  "model.n_kv_heads=1",
  "model.intermediate_size=64",
  "train.global_batch_size=1",
]
# name, bundled config, global batch (smaller than the configs': a smoke test, not a run),
# model overrides (full size, tiny), every attention kernel × remat (else one case: the
# first kernel, remat block)
MODELS = [
  ("gpt2-124m", "gpt2-124m", 64, ([], TINY), True),
  ("gpt-1.3b", "gpt-1.3b", 16, ([], TINY), True),
  ("llama-1b", "gpt-1.3b", 16, (LLAMA_1B, TINY_LLAMA), False),
]


def _config(model: tuple, overrides: list[str], run_dir: str, tiny: bool):
  _, config, batch, (full, small), _ = model
  base = [
    "data.path=bundled:text",
    "data.eval_fraction=0",
    f"train.global_batch_size={8 if tiny else batch}",
    "train.progress=false",
    f"run_dir={run_dir}",
  ]
  return config_lib.load(config, [*base, *full, *(small if tiny else []), *overrides])


def _random_batch(run, seed: int = 0) -> dict:
  t = run.cfg.train
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, 256, (t.global_batch_size, t.seq_len + 1), dtype=np.int32)
  batch = {
    "inputs": ids[:, :-1],
    "targets": ids[:, 1:],
    "loss_mask": np.ones((t.global_batch_size, t.seq_len), np.int32),
  }
  return jax.device_put(batch, run.batch_sharding)


def _peak_memory(device) -> int | None:
  stats = device.memory_stats() or {}
  return stats.get("peak_bytes_in_use")


def measure(model, attention, remat, steps, tiny) -> dict:
  """One case of ``model`` (a ``MODELS`` entry): build (``grad_accum_steps: auto``), one
  step to compile, ``steps`` timed."""
  overrides = [
    f"model.attention={attention}",
    f"model.remat={remat}",
    "train.grad_accum_steps=auto",
  ]
  with tempfile.TemporaryDirectory() as run_dir:
    cfg = _config(model, overrides, run_dir, tiny)
    t0 = time.perf_counter()
    run, state, _ = build(cfg)
    num_params = sum(x.size for x in jax.tree.leaves(state.params))
    data = _random_batch(run)
    state, metrics = run.step_fn(state, data)
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(steps):
      state, metrics = run.step_fn(state, data)
    jax.block_until_ready((state, metrics))
    seconds = (time.perf_counter() - t0) / steps
  t = run.cfg.train
  tokens_per_s = t.global_batch_size * t.seq_len / seconds
  peak = peak_flops_per_device(GPU_PEAK_TFLOPS if jax.default_backend() == "gpu" else 0.0)
  memory = _peak_memory(jax.local_devices()[0])
  return {
    "model": model[0],
    "family": type(run.cfg.model).__name__,
    "params": num_params,
    "attention": attention,
    "remat": remat,
    "grad_accum_steps": t.grad_accum_steps,
    "auto_table_gib": {k: round(b / GIB, 3) for k, b in run.accum_table},
    "global_batch_size": t.global_batch_size,
    "step_s": round(seconds, 4),
    "tokens_per_s": round(tokens_per_s, 1),
    "mfu": round(mfu(run.flops_per_token, tokens_per_s, peak, run.mesh.devices.size), 4),
    "device_peak_memory_gib": None if memory is None else round(memory / GIB, 3),
    "build_and_first_step_s": round(compile_s, 1),
    "loss": float(metrics["loss"]),
  }


def _bitwise_equal(a, b) -> bool:
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(leaves_a) == len(leaves_b) and all(
    np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(leaves_a, leaves_b, strict=True)
  )


def _abstract(state, sharding=None):
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding or x.sharding), state
  )


def checkpoint_round_trip(model: tuple, tiny: bool) -> dict:
  """Save from the device, restore on the device and on the CPU, continue one step."""
  with tempfile.TemporaryDirectory() as run_dir:
    run, state, _ = build(_config(model, ["train.grad_accum_steps=4"], run_dir, tiny))
    data = _random_batch(run)
    state, _ = run.step_fn(state, data)  # a state with non-zero moments
    host, target = jax.device_get(state), _abstract(state)
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    with Checkpointer(f"{run_dir}/checkpoints") as ckpt:
      t0 = time.perf_counter()
      ckpt.save(1, state)
      ckpt.wait()
      save_s = time.perf_counter() - t0
      t0 = time.perf_counter()
      restored = ckpt.restore(target).state
      jax.block_until_ready(restored)
      restore_s = time.perf_counter() - t0
      on_cpu = ckpt.restore(_abstract(state, cpu)).state
    checks = {
      "restored_on_device_bitwise": _bitwise_equal(restored, host),
      "restored_on_cpu_bitwise": _bitwise_equal(on_cpu, host),
      "cpu_copy_platform": jax.tree.leaves(on_cpu)[0].devices().pop().platform,
    }
    original = jax.device_put(host, jax.tree.map(lambda x: x.sharding, target))
    after_original = jax.device_get(run.step_fn(original, data))  # both donate their state
    checks["next_step_bitwise"] = _bitwise_equal(after_original, run.step_fn(restored, data))
  return {
    "state_gib": round(sum(x.nbytes for x in jax.tree.leaves(host)) / GIB, 3),
    "save_s": round(save_s, 2),
    "restore_s": round(restore_s, 2),
    **checks,
  }


CHECKS = ("restored_on_device_bitwise", "next_step_bitwise", "restored_on_cpu_bitwise")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tiny", action="store_true", help="tiny shapes (any host)")
  parser.add_argument("--steps", type=int, default=5, help="timed update steps per case")
  parser.add_argument("--budget-s", type=float, default=390, help="skip cases started later")
  parser.add_argument(
    "--max-cases", type=int, default=0, help="run only this many per model (0 = all)"
  )
  parser.add_argument(
    "--models",
    nargs="+",
    choices=[m[0] for m in MODELS],
    help="measure only these models (default: all; the others' cases are listed as skipped)",
  )
  parser.add_argument("--out", help="also write the JSON line to this file")
  args = parser.parse_args(argv)
  start = time.perf_counter()
  kernels = ["cudnn", "xla"] if jax.default_backend() == "gpu" else ["blocked", "xla"]
  result = {"platform": jax.default_backend(), "device": jax.devices()[0].device_kind}
  result["checkpoint"] = checkpoint_round_trip(MODELS[0], args.tiny)
  result["cases"], result["skipped"] = [], []
  for model in MODELS:
    name, every = model[0], model[-1]
    variants = (
      [(a, r) for a in kernels for r in ("block", "none")] if every else [(kernels[0], "block")]
    )
    measured = 0
    for attention, remat in variants:
      over_time = time.perf_counter() - start > args.budget_s
      chosen = args.models is None or name in args.models
      if over_time or not chosen or measured == (args.max_cases or -1):
        result["skipped"].append(f"{name} {attention} remat={remat}")
        continue
      case = measure(model, attention, remat, args.steps, args.tiny)
      measured += 1
      result["cases"].append(case)
      print(json.dumps(case), file=sys.stderr, flush=True)
  result["seconds"] = round(time.perf_counter() - start, 1)
  line = json.dumps(result)
  print(line)
  if args.out:
    with open(args.out, "w") as f:
      f.write(line + "\n")
  return 0 if all(result["checkpoint"][k] for k in CHECKS) else 1


if __name__ == "__main__":
  sys.exit(main())
