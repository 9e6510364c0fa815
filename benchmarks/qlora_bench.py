"""QLoRA (``model.lora.base_quant``): the quantized base's bytes and the step's time.

Bytes (no worker, nothing allocated): the frozen base of a Llama-3-8B-shaped model (32
blocks of width 4,096, SwiGLU 14,336, 32 / 8 heads, vocabulary 128,256, untied) as a QLoRA
run stores it, NF4 in blocks of 64 with an fp32 scale each, ÷ the same weights in bf16:
the block weights it quantizes (``qlora_nf4_base_bytes_over_bf16``), and the whole frozen
model with the embeddings and the head left in bf16 (``qlora_nf4_model_bytes_over_bf16``),
as bitsandbytes leaves them.

Time (``qlora_step``, interleaved workers): a LoRA SFT step (rank 16 on every projection,
scanned blocks, remat ``block``, as a run from a model folder) with the base in NF4 ÷ the
same step with the base in bf16, one CPU device, median of per-round ratios
(``qlora_step_over_lora_bf16``): the NF4 step dequantizes each block's weights in the
forward pass and again in the backward pass's recompute.
"""

from __future__ import annotations

LLAMA3_8B = dict(
  vocab_size=128_256, max_seq_len=8192, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
  intermediate_size=14_336, scan_layers=True,
)  # fmt: skip
SMALL = dict(
  vocab_size=8192, max_seq_len=256, d_model=576, n_layers=4, n_heads=9, n_kv_heads=3,
  head_dim=64, intermediate_size=1536, tie_embeddings=True, scan_layers=True, remat="block",
)  # fmt: skip
QUICK_SMALL = {**SMALL, "n_layers": 2, "max_seq_len": 64, "d_model": 128, "n_heads": 2,
               "n_kv_heads": 1, "intermediate_size": 256}  # fmt: skip


def base_bytes(model: dict, block: int = 64) -> dict:
  """Bytes of ``model``'s frozen base in bf16 and as NF4 stores it (abstract params)."""
  import jax
  import jax.numpy as jnp

  from jaxstep import models
  from jaxstep.core.trees import path_name
  from jaxstep.models import quant

  _, params = models.build(models.LlamaConfig(**model), 0, abstract=True)
  bf16 = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), params)
  stored = quant.quantized(bf16, "nf4", block)
  leaves = jax.tree_util.tree_flatten_with_path(bf16)[0]
  weights = {path_name(p) for p, _ in leaves if quant.quantizable(path_name(p))}

  def part(tree, names):
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=quant.is_quantized)[0]
    return quant.nbytes([x for p, x in flat if (path_name(p) in weights) == names])

  return {
    "bf16_weights": part(bf16, True),
    "nf4_weights": part(stored, True),
    "bf16_rest": part(bf16, False),
  }


def qlora_step(spec: dict):
  """Seconds of one LoRA SFT step with the base in ``spec["base"]`` (bf16 | nf4)."""
  from jaxstep.parallel.cpu_devices import configure_cpu_defaults

  configure_cpu_defaults(spec["rows"], 1, cpu_devices=1)  # the CLI's flags, one device
  import jax.numpy as jnp

  from benchmarks.step_bench import full_batch, timed_step
  from jaxstep import make_train_step, models
  from jaxstep.core import freeze
  from jaxstep.core.losses import next_token_loss
  from jaxstep.core.optim import OptimConfig, make_optimizer
  from jaxstep.models import lora, quant

  cfg = models.LlamaConfig(**spec["model"], lora=lora.LoraConfig(rank=16))
  apply_fn, params = models.build(cfg, 0)
  trainable = freeze.by_patterns([lora.ADAPTER])
  params = freeze.cast_frozen(params, trainable, jnp.bfloat16)
  if spec["base"] == "nf4":
    params = quant.quantized(params, "nf4", 64, lambda name: "/lora/" not in name)
  opt = make_optimizer(OptimConfig(lr=1e-3, warmup_steps=0), 1000)
  step = make_train_step(next_token_loss(apply_fn, 0), opt, grad_accum_steps=1, trainable=trainable)
  batch = full_batch(spec["rows"], cfg.max_seq_len, cfg.vocab_size)
  return timed_step(step, step.init(params, 0), batch, spec.get("repeats", 2))


CONTENDERS = {"qlora_step": qlora_step}


def suite_qlora(quick: bool) -> dict:
  """``qlora_nf4_base_bytes_over_bf16``, ``qlora_nf4_model_bytes_over_bf16`` and
  ``qlora_step_over_lora_bf16``."""
  from benchmarks.harness import fmt, measure, ratio_stats

  sizes = base_bytes(LLAMA3_8B)
  weights = sizes["nf4_weights"] / sizes["bf16_weights"]
  whole = (sizes["nf4_weights"] + sizes["bf16_rest"]) / (sizes["bf16_weights"] + sizes["bf16_rest"])
  model = QUICK_SMALL if quick else SMALL
  rows = 2 if quick else 4
  base = {"kind": "qlora_step", "model": model, "rows": rows}
  specs = {"bf16": {**base, "base": "bf16"}, "nf4": {**base, "base": "nf4"}}
  res, info, failed = measure(specs, rounds=1 if quick else 7)
  sec = {n: [r["seconds"] for r in runs] for n, runs in res.items()}
  time_ratio = ratio_stats(sec["nf4"], sec["bf16"])
  gib = 2**30
  rows_out = [
    (
      f"the block weights of a Llama-3-8B-shaped base in NF4 (blocks of 64, an fp32 scale "
      f"each) ÷ bf16 ({sizes['nf4_weights'] / gib:.2f} GiB vs "
      f"{sizes['bf16_weights'] / gib:.2f} GiB)",
      f"{weights:.3f}",
      "≤ 0.3",
    ),
    (
      f"that whole frozen model, the embeddings and head ({sizes['bf16_rest'] / gib:.2f} "
      f"GiB) left in bf16, ÷ all of it in bf16",
      f"{whole:.3f}",
      "record",
    ),
    (
      f"LoRA SFT step seconds (rank 16 on every projection, {model['n_layers']} blocks of "
      f"width {model['d_model']}, {rows} × {model['max_seq_len']} tokens, remat block, one "
      f"CPU device), NF4 base ÷ bf16 base",
      fmt(time_ratio),
      "≤ 1.5",
    ),
  ]
  return {
    "config": {"bytes_model": LLAMA3_8B, **base},
    "bytes": sizes,
    "raw": res,
    "info": info,
    "failed": failed,
    "rows": rows_out,
    "summary": {
      "qlora_nf4_base_bytes_over_bf16": weights,
      "qlora_nf4_model_bytes_over_bf16": whole,
      "qlora_step_over_lora_bf16": time_ratio["median"],
    },
  }
