"""One rollout: G completions of each of P prompts sampled with the current params, scored by
the rewards, turned into group advantages and laid out as the RL step's rows
(``jaxstep.core.rl``): prompt + completion as a shifted window, the completion's targets
masked, the sampler's log-probs of them as ``old_logps``.

A rollout is a pure function of the params, the prompts, the settings and its seed, so a
resumed run samples the same completions again.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from jaxstep.core import rl
from jaxstep.core.layout import rows_here
from jaxstep.data.permutation import shuffled_index
from jaxstep.data.prompt_rows import PromptSet
from jaxstep.parallel import gather_rows
from jaxstep.trainer.rl import rewards as rewards_lib


@dataclasses.dataclass(frozen=True)
class Rollout:
  batch: dict  # the step's rows (numpy), P·G of them
  metrics: dict  # host metrics of the sampling and the rewards


def prompt_batch(prompts: PromptSet, seed: int, epoch: int, index: int, size: int) -> PromptSet:
  """Rollout ``index`` of ``epoch``'s prompts: ``size`` of them, at positions ``index·size``
  … of the epoch's keyed permutation (``permutation.shuffled_index``), as batches of a
  corpus are taken."""
  positions = index * size + np.arange(size)
  return prompts.take(shuffled_index(seed, epoch, len(prompts), positions))


def rows(prompts: list[np.ndarray], completions: list[list[int]], logps, seq_len: int, pad: int):
  """``inputs``/``targets`` int32[N, seq_len] (prompt + completion, padded), ``completion_mask``
  on the completion's targets, ``old_logps`` there (float32)."""
  n = len(prompts)
  starts = np.array([len(p) for p in prompts])
  ends = starts + np.array([len(c) for c in completions])
  if n and ends.max() > seq_len + 1:
    r = int(np.argmax(ends > seq_len + 1))
    raise ValueError(f"row {r}: {ends[r]} tokens do not fit train.seq_len {seq_len} + 1")
  column = np.arange(seq_len + 1)
  filled = column < ends[:, None]  # row-major: each row's prompt, then its completion
  tokens = np.full((n, seq_len + 1), pad, np.int32)
  pieces = [np.concatenate([p, c]) for p, c in zip(prompts, completions, strict=True)]
  tokens[filled] = np.concatenate(pieces)
  target = column[:-1]
  completion = (target >= starts[:, None] - 1) & (target < ends[:, None] - 1)
  old = np.zeros((n, seq_len), np.float32)
  old[completion] = np.concatenate([np.asarray(x, np.float32).reshape(-1) for x in logps])
  return {
    "inputs": tokens[:, :-1],
    "targets": tokens[:, 1:],
    "completion_mask": completion.astype(np.int32),
    "old_logps": old,
  }


def sample(
  generator,
  params,
  prompts: PromptSet,
  cfg: rl.RLConfig,
  rewards: list,
  *,
  seq_len: int,
  seed: int,
  temperature: float | None = None,
  sharding=None,
) -> Rollout:
  """``cfg.num_generations`` completions of every prompt (``temperature`` None: the
  config's; 0: greedy, for evaluation), scored and laid out; ``sharding``: where the rows
  are decoded (the step's batch sharding: each device samples its own rows). Over several
  processes each samples and scores only the rows its devices hold, and the batch holds
  those; the rewards and lengths are gathered, so the advantages and metrics are the
  global batch's on every process."""
  g = cfg.num_generations if temperature is None else 1
  n = len(prompts) * g
  here = None if sharding is None or sharding.is_fully_addressable else rows_here(sharding, n)
  index = np.arange(n) if here is None else here
  generator.params = params
  begun = time.perf_counter()
  prompt_rows = [prompts.ids[i // g] for i in index]
  ids, reasons, logps = generator.sample_ids(
    prompt_rows,
    max_new_tokens=cfg.max_new_tokens,
    temperature=cfg.temperature if temperature is None else temperature,
    top_k=cfg.top_k,
    top_p=cfg.top_p,
    seed=seed,
    prefill_to=seq_len + 1 - cfg.max_new_tokens,  # the longest prompt: one compile for all
    sharding=sharding,
    global_rows=n,
  )
  sampled = time.perf_counter() - begun
  tok = generator.tokenizer
  texts = [tok.decode(c[:-1] if r == "eos" else c) for c, r in zip(ids, reasons, strict=True)]
  columns = {k: [v[i // g] for i in index] for k, v in prompts.columns.items()}
  columns["stop_reason"] = reasons
  prompt_texts = [prompts.texts[i // g] for i in index]
  per_fn, total = rewards_lib.score(
    rewards, prompt_texts, texts, columns, timeout=cfg.reward_timeout
  )
  batch = rows(prompt_rows, ids, logps, seq_len, tok.PAD)
  lengths = np.array([len(c) for c in ids])
  clipped = np.array([r != "eos" for r in reasons])
  if here is not None:  # every process's rows, for the group statistics
    per_fn, total, lengths, clipped = (
      gather_rows(x, here, n) for x in (per_fn.T, total, lengths, clipped)
    )
    per_fn = per_fn.T
  metrics = {
    "reward": float(total.mean()),
    "reward_std": float(total.std()),
    **{f"rewards/{r.name}/mean": float(v.mean()) for r, v in zip(rewards, per_fn, strict=True)},
    **{f"rewards/{r.name}/std": float(v.std()) for r, v in zip(rewards, per_fn, strict=True)},
    "completions/mean_length": float(lengths.mean()),
    "completions/max_length": int(lengths.max()),
    "completions/clipped_ratio": float(clipped.mean()),
    "rollout_s": sampled,
    "rollout_tokens_per_s": float(lengths.sum() / max(sampled, 1e-9)),
  }
  if temperature is None:
    grouped = total.reshape(-1, g)
    adv = np.asarray(rl.group_advantages(grouped, cfg.advantage)).reshape(-1)
    batch["advantages"] = adv[index].astype(np.float32)
    metrics["advantage_std"] = float(adv.std())
    metrics["frac_reward_zero_std"] = float(np.mean(grouped.std(axis=1) == 0))
  return Rollout(batch, metrics)
