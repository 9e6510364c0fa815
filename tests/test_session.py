"""Session: micro-batches one at a time, the same exact math as make_train_step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import lm_batch, regression_loss, tiny_lm_apply, tiny_lm_params
from tolerance import assert_close, assert_far, planted

from jaxstep import (
  AccumulationError,
  ConfigError,
  EmptyBatchError,
  Session,
  TrainState,
  make_train_step,
)
from jaxstep.core.accumulate import split_micro_batches
from jaxstep.core.losses import next_token_loss
from jaxstep.core.optim import OptimConfig, make_optimizer
from jaxstep.core.step import apply_update


def micro(xs, ys, mask=None):
  mask = np.ones(len(xs)) if mask is None else np.asarray(mask, float)
  return {
    "x": jnp.asarray(xs, jnp.float32),
    "y": jnp.asarray(ys, jnp.float32),
    "loss_mask": jnp.asarray(mask, jnp.float32),
  }


def session(k=2, lr=0.1, optimizer=None):
  return Session(
    regression_loss, optimizer or optax.sgd(lr), {"w": jnp.float32(1.0)}, grad_accum_steps=k
  )


def test_two_micro_steps_with_k2_make_exactly_one_update():
  s = session()
  first = s.train_step(micro([1.0], [2.0]), normalization_units=1)
  assert not first.parameters_updated and first.microsteps_accumulated == 1
  assert float(s.state.params["w"]) == 1.0 and s.optimizer_step == 0  # nothing before K
  second = s.train_step(micro([3.0], [6.0]), normalization_units=1)
  assert second.parameters_updated and second.optimizer_step == 1
  assert second.loss_sum == pytest.approx(0.5 + 4.5) and second.loss_units == 2
  assert float(s.state.params["w"]) == pytest.approx(1.5)  # mean gradient −5
  assert s.microsteps_accumulated == 0 and s.loss_numerator == 0.0


def test_unequal_unit_counts_use_the_global_normalization():
  # Micro 0: two samples of gradient 3; micro 1: one of gradient 9 + a padded row.
  s = session()
  s.train_step(micro([1.0, 1.0], [-2.0, -2.0]), normalization_units=2)
  report = s.train_step(micro([3.0, 5.0], [0.0, 0.0], mask=[1, 0]), normalization_units=1)
  assert report.parameters_updated
  assert float(s.state.params["w"]) == pytest.approx(1.0 - 0.1 * 5.0)  # not (3 + 9) / 2


def test_force_update_commits_a_short_tail():
  s = session(k=4)
  s.train_step(micro([1.0], [2.0]), normalization_units=1)
  report = s.train_step(micro([3.0], [6.0]), normalization_units=1, force_update=True)
  assert report.parameters_updated and report.microsteps_accumulated == 2
  assert float(s.state.params["w"]) == pytest.approx(1.5)


def test_zero_units_at_the_boundary_is_an_error_and_nothing_changes():
  s = session()
  s.train_step(micro([1.0], [2.0], mask=[0]), normalization_units=0)
  with pytest.raises(EmptyBatchError):
    s.train_step(micro([3.0], [6.0], mask=[0]), normalization_units=0)
  assert float(s.state.params["w"]) == 1.0 and s.optimizer_step == 0
  with pytest.raises(AccumulationError):
    s.train_step(micro([1.0], [2.0]), normalization_units=1)


def test_hook_abort_invalidates_until_reset():
  s = session()
  s.train_step(micro([1.0], [2.0]), normalization_units=1)
  report = s.train_step(
    micro([3.0], [6.0]), normalization_units=1, before_update=lambda r: r.loss_units == 2
  )
  assert not report.parameters_updated and float(s.state.params["w"]) == 1.0
  with pytest.raises(AccumulationError, match="reset"):
    s.train_step(micro([1.0], [2.0]), normalization_units=1)
  s.reset()
  s.train_step(micro([1.0], [2.0]), normalization_units=1)
  assert s.train_step(micro([3.0], [6.0]), normalization_units=1).parameters_updated


def test_exception_in_a_hook_invalidates_and_after_update_sees_the_report():
  s = session()
  seen = []
  s.train_step(micro([1.0], [2.0]), normalization_units=1)
  s.train_step(micro([3.0], [6.0]), normalization_units=1, after_update=seen.append)
  assert seen and seen[0].parameters_updated and seen[0].optimizer_step == 1

  def boom(report):
    raise RuntimeError("hook failed")

  s.train_step(micro([1.0], [2.0]), normalization_units=1)
  with pytest.raises(RuntimeError, match="hook failed"):
    s.train_step(micro([3.0], [6.0]), normalization_units=1, before_update=boom)
  assert not s.valid
  with pytest.raises(AccumulationError):
    s.train_step(micro([1.0], [2.0]), normalization_units=1)


def test_session_and_make_train_step_agree(np_rng):
  opt = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=0, clip_grad_norm=0.5), 10)
  loss_fn = next_token_loss(tiny_lm_apply)
  params = tiny_lm_params()
  step = jax.jit(make_train_step(loss_fn, opt, grad_accum_steps=3))
  state = TrainState.create(params=params, optimizer=opt, rng=0)
  s = Session(loss_fn, opt, params, grad_accum_steps=3)
  for _ in range(3):
    mask = (np_rng.random((6, 5)) < np_rng.choice([0.1, 0.9], size=(6, 1))).astype(np.int32)
    mask[0, 0] = 1
    batch = lm_batch(np_rng, 6, 5, vocab=11, mask=mask)
    state, _ = step(state, batch)
    micro_batches = jax.tree.map(np.asarray, split_micro_batches(batch, 3))
    for k in range(3):
      mb = jax.tree.map(lambda x, k=k: x[k], micro_batches)
      s.train_step(mb, normalization_units=int(mb["loss_mask"].sum()))
  assert s.optimizer_step == 3
  # three AdamW updates of the same gradients summed in another order: Adam divides each
  # gradient by its own running scale, which keeps the rounding relative to the largest
  # parameter (the tolerance's floor), not to a near-zero one
  assert_close(s.state.params, state.params, terms=11 * 6 * 5)
  assert_far(planted(s.state.params), state.params, terms=11 * 6 * 5)
  assert s.lr == pytest.approx(float(state.opt_state[1].hyperparams["learning_rate"]))


def test_lr_override_equals_an_optimizer_built_with_that_lr():
  cfg = dict(schedule="constant", clip_grad_norm=0.0, weight_decay=0.1)
  a = session(optimizer=make_optimizer(OptimConfig(lr=0.1, **cfg), 10))
  b = session(optimizer=make_optimizer(OptimConfig(lr=0.03, **cfg), 10))
  for s, lr in ((a, 0.03), (b, None)):
    s.train_step(micro([1.0], [2.0]), normalization_units=1)
    s.train_step(micro([3.0], [6.0]), normalization_units=1, lr=lr)
  assert float(a.state.params["w"]) == pytest.approx(float(b.state.params["w"]), rel=1e-6)
  assert float(a.state.params["w"]) != 1.0


def test_lr_override_without_an_injected_lr_is_a_config_error_before_anything_changes():
  s = session()  # plain optax.sgd(0.1): its lr is a constant, not in the optimizer state
  with pytest.raises(ConfigError, match="inject_hyperparams"):
    s.train_step(micro([1.0], [2.0]), normalization_units=1, lr=0.05)
  assert s.valid and s.microsteps_accumulated == 0 and s.optimizer_step == 0
  s.train_step(micro([1.0], [2.0]), normalization_units=1)  # still usable, no reset needed
  report = s.train_step(micro([3.0], [6.0]), normalization_units=1)
  assert report.parameters_updated and float(s.params["w"]) == pytest.approx(1.5)


def test_apply_update_with_an_lr_needs_an_injected_lr():
  params = {"w": jnp.float32(1.0)}
  state = TrainState.create(params=params, optimizer=optax.sgd(0.1), rng=0)
  grads = {"w": jnp.float32(1.0)}
  with pytest.raises(ConfigError, match="inject_hyperparams"):
    apply_update(optax.sgd(0.1), state, grads, jnp.bool_(True), lr=0.05)


def test_lr_override_when_the_schedule_is_at_zero_skips_instead_of_nan():
  # warmup from 0: the first update's scheduled lr is exactly 0, so no rescaling of its
  # (zero) update can reach another lr; the update is skipped, never applied as NaN
  opt = make_optimizer(OptimConfig(lr=0.1, warmup_steps=5, clip_grad_norm=0.0), 10)
  s = session(k=1, optimizer=opt)
  report = s.train_step(micro([1.0], [2.0]), normalization_units=1, lr=0.05)
  assert not report.parameters_updated and int(s.state.skipped) == 1
  assert float(s.params["w"]) == 1.0
