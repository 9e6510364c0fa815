"""RL rewards: the bundled ones on hand-made completions, loading by name with weights, the
weighted sum, a reward that fails named with its row in one line, and one that never
returns stopped at ``rl.reward_timeout``."""

import logging
import math
import re
import signal
import sys
import threading
import time

import numpy as np
import pytest

from jaxstep.errors import ConfigError, RewardError
from jaxstep.trainer.config import loading as config_lib
from jaxstep.trainer.rl import rewards

PROMPTS = ["1 + 2 = ", "3 + 4 = ", "5 + 5 = ", "2 + 2 = "]
COMPLETIONS = ["3", " 7 \nmore text", "11", "four"]
COLUMNS = {"answer": ["3", "7", "10", "4"], "stop_reason": ["eos", "eos", "max_new_tokens", "eos"]}


def test_the_bundled_rewards_on_hand_made_completions():
  assert rewards.exact_answer(PROMPTS, COMPLETIONS, **COLUMNS) == [1.0, 1.0, 0.0, 0.0]
  assert rewards.format_check(PROMPTS, COMPLETIONS, **COLUMNS) == [1.0, 1.0, 0.0, 0.0]
  assert rewards.digit_match(PROMPTS, COMPLETIONS, **COLUMNS) == [1.0, 1.0, 0.5, 0.0]
  said = ["68", "58", "168", "8", "6 8", "-68", "", "68\n1", "6²", "٦٨"]
  partial = rewards.digit_match(["a + b = "] * 10, said, answer=["68"] * 10)
  assert partial == [1.0, 0.5, 2 / 3, 0.5, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]


def test_weighted_rewards_sum_per_completion():
  loaded = rewards.load_rewards(["exact_answer", "format_check"], [1.0, 0.25])
  per, total = rewards.score(loaded, PROMPTS, COMPLETIONS, COLUMNS)
  np.testing.assert_array_equal(per, [[1, 1, 0, 0], [1, 1, 0, 0]])
  np.testing.assert_allclose(total, [1.25, 1.25, 0.0, 0.0])


def length_reward(prompts, completions, **_):
  return [float(len(c)) for c in completions]


def picky_reward(prompts, completions, answer, **_):
  return [1.0 / (int(a) - 10) for a in answer]  # divides by zero on the third row


def nan_reward(prompts, completions, **_):
  return [0.0, math.nan, 0.0, 0.0]


def test_a_module_function_is_loaded_by_name():
  (loaded,) = rewards.load_rewards([f"{__name__}:length_reward"])
  assert loaded.fn is sys.modules[__name__].length_reward and loaded.weight == 1.0
  _, total = rewards.score([loaded], PROMPTS, COMPLETIONS, COLUMNS)
  np.testing.assert_array_equal(total, [len(c) for c in COMPLETIONS])


@pytest.mark.parametrize(
  "names, weights, words",
  [
    ([], [], "at least one reward"),
    (["nope"], [], "module:function"),
    (["no_such_module_xyz:f"], [], "does not import"),
    ([f"{__name__}:PROMPTS"], [], "not a function"),
    (["exact_answer"], [1.0, 2.0], "2 weights for 1 rewards"),
  ],
)
def test_bad_reward_names_are_one_line(names, weights, words):
  with pytest.raises(ConfigError, match=words):
    rewards.load_rewards(names, weights)


@pytest.mark.parametrize(
  "name, words",
  [
    ("picky_reward", "raised ZeroDivisionError on completion 2 (prompt '5 + 5 = ')"),
    ("nan_reward", "scored completion 1 (prompt '3 + 4 = ') with nan"),
  ],
)
def test_a_failing_reward_names_the_function_and_the_row(name, words):
  loaded = rewards.load_rewards([f"{__name__}:{name}"])
  with pytest.raises(RewardError, match=re.escape(words)) as e:
    rewards.score(loaded, PROMPTS, COMPLETIONS, COLUMNS)
  assert name in str(e.value) and "\n" not in str(e.value)


SLOW_REWARDS = """
import time


def stuck(prompts, completions, **_):
  scores = []
  for c in completions:
    if c.startswith("1"):  # the third row, '11'
      time.sleep(10**6)
    scores.append(0.0)
  return scores


def stubborn(prompts, completions, **_):
  while True:  # swallows every Exception raised into it
    try:
      time.sleep(10**6)
    except Exception:
      pass


def quick(prompts, completions, **_):
  return [1.0] * len(completions)
"""


@pytest.fixture
def slow_rewards(tmp_path, monkeypatch):
  """A reward module in its own folder on ``sys.path``, as a user's would be."""
  (tmp_path / "slow_rewards.py").write_text(SLOW_REWARDS)
  monkeypatch.syspath_prepend(str(tmp_path))
  yield "slow_rewards"
  sys.modules.pop("slow_rewards", None)


@pytest.mark.parametrize(
  "fn, where",
  [
    ("stuck", "on completion 2 (prompt '5 + 5 = ')"),
    ("stubborn", "on completions 0–3, one call"),  # it holds no row's text
  ],
  ids=["stuck", "stubborn"],
)
def test_a_reward_that_never_returns_stops_at_its_timeout_naming_the_row(slow_rewards, fn, where):
  """A 1 s limit ends the call within seconds with one line naming the function and the
  completion it was on, even when the function catches Exception; no thread, process or
  timer is left behind, and SIGALRM has the handler it had."""
  (loaded,) = rewards.load_rewards([f"{slow_rewards}:{fn}"])
  handler, threads = signal.getsignal(signal.SIGALRM), threading.enumerate()
  begun = time.monotonic()
  with pytest.raises(RewardError) as e:
    rewards.score([loaded], PROMPTS, COMPLETIONS, COLUMNS, timeout=1)
  assert time.monotonic() - begun < 5
  message = str(e.value)
  assert f"reward {slow_rewards}:{fn} did not return within 1 s (rl.reward_timeout) {where}" in (
    message
  )
  assert "\n" not in message
  assert signal.getsignal(signal.SIGALRM) is handler
  assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
  assert threading.enumerate() == threads


def test_a_long_reward_call_says_so_while_it_runs(slow_rewards, monkeypatch, caplog):
  monkeypatch.setattr(rewards, "PROGRESS_S", 0.3)  # 10 s in a run
  caplog.set_level(logging.INFO, logger="jaxstep")
  with pytest.raises(RewardError):
    rewards.score(
      rewards.load_rewards([f"{slow_rewards}:stuck"]), PROMPTS, COMPLETIONS, COLUMNS, timeout=1.5
    )
  lines = [r.getMessage() for r in caplog.records if "still running" in r.getMessage()]
  assert len(lines) == 3, lines  # after 0.3, 0.6 and 1.2 s
  pattern = r"rewards: slow_rewards:stuck still running on completion 2 \(prompt '5 \+ 5 = '\) "
  assert all(re.fullmatch(pattern + r"after \d+ s \(rl.reward_timeout 1.5 s\)", x) for x in lines)


def test_a_reward_in_time_keeps_a_timer_set_before(slow_rewards):
  """Another user of SIGALRM (a test runner's own timeout): its handler and its timer, less
  the time the rewards took, are back after the call."""

  def theirs(signum, frame):
    raise AssertionError("their timer fired")

  before = signal.signal(signal.SIGALRM, theirs)
  signal.setitimer(signal.ITIMER_REAL, 100)
  try:
    _, total = rewards.score(
      rewards.load_rewards([f"{slow_rewards}:quick"]), PROMPTS, COMPLETIONS, COLUMNS, timeout=1
    )
    assert signal.getsignal(signal.SIGALRM) is theirs
    assert 90 < signal.getitimer(signal.ITIMER_REAL)[0] <= 100
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, before)
  np.testing.assert_array_equal(total, [1, 1, 1, 1])


def test_off_the_main_thread_the_timeout_is_off_and_one_warning_says_so(slow_rewards, caplog):
  loaded = rewards.load_rewards([f"{slow_rewards}:quick"])
  out = {}

  def run():
    for _ in range(2):
      out["total"] = rewards.score(loaded, PROMPTS, COMPLETIONS, COLUMNS, timeout=1)[1]

  worker = threading.Thread(target=run)
  worker.start()
  worker.join()
  np.testing.assert_array_equal(out["total"], [1, 1, 1, 1])
  warned = [r for r in caplog.records if "rl.reward_timeout is not enforced" in r.getMessage()]
  assert len(warned) == 1


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_the_reward_timeout_is_a_finite_number_of_seconds(value):
  with pytest.raises(ConfigError, match=r"rl.reward_timeout.* must be a finite number"):
    config_lib.load(None, [f"rl.reward_timeout={value}"])
  assert config_lib.load(None, ["rl.reward_timeout=0"]).rl.reward_timeout == 0
