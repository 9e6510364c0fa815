"""An RL run's evaluation: its held-out prompts answered greedily (temperature 0, one
completion each) and scored by the run's rewards: ``eval_reward`` (the weighted sum's mean)
and ``eval_rewards/<name>`` (each function's mean), the accuracy of an exact-answer reward."""

from __future__ import annotations

import numpy as np

from jaxstep.data.prompt_rows import PromptSet
from jaxstep.trainer.rl import rollout as rollout_lib

CHUNK = 64  # prompts decoded together


def evaluate_prompts(generator, params, prompts: PromptSet, cfg, rewards, *, seq_len: int) -> dict:
  totals, per_fn, n = [], [], len(prompts)
  for start in range(0, n, CHUNK):
    part = prompts.take(range(start, min(start + CHUNK, n)))
    out = rollout_lib.sample(
      generator, params, part, cfg, rewards, seq_len=seq_len, seed=0, temperature=0.0
    )
    totals.append(out.metrics["reward"] * len(part))
    per_fn.append([out.metrics[f"rewards/{r.name}/mean"] * len(part) for r in rewards])
  sums = np.sum(per_fn, axis=0)
  record = {"eval_reward": float(np.sum(totals) / n), "eval_prompts": n}
  record |= {f"eval_rewards/{r.name}": float(s / n) for r, s in zip(rewards, sums, strict=True)}
  return record


def scorer(run):
  """``(params, prompts) -> record``: ``run``'s (an RL ``plan.build.Run``) prompts decoded
  greedily and scored by its rewards."""
  from jaxstep.generation import Generator
  from jaxstep.trainer.rl.rewards import load_rewards

  r = run.cfg.rl
  generator = Generator(run.cfg.model, None, run.dataset.tokenizer)
  rewards = load_rewards(r.rewards, r.reward_weights)
  seq_len = run.cfg.train.seq_len

  def score(params, prompts) -> dict:
    return evaluate_prompts(generator, params, prompts, r, rewards, seq_len=seq_len)

  return score
