"""LoRA against full fine-tuning of the same Llama, paired in one run.

- Memory (``jaxstep.trainer.plan.memory.compiled_memory``: the real train step compiled on
  abstract inputs, nothing allocated): a GPT-2-124M-sized Llama (``MEMORY_MODEL``: d 768,
  12 blocks, 12 heads, SwiGLU 2048, vocabulary 50,304 tied, scanned blocks), one sequence of
  1,024 tokens per micro-step, K = 4. Full fine-tuning (fp32 params + Adam) against LoRA
  rank 8 on every projection: the persistent state (params + optimizer state) with the
  frozen base in bf16, and the compiled step's peak per device with the base in fp32 and in
  bf16 (XLA:CPU widens a bf16 weight into a temporary fp32 copy at each use, so the bf16 base
  that halves the state raises the step's temporaries).
- Checkpoint: the bytes a checkpoint of each run holds — the whole state, against a LoRA
  run from ``model.init_from``, which stores the adapters, their Adam moments and the
  counters (``Checkpointer(stored=…)``); summed from the same abstract states.
- Speed: tokens/s of the train step (``step_bench``'s ``jaxstep`` contender, CPU defaults)
  on ``hf_bench.TRAIN_MODEL``, full against LoRA rank 8 (fp32 base: a bf16 weight is
  widened at every matmul on a CPU), interleaved rounds.
"""

from __future__ import annotations

from benchmarks.hf_bench import QUICK_TRAIN_MODEL, TRAIN_MODEL

MEMORY_MODEL = {
  "family": "llama",
  "vocab_size": 50304,
  "max_seq_len": 1024,
  "d_model": 768,
  "n_layers": 12,
  "n_heads": 12,
  "intermediate_size": 2048,
  "tie_embeddings": True,
  "scan_layers": True,
}
QUICK_MEMORY_MODEL = {**MEMORY_MODEL, "vocab_size": 512, "max_seq_len": 32, "d_model": 32}
QUICK_MEMORY_MODEL |= {"n_layers": 1, "n_heads": 2, "intermediate_size": 64}
LORA = ["model.lora.rank=8"]


def _config(model: dict, extra: list[str], g: int, k: int):
  from jaxstep.trainer.config import loading as config_lib

  overrides = [f"model.{key}={value}" for key, value in model.items()]
  overrides += [f"train.seq_len={model['max_seq_len']}", f"train.global_batch_size={g}"]
  overrides += [f"train.grad_accum_steps={k}", "mesh.cpu_devices=1", *extra]
  return config_lib.load("tiny", overrides)


def _stored_bytes(cfg) -> tuple[int, int]:
  """``(whole state, what a checkpoint of a model.init_from run holds)`` in bytes, from the
  abstract train state."""
  import jax

  from jaxstep.core import freeze
  from jaxstep.trainer.plan import steps
  from jaxstep.trainer.plan.numbers import make_plan

  plan = make_plan(cfg)
  _, state = steps.abstract_state(plan.cfg, plan.mesh, plan.schedule_steps)
  size = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa: E731
  trainable = steps.trainable(plan.cfg)
  kept = (
    state
    if trainable is None
    else state.replace(params=freeze.partition(state.params, trainable)[0])
  )
  return size(state), size(kept)


def memory_rows(quick: bool) -> dict:
  from jaxstep.trainer.plan.memory import compiled_memory

  model = QUICK_MEMORY_MODEL if quick else MEMORY_MODEL
  out = {}
  variants = {"full": [], "lora": LORA, "lora_bf16": [*LORA, "optim.frozen_dtype=bf16"]}
  for name, extra in variants.items():
    cfg = _config(model, extra, 4, 4)
    c = compiled_memory(cfg)
    whole, kept = _stored_bytes(cfg)
    out[name] = {
      "num_params": c["num_params"],
      "trainable_params": c["trainable_params"],
      "state_bytes": c["state_bytes"],
      "peak_bytes": c["peak_bytes"],
      "checkpoint_bytes": whole if name == "full" else kept,
    }
  return {"model": model, "g": 4, "k": 4, **out}


def suite_lora(quick: bool) -> dict:
  """LoRA's state, step peak and checkpoint bytes ÷ full fine-tuning's, and its speed."""
  from benchmarks.harness import fmt, measure, ratio_stats

  mem = memory_rows(quick)
  full, lora, bf16 = mem["full"], mem["lora"], mem["lora_bf16"]
  model, g, k = (QUICK_TRAIN_MODEL, 8, 2) if quick else (TRAIN_MODEL, 32, 8)
  base = {"kind": "jaxstep", "model": model, "g": g, "k": k}
  specs = {"full": base, "lora": {**base, "overrides": LORA}}
  res, info, failed = measure(specs, rounds=1 if quick else 8)
  speed = ratio_stats([r["seconds"] for r in res["full"]], [r["seconds"] for r in res["lora"]])
  ratios = {
    "lora_state_over_full": bf16["state_bytes"] / full["state_bytes"],
    "lora_fp32_base_state_over_full": lora["state_bytes"] / full["state_bytes"],
    "lora_step_peak_over_full": lora["peak_bytes"] / full["peak_bytes"],
    "lora_bf16_base_step_peak_over_full": bf16["peak_bytes"] / full["peak_bytes"],
    "lora_checkpoint_bytes_over_full": lora["checkpoint_bytes"] / full["checkpoint_bytes"],
  }
  shape = (
    f"{full['num_params'] / 1e6:.0f} M-param Llama, LoRA r=8 on every projection "
    f"({lora['trainable_params'] / 1e6:.2f} M trainable)"
  )
  gib = lambda b: f"{b / 2**30:.3f} GiB"  # noqa: E731
  rows = [
    (
      f"persistent state (params + Adam), LoRA with a bf16 base ÷ full ({shape}; "
      f"{gib(bf16['state_bytes'])} vs {gib(full['state_bytes'])})",
      f"{ratios['lora_state_over_full']:.3f}",
      "≤ 0.30",
    ),
    (
      f"persistent state, LoRA with an fp32 base ÷ full ({gib(lora['state_bytes'])})",
      f"{ratios['lora_fp32_base_state_over_full']:.3f}",
      "",
    ),
    (
      f"compiled step peak, LoRA with an fp32 base ÷ full ({gib(lora['peak_bytes'])} vs "
      f"{gib(full['peak_bytes'])}; 1 × {mem['model']['max_seq_len']} tokens per micro-step)",
      f"{ratios['lora_step_peak_over_full']:.3f}",
      "≤ 0.6",
    ),
    (
      f"compiled step peak, LoRA with a bf16 base ÷ full ({gib(bf16['peak_bytes'])})",
      f"{ratios['lora_bf16_base_step_peak_over_full']:.3f}",
      "",
    ),
    (
      "checkpoint bytes, LoRA run from model.init_from ÷ full "
      f"({lora['checkpoint_bytes'] / 2**20:.1f} MiB vs {full['checkpoint_bytes'] / 2**20:.0f} MiB)",
      f"{ratios['lora_checkpoint_bytes_over_full']:.4f}",
      "≤ 0.05",
    ),
    (
      f"train step tokens/s, LoRA ÷ full (d {model['d_model']}, {model['n_layers']} layers, "
      f"G={g} × {model['max_seq_len']}, K={k})",
      fmt(speed),
      "≥ 1.0",
    ),
  ]
  summary = {**ratios, "lora_tokens_over_full": speed["median"]}
  return {
    "memory": mem,
    "train": base,
    "raw": res,
    "info": info,
    "failed": failed,
    "speed": speed,
    "rows": rows,
    "summary": summary,
  }
