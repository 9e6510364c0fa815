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

A reward that does not return stops the run too: each call of a function has
``rl.reward_timeout`` seconds (``_Clock``). The functions run in this process, in the
thread that called ``score`` — a function may be a closure, hold a model or a cache, and
costs no pickling or process start, as a worker process killed at the limit would — and
the limit is a ``SIGALRM`` timer (``setitimer``) whose handler raises into the function:
it ends a ``time.sleep``, a blocking read or a pure-Python loop at once (Linux delivers
the timer's signal to the main thread, whose blocking call it interrupts), but not a C
call that never returns to the interpreter (a native library's own loop, a lock taken in
C). Python runs signal handlers in the main thread only, so called from another thread
(``RLTrainer.fit`` run in a thread) a function has no limit, which one warning says.
``jaxstep train`` and ``RLTrainer.fit`` call the rewards in their loop's thread, the main
one as a script runs them. A call shorter than ``PROGRESS_S`` and the limit sees no signal.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import math
import re
import signal
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from jaxstep.errors import ConfigError, RewardError

log = logging.getLogger("jaxstep")

PROGRESS_S = 10.0  # a call running this long gets a progress line, and again at each doubling


def answer_text(completion: str) -> str:
  """What a completion answers: its first line, stripped."""
  return completion.strip().split("\n", 1)[0].strip()


def exact_answer(prompts, completions, answer, **_) -> list[float]:
  """1.0 where the completion's first line, stripped, is the row's ``answer`` column
  (compared as text, stripped); else 0.0."""
  return [float(answer_text(c) == str(a).strip()) for c, a in zip(completions, answer, strict=True)]


_NUMBER = re.compile(r"-?\d+(\.\d+)?")
_DIGITS = re.compile(r"[0-9]+")  # ASCII only: str.isdigit() also takes "²" and "٦"


def format_check(prompts, completions, stop_reason, **_) -> list[float]:
  """1.0 where the completion's first line is a number and nothing else, and that line
  ended (a newline, or a stop id: not cut by the length limit); else 0.0."""
  return [
    float(("\n" in c or reason == "eos") and bool(_NUMBER.fullmatch(answer_text(c))))
    for c, reason in zip(completions, stop_reason, strict=True)
  ]


def digit_match(prompts, completions, answer, **_) -> list[float]:
  """Partial credit for a whole-number answer: the share of digit places, aligned from the
  units, where the completion's first line and the ``answer`` column agree, over the longer
  of the two (``"68"`` for 68: 1; ``"58"``: 0.5; ``"168"``: 2/3); 0 where either is not
  digits alone. A 0/1 reward from a weak policy leaves most groups with equal rewards and
  no advantage; getting the units digit right first is a step the policy can find."""
  scores = []
  for c, a in zip(completions, answer, strict=True):
    said, right = answer_text(c), str(a).strip()
    if not (_DIGITS.fullmatch(said) and _DIGITS.fullmatch(right)):
      scores.append(0.0)
      continue
    width = max(len(said), len(right))
    pairs = zip(said.rjust(width), right.rjust(width), strict=True)
    scores.append(sum(x == y for x, y in pairs) / width)
  return scores


BUNDLED = {"exact_answer": exact_answer, "format_check": format_check, "digit_match": digit_match}


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
  rewards: Sequence[Reward],
  prompts: list[str],
  completions: list[str],
  columns: dict,
  *,
  timeout: float = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
  """``(per_function float32[F, N], total float32[N])``: every reward on the N
  completions, and their weighted sum. ``timeout``: seconds each call of a function may
  take (``rl.reward_timeout``; 0: no limit); a call running longer than ``PROGRESS_S``
  logs a line saying so.

  Raises:
    RewardError: a function raised, returned another number of scores, a score that is
      not a finite number, or did not return within ``timeout``; the line names the
      function and the row.
  """
  n = len(completions)
  out = np.zeros((len(rewards), n), np.float32)
  for k, r in enumerate(rewards):
    try:
      values = _call(r, prompts, completions, columns, timeout)
    except _Overdue as e:
      raise RewardError(
        f"reward {r.name} did not return within {timeout:g} s (rl.reward_timeout){e.args[0]}; "
        f"make it faster, or raise rl.reward_timeout (0: no limit)"
      ) from None
    except Exception as e:  # a user's function: any failure is reported, naming its row
      row = _failing_row(r, prompts, completions, columns, timeout)
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


def _failing_row(r: Reward, prompts, completions, columns, timeout: float) -> int | None:
  """The first row on which ``r`` alone raises too, or does not return in time (None if
  none does)."""
  for i in range(len(completions)):
    try:
      one = {k: [v[i]] for k, v in columns.items()}
      _call(r, [prompts[i]], [completions[i]], one, timeout, first=i)
    except (Exception, _Overdue):
      return i
  return None


def _call(r: Reward, prompts, completions, columns, timeout: float, first: int = 0) -> list:
  """``r``'s scores of the rows (``first``: the first one's index in the rollout), the call
  limited to ``timeout`` seconds (0: none).

  Raises:
    _Overdue: the call did not return in time; its argument says which row it was on.
  """
  clock = _Clock(r, prompts, completions, timeout, first)
  try:
    return list(r.fn(prompts, completions, **columns))
  finally:
    clock.stop()  # after it no _Overdue of this call can come


class _Overdue(BaseException):
  """Raised into a reward function at its deadline: a ``BaseException``, as
  ``KeyboardInterrupt`` is, so that the function's own ``except Exception`` (a reward that
  scores a row it cannot parse 0) does not swallow it."""


_UNLIMITED = set()  # threads already told that their rewards have no time limit


class _Clock:
  """One call's deadline and progress lines: a one-shot ``ITIMER_REAL`` timer, re-armed by
  its ``SIGALRM`` handler for the next progress line or the deadline (the handler runs in
  the main thread between two bytecodes, where it can raise into the function). The
  handler and a timer set before are put back by ``stop``; the earlier timer is then
  re-armed with its remaining time, so it fires late by at most this call's length. Off the
  main thread, or without ``setitimer``, the clock does nothing (one warning per thread)."""

  def __init__(self, r: Reward, prompts, completions, timeout: float, first: int = 0):
    self.r, self.prompts, self.completions, self.timeout = r, prompts, completions, timeout
    self.first = first
    self.started = time.monotonic()
    self.deadline = self.started + timeout if timeout else math.inf
    self.next_line = self.started + PROGRESS_S
    self.on = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if not self.on:
      if timeout and threading.get_ident() not in _UNLIMITED:
        _UNLIMITED.add(threading.get_ident())
        log.warning(
          "rl.reward_timeout is not enforced: the rewards run in thread %r, and only the "
          "main thread can be interrupted",
          threading.current_thread().name,
        )
      return
    self.handler = signal.signal(signal.SIGALRM, self._fire)
    if self.handler is None:  # one set outside Python: it cannot be put back as it was
      self.handler = signal.SIG_DFL
    self.before = signal.setitimer(signal.ITIMER_REAL, self._until_next(self.started))

  def _until_next(self, now: float) -> float:
    return max(min(self.next_line, self.deadline) - now, 1e-3)

  def _fire(self, signum, frame) -> None:
    del signum
    now = time.monotonic()
    where = self._where(frame)
    if now >= self.deadline:
      signal.setitimer(signal.ITIMER_REAL, 1.0)  # again, should the function swallow it
      raise _Overdue(where)
    log.info(
      "rewards: %s still running%s after %.0f s%s",
      self.r.name,
      where,
      now - self.started,
      f" (rl.reward_timeout {self.timeout:g} s)" if self.timeout else "",
    )
    self.next_line = self.started + 2 * (now - self.started)
    signal.setitimer(signal.ITIMER_REAL, self._until_next(now))

  def _where(self, frame) -> str:
    """`` on completion i (prompt …)``: the row whose text (the very string object) a
    frame of the function holds — its loop variable, say — innermost frame first; else the
    rows of the call. A text several rows share as one object (Python keeps one object of
    each one-character string) names no row."""
    rows = {}
    for i, c in enumerate(self.completions):
      rows[id(c)] = -1 if id(c) in rows else i
    while frame is not None and frame.f_code is not _call.__code__:
      for value in frame.f_locals.values():
        if isinstance(value, str) and rows.get(id(value), -1) >= 0:
          i = rows[id(value)]
          return f" on completion {self.first + i} (prompt {self.prompts[i]!r})"
      frame = frame.f_back
    n = len(self.completions)
    if n == 1:
      return f" on completion {self.first} (prompt {self.prompts[0]!r})"
    return f" on completions {self.first}–{self.first + n - 1}, one call"

  def stop(self) -> None:
    """Puts back the handler and the timer there were before; a last ``_Overdue`` that
    fires meanwhile is dropped (the call has ended, or is ending with one already)."""
    if not self.on:
      return
    while True:
      try:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self.handler)
        break
      except _Overdue:
        continue
    self.on = False
    remaining, interval = self.before
    if remaining:
      elapsed = time.monotonic() - self.started
      signal.setitimer(signal.ITIMER_REAL, max(remaining - elapsed, 1e-3), interval)
