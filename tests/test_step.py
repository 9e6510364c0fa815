"""The exact accumulation step: hand-computed updates, properties, skips, bad input."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import lm_batch, regression_loss, tiny_lm_apply, tiny_lm_params
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tolerance import assert_close, assert_far, planted

from jaxstep import BatchError, ConfigError, TrainState, make_train_step, models
from jaxstep.core.accumulate import split_micro_batches
from jaxstep.core.losses import next_token_loss
from jaxstep.core.optim import OptimConfig, make_optimizer


def regression_batch(xs, ys, mask=None):
  mask = np.ones(len(xs)) if mask is None else mask
  return {
    "x": jnp.asarray(xs, jnp.float32),
    "y": jnp.asarray(ys, jnp.float32),
    "loss_mask": jnp.asarray(mask, jnp.float32),
  }


def run_regression(batch, *, w=1.0, lr=0.1, k=1, optimizer=None):
  optimizer = optimizer or optax.sgd(lr)
  state = TrainState.create(params={"w": jnp.float32(w)}, optimizer=optimizer, rng=0)
  step = jax.jit(make_train_step(regression_loss, optimizer, grad_accum_steps=k))
  return step(state, batch)


@pytest.mark.parametrize("lr, new_w, new_loss", [(0.1, 1.4, 0.72), (0.05, 1.2, 1.28)])
def test_hand_computed_single_update(lr, new_w, new_loss):
  batch = regression_batch([2.0], [4.0])
  state, metrics = run_regression(batch, lr=lr)
  assert float(metrics["grad_norm"]) == pytest.approx(4.0)  # |dL/dw| = |(w·x − y)·x| = 4
  assert float(metrics["loss"]) == pytest.approx(2.0)  # (2 − 4)² / 2
  assert float(state.params["w"]) == pytest.approx(new_w, rel=1e-6)
  loss_after, _ = regression_loss(state.params, batch, None)
  assert float(loss_after) == pytest.approx(new_loss, rel=1e-5)


@pytest.mark.parametrize("k", [1, 2])
def test_accumulation_averages_instead_of_summing(k):
  # Per-sample gradients −1 and −9: the mean −5 gives w = 1.5; a sum would give w = 2.
  state, metrics = run_regression(regression_batch([1.0, 3.0], [2.0, 6.0]), k=k)
  assert float(metrics["grad_norm"]) == pytest.approx(5.0)
  assert float(state.params["w"]) == pytest.approx(1.5, rel=1e-6)


def test_unequal_micro_batches_are_weighted_by_units():
  # K=2 splits rows {0, 2} and {1, 3}: micro 0 = two samples of gradient 3, micro 1 = one
  # sample of gradient 9 plus a loss_mask-0 pad. Global mean (3+3+9)/3 = 5, not (3+9)/2 = 6.
  batch = regression_batch([1.0, 3.0, 1.0, 5.0], [-2.0, 0.0, -2.0, 0.0], mask=[1, 1, 1, 0])
  micro = split_micro_batches(batch, 2)
  np.testing.assert_array_equal(micro["loss_mask"], [[1, 1], [1, 0]])
  state, metrics = run_regression(batch, k=2)
  assert float(metrics["tokens"]) == 3
  assert float(metrics["grad_norm"]) == pytest.approx(5.0)
  assert float(state.params["w"]) == pytest.approx(0.5, rel=1e-6)


def test_micro_batches_stay_spread_over_data_parallel_shards():
  # With G=8 split over 2 devices as rows 0-3 | 4-7, each micro-batch takes half its rows
  # from each device.
  micro = split_micro_batches({"i": jnp.arange(8)}, 2)["i"]
  np.testing.assert_array_equal(micro, [[0, 2, 4, 6], [1, 3, 5, 7]])


# --- property: K micro-steps == one big batch with plain jax.grad ----------------------

OPTIMIZER = make_optimizer(OptimConfig(lr=1e-2, clip_grad_norm=0.5, weight_decay=0.1), 10)
LM_LOSS = next_token_loss(tiny_lm_apply)


@functools.cache
def jitted_step(k):
  return jax.jit(make_train_step(LM_LOSS, OPTIMIZER, grad_accum_steps=k))


@jax.jit
def big_batch_update(params, opt_state, batch):
  """Independent reference: one jax.grad of the masked-mean NLL, then the same chain."""

  def mean_loss(p):
    logits = tiny_lm_apply(p, batch["inputs"])
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return jnp.sum(nll * batch["loss_mask"]) / jnp.sum(batch["loss_mask"])

  loss, grads = jax.value_and_grad(mean_loss)(params)
  updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def assert_trees_rel_close(a, b, tol):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    assert rel_err(x, y) <= tol, (rel_err(x, y), x, y)


@st.composite
def uneven_batches(draw):
  k = draw(st.sampled_from([1, 2, 3, 4]))
  g = k * draw(st.integers(1, 3))
  s = draw(st.sampled_from([1, 4, 9]))
  # Per-row mask density from {empty, sparse, dense, full}: token counts per micro-batch
  # differ wildly, including micro-batches with no tokens at all.
  densities = draw(st.lists(st.sampled_from([0.0, 0.1, 0.8, 1.0]), min_size=g, max_size=g))
  seed = draw(st.integers(0, 2**31 - 1))
  rng = np.random.default_rng(seed)
  mask = (rng.random((g, s)) < np.asarray(densities)[:, None]).astype(np.int32)
  if mask.sum() == 0:
    mask[rng.integers(g), rng.integers(s)] = 1
  return k, lm_batch(rng, g, s, vocab=11, mask=mask)


@pytest.mark.slow
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(uneven_batches())
def test_k_micro_steps_equal_one_big_batch(case):
  k_micro_steps_equal_one_big_batch(case)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(uneven_batches())
def test_k_micro_steps_equal_one_big_batch_on_a_few_cases(case):
  """The same property in the fast tier, on fewer drawn batches."""
  k_micro_steps_equal_one_big_batch(case)


def k_micro_steps_equal_one_big_batch(case):
  k, batch = case
  params = tiny_lm_params()
  state = TrainState.create(params=params, optimizer=OPTIMIZER, rng=0)
  new_state, metrics = jitted_step(k)(state, batch)
  ref_params, ref_opt, ref_loss, ref_norm = big_batch_update(params, state.opt_state, batch)
  assert bool(metrics["updated"])
  assert int(metrics["tokens"]) == int(np.sum(batch["loss_mask"]))
  # the gradient's own sums: Adam's moments (its first is (1 − β1)·g), the loss, the norm
  assert_trees_rel_close(new_state.opt_state, ref_opt, 1e-5)
  assert rel_err(metrics["loss"], ref_loss) <= 1e-5
  assert rel_err(metrics["grad_norm"], ref_norm) <= 1e-5
  # AdamW moves each weight by about lr (1e-2) whatever its gradient's size, so a weight
  # whose gradient is near 0 carries the sums' last bits into its update (an Intel Xeon
  # drew one 1e-5 off): the weights agree to 1 % of a step
  for x, y in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(ref_params), strict=True):
    np.testing.assert_allclose(x, y, rtol=0, atol=1e-4)


def test_clipping_sees_the_accumulated_gradient_once(np_rng):
  optimizer = optax.chain(optax.clip_by_global_norm(1e-3), optax.sgd(1.0))
  params = tiny_lm_params()
  batch = lm_batch(np_rng, 8, 5, vocab=11)
  results = []
  for k in (1, 4):
    state = TrainState.create(params=params, optimizer=optimizer, rng=0)
    step = jax.jit(make_train_step(LM_LOSS, optimizer, grad_accum_steps=k))
    results.append(step(state, batch)[0].params)
  terms = 11 * 8 * 5  # the gradient: a sum over the 40 tokens of sums over the vocabulary
  assert_close(results[1], results[0], terms=terms)
  # the margin: the same step without the clipping
  state = TrainState.create(params=params, optimizer=optax.sgd(1.0), rng=0)
  unclipped = jax.jit(make_train_step(LM_LOSS, optax.sgd(1.0), grad_accum_steps=4))
  assert_far(unclipped(state, batch)[0].params, results[0], terms=terms)
  update_norm = jax.jit(lambda a, b: optax.tree.norm(jax.tree.map(jnp.subtract, a, b)))(
    results[1], params
  )
  assert float(update_norm) == pytest.approx(1e-3, rel=1e-4)  # clipped exactly once


def test_extra_loss_is_averaged_over_micro_steps():
  def loss_with_extra(params, batch, rng):
    loss_sum, aux = regression_loss(params, batch, rng)
    return loss_sum, {**aux, "extra_loss": params["w"] ** 2}  # mean-type: d/dw = 2w

  batch = regression_batch([1.0, 3.0], [2.0, 6.0])
  outs = []
  for k in (1, 2):
    state = TrainState.create(params={"w": jnp.float32(1.0)}, optimizer=optax.sgd(0.1), rng=0)
    outs.append(
      jax.jit(make_train_step(loss_with_extra, optax.sgd(0.1), grad_accum_steps=k))(state, batch)
    )
  for state, metrics in outs:
    assert float(state.params["w"]) == pytest.approx(1.0 - 0.1 * (-5.0 + 2.0), rel=1e-6)
    assert float(metrics["extra_loss"]) == pytest.approx(1.0)
    assert float(metrics["loss"]) == pytest.approx(2.5)  # data loss only: (1/2 + 9/2) / 2


@functools.cache
def adamw_regression_step():
  """AdamW on ``regression_loss`` at K = 2, jitted once for the cases that run it."""
  optimizer = optax.adamw(0.1)
  return optimizer, jax.jit(make_train_step(regression_loss, optimizer, grad_accum_steps=2))


@pytest.mark.parametrize("bad", ["zero_tokens", "nan"])
def test_bad_batch_skips_update_then_next_batch_updates(bad):
  optimizer, step = adamw_regression_step()
  state = TrainState.create(params={"w": jnp.float32(1.0)}, optimizer=optimizer, rng=0)
  if bad == "zero_tokens":
    bad_batch = regression_batch([1.0, 3.0], [2.0, 6.0], mask=[0, 0])
  else:
    bad_batch = regression_batch([1.0, np.nan], [2.0, 6.0])
  skipped, metrics = step(state, bad_batch)
  assert not bool(metrics["updated"])
  chex.assert_trees_all_equal(skipped.params, state.params)
  chex.assert_trees_all_equal(skipped.opt_state, state.opt_state)
  assert int(skipped.skipped) == 1 and int(skipped.step) == 1
  good, metrics = step(skipped, regression_batch([1.0, 3.0], [2.0, 6.0]))
  assert bool(metrics["updated"]) and int(good.skipped) == 1 and int(good.step) == 2
  assert float(good.params["w"]) != 1.0


def test_step_compiles_once_across_steps(np_rng):
  optimizer = optax.adam(1e-2)
  traced = chex.assert_max_traces(make_train_step(LM_LOSS, optimizer, grad_accum_steps=2), n=1)
  step = jax.jit(traced)
  state = TrainState.create(params=tiny_lm_params(), optimizer=optimizer, rng=0)
  for _ in range(3):
    state, _ = step(state, lm_batch(np_rng, 4, 5, vocab=11))
  assert int(state.step) == 3


@pytest.mark.parametrize("make_key", [jax.random.PRNGKey, jax.random.key], ids=["raw", "typed"])
def test_a_donating_step_leaves_the_callers_params_and_key_alive(make_key):
  """``init`` copies what it is given: a step jitted with ``donate_argnums=0`` consumes the
  state, never the caller's params or key, which the caller may use again."""
  params, key = {"w": jnp.float32(1.0)}, make_key(0)
  step = make_train_step(regression_loss, optax.sgd(0.1), grad_accum_steps=1)
  batch = {"x": jnp.ones(2), "y": jnp.zeros(2), "loss_mask": jnp.ones(2)}
  jax.block_until_ready(jax.jit(step, donate_argnums=0)(step.init(params, key), batch))
  assert float(params["w"]) == 1.0
  assert jax.random.uniform(key).shape == ()  # raises on a donated (deleted) buffer


def test_micro_step_rngs_differ_per_micro_step_and_update():
  def rng_loss(params, batch, rng):
    return jnp.sum(batch["loss_mask"]) * params["w"], {"r": jax.random.uniform(rng)}

  optimizer = optax.sgd(0.0)
  state = TrainState.create(params={"w": jnp.float32(1.0)}, optimizer=optimizer, rng=3)
  step = jax.jit(make_train_step(rng_loss, optimizer, grad_accum_steps=2))
  batch = {"loss_mask": jnp.ones((2, 1))}
  state, m1 = step(state, batch)
  _, m2 = step(state, batch)

  @jax.jit
  def draws():  # micro-step k's key: the update's key folded with k
    step_rng = jax.random.fold_in(jax.random.PRNGKey(3), 0)
    return [jax.random.uniform(jax.random.fold_in(step_rng, k)) for k in (0, 1)]

  expected = sum(float(u) for u in draws())
  assert float(m1["r"]) == pytest.approx(expected)
  assert float(m1["r"]) != float(m2["r"])


# --- bad input: readable errors at trace time, never an XLA shape error ----------------


def trace(batch, k=2, **kwargs):
  optimizer = optax.sgd(0.1)
  state = TrainState.create(params={"w": jnp.float32(1.0)}, optimizer=optimizer, rng=0)
  return jax.jit(make_train_step(regression_loss, optimizer, grad_accum_steps=k, **kwargs))(
    state, batch
  )


def test_non_divisible_global_batch_names_both_numbers():
  with pytest.raises(BatchError, match=r"global batch size 3 .* grad_accum_steps 2"):
    trace(regression_batch([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]))


def test_empty_global_batch_is_rejected():
  with pytest.raises(BatchError, match="needs at least one"):
    trace(regression_batch([], []))


def test_leaves_with_different_leading_dims_are_rejected():
  batch = {"x": jnp.ones(4), "y": jnp.ones(2), "loss_mask": jnp.ones(4)}
  with pytest.raises(BatchError, match="same leading"):
    trace(batch)


def test_missing_loss_mask_with_default_units_fn_says_what_to_add():
  with pytest.raises(BatchError, match="add a 'loss_mask' or pass units_fn"):
    trace({"x": jnp.ones(2), "y": jnp.ones(2)})


def test_unknown_precision_is_rejected_naming_the_choices():
  with pytest.raises(ConfigError, match="must be one of fp32, bf16, fp16"):
    make_train_step(regression_loss, optax.sgd(0.1), grad_accum_steps=1, precision="fp8")


@pytest.mark.parametrize("k", [0, -1, 1.5, 2.0, True, "4"])
def test_grad_accum_steps_must_be_a_positive_integer(k):
  with pytest.raises(ConfigError, match="positive integer"):
    make_train_step(regression_loss, optax.sgd(0.1), grad_accum_steps=k)


def test_grad_accum_steps_accepts_any_integer_type():
  batch = regression_batch([1.0, 3.0], [2.0, 6.0])
  for k in (np.int64(2), np.int32(2), jnp.int32(2)):
    state, _ = run_regression(batch, k=k)
    assert float(state.params["w"]) == pytest.approx(1.5, rel=1e-6)


def test_loss_spike_guard_skips_outliers_only_when_enabled():
  optimizer = optax.sgd(0.01)
  normal, spiky = regression_batch([1.0], [1.5]), regression_batch([1.0], [40.0])
  for factor, expect_skip in ((5.0, True), (0.0, False)):
    state = TrainState.create(
      params={"w": jnp.float32(1.0)}, optimizer=optimizer, rng=0, loss_window=4
    )
    step = jax.jit(
      make_train_step(regression_loss, optimizer, grad_accum_steps=1, spike_factor=factor)
    )
    for _ in range(3):
      state, metrics = step(state, normal)
      assert bool(metrics["updated"]) and not bool(metrics["spike"])
    before = float(state.params["w"])
    state, metrics = step(state, spiky)
    assert bool(metrics["spike"]) is expect_skip and bool(metrics["updated"]) is not expect_skip
    assert (float(state.params["w"]) == before) is expect_skip
    state, metrics = step(state, normal)
    assert bool(metrics["updated"])


@pytest.mark.parametrize("k", [3, pytest.param(4, marks=pytest.mark.slow)])
def test_scan_unroll_changes_speed_not_results(np_rng, k):
  batch = lm_batch(np_rng, 12, 5, vocab=11)
  state = TrainState.create(params=tiny_lm_params(), optimizer=OPTIMIZER, rng=0)
  steps = [
    jax.jit(make_train_step(LM_LOSS, OPTIMIZER, grad_accum_steps=k, scan_unroll=unroll))
    for unroll in (1, 2)
  ]
  rolled, unrolled = (step(state, batch)[0].params for step in steps)
  terms = 11 * 12 * 5  # the gradient: a sum over the 60 tokens of sums over the vocabulary
  assert_close(unrolled, rolled, terms=terms)
  # the margin: a micro-batch left out of the sum (micro-batch 0 is rows 0, k, 2k, …)
  mask = np.asarray(batch["loss_mask"]).copy()
  mask[::k] = 0
  dropped = steps[0](state, {**batch, "loss_mask": jnp.asarray(mask)})[0].params
  assert_far(dropped, rolled, terms=terms)


@pytest.mark.slow
def test_temp_memory_does_not_grow_with_the_global_batch():
  """At a fixed micro-batch, K = 64 needs no more scratch memory than K = 4: the scan reads
  each micro-batch out of the batch in place instead of first copying the whole global
  batch into micro-batch order (that copy grows with G = K × micro-batch)."""
  cfg = models.GPTConfig(vocab_size=32, max_seq_len=64, d_model=8, n_layers=1, n_heads=1)
  apply_fn, params = models.build(cfg, 0)
  state = TrainState.create(params=params, optimizer=OPTIMIZER, rng=0)
  temp = {}
  for k in (4, 64):
    batch = {n: jnp.zeros((4 * k, 64), jnp.int32) for n in ("inputs", "targets", "loss_mask")}
    step = jax.jit(make_train_step(next_token_loss(apply_fn), OPTIMIZER, grad_accum_steps=k))
    temp[k] = step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes
  one_leaf = 4 * 64 * 64 * 4  # bytes of one [G, S] int32 leaf at K = 64
  assert temp[64] - temp[4] < one_leaf, temp


@pytest.mark.parametrize("precision, dtype", [("bf16", jnp.bfloat16), ("fp16", jnp.float16)])
def test_low_precision_casts_float_inputs_so_the_model_computes_in_that_dtype(precision, dtype):
  seen = {}

  def loss_fn(params, batch, rng):
    h = batch["x"] @ params["w"]  # the user's own model: float inputs, no cast of its own
    seen.update(x=batch["x"].dtype, h=h.dtype, ids=batch["ids"].dtype)
    nll = jnp.sum(h.astype(jnp.float32) ** 2, axis=-1) + batch["ids"]
    return jnp.sum(batch["loss_mask"] * nll), {}

  rng = np.random.default_rng(0)
  batch = {
    "x": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32),
    "ids": jnp.arange(4, dtype=jnp.int32),
    "loss_mask": jnp.ones(4, jnp.int32),
  }
  w = jnp.asarray(rng.normal(size=(3, 5)), jnp.float32)
  train_step = make_train_step(loss_fn, optax.sgd(0.1), grad_accum_steps=2, precision=precision)
  _, metrics = jax.jit(train_step)(train_step.init({"w": w}, 0), batch)
  assert seen == {"x": dtype, "h": dtype, "ids": jnp.int32}  # integer leaves untouched

  @functools.partial(jax.jit, static_argnums=2)
  def by_hand(x, w, dtype):  # row-wise, so the micro-batch split does not matter
    h = (x.astype(dtype) @ w.astype(dtype)).astype(jnp.float32)
    return (jnp.sum(h**2) + jnp.sum(batch["ids"])) / 4

  expected, in_fp32 = by_hand(batch["x"], w, dtype), by_hand(batch["x"], w, jnp.float32)
  terms = 4 * 5  # the loss: the same rows, their 20 squares summed in another order
  assert_close(float(metrics["loss"]), float(expected), terms=terms)
  assert_far(planted(float(expected)), float(expected), terms=terms)  # the margin: 1 % off
  # not the fp32 result: fp16's rounding, averaged over 20 squares, is only ~60 tolerances
  # of this comparison away from it, short of assert_far's 100
  assert abs(float(metrics["loss"]) - float(in_fp32)) > 1e-4
