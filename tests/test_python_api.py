"""The Python API with your own flax model: NNX and linen modules with dropout and
BatchNorm, state built by the step, checkpoints, Session safety."""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import regression_loss
from flax import nnx
from tolerance import assert_close, assert_far

from jaxstep import Checkpointer, ConfigError, Session, make_train_step, models
from jaxstep.core.accumulate import split_micro_batches
from jaxstep.core.loss_scale import DynamicLossScale

K = 4
TERMS = 16  # the longest sums: Net's 16 hidden units, a gradient's sum over the 16 rows


class Net(nnx.Module):
  """The standard NNX patterns: dropout holding its own Rngs, BatchNorm in batch mode."""

  def __init__(self, rngs: nnx.Rngs):
    self.lin = nnx.Linear(4, 16, rngs=rngs)
    self.bn = nnx.BatchNorm(16, use_running_average=False, momentum=0.9, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)
    self.out = nnx.Linear(16, 3, rngs=rngs)

  def __call__(self, x):
    return self.out(self.drop(nnx.relu(self.bn(self.lin(x)))))


def classification_loss(apply_fn):
  def loss_fn(params, batch, rng, model_state):
    logits, model_state = apply_fn(params, batch["x"], rng=rng, train=True, model_state=model_state)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return jnp.sum(nll * batch["loss_mask"]), {}, model_state

  return loss_fn


@functools.cache
def nnx_model():
  """``Net`` through ``models.from_nnx``, built once: no test changes it."""
  return models.from_nnx(Net(nnx.Rngs(0)))


@functools.cache
def nnx_sgd_step():
  """The train step of ``nnx_model`` with SGD, and its jitted form that donates the state."""
  train_step = make_train_step(
    classification_loss(nnx_model().apply_fn), optax.sgd(0.1), grad_accum_steps=K
  )
  return train_step, jax.jit(train_step, donate_argnums=0)


def data(g=16, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(g, 4)).astype(np.float32)
  return {
    "x": jnp.asarray(x),
    "y": jnp.asarray((x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 1)),
    "loss_mask": jnp.asarray((rng.random(g) < 0.8).astype(np.float32)),
  }


def test_nnx_dropout_rngs_and_batchnorm_train_under_jit():
  model = nnx_model()
  assert set(model.model_state["bn"]) == {"mean", "var"}
  train_step, step = nnx_sgd_step()
  state = train_step.init(model.params, 0, model_state=model.model_state)
  for seed in range(3):
    state, metrics = step(state, data(seed=seed))
    assert bool(metrics["updated"])
  assert not np.allclose(state.model_state["bn"]["mean"], model.model_state["bn"]["mean"])
  assert not np.allclose(state.params["out"]["kernel"], model.params["out"]["kernel"])


@pytest.mark.slow
def test_model_state_goes_through_the_micro_steps_in_order_like_a_pytorch_loop():
  model = models.from_nnx(Net(nnx.Rngs(0)))
  loss_fn, lr, batch = classification_loss(model.apply_fn), 0.1, data()
  train_step = make_train_step(loss_fn, optax.sgd(lr), grad_accum_steps=K)
  state = train_step.init(model.params, 7, model_state=model.model_state)
  new, _ = jax.jit(train_step)(state, batch)

  # The reference: micro-batch k (rows k, k+K, …) after micro-batch k-1, each with the
  # step's key for micro-step k, gradients of loss_sum_k / N summed, one SGD update.
  n = jnp.sum(batch["loss_mask"])
  micro = split_micro_batches(batch, K)
  step_rng = jax.random.fold_in(state.rng, 0)

  def reference(order):
    grads, model_state = jax.tree.map(jnp.zeros_like, model.params), model.model_state
    for k in order:
      mb = jax.tree.map(lambda x, k=k: x[k], micro)

      def objective(p, mb=mb, k=k, ms=model_state):
        loss_sum, _, ms = loss_fn(p, mb, jax.random.fold_in(step_rng, k), ms)
        return loss_sum / n, ms

      g, model_state = jax.grad(objective, has_aux=True)(model.params)
      grads = jax.tree.map(jnp.add, grads, g)
    return jax.tree.map(lambda p, g: p - lr * g, model.params, grads), model_state

  expected, model_state = reference(range(K))
  assert_close(new.params, expected, terms=TERMS)
  assert_close(new.model_state, model_state, terms=TERMS)
  # the margin: the micro-batches' statistics folded into the running ones in reverse order
  _, reversed_state = reference(reversed(range(K)))
  assert_far(reversed_state, model_state, terms=TERMS)


def test_each_micro_step_draws_fresh_dropout_and_eval_is_deterministic():
  model = nnx_model()
  x = data()["x"]

  def run(rng, train):
    out, _ = model.apply_fn(model.params, x, rng=rng, train=train, model_state=model.model_state)
    return out

  k1, k2 = jax.random.PRNGKey(1), jax.random.PRNGKey(2)
  np.testing.assert_array_equal(run(k1, True), run(k1, True))  # reproducible from the key
  assert not np.allclose(run(k1, True), run(k2, True))  # a new key, a new mask
  np.testing.assert_array_equal(run(k1, False), run(k2, False))  # eval: no dropout
  _, state = model.apply_fn(model.params, x, train=False, model_state=model.model_state)
  chex.assert_trees_all_equal(state, model.model_state)  # eval: running statistics only


class LinenNet(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Dense(16)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
    x = nn.Dropout(0.5, deterministic=not train)(nn.relu(x))
    return nn.Dense(3)(x)


def test_linen_module_with_batch_stats_and_dropout():
  model = models.from_linen(LinenNet(), data()["x"], rng=0)
  assert set(model.model_state) == {"batch_stats"}
  train_step = make_train_step(
    classification_loss(model.apply_fn), optax.adam(1e-2), grad_accum_steps=K
  )
  state = train_step.init(model.params, 0, model_state=model.model_state)
  step = jax.jit(train_step)
  losses = []
  for seed in range(20):
    state, metrics = step(state, data(seed=seed % 4))
    losses.append(float(metrics["loss"]))
  assert losses[-1] < losses[0]
  before = model.model_state["batch_stats"]
  assert not np.allclose(
    jax.tree.leaves(state.model_state["batch_stats"])[0], jax.tree.leaves(before)[0]
  )


def test_state_with_model_state_round_trips_through_a_checkpoint(tmp_path):
  model = nnx_model()
  train_step = make_train_step(
    classification_loss(model.apply_fn), optax.adamw(1e-3), grad_accum_steps=K
  )
  state = train_step.init(model.params, 0, model_state=model.model_state)
  step = jax.jit(train_step)
  with Checkpointer(tmp_path / "ckpt", keep=2) as ckpt:
    for seed in range(4):
      state, _ = step(state, data(seed=seed))
      ckpt.save(int(state.step), state, {"seed": seed})
    assert ckpt.steps() == [3, 4]  # keep=2
  fresh = train_step.init(model.params, 0, model_state=model.model_state)
  restored, metadata, saved_step = Checkpointer(tmp_path / "ckpt").restore(fresh)
  assert saved_step == 4 and metadata == {"seed": 3}
  chex.assert_trees_all_equal(restored, state)
  assert type(restored) is type(state)


def test_init_owns_the_loss_scale_and_the_spike_window():
  params = {"w": jnp.float32(1.0)}
  fp16 = make_train_step(regression_loss, optax.sgd(0.1), grad_accum_steps=2, precision="fp16")
  assert float(fp16.init(params, 0).loss_scale.scale) == 2.0**15
  custom = make_train_step(
    regression_loss,
    optax.sgd(0.1),
    grad_accum_steps=2,
    precision="fp16",
    loss_scale=DynamicLossScale(init_scale=64.0),
    spike_window=8,
  )
  state = custom.init(params, 0)
  assert float(state.loss_scale.scale) == 64.0 and state.recent_losses.shape == (8,)
  fp32 = make_train_step(regression_loss, optax.sgd(0.1), grad_accum_steps=2)
  assert float(fp32.init(params, 0).loss_scale.scale) == 1.0


def regression_micro(x, y):
  return {"x": jnp.asarray(x), "y": jnp.asarray(y), "loss_mask": jnp.ones_like(jnp.asarray(x))}


def test_donating_the_state_never_deletes_the_callers_params():
  params = {"w": jnp.ones(3)}
  train_step = make_train_step(regression_loss, optax.sgd(0.1), grad_accum_steps=2)
  step = jax.jit(train_step, donate_argnums=0)
  state = train_step.init(params, 0)
  state, _ = step(state, regression_micro([1.0, 2.0], [2.0, 4.0]))
  state, _ = step(state, regression_micro([1.0, 2.0], [2.0, 4.0]))
  np.testing.assert_array_equal(params["w"] + 1, 2.0)  # still alive


def test_session_never_deletes_the_callers_params():
  params = {"w": jnp.float32(1.0)}
  session = Session(regression_loss, optax.sgd(0.1), params, grad_accum_steps=2)
  for _ in range(2):
    session.train_step(regression_micro([1.0], [2.0]), normalization_units=1)
    session.train_step(regression_micro([3.0], [6.0]), normalization_units=1)
  assert float(params["w"]) == 1.0  # usable, and untouched
  assert session.optimizer_step == 2 and float(session.params["w"]) != 1.0


def test_session_empty_batch_error_says_to_reset():
  session = Session(regression_loss, optax.sgd(0.1), {"w": jnp.float32(1.0)}, grad_accum_steps=1)
  with pytest.raises(Exception, match=r"call reset\(\)"):
    session.train_step(regression_micro([1.0], [2.0]), normalization_units=0)


def test_a_checkpoint_of_another_model_state_is_a_clear_error(tmp_path):
  from jaxstep import CheckpointError

  model = nnx_model()
  train_step, _ = nnx_sgd_step()
  state = train_step.init(model.params, 0, model_state=model.model_state)
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    ckpt.save(0, state)
  other = {"bn": {"mean": jnp.zeros(8), "var": jnp.ones(8)}}
  with pytest.raises(CheckpointError, match="model state bn/mean has shape"):
    Checkpointer(tmp_path / "ckpt").restore(state.replace(model_state=other))


def test_a_typed_key_a_raw_key_and_an_int_seed_give_the_same_run():
  model = nnx_model()
  train_step, _ = nnx_sgd_step()
  step = jax.jit(train_step)
  typed = jax.random.key(3)
  results = []
  for rng in (typed, jax.random.key_data(typed), 3):
    state = train_step.init(model.params, rng, model_state=model.model_state)
    assert state.rng.dtype == jnp.uint32 and state.rng.shape == (2,)  # one stored form
    for seed in range(2):
      state, metrics = step(state, data(seed=seed))
    results.append((state.params, state.model_state, metrics["loss"]))
  chex.assert_trees_all_equal(results[0], results[1])
  chex.assert_trees_all_equal(results[0], results[2])
  # the adapter's apply_fn takes either form directly
  x = data()["x"]
  by_typed, _ = model.apply_fn(
    model.params, x, rng=typed, train=True, model_state=model.model_state
  )
  by_raw, _ = model.apply_fn(
    model.params, x, rng=jax.random.key_data(typed), train=True, model_state=model.model_state
  )
  np.testing.assert_array_equal(by_typed, by_raw)


def test_session_takes_a_typed_key():
  typed = jax.random.key(5)
  a = Session(
    regression_loss, optax.sgd(0.1), {"w": jnp.float32(1.0)}, grad_accum_steps=1, rng=typed
  )
  b = Session(
    regression_loss,
    optax.sgd(0.1),
    {"w": jnp.float32(1.0)},
    grad_accum_steps=1,
    rng=jax.random.key_data(typed),
  )
  np.testing.assert_array_equal(a.state.rng, b.state.rng)
  assert a.state.rng.dtype == jnp.uint32


class LinenMLP(nn.Module):
  """A linen module without any collection besides ``params``."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(nn.relu(nn.Dense(8)(x)))


@pytest.mark.slow
def test_a_stateless_linen_module_trains_with_the_documented_init_and_a_3_argument_loss():
  model = models.from_linen(LinenMLP(), data()["x"], rng=0)
  assert model.model_state == {}

  def loss_fn(params, batch, rng):
    logits, _ = model.apply_fn(params, batch["x"], rng=rng, train=True)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return jnp.sum(nll * batch["loss_mask"]), {}

  train_step = make_train_step(loss_fn, optax.sgd(0.1), grad_accum_steps=K)
  state = train_step.init(model.params, 0, model_state=model.model_state)  # as the docs show
  assert state.model_state is None
  state, metrics = jax.jit(train_step)(state, data())
  assert bool(metrics["updated"])
  # the same update as a plain gradient of Σ loss / N over the whole batch
  batch = data()
  loss_sum, _ = loss_fn(model.params, batch, None)
  grads = jax.grad(lambda p: loss_fn(p, batch, None)[0] / batch["loss_mask"].sum())(model.params)
  expected = jax.tree.map(lambda p, g: p - 0.1 * g, model.params, grads)
  assert_close(state.params, expected, terms=TERMS)
  # the loss: a sum over the 16 rows of per-row values from 8 hidden units
  assert_close(metrics["loss"], loss_sum / batch["loss_mask"].sum(), terms=16 * 8)
  # the margin: the mean of the micro-batches' mean gradients, not the global mean
  micro = split_micro_batches(batch, K)
  means = [
    jax.grad(lambda p, mb=mb: loss_fn(p, mb, None)[0] / mb["loss_mask"].sum())(model.params)
    for mb in (jax.tree.map(lambda x, k=k: x[k], micro) for k in range(K))
  ]
  mean_of_means = jax.tree.map(lambda *g: sum(g) / K, *means)
  wrong = jax.tree.map(lambda p, g: p - 0.1 * g, model.params, mean_of_means)
  assert_far(wrong, expected, terms=TERMS)


def test_a_stateless_model_with_a_4_argument_loss_is_a_clear_error_at_init():
  model = models.from_linen(LinenMLP(), data()["x"], rng=0)
  train_step = make_train_step(
    classification_loss(model.apply_fn), optax.sgd(0.1), grad_accum_steps=K
  )
  with pytest.raises(ConfigError, match="no model state"):
    train_step.init(model.params, 0, model_state=model.model_state)
