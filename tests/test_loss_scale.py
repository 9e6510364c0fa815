"""Precision: dynamic loss scaling for fp16, bf16 compute with fp32 params and accumulator."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_cfg, regression_loss

from jaxstep import NonFiniteError, TrainState, make_train_step, models, trainer
from jaxstep.core.accumulate import accumulate, split_micro_batches
from jaxstep.core.loss_scale import DynamicLossScale, fixed_state
from jaxstep.core.losses import next_token_loss
from jaxstep.trainer.loop.nonfinite_guard import NonFiniteGuard
from jaxstep.trainer.tracking.metrics import LateMetrics, NullSink


def test_scale_halves_on_overflow_and_doubles_after_the_interval():
  scaler = DynamicLossScale(init_scale=8.0, growth_interval=3, min_scale=2.0, max_scale=16.0)
  s = scaler.init()
  s = scaler.adjust(s, jnp.bool_(False))
  assert (float(s.scale), int(s.good_steps)) == (4.0, 0)
  for expected in (4.0, 4.0, 8.0, 8.0, 8.0, 16.0, 16.0, 16.0, 16.0):
    s = scaler.adjust(s, jnp.bool_(True))
    assert float(s.scale) == expected
  for expected in (8.0, 4.0, 2.0, 2.0):  # never below min_scale
    s = scaler.adjust(s, jnp.bool_(False))
    assert float(s.scale) == expected


def fp16_regression(batch, *, scale, optimizer, growth_interval=2000, steps=1):
  scaler = DynamicLossScale(init_scale=scale, growth_interval=growth_interval)
  state = TrainState.create(
    params={"w": jnp.float32(1.0)}, optimizer=optimizer, rng=0, loss_scale=scaler.init()
  )
  step = jax.jit(
    make_train_step(
      regression_loss, optimizer, grad_accum_steps=1, precision="fp16", loss_scale=scaler
    )
  )
  out = []
  for _ in range(steps):
    state, metrics = step(state, batch)
    out.append(metrics)
  return state, out


def batch(x, y):
  return {
    "x": jnp.array([x], jnp.float32),
    "y": jnp.array([y], jnp.float32),
    "loss_mask": jnp.ones(1),
  }


def test_fp16_overflow_skips_the_update_and_halves_the_scale():
  # (w·x − y)·scale = 300 · 32768 overflows fp16 (max 65504) in the backward pass.
  state, (metrics,) = fp16_regression(batch(300.0, 0.0), scale=32768.0, optimizer=optax.sgd(1e-6))
  assert not bool(metrics["updated"]) and int(state.skipped) == 1
  assert float(state.params["w"]) == 1.0
  assert float(state.loss_scale.scale) == 16384.0


def test_fp16_scale_grows_after_clean_steps():
  state, metrics = fp16_regression(
    batch(2.0, 4.0), scale=4.0, optimizer=optax.sgd(0.0), growth_interval=2, steps=4
  )
  assert [float(m["loss_scale"]) for m in metrics] == [4.0, 8.0, 8.0, 16.0]
  assert all(bool(m["updated"]) for m in metrics)


def test_fp16_clips_the_unscaled_gradient():
  # grad −4 clipped to norm 1 → w = 1 + 1 = 2. Clipping the scaled grad (−4096 → −1) and
  # unscaling afterwards would move w by only 1/1024.
  opt = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
  state, (metrics,) = fp16_regression(batch(2.0, 4.0), scale=1024.0, optimizer=opt)
  assert float(metrics["grad_norm"]) == pytest.approx(4.0)
  assert float(state.params["w"]) == pytest.approx(2.0)


@pytest.mark.slow
def test_bf16_keeps_fp32_params_and_an_fp32_accumulator():
  cfg = models.GPTConfig(vocab_size=16, max_seq_len=8, d_model=32, n_layers=1, n_heads=2)
  apply_fn, params = models.build(cfg, 0)
  tokens = np.random.default_rng(0).integers(0, 16, size=(4, 9)).astype(np.int32)
  b = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": np.ones((4, 8))}
  grads, loss, _, _, _ = jax.eval_shape(
    lambda p: accumulate(
      next_token_loss(apply_fn),
      p,
      split_micro_batches(b, 2),
      jnp.float32(32),
      jax.random.PRNGKey(0),
      compute_dtype=jnp.bfloat16,
    ),
    params,
  )
  assert {x.dtype for x in jax.tree.leaves(grads)} == {jnp.dtype("float32")}
  assert loss.dtype == jnp.float32
  opt = optax.adam(1e-3)
  train_step = make_train_step(next_token_loss(apply_fn), opt, grad_accum_steps=2, precision="bf16")
  state, _ = jax.jit(train_step)(train_step.init(params, 0), b)
  assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype("float32")}
  assert state.loss_scale == fixed_state(1.0)


@pytest.mark.slow
def test_bf16_training_tracks_fp32(tmp_path):
  # Documented tolerance: after 30 updates the bf16 loss is within 3 % of the fp32 loss.
  args = ["train.max_steps=30", "train.log_every=1", "data.eval_fraction=0"]
  fp32 = trainer.train(make_cfg(tmp_path / "a", *args))
  bf16 = trainer.train(make_cfg(tmp_path / "b", *args, "train.precision=bf16"))
  assert bf16.last_metrics["loss"] < 3.5  # it trains (it starts near ln 264 ≈ 5.6)
  assert bf16.last_metrics["loss"] == pytest.approx(fp32.last_metrics["loss"], rel=0.03)
  assert {x.dtype for x in jax.tree.leaves(bf16.state.params)} == {jnp.dtype("float32")}


@pytest.mark.slow
def test_fp16_cli_config_trains(tmp_path):
  result = trainer.train(
    make_cfg(tmp_path, "train.max_steps=10", "train.precision=fp16", "train.loss_scale_init=1024")
  )
  assert result.run_state.step == 10 and np.isfinite(result.last_metrics["loss"])
  assert result.last_metrics["loss_scale"] >= 1.0


def step_metrics(*, loss, spike, updated, skipped_total, grad_norm=1.0):
  return {
    "loss": jnp.float32(loss),
    "tokens": jnp.int32(8),
    "grad_norm": jnp.float32(grad_norm),
    "lr": jnp.float32(0.1),
    "updated": jnp.bool_(updated),
    "extra_loss": jnp.float32(0.0),
    "skipped_total": jnp.int32(skipped_total),
    "spike": jnp.bool_(spike),
    "loss_scale": jnp.float32(1.0),
  }


def late_metrics():
  return LateMetrics(
    NullSink(), log_every=1, total_steps=10, tokens_per_step=8, flops_per_token=1.0, peak_flops=1.0
  )


def test_a_loss_spike_skip_never_halts_and_is_not_counted_as_non_finite(tmp_path, caplog):
  late, guard = late_metrics(), NonFiniteGuard("halt", tmp_path)
  batch, where = {"x": np.zeros(2)}, {"epoch": 0, "step_in_epoch": 0}
  steps = [
    step_metrics(loss=1.0, spike=False, updated=True, skipped_total=0),
    step_metrics(loss=50.0, spike=True, updated=False, skipped_total=1),  # a finite spike
    step_metrics(loss=1.0, spike=False, updated=True, skipped_total=1),
  ]
  records = []
  for step, metrics in enumerate(steps, start=1):
    reported = late.submit(step, metrics, batch, where)
    if reported is not None:
      guard.after_step(reported.step, reported.record, reported.batch, reported.position)
      records.append(reported.record)
  reported = late.flush()
  guard.after_step(reported.step, reported.record, reported.batch, reported.position)
  records.append(reported.record)
  assert [r["skipped"] for r in records] == [False, True, False]
  assert [r["nonfinite_total"] for r in records] == [0, 0, 0]
  assert [r["spikes_total"] for r in records] == [0, 1, 1]
  assert "loss spike" in caplog.text and "non-finite" not in caplog.text
  assert (tmp_path / "bad_batches" / "step_00000002.npz").exists()  # kept for debugging


def test_a_non_finite_update_still_halts_and_counts(tmp_path):
  late, guard = late_metrics(), NonFiniteGuard("halt", tmp_path)
  where = {"epoch": 0, "step_in_epoch": 0}
  # a spike flag on an update whose gradient overflowed: non-finite, not a spike
  late.submit(
    1,
    step_metrics(loss=50.0, spike=True, updated=False, skipped_total=1, grad_norm=float("inf")),
    {"x": np.zeros(2)},
    where,
  )
  reported = late.flush()
  assert reported.record["nonfinite_total"] == 1 and reported.record["spikes_total"] == 0
  with pytest.raises(NonFiniteError, match="non-finite"):
    guard.after_step(reported.step, reported.record, reported.batch, reported.position)


def test_consecutive_spike_skips_still_stop_at_max_consecutive_skips(tmp_path):
  guard = NonFiniteGuard("halt", None, max_consecutive=2)
  record = {
    "tokens": 8,
    "skipped": True,
    "spike": True,
    "loss": 9.0,
    "grad_norm": 1.0,
    "extra_loss": 0.0,
  }
  guard.after_step(1, record, {}, {})
  with pytest.raises(NonFiniteError, match="2 updates in a row"):
    guard.after_step(2, record, {}, {})
