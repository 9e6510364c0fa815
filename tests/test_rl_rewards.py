"""RL rewards: the bundled ones on hand-made completions, loading by name with weights, the
weighted sum, and a reward that fails named with its row in one line."""

import math
import re
import sys

import numpy as np
import pytest

from jaxstep.errors import ConfigError, RewardError
from jaxstep.trainer.rl import rewards

PROMPTS = ["1 + 2 = ", "3 + 4 = ", "5 + 5 = ", "2 + 2 = "]
COMPLETIONS = ["3", " 7 \nmore text", "11", "four"]
COLUMNS = {"answer": ["3", "7", "10", "4"], "stop_reason": ["eos", "eos", "max_new_tokens", "eos"]}


def test_the_bundled_rewards_on_hand_made_completions():
  assert rewards.exact_answer(PROMPTS, COMPLETIONS, **COLUMNS) == [1.0, 1.0, 0.0, 0.0]
  assert rewards.format_check(PROMPTS, COMPLETIONS, **COLUMNS) == [1.0, 1.0, 0.0, 0.0]


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
