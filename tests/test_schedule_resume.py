"""The lr of every update step equals the schedule, whichever way the run got there.

Convention (``jaxstep/core/optim.py`` with ``optax.inject_hyperparams``): the schedule is a
function of optax's update count, which is read *before* it advances, so update step ``k``
(1-based, as metrics.jsonl counts) is applied with ``schedule(k - 1)``; the metrics line of
step ``k`` reports that lr. The expected values here come from optax's own
``warmup_cosine_decay_schedule`` (warmup from 0 to the peak, then cosine to
``peak × final_lr_fraction`` at the schedule's end), not from jaxstep's ``make_schedule``.

A re-planned schedule (``checkpoint.allow_schedule_change=true``) is documented as "re-planned
for the new length from the current step": steps after the resume follow the schedule of the
new length at their own step index, steps before it keep the old one.
"""

import optax
import pytest
from conftest import make_cfg, read_lines

from jaxstep import trainer
from jaxstep.trainer.loop.callbacks import Callback

PEAK, WARMUP, FINAL = 1e-3, 3, 0.1
N = 8  # update steps of every run here

pytestmark = pytest.mark.slow


def schedule(length: int):
  """The reference lr schedule spanning ``length`` update steps."""
  return optax.warmup_cosine_decay_schedule(
    0.0, PEAK, WARMUP, decay_steps=length, end_value=PEAK * FINAL
  )


def cfg_for(tmp_path, *overrides, run="run", steps=N, schedule_steps=N, k=2):
  return make_cfg(
    tmp_path,
    f"optim.lr={PEAK}",
    f"optim.warmup_steps={WARMUP}",
    "optim.schedule=cosine",
    f"optim.final_lr_fraction={FINAL}",
    "train.global_batch_size=4",
    f"train.grad_accum_steps={k}",
    f"train.max_steps={steps}",
    f"train.schedule_steps={schedule_steps}",
    "train.log_every=1",
    "train.eval_every=0",
    "data.eval_fraction=0",
    f"run_dir={tmp_path / run}",
    *overrides,
  )


def logged_lrs(run_dir) -> dict[int, float]:
  return {r["step"]: r["lr"] for r in read_lines(run_dir / "metrics.jsonl")}


def assert_lrs(run_dir, expected: dict[int, float]) -> None:
  got = logged_lrs(run_dir)
  assert sorted(got) == sorted(expected), "one metrics line per update step"
  for step, lr in expected.items():
    assert got[step] == pytest.approx(lr, rel=1e-5, abs=1e-9), f"update step {step}"


def planned(length: int, steps) -> dict[int, float]:
  """Update step k → the lr it is applied with: ``schedule(length)(k - 1)``."""
  s = schedule(length)
  return {k: float(s(k - 1)) for k in steps}


class StopAfter(Callback):
  """Stops the run after update step ``step`` (the loop stops at the step it is told)."""

  def __init__(self, step: int):
    self.step = step

  def on_step_end(self, step, metrics, control):
    if step >= self.step:
      control.stop(f"stopped at {step}")


def test_straight_run(tmp_path):
  trainer.train(cfg_for(tmp_path))
  assert_lrs(tmp_path / "run", planned(N, range(1, N + 1)))


def test_resume_with_a_larger_max_steps(tmp_path):
  trainer.train(cfg_for(tmp_path, steps=N // 2))
  trainer.train(cfg_for(tmp_path))
  assert_lrs(tmp_path / "run", planned(N, range(1, N + 1)))


def test_resume_after_a_stop_mid_run(tmp_path):
  result = trainer.train(cfg_for(tmp_path), callbacks=[StopAfter(3)])
  stopped = result.run_state.step
  assert 3 <= stopped < N
  trainer.train(cfg_for(tmp_path))
  assert_lrs(tmp_path / "run", planned(N, range(1, N + 1)))


def test_resume_from_another_runs_checkpoint(tmp_path):
  trainer.train(cfg_for(tmp_path, run="source", steps=N // 2))
  trainer.train(cfg_for(tmp_path), resume_from=str(tmp_path / "source"))
  assert_lrs(tmp_path / "run", planned(N, range(N // 2 + 1, N + 1)))


def test_resume_with_a_replanned_schedule(tmp_path):
  trainer.train(cfg_for(tmp_path, steps=N // 2))
  longer = 12
  trainer.train(
    cfg_for(tmp_path, "checkpoint.allow_schedule_change=true", steps=longer, schedule_steps=longer)
  )
  before = planned(N, range(1, N // 2 + 1))
  assert_lrs(tmp_path / "run", {**before, **planned(longer, range(N // 2 + 1, longer + 1))})


def test_resume_with_another_grad_accum_steps(tmp_path):
  trainer.train(cfg_for(tmp_path, steps=N // 2, k=2))
  trainer.train(cfg_for(tmp_path, k=4))
  assert_lrs(tmp_path / "run", planned(N, range(1, N + 1)))


def wsd_cfg(tmp_path, *overrides, steps, run="run"):
  """A warmup-stable-decay run (warmup 3, decay over the last half), planned for its
  ``train.max_steps`` (no ``train.schedule_steps``)."""
  return make_cfg(
    tmp_path,
    f"optim.lr={PEAK}",
    f"optim.warmup_steps={WARMUP}",
    "optim.schedule=wsd",
    "optim.decay_fraction=0.5",
    f"optim.final_lr_fraction={FINAL}",
    "train.global_batch_size=4",
    "train.grad_accum_steps=2",
    f"train.max_steps={steps}",
    "train.schedule_steps=0",  # the plan follows train.max_steps
    "train.log_every=1",
    "train.eval_every=0",
    "checkpoint.every=1",
    "data.eval_fraction=0",
    f"run_dir={tmp_path / run}",
    *overrides,
  )


def wsd_planned(length: int, steps) -> dict[int, float]:
  """Update step k of a WSD plan of ``length`` steps → its lr, from the formula."""
  stable_end = WARMUP + (length - WARMUP) - round(0.5 * (length - WARMUP))
  decay = length - stable_end

  def lr(count):
    if count < WARMUP:
      return PEAK * count / WARMUP
    x = min(max((count - stable_end) / decay, 0.0), 1.0)
    return PEAK * (1 - (1 - FINAL) * x)

  return {k: lr(k - 1) for k in steps}


def test_a_wsd_run_extended_on_resume_keeps_its_stable_phase_and_moves_the_decay(tmp_path):
  """8 steps planned (stable to step 5), stopped at 5, resumed with 15: no refusal, and
  every lr is the 15-step plan's, the first five being the same under both."""
  trainer.train(wsd_cfg(tmp_path, steps=8), callbacks=[StopAfter(5)])
  trainer.train(wsd_cfg(tmp_path, steps=15))
  assert wsd_planned(8, range(1, 6)) == wsd_planned(15, range(1, 6))
  assert_lrs(tmp_path / "run", wsd_planned(15, range(1, 16)))


def test_a_decay_branches_from_a_stable_checkpoint(tmp_path):
  """A 20-step plan's checkpoint at step 6 (stable), resumed into a 10-step run: its decay
  runs from step 7 to 10."""
  trainer.train(wsd_cfg(tmp_path, steps=20, run="long"), callbacks=[StopAfter(6)])
  steps = tmp_path / "long" / "checkpoints" / "6"
  trainer.train(wsd_cfg(tmp_path, steps=10, run="branch"), resume_from=str(steps))
  assert_lrs(tmp_path / "branch", wsd_planned(10, range(7, 11)))


def test_a_wsd_checkpoint_already_decaying_is_not_extended_silently(tmp_path):
  from jaxstep.errors import CheckpointError

  trainer.train(wsd_cfg(tmp_path, steps=8))  # ends decayed, at step 8
  with pytest.raises(CheckpointError, match="planned for 8 update steps, this config plans 12"):
    trainer.train(wsd_cfg(tmp_path, steps=12))
