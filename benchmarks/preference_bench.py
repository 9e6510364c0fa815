"""Preference optimization (DPO): its memory, its speed against TRL, and its cost over SFT.

- State (``jaxstep.trainer.plan.steps.abstract_state``: shapes only, nothing allocated):
  ``lora_bench.MEMORY_MODEL`` (a GPT-2-124M-sized Llama), LoRA rank 8 on every projection;
  params + optimizer state + ``model_state`` of a DPO run ÷ those of an SFT run. With LoRA
  the reference is the base with the adapters off, so the two states should be one size;
  full fine-tuning DPO carries a frozen copy of the params (fp32 or bf16), shown beside it.
- Speed against TRL 1.16's ``DPOTrainer`` (``PAIR_MODEL``: ``hf_bench.TRAIN_MODEL`` at 128
  positions, fp32, full fine-tuning, β 0.1, AdamW + clip 1.0): the same G pairs of random
  ids, each a ``PROMPT``-token prompt and two completions that fill the S = 128 positions
  (no padding), in K micro-steps; the reference a separate frozen copy in both. jaxstep:
  the CLI's train step (``trainer.build`` with ``preference.loss=dpo``: the reference is the
  state's ``model_state``; the CPU split into devices as the CLI does). TRL: one update is
  K × ``trainer.training_step`` (its ``compute_loss``: the policy's forward with TRL's fused
  LM head, the reference's forward under ``no_grad``, the loss, ``backward``), then
  ``clip_grad_norm_(1.0)``, ``optimizer.step()`` and ``zero_grad()`` — the body of
  ``Trainer``'s loop without its data loader, callbacks and logging. Tokens per update are
  each real pair's prompt once plus both completions (``pair_tokens``); the model reads
  2 × S tokens per pair.
- DPO with precomputed reference log-probs (``ref_chosen_logps``/``ref_rejected_logps`` in
  the batch: no reference forward) ÷ SFT (``next_token_loss``) on the same tokens: G pairs
  of length S against 2G sequences of length S, the same model, ``make_train_step`` jitted
  on one CPU device (the core API: the CLI does not precompute yet).
- Peak RSS of whole LoRA runs against PEFT and TRL: ``preference_rss``.

Speed rounds are interleaved (``harness.measure``), every contender in its own process.
"""

from __future__ import annotations

import os

import numpy as np

from benchmarks.hf_bench import QUICK_TRAIN_MODEL, TRAIN_MODEL
from benchmarks.step_bench import mean_seconds

PAIR_MODEL = {**TRAIN_MODEL, "max_seq_len": 128}
QUICK_PAIR_MODEL = {**QUICK_TRAIN_MODEL, "max_seq_len": 32}
BETA = 0.1


def pair_layout(seq: int) -> tuple[int, int]:
  """``(prompt tokens, completion tokens)`` of every pair: a prompt of half the positions,
  each completion the rest (the sequence fills all ``seq`` positions)."""
  return seq // 2, seq - seq // 2


def pair_tokens(g: int, seq: int) -> int:
  """Tokens of ``g`` real pairs: the prompt once plus the chosen and rejected completions."""
  prompt, completion = pair_layout(seq)
  return g * (prompt + 2 * completion)


def pair_ids(g: int, seq: int, vocab: int, seed: int = 0):
  """``(prompts int32[G, P], chosen int32[G, C], rejected int32[G, C])``: random ids,
  P + C = ``seq``, none of them 0 (TRL's pad id)."""
  rng = np.random.default_rng(seed)
  prompt, completion = pair_layout(seq)
  draw = lambda n: rng.integers(1, vocab, size=(g, n), dtype=np.int32)  # noqa: E731
  return draw(prompt), draw(completion), draw(completion)


def pair_batch(g: int, seq: int, vocab: int, ref_logps: bool = False) -> dict:
  """``pair_ids`` as a jaxstep preference batch (``jaxstep.core.preference``): inputs are
  the ``seq`` tokens, targets the next ones (the last position has none: mask 0), masks 1
  on completion targets; with ``ref_logps``, precomputed reference log-probs as well."""
  prompts, chosen, rejected = pair_ids(g, seq, vocab)
  batch = {"pair_mask": np.ones(g, np.int32)}
  for side, completion in (("chosen", chosen), ("rejected", rejected)):
    inputs = np.concatenate([prompts, completion], axis=1)
    targets = np.concatenate([inputs[:, 1:], np.zeros((g, 1), np.int32)], axis=1)
    mask = np.zeros((g, seq), np.int32)
    mask[:, prompts.shape[1] - 1 : seq - 1] = 1  # targets that are completion tokens
    batch |= {f"{side}_inputs": inputs, f"{side}_targets": targets, f"{side}_mask": mask}
  if ref_logps:
    rng = np.random.default_rng(1)  # about a random model's: completion · −ln V
    level = -completion.shape[1] * np.log(vocab)
    for side in ("chosen", "rejected"):
      batch[f"ref_{side}_logps"] = (level + rng.normal(size=g)).astype(np.float32)
  return batch


# ---------------------------------------------------------------------------- contenders


def dpo_jaxstep(spec):
  """The CLI's DPO train step: ``trainer.build`` of ``preference.loss=dpo`` (full fine-tuning:
  the reference a frozen fp32 copy in the state's ``model_state``), CPU defaults."""
  from jaxstep.trainer.config import loading as config_lib
  from jaxstep.trainer.plan.numbers import configure_devices

  m, seq = spec["model"], spec["model"]["max_seq_len"]
  overrides = [f"model.{k}={v}" for k, v in m.items()] + [
    f"train.seq_len={seq}",
    f"train.global_batch_size={spec['g']}",
    f"train.grad_accum_steps={spec['k']}",
    "optim.warmup_steps=0",
    "optim.lr=1e-3",
    "data.path=bundled:pairs",
    "data.eval_fraction=0",
    "preference.loss=dpo",
    f"preference.beta={BETA}",
  ]
  cfg = config_lib.load("tiny", overrides)
  configure_devices(cfg)
  import jax

  from jaxstep import parallel, trainer

  r, state, _ = trainer.build(cfg)
  batch = pair_batch(spec["g"], seq, m["vocab_size"])
  holder = {"state": state}

  def once():
    holder["state"], metrics = r.step_fn(
      holder["state"], parallel.put_batch(batch, r.batch_sharding)
    )
    jax.block_until_ready(metrics)

  once()
  once()
  info = {"devices": jax.device_count(), "xla_flags": os.environ.get("XLA_FLAGS", "")}
  info["reference"] = sorted(state.model_state or {})
  return info, lambda: mean_seconds(once, spec.get("repeats", 2))


def dpo_trl(spec):
  """TRL's ``DPOTrainer`` (transformers' ``LlamaForCausalLM``, fp32, SDPA) with a separate
  ``ref_model``: one update is K × ``training_step``, clip, AdamW, ``zero_grad``."""
  import tempfile

  import torch
  from datasets import Dataset
  from tokenizers import Tokenizer, models
  from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
  from trl import DPOConfig, DPOTrainer
  from trl.trainer.dpo_trainer import DataCollatorForPreference

  from benchmarks.hf_bench import hf_llama_kwargs

  torch.set_num_threads(os.cpu_count() or 1)
  g, k, m = spec["g"], spec["k"], spec["model"]
  config = LlamaConfig(**hf_llama_kwargs(m))
  torch.manual_seed(0)
  model = LlamaForCausalLM(config)
  ref = LlamaForCausalLM(config)
  ref.load_state_dict(model.state_dict())
  # a tokenizer only for the trainer's construction (it tokenizes its one-row dataset)
  vocab = {"<pad>": 0, "</s>": 1, "a": 2}
  tok = PreTrainedTokenizerFast(
    tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="a")),
    pad_token="<pad>",
    eos_token="</s>",
  )
  out = tempfile.TemporaryDirectory(prefix="jaxstep-bench-trl-")  # removed at exit
  args = DPOConfig(
    out.name,
    per_device_train_batch_size=g // k,
    gradient_accumulation_steps=k,
    learning_rate=1e-3,
    weight_decay=0.1,
    adam_beta2=0.95,
    max_grad_norm=1.0,
    beta=BETA,
    max_length=None,
    use_cpu=True,
    report_to="none",
    save_strategy="no",
    disable_tqdm=True,
  )
  rows = Dataset.from_list([{"prompt": "a", "chosen": "a", "rejected": "a"}])
  trainer = DPOTrainer(model, ref, args=args, train_dataset=rows, processing_class=tok)
  trainer.create_optimizer()
  trainer.current_gradient_accumulation_steps = k
  trainer.model.train()
  collate = DataCollatorForPreference(pad_token_id=0)
  prompts, chosen, rejected = pair_ids(g, m["max_seq_len"], m["vocab_size"])
  examples = [
    {"prompt_ids": p.tolist(), "chosen_ids": c.tolist(), "rejected_ids": r.tolist()}
    for p, c, r in zip(prompts, chosen, rejected, strict=True)
  ]
  micro = [collate(examples[i::k]) for i in range(k)]  # jaxstep's split: rows i, i+K, …
  params = [p for p in trainer.model.parameters() if p.requires_grad]

  def once(_kept=out):
    for mb in micro:
      trainer.training_step(trainer.model, mb)
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)

  once()
  once()
  info = {"threads": torch.get_num_threads(), "attention": config._attn_implementation}
  info["optimizer"] = type(trainer.optimizer).__name__
  return info, lambda: mean_seconds(once, spec.get("repeats", 2))


def core_step(spec):
  """``make_train_step`` jitted on one CPU device (all cores): ``loss: dpo_precomputed``,
  DPO on G pairs with the reference log-probs in the batch; ``loss: sft``,
  ``next_token_loss`` on the same tokens as 2G sequences."""
  from jaxstep.parallel.cpu_devices import configure_cpu_defaults

  g, k, m = spec["g"], spec["k"], spec["model"]
  configure_cpu_defaults(g, k, cpu_devices=1)  # the CLI's flags for one CPU device
  import jax

  from benchmarks.hf_bench import jax_llama_config
  from benchmarks.step_bench import make_batch, timed_step
  from jaxstep import make_train_step, models
  from jaxstep.core.losses import next_token_loss
  from jaxstep.core.optim import OptimConfig, make_optimizer
  from jaxstep.core.preference import pair_units, preference_loss

  apply_fn, params = models.build(jax_llama_config(m), 0)
  opt = make_optimizer(OptimConfig(lr=1e-3, warmup_steps=0), 1000)
  seq = m["max_seq_len"]
  if spec["loss"] == "sft":
    batch = make_batch(2 * g, seq, m["vocab_size"])
    step = make_train_step(next_token_loss(apply_fn), opt, grad_accum_steps=k)
  else:
    batch = pair_batch(g, seq, m["vocab_size"], ref_logps=True)
    loss_fn = preference_loss(apply_fn, loss="dpo", beta=BETA)  # no reference: the batch's
    step = make_train_step(loss_fn, opt, grad_accum_steps=k, units_fn=pair_units)
  state = step.init(params, jax.random.PRNGKey(0))
  return timed_step(step, state, batch, spec.get("repeats", 2))


CONTENDERS = {"dpo_jaxstep": dpo_jaxstep, "dpo_trl": dpo_trl, "core_step": core_step}


# ---------------------------------------------------------------------------- state bytes


def state_bytes(extra: list[str], quick: bool) -> dict:
  """Bytes of the abstract train state of ``lora_bench``'s memory model with ``extra``
  overrides (G 4, K 4): ``params``, ``opt_state``, ``model_state`` and ``total``."""
  import jax

  from benchmarks.lora_bench import MEMORY_MODEL, QUICK_MEMORY_MODEL, _config
  from jaxstep.trainer.plan import steps
  from jaxstep.trainer.plan.numbers import make_plan

  plan = make_plan(_config(QUICK_MEMORY_MODEL if quick else MEMORY_MODEL, extra, 4, 4))
  _, state = steps.abstract_state(plan.cfg, plan.mesh, plan.schedule_steps)
  size = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa: E731
  out = {part: size(getattr(state, part)) for part in ("params", "opt_state", "model_state")}
  return {**out, "total": size(state)}
