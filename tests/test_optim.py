"""Schedules count update steps and match their closed forms; decay mask; validation."""

import math

import jax
import jax.numpy as jnp
import optax
import pytest

from jaxstep import ConfigError, TrainState, make_train_step
from jaxstep.core.optim import OptimConfig, decay_mask, make_optimizer, make_schedule


@pytest.mark.parametrize("s", [0, 50, 100])
def test_cosine_without_warmup_matches_closed_form(s):
  lr, total = 3e-3, 100
  sched = make_schedule(OptimConfig(lr=lr, schedule="cosine", final_lr_fraction=0.1), total)
  expected = lr * (0.1 + 0.45 * (1 + math.cos(math.pi * s / total)))
  assert float(sched(s)) == pytest.approx(expected, rel=1e-6)


def test_warmup_then_linear_decay():
  sched = make_schedule(
    OptimConfig(lr=1.0, schedule="linear", warmup_steps=10, final_lr_fraction=0.0), 110
  )
  assert [float(sched(s)) for s in (0, 5, 10, 60, 110)] == pytest.approx(
    [0.0, 0.5, 1.0, 0.5, 0.0], abs=1e-6
  )


def test_constant_schedule_with_warmup():
  sched = make_schedule(OptimConfig(lr=2.0, schedule="constant", warmup_steps=4), 50)
  assert [float(sched(s)) for s in (0, 2, 4, 49)] == pytest.approx([0.0, 1.0, 2.0, 2.0])


def test_schedule_advances_once_per_update_not_per_micro_step():
  cfg = OptimConfig(lr=1.0, schedule="linear", final_lr_fraction=0.0, clip_grad_norm=0.0)
  optimizer = make_optimizer(cfg, total_steps=4)

  def loss_fn(params, batch, rng):
    return jnp.sum(batch["loss_mask"] * params["w"]), {}

  step = jax.jit(make_train_step(loss_fn, optimizer, grad_accum_steps=4))
  state = TrainState.create(params={"w": jnp.ones((2, 2))}, optimizer=optimizer, rng=0)
  lrs = []
  for _ in range(3):
    state, metrics = step(state, {"loss_mask": jnp.ones((8,))})
    lrs.append(float(metrics["lr"]))
  assert lrs == pytest.approx([1.0, 0.75, 0.5])  # 8 samples / K=4 micro-steps → 1 update


def test_decay_mask_skips_biases_norms_and_embeddings_by_default():
  params = {
    "embed": {"embedding": jnp.ones((5, 3))},
    "fc": {"kernel": jnp.ones((3, 3)), "bias": jnp.ones(3)},
    "ln": {"scale": jnp.ones(3)},
  }
  assert decay_mask(params) == {
    "embed": {"embedding": False},
    "fc": {"kernel": True, "bias": False},
    "ln": {"scale": False},
  }
  assert decay_mask(params, decay_embeddings=True)["embed"]["embedding"] is True


def test_weight_decay_only_moves_decayed_leaves_when_gradient_is_zero():
  cfg = OptimConfig(lr=0.1, schedule="constant", weight_decay=0.5, clip_grad_norm=0.0)
  params = {"fc": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)}}
  optimizer = make_optimizer(cfg, 10)
  updates, _ = optimizer.update(optax.tree.zeros_like(params), optimizer.init(params), params)
  new = optax.apply_updates(params, updates)
  assert float(new["fc"]["kernel"][0, 0]) == pytest.approx(1 - 0.1 * 0.5)
  assert float(new["fc"]["bias"][0]) == 1.0


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"schedule": "exp"}, "optim.schedule"),
    ({"lr": 0.0}, "optim.lr"),
    ({"warmup_steps": -1}, "optim.warmup_steps"),
    ({"final_lr_fraction": 2.0}, "optim.final_lr_fraction"),
    ({"clip_grad_norm": -1.0}, "optim.clip_grad_norm"),
  ],
)
def test_invalid_optim_config_names_the_key(kwargs, match):
  with pytest.raises(ConfigError, match=match):
    OptimConfig(**kwargs)


def test_warmup_longer_than_the_run_is_clamped():
  sched = make_schedule(OptimConfig(lr=1.0, warmup_steps=20), total_steps=3)
  assert [float(sched(s)) for s in (0, 3)] == pytest.approx([0.0, 1.0])
