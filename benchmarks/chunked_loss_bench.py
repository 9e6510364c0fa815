"""The loss from the hidden states in chunks (``model.loss_chunk``) against the whole logits.

Memory (``ce_memory``, a worker per loss, nothing allocated): the compiled temporaries of a
SmolLM2-135M-shaped SFT step (vocabulary 49,152, 30 blocks of width 576, tied head;
``scan_layers`` and ``remat: block``, what a run from a model folder uses) on 8 sequences
of 2,048 tokens in one micro-step, ``loss_chunk: auto`` ÷ ``0``
(``ce_chunked_temp_over_full``); the same for a LoRA DPO step on 4 pairs of those
sequences, the reference the adapters off (``dpo_chunked_temp_over_full``); and for a LoRA
GRPO step on 8 completions with a KL to that reference (``grpo_chunked_temp_over_full``).

Time (``ce_step``, interleaved workers): a step whose time the head dominates (width 256,
2 blocks, vocabulary 49,152, 4 × 512 tokens, one CPU device), chunked ÷ whole, median of
per-round ratios (``ce_chunked_step_time_over_full``): the chunked loss computes each
chunk's gradients with its loss (the same three products of the head's size as the whole
logits), in a loop of chunks instead of three large products.
"""

from __future__ import annotations

SMOLLM2 = dict(
  vocab_size=49_152, max_seq_len=2048, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
  head_dim=64, intermediate_size=1536, tie_embeddings=True, scan_layers=True, remat="block",
)  # fmt: skip
QUICK_SMOLLM2 = {**SMOLLM2, "n_layers": 2, "max_seq_len": 256}
HEAD_HEAVY = dict(
  vocab_size=49_152, max_seq_len=512, d_model=256, n_layers=2, n_heads=4,
  intermediate_size=704, tie_embeddings=True,
)  # fmt: skip
QUICK_HEAD_HEAVY = {**HEAD_HEAVY, "vocab_size": 8192, "max_seq_len": 128}


def _step(model: dict, chunk, rows: int, loss: str = "sft"):
  """``(jitted step, state, batch)`` of ``model`` (a ``LlamaConfig``'s fields) in chunks of
  ``chunk``, K = 1: ``sft``, full fine-tuning on ``rows`` sequences of ``max_seq_len``
  tokens; ``dpo``, LoRA (rank 16 on every projection) DPO on ``rows / 2`` pairs, the
  reference the adapters switched off."""
  import jax
  import jax.numpy as jnp

  from jaxstep import make_train_step, models
  from jaxstep.core import freeze, rl
  from jaxstep.core.losses import next_token_loss
  from jaxstep.core.optim import OptimConfig, make_optimizer
  from jaxstep.core.preference import PAIR_FIELDS, pair_units, preference_loss
  from jaxstep.models import lora
  from jaxstep.trainer.plan.reference_model import loss_with_reference

  adapters = lora.LoraConfig(rank=16) if loss != "sft" else lora.LoraConfig()
  cfg = models.LlamaConfig(**model, loss_chunk=chunk, lora=adapters)
  apply_fn, params = models.build(cfg, 0, abstract=True)
  opt = make_optimizer(OptimConfig(lr=1e-3, warmup_steps=0), 1000)
  shape = (rows, cfg.max_seq_len)
  if loss == "sft":
    step = make_train_step(next_token_loss(apply_fn, chunk), opt, grad_accum_steps=1)
    names = ("inputs", "targets", "loss_mask")
  elif loss == "dpo":
    build = lambda ref: preference_loss(apply_fn, loss="dpo", reference=ref, chunk=chunk)  # noqa: E731
    loss_fn = loss_with_reference("adapters", apply_fn, build)
    trainable = freeze.by_patterns([lora.ADAPTER])
    step = make_train_step(
      loss_fn, opt, grad_accum_steps=1, units_fn=pair_units, trainable=trainable
    )
    shape, names = (rows // 2, cfg.max_seq_len), (*PAIR_FIELDS, "pair_mask")
  else:  # GRPO with a KL to the reference (the adapters off), policy and reference chunked
    build = lambda ref: rl.grpo_loss(apply_fn, beta=0.04, reference=ref, chunk=chunk)  # noqa: E731
    loss_fn = loss_with_reference("adapters", apply_fn, build)
    trainable = freeze.by_patterns([lora.ADAPTER])
    step = make_train_step(
      loss_fn, opt, grad_accum_steps=1, units_fn=rl.units_fn("tokens"), trainable=trainable
    )
    names = ("inputs", "targets", "completion_mask")
  state = jax.eval_shape(step.init, params, jax.random.PRNGKey(0))
  batch = {n: jax.ShapeDtypeStruct(shape, jnp.int32) for n in names}
  if loss == "dpo":
    batch["pair_mask"] = jax.ShapeDtypeStruct(shape[:1], jnp.int32)
  if loss == "grpo":
    batch["old_logps"] = jax.ShapeDtypeStruct(shape, jnp.float32)
    batch["advantages"] = jax.ShapeDtypeStruct(shape[:1], jnp.float32)
  return jax.jit(step, donate_argnums=0), state, batch


def ce_memory(spec: dict):
  """Compiled temporaries for each chunk setting."""
  out = {}
  for chunk in spec["chunks"]:
    jitted, state, batch = _step(spec["model"], chunk, spec["rows"], spec.get("loss", "sft"))
    mem = jitted.lower(state, batch).compile().memory_analysis()
    out[str(chunk)] = {"temp_bytes": mem.temp_size_in_bytes}
  return {"compiled": out}, lambda: {}


def ce_step(spec: dict):
  """Seconds of one train step (the mean of ``repeats``, after two warm-up steps)."""
  from jaxstep.parallel.cpu_devices import configure_cpu_defaults

  configure_cpu_defaults(spec["rows"], 1, cpu_devices=1)  # the CLI's flags, one device

  from benchmarks.step_bench import full_batch, timed_step
  from jaxstep import make_train_step, models
  from jaxstep.core.losses import next_token_loss
  from jaxstep.core.optim import OptimConfig, make_optimizer

  cfg = models.LlamaConfig(**spec["model"])
  apply_fn, params = models.build(cfg, 0)
  opt = make_optimizer(OptimConfig(lr=1e-3, warmup_steps=0), 1000)
  step = make_train_step(next_token_loss(apply_fn, spec["chunk"]), opt, grad_accum_steps=1)
  batch = full_batch(spec["rows"], cfg.max_seq_len, cfg.vocab_size)
  return timed_step(step, step.init(params, 0), batch, spec.get("repeats", 2))


CONTENDERS = {"ce_memory": ce_memory, "ce_step": ce_step}


def suite_chunked_loss(quick: bool) -> dict:
  """``ce_chunked_temp_over_full`` and ``ce_chunked_step_time_over_full``."""
  from benchmarks.harness import Worker, fmt, measure, ratio_stats

  mem_model = QUICK_SMOLLM2 if quick else SMOLLM2
  mem_rows = 2 if quick else 8
  chunks = [0, 128] if quick else [0, "auto"]
  compiled = {}
  for loss in ("sft", "dpo", "grpo"):
    spec = {"kind": "ce_memory", "model": mem_model, "rows": mem_rows, "chunks": chunks}
    w = Worker({**spec, "loss": loss})
    compiled[loss] = w.info["compiled"]
    w.close()
  whole, chunked = (compiled["sft"][str(c)]["temp_bytes"] for c in chunks)
  dpo_whole, dpo_chunked = (compiled["dpo"][str(c)]["temp_bytes"] for c in chunks)
  grpo_whole, grpo_chunked = (compiled["grpo"][str(c)]["temp_bytes"] for c in chunks)
  model = QUICK_HEAD_HEAVY if quick else HEAD_HEAVY
  rows, step_chunk = (2, 64) if quick else (4, 512)
  base = {"kind": "ce_step", "model": model, "rows": rows}
  specs = {"whole": {**base, "chunk": 0}, "chunked": {**base, "chunk": step_chunk}}
  res, info, failed = measure(specs, rounds=1 if quick else 7)
  sec = {n: [r["seconds"] for r in runs] for n, runs in res.items()}
  time_ratio = ratio_stats(sec["chunked"], sec["whole"])
  gib = 2**30
  tokens = mem_rows * mem_model["max_seq_len"]
  rows_out = [
    (
      f"compiled temporaries of a SmolLM2-135M-shaped SFT step ({mem_model['n_layers']} blocks, "
      f"{tokens:,} tokens in one micro-step, vocabulary {mem_model['vocab_size']:,}), "
      f"model.loss_chunk={chunks[1]} ÷ 0 ({chunked / gib:.2f} GiB vs {whole / gib:.2f} GiB)",
      f"{chunked / whole:.3f}",
      "≤ 0.4",
    ),
    (
      f"compiled temporaries of a LoRA DPO step of that model (rank 16 on every projection, "
      f"{mem_rows // 2} pairs of {mem_model['max_seq_len']:,} tokens a side, the reference "
      f"the adapters off), model.loss_chunk={chunks[1]} ÷ 0 ({dpo_chunked / gib:.2f} GiB vs "
      f"{dpo_whole / gib:.2f} GiB)",
      f"{dpo_chunked / dpo_whole:.3f}",
      "≤ 0.4",
    ),
    (
      f"compiled temporaries of a LoRA GRPO step of that model (rank 16 on every projection, "
      f"{mem_rows} completions of {mem_model['max_seq_len']:,} tokens, a KL to the reference "
      f"the adapters off), model.loss_chunk={chunks[1]} ÷ 0 ({grpo_chunked / gib:.2f} GiB vs "
      f"{grpo_whole / gib:.2f} GiB)",
      f"{grpo_chunked / grpo_whole:.3f}",
      "≤ 0.4",
    ),
    (
      f"train step seconds, chunks of {step_chunk} tokens ÷ the whole logits (width "
      f"{model['d_model']}, {model['n_layers']} blocks, vocabulary {model['vocab_size']:,}, "
      f"{rows} × {model['max_seq_len']} tokens, one CPU device)",
      fmt(time_ratio),
      "≤ 1.1",
    ),
  ]
  return {
    "config": {"memory_model": mem_model, "memory_rows": mem_rows, "chunks": chunks, **base},
    "compiled": compiled,
    "raw": res,
    "info": info,
    "failed": failed,
    "rows": rows_out,
    "summary": {
      "ce_chunked_temp_over_full": chunked / whole,
      "dpo_chunked_temp_over_full": dpo_chunked / dpo_whole,
      "grpo_chunked_temp_over_full": grpo_chunked / grpo_whole,
      "ce_chunked_step_time_over_full": time_ratio["median"],
    },
  }
