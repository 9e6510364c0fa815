"""RL (GRPO): the rollout sampler against transformers, and what a whole update costs besides
its sampling and its train step. Headline keys (goals in the rows): ``rl_rollout_tokens_vs_hf``
(≥ 1.5) and ``rl_update_overhead`` (≤ 0.05); ``distill_bench`` adds ``distill_step_over_grpo``.

- Sampling (``rl_sample_jax`` / ``rl_sample_hf``): ``ROLLOUT_MODEL`` (``hf_bench.TRAIN_MODEL``,
  a d 256, 4-layer Llama with a vocabulary of 8,192, 256 positions), random weights, fp32;
  P prompts of ``prompt_len`` random ids, each repeated G times (a rollout's B·G rows), and
  exactly ``new_tokens`` new tokens per row, drawn at temperature 1.0 with top-k and top-p
  off. jaxstep: ``Generator.sample_ids`` (the key/value cache engine, one jitted prefill +
  decode loop, per-token log-probs included; its EOS is an id the model never produces).
  transformers: ``LlamaForCausalLM.generate(do_sample=True, use_cache=True, top_k=0,
  top_p=1.0, min_new_tokens=max_new_tokens)`` (EOS masked until the last token), all cores.
  Tokens/s is new tokens ÷ the call's wall time (ids back on the host); jaxstep's greedy
  tokens/s (the same loop, argmax in place of the draw) shows what the draw costs.
- Update overhead (``rl_run``): a whole ``jaxstep train`` run (``config_run.train``, in
  process) of ``grpo-arith``'s settings (32 prompts × 8 completions of ``bundled:sums``, 5
  new tokens, K=4) on the ``tiny`` config's GPT with random weights. A ``Hook`` stamps each
  update's start (``before_step``, just before the batch's transfer and the dispatch), blocks
  on the new state in ``after_step`` (the step: transfer, dispatch and device run) and wraps
  the rollout's ``sample_ids``. Update i's wall time is ``before_step(i)`` →
  ``before_step(i+1)``: the step of update i and the rollout of update i+1; ``overhead =
  (wall − sampling − step) ÷ wall``: rewards, advantages, the row layout and its transfer,
  records, hooks and the loop's checks (the sampler/trainer log-prob check is a count the
  loss reports: it is in the step). Blocking in
  ``after_step`` keeps the loop's host work after a dispatch from overlapping the step, so
  the overhead is an upper bound. Updates before ``SKIP`` (compiles) are left out.
"""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np

from benchmarks.hf_bench import QUICK_TRAIN_MODEL, TRAIN_MODEL

ROLLOUT_MODEL = TRAIN_MODEL
QUICK_ROLLOUT_MODEL = {**QUICK_TRAIN_MODEL, "max_seq_len": 32}
PAD, BOS, EOS = 256, 257, 258  # transformers' pad and EOS ids (EOS masked: no early stop)
SAMPLING = {"prompts": 8, "g": 8, "prompt_len": 16, "new_tokens": 64}  # B·G = 64 rows
SAMPLING_ROUNDS, RUN_ROUNDS, UPDATES = 10, 5, 40
SKIP = 3  # updates whose wall time holds compiles (the step's, the sampler's, the check's)

# ``grpo-arith``'s RL settings on the ``tiny`` config's model, random weights
RUN = [
  "data.path=bundled:sums",
  "data.eval_fraction=0",
  "rl.rewards=[exact_answer,format_check]",
  "rl.reward_weights=[1.0,0.1]",
  "rl.num_generations=8",
  "rl.max_new_tokens=5",
  "rl.temperature=1.0",
  "train.global_batch_size=256",
  "train.grad_accum_steps=4",
  "train.seq_len=16",
  "train.eval_every=0",
  "train.sample_every=0",
  "train.progress=false",
  "checkpoint.every=0",
  "optim.lr=3e-4",
  "optim.warmup_steps=0",
]
QUICK_RUN = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2"]


def rollout_prompts(prompts: int, generations: int, length: int, vocab: int) -> list:
  """P random prompts of ``length`` ids (none of them PAD, BOS or EOS), each G times."""
  rng = np.random.default_rng(0)
  ids = rng.integers(EOS + 1, vocab, size=(prompts, length), dtype=np.int32)
  return [ids[i // generations] for i in range(prompts * generations)]


def _rate(seconds: float, new: int) -> dict:
  return {"seconds": seconds, "new_tokens_per_s": new / seconds}


def sample_jax(spec: dict):
  """Worker: ``Generator.sample_ids`` at temperature 1.0, top-k/top-p off, every id of the
  model allowed but PAD and BOS, EOS an id it never draws."""
  import jax

  from benchmarks.hf_bench import jax_llama_config
  from jaxstep import models
  from jaxstep.data import ByteTokenizer
  from jaxstep.generation import Generator

  cfg = jax_llama_config(spec["model"])

  class NoEos(ByteTokenizer):
    EOS = 10**9  # never produced: every row runs to new_tokens
    vocab_size = cfg.vocab_size

  gen = Generator(cfg, models.build(cfg, 0)[1], NoEos())
  prompts = rollout_prompts(spec["prompts"], spec["g"], spec["prompt_len"], cfg.vocab_size)
  seed = iter(range(10**6))

  def call(temperature: float) -> tuple[float, int]:
    start = time.perf_counter()
    ids, _, logps = gen.sample_ids(
      prompts, max_new_tokens=spec["new_tokens"], temperature=temperature, top_k=0, top_p=1.0,
      seed=next(seed),
    )  # fmt: skip
    seconds = time.perf_counter() - start
    assert all(len(i) == spec["new_tokens"] == len(lp) for i, lp in zip(ids, logps, strict=True))
    return seconds, sum(map(len, ids))

  def once():
    out = _rate(*call(1.0))
    seconds, new = call(0.0)  # the same loop, argmax in place of the draw: what a draw costs
    return {**out, "greedy_new_tokens_per_s": new / seconds}

  once(), once()
  return {"devices": jax.device_count()}, once


def sample_hf(spec: dict):
  """Worker: ``LlamaForCausalLM.generate(do_sample=True, use_cache=True)`` at temperature
  1.0, top-k/top-p off, exactly ``new_tokens`` per row."""
  import torch
  from transformers import LlamaConfig, LlamaForCausalLM

  from benchmarks.hf_bench import hf_llama_kwargs

  torch.manual_seed(0)
  config = LlamaConfig(**hf_llama_kwargs(spec["model"]), bos_token_id=BOS, eos_token_id=EOS)
  model = LlamaForCausalLM(config).eval()
  rows = rollout_prompts(spec["prompts"], spec["g"], spec["prompt_len"], config.vocab_size)
  prompts = torch.from_numpy(np.stack(rows).astype(np.int64))
  mask = torch.ones_like(prompts)
  new = spec["new_tokens"]

  def once():
    start = time.perf_counter()
    with torch.inference_mode():
      out = model.generate(
        prompts, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=True,
        temperature=1.0, top_k=0, top_p=1.0, use_cache=True, pad_token_id=PAD,
      )  # fmt: skip
    seconds = time.perf_counter() - start
    assert out.shape[1] - prompts.shape[1] == new
    return _rate(seconds, (out.shape[1] - prompts.shape[1]) * out.shape[0])

  once(), once()
  return {"torch": torch.__version__, "threads": torch.get_num_threads()}, once


def update_timer():
  """A ``Hook`` that stamps every update of an RL run (``per_update`` turns the stamps into
  each update's parts); built here, since the trainer is imported only in a worker."""
  import jax

  from jaxstep.trainer.loop.hooks import Hook

  class Timer(Hook):
    def __init__(self):
      self.before, self.done = [], []
      self.sample, self.rollout = [], []

    def on_start(self, loop):
      src = loop.source
      rollouts = src.rollouts
      assert rollouts.r.iterations == 1, "one rollout per update"
      rollouts.generator.sample_ids = self._timed(rollouts.generator.sample_ids, self.sample)
      src.next_batch = self._timed(src.next_batch, self.rollout)

    @staticmethod
    def _timed(fn, into: list, block: bool = False):
      def timed(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        if block:
          out = jax.block_until_ready(out)
        into.append(time.perf_counter() - start)
        return out

      return timed

    def before_step(self, loop, step):
      self.before.append(time.perf_counter())

    def after_step(self, loop):
      jax.block_until_ready(loop.state)
      self.done.append(time.perf_counter())

  return Timer()


def per_update(t) -> dict:
  """Seconds of each update i ≥ ``SKIP`` (1-based) that has a next one: ``wall`` (start
  of i → start of i+1), ``step`` (start → new state ready), ``sampling`` (the next
  rollout's ``sample_ids``), ``rollout`` (its whole ``next_batch``), and the shares of the
  wall time. The sampler/trainer log-prob check is part of the step (a count the loss
  reports), so it has no time of its own."""
  n = len(t.before) - 1
  keep = range(SKIP - 1, n)
  wall = np.array([t.before[i + 1] - t.before[i] for i in keep])
  step = np.array([t.done[i] - t.before[i] for i in keep])
  sampling, rollout = (np.array([xs[i + 1] for i in keep]) for xs in (t.sample, t.rollout))
  out = {"wall": wall, "step": step, "sampling": sampling, "rollout": rollout}
  out["overhead"] = (wall - sampling - step) / wall
  out["rewards_rows_share"] = (rollout - sampling) / wall  # rewards, advantages, rows
  out["loop_share"] = (wall - step - rollout) / wall  # records, hooks, the loop's checks
  return {k: v.tolist() for k, v in out.items()}


def rl_run(spec: dict):
  """Worker: each run is a fresh ``jaxstep train`` of ``RUN`` for ``updates`` updates."""
  from jaxstep.trainer import config_run
  from jaxstep.trainer.config import loading as config_lib

  def once():
    with tempfile.TemporaryDirectory(prefix="jaxstep-bench-rl-") as tmp:
      overrides = [*RUN, *spec["overrides"], f"train.max_steps={spec['updates']}"]
      cfg = config_lib.load("tiny", [*overrides, f"run_dir={tmp}/run"])
      timer = update_timer()
      config_run.train(cfg, hooks=[timer])
    parts = per_update(timer)
    med = {k: float(np.median(v)) for k, v in parts.items()}
    return {"seconds": med["wall"], "median": med, "per_update": parts}

  return {"cpu_count": os.cpu_count()}, once


CONTENDERS = {"rl_sample_jax": sample_jax, "rl_sample_hf": sample_hf, "rl_run": rl_run}


# ---------------------------------------------------------------------------- the suite


def _sampling_rows(quick: bool) -> tuple[dict, list, dict]:
  """jaxstep's rollout sampler ÷ transformers' sampling ``generate``, interleaved rounds."""
  import importlib.util

  from benchmarks.harness import fmt, measure, ratio_stats

  model = QUICK_ROLLOUT_MODEL if quick else ROLLOUT_MODEL
  shape = {"prompts": 2, "g": 2, "prompt_len": 4, "new_tokens": 4} if quick else SAMPLING
  specs = {"jaxstep": {"kind": "rl_sample_jax", "model": model, **shape}}
  if importlib.util.find_spec("torch") and importlib.util.find_spec("transformers"):
    specs["transformers"] = {"kind": "rl_sample_hf", "model": model, **shape}
  res, info, failed = measure(specs, rounds=1 if quick else SAMPLING_ROUNDS)
  rate = {n: [r["new_tokens_per_s"] for r in rs] for n, rs in res.items()}
  out = {"config": {"model": model, **shape}, "raw": res, "info": info, "failed": failed}
  median = lambda xs: ratio_stats(xs, 1)["median"]  # noqa: E731
  greedy = [r["greedy_new_tokens_per_s"] for r in res.get("jaxstep", [])]
  rows, summary = [], {}
  rows_of = shape["prompts"] * shape["g"]
  if "jaxstep" in rate and "transformers" in rate:
    vs = ratio_stats(rate["jaxstep"], rate["transformers"])
    out["rl_rollout_tokens_vs_hf"] = vs
    summary["rl_rollout_tokens_vs_hf"] = vs["median"]
    rows.append((
      f"RL rollout sampling new tokens/s, jaxstep Generator.sample_ids ÷ transformers "
      f"generate(do_sample=True) (Llama d {model['d_model']}, {model['n_layers']} layers, "
      f"vocab {model['vocab_size']}; {shape['prompts']} prompts × {shape['g']} = {rows_of} "
      f"rows of {shape['prompt_len']} ids, {shape['new_tokens']} new, temperature 1; "
      f"{median(rate['jaxstep']):,.0f} vs {median(rate['transformers']):,.0f} tokens/s)",
      fmt(vs),
      "≥ 1.5",
    ))  # fmt: skip
  if greedy:
    out["jax_greedy_over_sampled"] = ratio_stats(greedy, rate["jaxstep"])
    rows.append((
      f"the same jaxstep loop greedy ÷ sampled (what the draw costs; {median(greedy):,.0f} "
      "tokens/s greedy)",
      fmt(out["jax_greedy_over_sampled"]),
      "",
    ))  # fmt: skip
  for name in failed:
    rows.append((f"rl sampling: {name}", "did not run here (see `failed` in rl.json)", ""))
  return out, rows, summary


def _overhead_rows(quick: bool) -> tuple[dict, list, dict]:
  """The share of a whole RL update that is neither sampling nor the train step."""
  from benchmarks.harness import fmt, measure, ratio_stats

  updates = SKIP + 2 if quick else UPDATES
  spec = {"kind": "rl_run", "overrides": QUICK_RUN if quick else [], "updates": updates}
  res, info, failed = measure({"run": spec}, rounds=1 if quick else RUN_ROUNDS)
  out = {"config": {"run": [*RUN, *spec["overrides"]], "updates": updates, "skipped": SKIP - 1}}
  out |= {"raw": res, "info": info, "failed": failed}
  if failed:
    return out, [("rl update overhead", "did not run here (see `failed` in rl.json)", "")], {}
  med = {k: [r["median"][k] for r in res["run"]] for k in res["run"][0]["median"]}
  stats = {k: ratio_stats(v, 1) for k, v in med.items()}
  out["per_round_medians"] = stats
  ms = lambda k: f"{stats[k]['median'] * 1000:.1f} ms"  # noqa: E731
  summary = {
    "rl_update_overhead": stats["overhead"]["median"],
  }
  rows = [
    (
      "RL update overhead: (update wall − sampling − train step) ÷ update wall, `jaxstep "
      "train` of grpo-arith's settings (32 prompts × 8, 5 new tokens, K=4) on the tiny GPT, "
      f"median over updates {SKIP}…{updates - 1} of each run ({ms('wall')} per update: step "
      f"{ms('step')}, sampling {ms('sampling')})",
      fmt(stats["overhead"]),
      "≤ 0.05",
    ),
    (
      "its parts ÷ update wall: rewards, advantages and rows · loop (records, hooks, its checks)",
      " · ".join(f"{stats[k]['median']:.3f}" for k in ("rewards_rows_share", "loop_share")),
      "",
    ),
  ]
  return out, rows, summary


def suite_rl(quick: bool) -> dict:
  """RL rollout sampling against transformers, a whole update's overhead, and on-policy
  distillation's update against GRPO's (``distill_bench``)."""
  from benchmarks.distill_bench import distill_rows

  sampling, rows, summary = _sampling_rows(quick)
  overhead, more_rows, more = _overhead_rows(quick)
  taught, distill, distill_summary = distill_rows(quick)
  return {
    "sampling": sampling,
    "update": overhead,
    "distill": taught,
    "rows": rows + more_rows + distill,
    "summary": summary | more | distill_summary,
  }
