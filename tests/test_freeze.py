"""Frozen parameters (``optim.trainable``, ``make_train_step(trainable=…)``): only the
trainable leaves get optimizer state, accumulator, gradient norm and updates; the frozen
ones stay bitwise what they were."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_cfg
from tolerance import assert_close, assert_far

from jaxstep import load_run, make_train_step, models, trainer
from jaxstep.cli import run as run_command
from jaxstep.core import freeze
from jaxstep.core.losses import next_token_loss
from jaxstep.core.optim import OptimConfig, make_optimizer
from jaxstep.core.trees import path_name

CFG = models.GPTConfig(vocab_size=32, max_seq_len=8, d_model=16, n_layers=2, n_heads=2)
TRAIN = freeze.by_patterns([r"blocks/1/", r"ln_f"])  # block 1 and the final norm
# the gradients sum over the batch's 8 × 8 tokens the values of a model whose longest sum is
# its MLP's down projection (4 × d_model)
TERMS = 4 * 16 * 8 * 8


def batch(g=8, s=8, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, 32, size=(g, s + 1)).astype(np.int32)
  mask = (rng.random((g, s)) < rng.choice([0.2, 0.9], size=(g, 1))).astype(np.int32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": mask}


def names(tree):
  return {path_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def setup(k=2, trainable=TRAIN, clip=1.0, optimizer=None):
  apply_fn, params = models.build(CFG, 0)
  optimizer = optimizer or make_optimizer(OptimConfig(lr=1e-2, clip_grad_norm=clip), 10)
  step = make_train_step(
    next_token_loss(apply_fn), optimizer, grad_accum_steps=k, trainable=trainable
  )
  return apply_fn, params, step


def test_frozen_leaves_stay_bitwise_and_get_no_optimizer_state():
  _, params, step = setup()
  state = jax.jit(step.init, static_argnums=1)(params, 0)
  for i in range(3):
    state, metrics = jax.jit(step)(state, batch(seed=i))
    assert bool(metrics["updated"])
  before, after = names(params), names(state.params)
  trained = {n for n in before if TRAIN(n, None)}
  assert trained and len(trained) < len(before)
  for name in before:
    same = np.array_equal(before[name], after[name])
    assert same != (name in trained), name
  # Adam's two moments exist for the trainable leaves only (plus scalar counts and lr)
  moments = [x for x in jax.tree.leaves(state.opt_state) if np.ndim(x) > 0]
  assert len(moments) == 2 * len(trained)


@pytest.mark.slow
def test_the_gradient_norm_is_over_the_trainable_leaves_only():
  apply_fn, params, step = setup(k=1, clip=0.0)
  b = batch()
  _, metrics = jax.jit(step)(step.init(params, 0), b)
  loss = next_token_loss(apply_fn)

  def mean_loss(p):
    total, _ = loss(p, jax.tree.map(jnp.asarray, b), None)
    return total / b["loss_mask"].sum()

  grads = names(jax.grad(mean_loss)(params))
  expected = np.sqrt(sum(float(jnp.sum(g**2)) for n, g in grads.items() if TRAIN(n, None)))
  full = np.sqrt(sum(float(jnp.sum(g**2)) for g in grads.values()))
  assert_close(float(metrics["grad_norm"]), expected, terms=TERMS)
  # the margin: the norm over every leaf, the frozen ones too, is far outside the tolerance
  assert_far(full, expected, terms=TERMS)


@pytest.mark.slow
def test_k_micro_steps_equal_one_big_batch_with_frozen_leaves():
  updates = []
  wide = lambda x: np.asarray(x, np.float64)  # noqa: E731
  sgd = optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.1))  # Adam's first step is
  # lr·sign(g): rounding of a ~0 gradient would flip whole updates
  for k, seed in ((1, 0), (4, 0), (4, 1)):  # the third: another batch, the wrong variant
    _, params, step = setup(k=k, optimizer=sgd)
    state, _ = jax.jit(step)(step.init(params, 0), batch(seed=seed))
    # the updates, not the params: weights of ~1 would swamp the tolerance of ~1e-2 steps
    updates.append(jax.tree.map(lambda a, b: wide(a) - wide(b), state.params, params))
  one, four, other = updates
  assert_close(four, one, terms=TERMS)
  # the margin: the update of another batch is far outside the tolerance
  assert_far(other, one, terms=TERMS)


@pytest.mark.slow
def test_a_frozen_leaf_may_stay_in_bf16():
  _, params, step = setup()
  params = jax.tree_util.tree_map_with_path(
    lambda p, x: x if TRAIN(path_name(p), x) else x.astype(jnp.bfloat16), params
  )
  state, _ = jax.jit(step)(step.init(params, 0), batch())
  for name, leaf in names(state.params).items():
    assert leaf.dtype == (jnp.float32 if TRAIN(name, None) else jnp.bfloat16)
    if not TRAIN(name, None):
      assert np.array_equal(leaf, names(params)[name])


def test_optim_trainable_freezes_the_rest_of_a_run(tmp_path):
  cfg = make_cfg(tmp_path, "train.max_steps=3", "optim.trainable=[qkv, ln_f]")
  trainer.train(cfg)
  saved = load_run(tmp_path / "run")
  _, init = models.build(saved.cfg.model, jax.random.PRNGKey(saved.cfg.train.seed))
  before, after = names(init), names(saved.params)
  for name in before:
    trains = "qkv" in name or "ln_f" in name
    assert np.array_equal(before[name], after[name]) != trains, name


@pytest.mark.parametrize(
  "value, message",
  [
    ("[nothing_like_this]", "'nothing_like_this' matches no parameter; the parameters are"),
    ("['(']", "is not a regular expression"),
  ],
)
def test_a_trainable_pattern_that_matches_nothing_is_one_line(tmp_path, capsys, value, message):
  make_cfg(tmp_path)
  args = [f"data.path={tmp_path / 'corpus.txt'}", f"run_dir={tmp_path / 'run'}"]
  code = run_command("train", [*args, f"optim.trainable={value}", "train.max_steps=1"])
  err = capsys.readouterr().err
  errors = [line for line in err.splitlines() if line.startswith("error:")]
  assert code == 2 and len(errors) == 1 and message in errors[0], err
  assert not (tmp_path / "run" / "checkpoints").exists()


def test_partition_and_combine_round_trip():
  _, params, _ = setup()
  train, frozen = freeze.partition(params, TRAIN)
  assert jax.tree.structure(freeze.combine(train, frozen)) == jax.tree.structure(params)
  assert freeze.count(params, TRAIN)[0] == sum(x.size for x in jax.tree.leaves(train))
  assert sum(freeze.count(params, TRAIN)) == models.num_params(params)
  norm = jax.jit(optax.tree.norm)
  assert norm(train) < norm(params)


@pytest.mark.slow
def test_frozen_leaves_on_an_fsdp_mesh_train_as_on_one_device(tmp_path):
  import subprocess
  import sys

  from conftest import SMALL_MODEL, read_lines

  make_cfg(tmp_path)
  common = [*SMALL_MODEL, f"data.path={tmp_path / 'corpus.txt'}", "optim.trainable=[qkv, fc]"]
  common += ["train.max_steps=3", "train.log_every=1", "train.eval_every=0"]
  common += ["train.global_batch_size=8", "train.grad_accum_steps=2"]
  losses = {}
  for name, mesh in {
    "one": ["mesh.cpu_devices=1"],
    "fsdp": ["mesh.cpu_devices=4", "mesh.fsdp=4"],
  }.items():
    command = [sys.executable, "-m", "jaxstep.train", *common, *mesh, f"run_dir={tmp_path / name}"]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    losses[name] = [r["loss"] for r in read_lines(tmp_path / name / "metrics.jsonl")]
  np.testing.assert_allclose(losses["fsdp"], losses["one"], rtol=2e-5)


@pytest.mark.slow
def test_resuming_with_other_trainable_leaves_names_the_key(tmp_path, capsys):
  from conftest import SMALL_MODEL

  trainer.train(make_cfg(tmp_path, "train.max_steps=2", "optim.trainable=[qkv]"))
  args = [f"data.path={tmp_path / 'corpus.txt'}", f"run_dir={tmp_path / 'run'}"]
  args += [*SMALL_MODEL, "train.schedule_steps=64", "train.max_steps=4"]
  code = run_command("train", args)
  err = capsys.readouterr().err
  assert code == 2 and "optim.trainable changed since the checkpoint of update step 2" in err
