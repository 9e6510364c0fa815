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
from collections.abc import Callable

import numpy as np

from jaxstep.core import rl
from jaxstep.core.distill import GIVEN, completion_text
from jaxstep.core.layout import rows_here
from jaxstep.data.permutation import shuffled_index
from jaxstep.data.prompt_rows import PromptSet
from jaxstep.errors import DataError
from jaxstep.generation.sampling import stop_ids
from jaxstep.parallel import gather_rows
from jaxstep.trainer.rl import rewards as rewards_lib

COIN_STREAM = 0x6B6D  # the key of the coins that choose a rollout's source (distill.lmbda)
# what a rollout of given completions leaves out of its record: the sampler's speed, and
# the group statistics of G copies of one completion
SAMPLING_ONLY = ("rollout_tokens_per_s", "frac_reward_zero_std", "advantage_std")


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


@dataclasses.dataclass(frozen=True)
class Draw:
  """One sampling of P prompts' groups, before advantages: ``rows`` this process's rows of
  the step's fields (``rows``); ``total`` every completion's weighted reward, ``per_fn``
  each function's, ``lengths`` and ``clipped`` for the whole draw (every process's rows, in
  row order); ``seconds`` spent sampling."""

  rows: dict
  total: np.ndarray
  per_fn: np.ndarray
  lengths: np.ndarray
  clipped: np.ndarray
  seconds: float


def draw(
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
) -> Draw:
  """``cfg.num_generations`` completions of every prompt (``temperature`` None: the
  config's; 0: greedy, one each, for evaluation), scored; ``sharding``: where the rows
  are decoded (the step's batch sharding: each device samples its own rows). Over several
  processes each samples and scores only the rows its devices hold; the rewards and
  lengths are gathered."""
  g = cfg.num_generations if temperature is None else 1
  n = len(prompts) * g
  index = _index(sharding, n)
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
  seconds = time.perf_counter() - begun
  return scored(generator.tokenizer, prompts, g, index, ids, reasons, logps, cfg, rewards,
                seq_len=seq_len, sharding=sharding, seconds=seconds)  # fmt: skip


def scored(tok, prompts, g: int, index, ids, reasons, logps, cfg, rewards, *, seq_len: int,
           sharding=None, seconds: float = 0.0) -> Draw:  # fmt: skip
  """The ``Draw`` of completions ``ids`` (with their stop ``reasons`` and log-probs) of
  this process's rows ``index`` (row i: prompt i // ``g``), scored by the rewards."""
  n = len(prompts) * g
  here = _here(sharding, n)
  texts = [tok.decode(c[:-1] if r == "eos" else c) for c, r in zip(ids, reasons, strict=True)]
  columns = {k: [v[i // g] for i in index] for k, v in prompts.columns.items()}
  columns["stop_reason"] = reasons
  prompt_texts = [prompts.texts[i // g] for i in index]
  per_fn, total = rewards_lib.score(
    rewards, prompt_texts, texts, columns, timeout=cfg.reward_timeout
  )
  lengths = np.array([len(c) for c in ids])
  clipped = np.array([r != "eos" for r in reasons])
  if here is not None:  # every process's rows, for the group statistics
    per_fn, total, lengths, clipped = (
      gather_rows(x, here, n) for x in (per_fn.T, total, lengths, clipped)
    )
    per_fn = per_fn.T
  batch = rows([prompts.ids[i // g] for i in index], ids, logps, seq_len, tok.PAD)
  return Draw(batch, total, per_fn, lengths, clipped, seconds)


def given(tok, prompts: PromptSet, cfg: rl.RLConfig, rewards: list, column: str, *,
          seq_len: int, sharding=None) -> Draw:  # fmt: skip
  """The prompts' own completions (``column``) laid out as a draw of ``num_generations``
  each: GKD's updates on the data (a share 1 − ``distill.lmbda``). A completion is encoded
  by itself and ends with the stop id, as a sample that stopped; one longer than
  ``max_new_tokens`` keeps its first tokens, as a clipped sample. Its log-probs are 0: no
  sampler drew it (the loss takes the policy's own, ``distill.GIVEN``)."""
  g = cfg.num_generations
  index = _index(sharding, len(prompts) * g)
  stop = stop_ids(tok)[0]
  banned = {tok.PAD, tok.BOS} - set(stop_ids(tok))  # what the sampler may never draw
  ids, reasons = [], []
  for i in index:
    value = prompts.columns[column][i // g]
    body = [*tok.encode(completion_text(value, column)), stop]
    if banned & set(body[:-1]):
      raise DataError(
        f"a prompt's {column!r} encodes to an id the sampler never draws "
        f"({sorted(banned & set(body[:-1]))}: padding or BOS), where the student's log-prob "
        f"is −inf: {value!r:.60}"
      )
    clipped = len(body) > cfg.max_new_tokens
    ids.append(body[: cfg.max_new_tokens])
    reasons.append("max_new_tokens" if clipped else "eos")
  logps = [np.zeros(len(c), np.float32) for c in ids]
  return scored(tok, prompts, g, index, ids, reasons, logps, cfg, rewards, seq_len=seq_len,
                sharding=sharding)  # fmt: skip


def sampled_or_given(seed: int, index: int, lmbda: float, sample: Callable[[], Rollout],
                     give: Callable[[], Rollout]) -> Rollout:  # fmt: skip
  """Rollout ``index``: ``sample()``; with GKD's ``distill.lmbda`` < 1, a coin of
  probability ``lmbda`` keyed by the run's seed and the index (so a resumed run, and
  ``jaxstep check``, flips the same one) chooses it, ``marked``, or ``give()``, the
  prompts' own completions (``given_rollout``)."""
  if lmbda >= 1:
    return sample()
  if np.random.default_rng([seed, index, COIN_STREAM]).random() < lmbda:
    return marked(sample(), sampled=True)
  return give()


def marked(out: Rollout, sampled: bool) -> Rollout:
  """``out`` with ``distill.GIVEN`` on its rows (0 sampled, 1 given) and its record's
  ``distill/on_policy`` (1 sampled, 0 given), as every rollout of a run with lmbda < 1."""
  rows = len(out.batch["inputs"])
  return Rollout(
    {**out.batch, GIVEN: np.full(rows, float(not sampled), np.float32)},
    {**out.metrics, "distill/on_policy": float(sampled)},
  )


def given_rollout(tok, prompts: PromptSet, cfg: rl.RLConfig, rewards: list, column: str, *,
                  seq_len: int, sharding=None) -> Rollout:  # fmt: skip
  """``given``'s draw as the rollout an update trains on, ``marked``; its record leaves out
  what only sampling has (``SAMPLING_ONLY``; its ``rollout_s`` is 0: nothing sampled)."""
  one = given(tok, prompts, cfg, rewards, column, seq_len=seq_len, sharding=sharding)
  out = assemble([one], cfg, rewards, sharding=sharding)
  metrics = {k: v for k, v in out.metrics.items() if k not in SAMPLING_ONLY}
  return marked(Rollout(out.batch, metrics), sampled=False)


def informative(total: np.ndarray, g: int) -> np.ndarray:
  """bool[P]: the groups (``g`` consecutive completions of ``total``) whose rewards are not
  all equal, the only ones whose advantages are not exactly 0 (DAPO's dynamic sampling
  keeps these; verl's ``filter_groups`` tests std > 0, which a float std of equal rewards
  can pass by rounding: here equal means equal bits)."""
  grouped = total.reshape(-1, g)
  return np.any(grouped != grouped[:, :1], axis=1)


def sample(generator, params, prompts, cfg, rewards, *, seq_len, seed, temperature=None,
           sharding=None) -> Rollout:  # fmt: skip
  """One ``draw``, laid out as the step's rows with advantages (``temperature`` None) and
  its metrics: what an update trains on without ``rl.filter_groups``."""
  one = draw(generator, params, prompts, cfg, rewards, seq_len=seq_len, seed=seed,
             temperature=temperature, sharding=sharding)  # fmt: skip
  return assemble([one], cfg, rewards, sharding=sharding, groups=None if temperature is None else 0)


def assemble(draws: list[Draw], cfg: rl.RLConfig, rewards: list, *, sharding=None,
             groups: int | None = None) -> Rollout:  # fmt: skip
  """The rollout an update trains on, from ``draws``.

  ``groups`` None: every group of the one draw, with its advantages. ``groups`` P > 0
  (dynamic sampling): the first P informative groups in draw order; when the draws hold
  fewer, the rest of the P slots are dropped groups with their ``completion_mask`` zeroed,
  rows that add nothing to the loss nor to its count, so the update is normalized over what
  it trains on; when no draw holds an informative group, the first draw as drawn (its
  advantages all 0: the plain GRPO update). ``groups`` 0: no advantages (evaluation).
  The metrics describe every drawn completion; ``advantage_std`` the trained rows."""
  g = 1 if groups == 0 else cfg.num_generations
  every = [d.total for d in draws]
  total, lengths = np.concatenate(every), np.concatenate([d.lengths for d in draws])
  per_fn = np.concatenate([d.per_fn for d in draws], axis=1)
  seconds = sum(d.seconds for d in draws)
  metrics = {
    "reward": float(total.mean()),
    "reward_std": float(total.std()),
    **{f"rewards/{r.name}/mean": float(v.mean()) for r, v in zip(rewards, per_fn, strict=True)},
    **{f"rewards/{r.name}/std": float(v.std()) for r, v in zip(rewards, per_fn, strict=True)},
    "completions/mean_length": float(lengths.mean()),
    "completions/max_length": int(lengths.max()),
    "completions/clipped_ratio": float(np.concatenate([d.clipped for d in draws]).mean()),
    "rollout_s": seconds,
    "rollout_tokens_per_s": float(lengths.sum() / max(seconds, 1e-9)),
  }
  if groups == 0:
    return Rollout(draws[0].rows, metrics)
  adv = np.concatenate(
    [rl.group_advantages(t.reshape(-1, g), cfg.advantage).reshape(-1) for t in every]
  )
  keep = np.concatenate([informative(t, g) for t in every])
  if g > 1:  # a group of one (on-policy distillation) has no spread to report
    metrics["frac_reward_zero_std"] = float(np.mean(~keep))
  n = every[0].size
  if groups is None:
    batch = {**draws[0].rows, "advantages": adv[_index(sharding, n)].astype(np.float32)}
    if g > 1:
      metrics["advantage_std"] = float(adv.std())
    return Rollout(batch, metrics)
  chosen, counted = _chosen(keep, groups)
  metrics |= {"groups_drawn": int(keep.size), "groups_kept": int(keep[chosen].sum())}
  picked = (chosen[:, None] * g + np.arange(g)).reshape(-1)  # rows of the draws laid end to end
  trained = np.repeat(counted, g)
  here = _here(sharding, n)
  whole = [d.rows if here is None else {k: gather_rows(v, here, n) for k, v in d.rows.items()}
           for d in draws]  # fmt: skip
  batch = {k: np.concatenate([w[k] for w in whole])[picked] for k in whole[0]}
  batch["advantages"] = adv[picked].astype(np.float32)
  weights = trained[:, None].astype(np.int32)  # rows that count for nothing are padding
  batch["completion_mask"] = batch["completion_mask"] * weights
  batch["old_logps"] = batch["old_logps"] * weights
  batch["advantages"] = batch["advantages"] * trained
  metrics["advantage_std"] = float(batch["advantages"][trained].std())
  mine = _index(sharding, n)
  return Rollout({k: v[mine] for k, v in batch.items()}, metrics)


def _chosen(keep: np.ndarray, p: int) -> tuple[np.ndarray, np.ndarray]:
  """The ``p`` groups an update trains on (indices into the draws' groups laid end to end)
  and which of them count: the first ``p`` kept, then dropped ones that do not count; none
  kept: the first draw's ``p``, all counting."""
  kept, dropped = np.flatnonzero(keep), np.flatnonzero(~keep)
  if not kept.size:
    return np.arange(p), np.ones(p, bool)
  chosen = np.concatenate([kept[:p], dropped[: max(p - kept.size, 0)]])
  return chosen, np.arange(p) < kept.size


def _here(sharding, n: int):
  """This process's rows of ``n`` when it holds only some (several processes), else None."""
  return None if sharding is None or sharding.is_fully_addressable else rows_here(sharding, n)


def _index(sharding, n: int) -> np.ndarray:
  here = _here(sharding, n)
  return np.arange(n) if here is None else here
