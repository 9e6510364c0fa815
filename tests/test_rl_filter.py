"""Dynamic sampling (``rl.filter_groups``): the groups whose rewards are all equal are dropped
and more prompts drawn, up to ``rl.max_draws`` rollouts per update; the update trains on the
first P informative groups, normalized over them alone, exact over K micro-batches, and a
run stopped in the middle of an update's draws resumes to the bit."""

import numpy as np
import pytest
from conftest import bitwise_same_checkpoints
from hypothesis import given, settings
from hypothesis import strategies as st
from test_rl_trainer import ROWS, records, trainer

from jaxstep.core import rl
from jaxstep.trainer.rl import rollout

G = 4  # completions per prompt


def half_tied(prompts, completions, answer, **_):
  """0 for every completion of a prompt whose answer is even (a group with nothing to
  learn), the share of digits for the others (groups a random model's samples split)."""
  return [0.0 if int(a) % 2 == 0 else sum(ch.isdigit() for ch in c) / max(len(c), 1)
          for c, a in zip(completions, answer, strict=True)]  # fmt: skip


def fake_draw(total: np.ndarray, first_row: int) -> rollout.Draw:
  """A draw whose rows are numbered (``inputs[:, 0]``) so a test can see which were kept."""
  n = total.size
  rows = {
    "inputs": np.arange(first_row, first_row + n, dtype=np.int32)[:, None].repeat(3, 1),
    "targets": np.zeros((n, 3), np.int32),
    "completion_mask": np.ones((n, 3), np.int32),
    "old_logps": np.full((n, 3), -1.5, np.float32),
  }
  return rollout.Draw(rows, total, total[None], np.ones(n), np.zeros(n, bool), 0.1)


def by_hand(draws: list[np.ndarray], p: int):
  """The filter of verl's ``filter_groups`` written out: walk the groups in draw order, keep
  the first ``p`` whose rewards are not all equal; fill the rest with dropped groups that
  count for nothing; keep the first draw whole when none is informative."""
  groups = [t[i : i + G] for t in draws for i in range(0, t.size, G)]
  kept = [i for i, r in enumerate(groups) if len(set(r.tolist())) > 1][:p]
  if not kept:
    return list(range(p)), [True] * p
  fill = [i for i, r in enumerate(groups) if len(set(r.tolist())) == 1][: p - len(kept)]
  return kept + fill, [True] * len(kept) + [False] * len(fill)


@settings(max_examples=60, deadline=None)
@given(
  st.integers(1, 3).flatmap(
    lambda d: st.lists(
      st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=3 * G, max_size=3 * G),  # 3 groups
      min_size=d,
      max_size=d,
    )
  )
)
def test_the_update_trains_on_exactly_the_groups_a_filter_by_hand_keeps(rewards):
  p = per_draw = 3  # groups an update trains on, groups a draw holds
  totals = [np.array(r, np.float32) for r in rewards]
  draws = [fake_draw(t, 100 * i) for i, t in enumerate(totals)]
  cfg = rl.RLConfig(rewards=("x",), num_generations=G, filter_groups=True)
  out = rollout.assemble(draws, cfg, [type("R", (), {"name": "x"})()], groups=p)
  chosen, counts = by_hand(totals, p)
  rows = np.array(
    [100 * (c // per_draw) + G * (c % per_draw) + j for c in chosen for j in range(G)]
  )
  np.testing.assert_array_equal(out.batch["inputs"][:, 0], rows)
  mask = np.repeat(counts, G)[:, None] * np.ones((1, 3), np.int32)
  np.testing.assert_array_equal(out.batch["completion_mask"], mask)
  assert not out.batch["old_logps"][mask == 0].any()  # rows that count for nothing: padding
  every = np.concatenate(totals)
  advantages = np.concatenate([rl.group_advantages(t.reshape(-1, G)).reshape(-1) for t in totals])
  position = (rows // 100) * per_draw * G + rows % 100  # in the draws laid end to end
  np.testing.assert_array_equal(out.batch["advantages"], advantages[position] * mask[:, 0])
  informative = [len(set(every[i : i + G].tolist())) > 1 for i in range(0, every.size, G)]
  assert out.metrics["groups_drawn"] == len(informative) == p * len(draws)
  assert out.metrics["groups_kept"] == min(sum(informative), p)
  assert out.metrics["frac_reward_zero_std"] == pytest.approx(1 - np.mean(informative))
  assert out.metrics["reward"] == pytest.approx(every.mean())


def test_a_process_holding_half_the_rows_trains_on_its_half_of_the_same_update(monkeypatch):
  """Over two processes each draw's rows are split between them and the kept groups come
  from both: each process gathers the draws' rows and keeps its own half of the update the
  single process would train on."""
  totals = [np.array([0, 0, 0, 0, 1, 0, 1, 0, 2, 2, 2, 2], np.float32),
            np.array([3, 3, 3, 3, 0, 1, 0, 1, 5, 5, 5, 5], np.float32)]  # fmt: skip
  cfg = rl.RLConfig(rewards=("x",), num_generations=G, filter_groups=True)
  named = [type("R", (), {"name": "x"})()]
  whole = [fake_draw(t, 100 * i) for i, t in enumerate(totals)]
  single = rollout.assemble(whole, cfg, named, groups=3)
  here = np.arange(6, 12)  # the second process's rows of each draw
  everyone = {}
  halves = []
  for d in whole:
    half = {k: v[here] for k, v in d.rows.items()}
    everyone |= {id(half[k]): v for k, v in d.rows.items()}
    halves.append(rollout.Draw(half, d.total, d.per_fn, d.lengths, d.clipped, d.seconds))
  monkeypatch.setattr(rollout, "_here", lambda sharding, n: here)
  monkeypatch.setattr(rollout, "gather_rows", lambda values, rows, n: everyone[id(values)])
  mine = rollout.assemble(halves, cfg, named, sharding="two processes", groups=3)
  assert single.metrics == mine.metrics and single.metrics["groups_kept"] == 2
  for k, v in single.batch.items():
    np.testing.assert_array_equal(mine.batch[k], v[here], err_msg=k)


def test_rewards_equal_up_to_their_last_bit_are_a_group_without_signal():
  total = np.array([0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1 + 2**-26], np.float32)
  np.testing.assert_array_equal(rollout.informative(total, 4), [False, True])


def test_a_run_keeps_only_informative_groups_and_k_micro_batches_agree(tmp_path):
  """Half the prompts give a group of zeros: each update draws again until its 4 groups all
  carry signal (or 4 rollouts are drawn), and K = 4 gives K = 1's losses and gradients on
  the same rows."""
  runs = {}
  for k in (1, 4):
    filtered = {"filter_groups": True, "max_draws": 4}
    trainer(tmp_path / f"k{k}", rewards=[half_tied], rl=filtered,
            train={"grad_accum_steps": k}).fit()  # fmt: skip
    runs[k] = records(tmp_path / f"k{k}")
  for a, b in zip(runs[1], runs[4], strict=True):
    assert (a["groups_drawn"], a["groups_kept"], a["reward"]) == (
      b["groups_drawn"],
      b["groups_kept"],
      b["reward"],
    )
    for key in ("loss", "grad_norm", "tokens"):
      np.testing.assert_allclose(b[key], a[key], rtol=2e-5, atol=1e-6, err_msg=key)
  assert all(r["groups_drawn"] % 4 == 0 and r["groups_drawn"] <= 16 for r in runs[1])
  assert any(r["groups_drawn"] > 4 for r in runs[1]), runs[1]  # the filter drew more
  assert all(r["groups_kept"] == 4 or r["groups_drawn"] == 16 for r in runs[1])


@pytest.mark.slow
def test_a_run_stopped_in_the_middle_of_an_updates_draws_resumes_to_the_bit(tmp_path):
  """A reward that fails on the second draw of an update (after a checkpoint at every
  update): the run stops there; run again, it resumes from the last checkpoint, draws the
  same prompts with the same seeds and ends as the run never stopped."""
  filtered = {"filter_groups": True, "max_draws": 4}
  every = {"checkpoint": {"every": 1}}
  trainer(tmp_path / "straight", rewards=[half_tied], rl=filtered, **every).fit()
  straight = records(tmp_path / "straight")
  draws = [r["groups_drawn"] // 4 for r in straight]
  update = next(u for u in (1, 2) if draws[u] > 1)  # an update after the first with a redraw
  crash_at = sum(draws[:update]) + 2  # its second draw
  calls = []

  def crashes(prompts, completions, answer, **kw):
    calls.append(1)
    if len(calls) == crash_at:
      raise RuntimeError("stopped in the middle of the draws")
    return half_tied(prompts, completions, answer)

  crashes.__name__ = "half_tied"  # the same metric names as the straight run's
  with pytest.raises(Exception, match="stopped in the middle"):
    trainer(tmp_path / "stopped", rewards=[crashes], rl=filtered, **every).fit()
  trainer(tmp_path / "stopped", rewards=[half_tied], rl=filtered, **every).fit()
  step, _ = bitwise_same_checkpoints(tmp_path / "straight", tmp_path / "stopped")
  assert step == 3
  assert records(tmp_path / "stopped")[-(3 - update) :] == straight[update:]


def test_filter_settings_are_checked():
  with pytest.raises(Exception, match="rl.max_draws must be >= 1"):
    rl.RLConfig(rewards=("x",), filter_groups=True, max_draws=0)
  with pytest.raises(Exception, match="needs rl.num_generations >= 2"):
    rl.RLConfig(rewards=("x",), filter_groups=True, num_generations=1, advantage="dr_grpo")
  assert ROWS  # the prompts the runs above draw from
