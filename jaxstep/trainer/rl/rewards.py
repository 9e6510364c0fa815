"""Reward functions of an RL run: Python callables that score completions, several with
weights, named in a config by ``module:function`` (or a bundled name).

A reward is ``reward(prompts, completions, **columns) -> list[float]``: one score per
completion, where ``prompts`` and ``completions`` are lists of strings (a completion's
text up to its stop id) and ``columns`` holds each of the row's other JSONL columns as a
list in the same order (e.g. ``answer``), plus ``stop_reason`` (``eos``,
``max_new_tokens``, ``max_seq_len``). A function may take only the columns it names and
``**kwargs`` for the rest, as TRL's reward functions do. ``None`` is not a score: a
function that cannot score a completion returns 0.

The run's reward is ``Σ_k weight_k · reward_k`` per completion. A reward that raises,
returns a list of another length, or a value that is not a finite number stops the run
with one line naming the function and the row.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import re
from collections.abc import Callable, Sequence

import numpy as np

from jaxstep.errors import ConfigError, RewardError


def answer_text(completion: str) -> str:
  """What a completion answers: its first line, stripped."""
  return completion.strip().split("\n", 1)[0].strip()


def exact_answer(prompts, completions, answer, **_) -> list[float]:
  """1.0 where the completion's first line, stripped, is the row's ``answer`` column
  (compared as text, stripped); else 0.0."""
  return [float(answer_text(c) == str(a).strip()) for c, a in zip(completions, answer, strict=True)]


_NUMBER = re.compile(r"-?\d+(\.\d+)?")


def format_check(prompts, completions, stop_reason, **_) -> list[float]:
  """1.0 where the completion's first line is a number and nothing else, and that line
  ended (a newline, or a stop id: not cut by the length limit); else 0.0."""
  return [
    float(("\n" in c or reason == "eos") and bool(_NUMBER.fullmatch(answer_text(c))))
    for c, reason in zip(completions, stop_reason, strict=True)
  ]


BUNDLED = {"exact_answer": exact_answer, "format_check": format_check}


@dataclasses.dataclass(frozen=True)
class Reward:
  name: str  # as the config names it: a bundled name or module:function
  fn: Callable
  weight: float


def load_rewards(names: Sequence[str | Callable], weights: Sequence[float] = ()) -> list[Reward]:
  """The functions ``names`` names (bundled, or ``module:function`` importable from the
  working directory or the installed packages; a callable is itself, named by its
  ``__name__``), with ``weights`` (default 1 each).

  Raises:
    ConfigError: no reward, a weight count that does not match, a name that does not
      import or is not callable — one line naming it.
  """
  if not names:
    raise ConfigError("an RL run needs at least one reward: rl.rewards=[exact_answer]")
  weights = list(weights) or [1.0] * len(names)
  if len(weights) != len(names):
    raise ConfigError(
      f"rl.reward_weights has {len(weights)} weights for {len(names)} rewards; give one each"
    )
  return [
    Reward(_name(name), _resolve(name), float(w)) for name, w in zip(names, weights, strict=True)
  ]


def _name(reward) -> str:
  return reward if isinstance(reward, str) else getattr(reward, "__name__", repr(reward))


def _resolve(name) -> Callable:
  if callable(name):
    return name
  if not isinstance(name, str):
    raise ConfigError(f"a reward is a function or its name, got {name!r}")
  if name in BUNDLED:
    return BUNDLED[name]
  module, _, attr = name.partition(":")
  if not module or not attr:
    raise ConfigError(
      f"reward {name!r}: name a bundled one ({', '.join(BUNDLED)}) or module:function"
    )
  try:
    fn = getattr(importlib.import_module(module), attr)
  except (ImportError, AttributeError) as e:
    raise ConfigError(f"reward {name!r} does not import: {e}") from e
  if not callable(fn):
    raise ConfigError(f"reward {name!r} is a {type(fn).__name__}, not a function")
  return fn


def score(
  rewards: Sequence[Reward], prompts: list[str], completions: list[str], columns: dict
) -> tuple[np.ndarray, np.ndarray]:
  """``(per_function float32[F, N], total float32[N])``: every reward on the N
  completions, and their weighted sum.

  Raises:
    RewardError: a function raised, returned another number of scores, or a score that is
      not a finite number; the line names the function and the row.
  """
  n = len(completions)
  out = np.zeros((len(rewards), n), np.float32)
  for k, r in enumerate(rewards):
    try:
      values = list(r.fn(prompts, completions, **columns))
    except Exception as e:  # a user's function: any failure is reported, naming its row
      row = _failing_row(r, prompts, completions, columns)
      where = "" if row is None else f" on completion {row} (prompt {prompts[row]!r})"
      raise RewardError(f"reward {r.name} raised {type(e).__name__}{where}: {e}") from e
    if len(values) != n:
      raise RewardError(f"reward {r.name} returned {len(values)} scores for {n} completions")
    for i, v in enumerate(values):
      if not isinstance(v, int | float | np.number) or not math.isfinite(float(v)):
        raise RewardError(
          f"reward {r.name} scored completion {i} (prompt {prompts[i]!r}) with {v!r}; "
          f"a reward must be a finite number"
        )
    out[k] = values
  weights = np.array([r.weight for r in rewards], np.float32)
  return out, weights @ out


def _failing_row(r: Reward, prompts, completions, columns) -> int | None:
  """The first row on which ``r`` alone raises too (None if none does)."""
  for i in range(len(completions)):
    try:
      r.fn([prompts[i]], [completions[i]], **{k: [v[i]] for k, v in columns.items()})
    except Exception:
      return i
  return None
