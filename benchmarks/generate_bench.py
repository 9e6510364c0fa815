"""Generation: new tokens/s with the key/value cache vs full recompute and vs Hugging Face
``GPT2LMHeadModel.generate`` (PyTorch, benchmark-only), prefill tokens/s and time to first
token; and what samples during training cost next to an update step.

Every contender decodes the same prompts greedily with random weights of the same layer
sizes (the ``small`` config's: d_model 256, 4 layers, 8 heads, vocabulary 264, positions
up to 512 so that 256 new tokens fit) and generates exactly ``new_tokens`` per row (EOS is
never chosen), so tokens/s compare like for like (``--quick``: ``QUICK_SHAPES``, one small
block).
"""

from __future__ import annotations

import time

import numpy as np

SHAPES = {"vocab_size": 264, "max_seq_len": 512, "d_model": 256, "n_layers": 4, "n_heads": 8}
QUICK_SHAPES = {"vocab_size": 264, "max_seq_len": 32, "d_model": 32, "n_layers": 1, "n_heads": 2}


def _prompts(batch: int, length: int) -> np.ndarray:
  return np.random.default_rng(0).integers(0, 256, size=(batch, length), dtype=np.int32)


def jax_decoder(spec: dict):
  """jaxstep's Generator; ``use_cache`` False is the reference full-recompute path."""
  from jaxstep import models

  cfg = models.GPTConfig(**spec.get("shapes", SHAPES))
  return timed_jax_decode(cfg, spec, use_cache=spec["use_cache"])


def timed_jax_decode(cfg, spec: dict, *, use_cache: bool = True, vocab_size: int | None = None):
  """A worker's ``(info, run_once)`` for ``jaxstep.Generator`` on ``cfg``'s model with random
  weights; ``vocab_size``: ids the tokenizer lets the model choose (default: the bytes')."""
  import jax

  from jaxstep import models
  from jaxstep.data import ByteTokenizer
  from jaxstep.generation import Generator

  class NoEos(ByteTokenizer):
    EOS = 10**9  # never produced: every row runs to new_tokens

  if vocab_size is not None:
    NoEos.vocab_size = vocab_size
  params = models.build(cfg, 0)[1]
  gen = Generator(cfg, params, NoEos(), use_cache=use_cache)
  prompts = list(_prompts(spec["batch"], spec["prompt_len"]))

  def decode(new):
    start = time.perf_counter()
    ids, _ = gen.generate_ids(prompts, max_new_tokens=new)
    return time.perf_counter() - start, sum(map(len, ids))

  decode(1), decode(spec["new_tokens"])  # compile both shapes

  def run_once():
    ttft, _ = decode(1)
    seconds, new = decode(spec["new_tokens"])
    return _result(spec, seconds, new, ttft)

  return {"devices": jax.device_count()}, run_once


def hf_decoder(spec: dict):
  """``transformers.GPT2LMHeadModel.generate(use_cache=True)``, greedy, the same shapes."""
  import torch
  from transformers import GPT2Config, GPT2LMHeadModel

  torch.manual_seed(0)
  shapes = spec.get("shapes", SHAPES)
  config = GPT2Config(
    vocab_size=shapes["vocab_size"],
    n_positions=shapes["max_seq_len"],
    n_embd=shapes["d_model"],
    n_layer=shapes["n_layers"],
    n_head=shapes["n_heads"],
    bos_token_id=257,
    eos_token_id=258,
  )
  return timed_hf_generate(GPT2LMHeadModel(config).eval(), spec)


def timed_hf_generate(model, spec: dict):
  """A worker's ``(info, run_once)`` for ``model.generate(use_cache=True)``, greedy, exactly
  ``new_tokens`` per row."""
  import torch

  prompts = torch.from_numpy(_prompts(spec["batch"], spec["prompt_len"]).astype(np.int64))
  mask = torch.ones_like(prompts)

  def decode(new):
    start = time.perf_counter()
    with torch.inference_mode():
      out = model.generate(
        prompts,
        attention_mask=mask,
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        use_cache=True,
        pad_token_id=256,
      )
    return time.perf_counter() - start, (out.shape[1] - prompts.shape[1]) * out.shape[0]

  decode(1), decode(8)

  def run_once():
    ttft, _ = decode(1)
    seconds, new = decode(spec["new_tokens"])
    return _result(spec, seconds, new, ttft)

  return {"torch": torch.__version__, "threads": torch.get_num_threads()}, run_once


def _result(spec, seconds, new, ttft) -> dict:
  return {
    "seconds": seconds,
    "new_tokens_per_s": new / seconds,
    "ttft_s": ttft,
    "prefill_tokens_per_s": spec["batch"] * spec["prompt_len"] / ttft,
  }


def samples_cost(spec: dict):
  """One round of training samples (tiny config: greedy + sampled, default prompts and
  length) next to one update step of the same run, both compiled and warm."""
  import jax

  from jaxstep import parallel, trainer
  from jaxstep.trainer.config import loading as config_lib
  from jaxstep.trainer.config_run import next_batch
  from jaxstep.trainer.evaluation.text_samples import TextSamples

  overrides = ["train.progress=false", "run_dir=/tmp/unused", *spec.get("overrides", [])]
  cfg = config_lib.load("tiny", overrides)
  run, state, rs = trainer.build(cfg)
  samples = TextSamples(run.cfg.model, run.dataset.tokenizer, run.cfg.train)
  batch = parallel.put_batch(next_batch(run, rs), run.batch_sharding)
  state, _ = run.step_fn(state, batch)
  samples(1, state.params)

  def run_once():
    nonlocal state
    start = time.perf_counter()
    for _ in range(spec["steps"]):
      state, metrics = run.step_fn(state, batch)
    jax.block_until_ready(metrics)
    step = (time.perf_counter() - start) / spec["steps"]
    start = time.perf_counter()
    samples(2, state.params)
    return {"seconds": step, "step_s": step, "samples_s": time.perf_counter() - start}

  return {}, run_once


CONTENDERS = {"decode_jax": jax_decoder, "decode_hf": hf_decoder, "samples_cost": samples_cost}


def suite_generate(quick: bool) -> dict:
  """Cache ÷ recompute and jaxstep ÷ Hugging Face new tokens/s at 1 and 8 prompts; prefill
  and time to first token; training samples ÷ an update step."""
  import importlib.util

  from benchmarks.harness import fmt, measure, ratio_stats
  from benchmarks.loop_suites import QUICK_STEPS, QUICK_TINY

  new, prompt_len = (4, 8) if quick else (256, 64)
  batches = (8,) if quick else (1, 8)  # quick: one worker per contender
  hf = bool(importlib.util.find_spec("torch") and importlib.util.find_spec("transformers"))
  specs = {"samples": {"kind": "samples_cost", "steps": 1 if quick else 10}}
  if quick:  # the loop suites' quick model and run length: their compiled train step
    specs["samples"]["overrides"] = [*QUICK_TINY, f"train.max_steps={QUICK_STEPS}"]
  for b in batches:
    base = {"batch": b, "new_tokens": new, "prompt_len": prompt_len}
    if quick:  # a one-block model (QUICK_SHAPES) in place of the small config's shapes
      base["shapes"] = QUICK_SHAPES
    specs[f"cache_b{b}"] = {**base, "kind": "decode_jax", "use_cache": True}
    specs[f"recompute_b{b}"] = {**base, "kind": "decode_jax", "use_cache": False}
    if hf:
      specs[f"hf_b{b}"] = {**base, "kind": "decode_hf"}
  res, info, failed = measure(specs, rounds=1 if quick else 5)
  rate = {n: [r["new_tokens_per_s"] for r in rounds] for n, rounds in res.items() if n != "samples"}
  out = {"new_tokens": new, "prompt_len": prompt_len, "raw": res, "info": info, "failed": failed}
  rows, summary = [], {}
  for b in batches:
    ratio = ratio_stats(rate[f"cache_b{b}"], rate[f"recompute_b{b}"])
    out[f"cache_over_recompute_b{b}"] = ratio
    summary[f"decode_cache_over_recompute_b{b}"] = ratio["median"]
    rows.append(
      (f"new tokens/s, KV cache ÷ full recompute ({b} prompt(s), {new} new)", fmt(ratio), "≥ 5")
    )
    if f"hf_b{b}" in rate:
      vs = ratio_stats(rate[f"cache_b{b}"], rate[f"hf_b{b}"])
      out[f"vs_hf_b{b}"] = vs
      summary[f"decode_vs_hf_b{b}"] = vs["median"]
      rows.append((f"new tokens/s ÷ transformers GPT2 generate ({b} prompt(s))", fmt(vs), "≥ 1.5"))
    cached = res[f"cache_b{b}"]
    ttft = ratio_stats([r["ttft_s"] * 1000 for r in cached], 1)
    prefill = ratio_stats([r["prefill_tokens_per_s"] for r in cached], 1)
    tokens = ratio_stats(rate[f"cache_b{b}"], 1)
    summary[f"decode_tokens_per_s_b{b}"] = tokens["median"]
    summary[f"prefill_tokens_per_s_b{b}"] = prefill["median"]
    summary[f"ttft_ms_b{b}"] = ttft["median"]
    rows.append((
      f"KV cache, {b} prompt(s) of {prompt_len}: new tokens/s · prefill tokens/s · first token ms",
      f"{tokens['median']:,.0f} · {prefill['median']:,.0f} · {ttft['median']:.1f}",
      "",
    ))  # fmt: skip
  summary["decode_cache_over_recompute"] = min(
    summary[f"decode_cache_over_recompute_b{b}"] for b in batches
  )
  if hf:
    summary["decode_vs_hf"] = min(summary[f"decode_vs_hf_b{b}"] for b in batches)
  samples = ratio_stats(
    [r["samples_s"] for r in res["samples"]], [r["step_s"] for r in res["samples"]]
  )
  out["samples_over_step"] = summary["samples_over_step"] = samples["median"]
  rows.append(
    ("training samples (tiny: 2 prompts × greedy + sampled) ÷ one update step", fmt(samples), "")
  )
  return {**out, "summary": summary, "rows": rows}
