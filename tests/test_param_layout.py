"""The GPT's fused q/k/v columns are head-major (``[heads, 3, head_dim]``), so a tensor split
of the columns keeps each head whole; checkpoints an older jaxstep wrote with GPT-2's
``[q | k | v]`` order are permuted as they are read, and resume as if never written so."""

import functools
import hashlib
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxstep import make_train_step, models
from jaxstep.core.losses import next_token_loss
from jaxstep.core.optim import OptimConfig, make_optimizer
from jaxstep.core.trees import key_name
from jaxstep.models import gpt, hf_gpt2
from jaxstep.models.lora import LoraConfig
from jaxstep.trainer.store import checkpoint_read
from jaxstep.trainer.store.checkpoint import Checkpointer
from jaxstep.trainer.store.param_layout import PARAM_LAYOUT, needs_upgrade

CFG = models.GPTConfig(vocab_size=32, max_seq_len=16, d_model=24, n_layers=2, n_heads=4)


@settings(max_examples=25, deadline=None)
@given(
  lead=st.lists(st.integers(1, 3), max_size=2),
  heads=st.integers(1, 4),
  head_dim=st.integers(1, 5),
)
def test_head_major_and_back_is_the_identity_and_splits_like_gpt2(lead, heads, head_dim):
  """``qkv_major`` inverts ``head_major`` on any leading shape, and the GPT's split of
  head-major columns gives the q, k, v that GPT-2's ``[q | k | v]`` split gives."""
  width = 3 * heads * head_dim
  x = np.random.default_rng(0).standard_normal((*lead, width)).astype(np.float32)
  np.testing.assert_array_equal(gpt.qkv_major(gpt.head_major(x, heads), heads), x)
  rows = np.random.default_rng(1).standard_normal((2, 3, width)).astype(np.float32)
  ours = jax.jit(gpt.split_heads, static_argnums=1)(jnp.asarray(gpt.head_major(rows, heads)), heads)
  theirs = np.split(rows.reshape(2, 3, 3 * heads, head_dim), 3, axis=2)  # GPT-2's order
  for a, b in zip(ours, theirs, strict=True):
    np.testing.assert_array_equal(np.asarray(a), b)
  if heads > 1:  # the test would pass on an identity: it is not one
    assert not np.array_equal(gpt.head_major(x, heads), x)


@functools.partial(jax.jit, static_argnums=(1, 2))
def old_layout(tree, n_heads: int, d_model: int):
  """``tree`` as an older jaxstep held it: every fused-column leaf in ``[q | k | v]``."""

  def leaf(path, x):
    keys = tuple(key_name(k) for k in path)
    if hf_gpt2.permuted(keys) and np.ndim(x) and x.shape[-1] == 3 * d_model:
      return gpt.qkv_major(x, n_heads)
    return x

  return jax.tree_util.tree_map_with_path(leaf, tree)


@functools.partial(jax.jit, static_argnums=0)
def a_trained_state(cfg):
  apply_fn, params = models.build(cfg, 0)
  step = make_train_step(
    next_token_loss(apply_fn), make_optimizer(OptimConfig(), 10), grad_accum_steps=1
  )
  state = step.init(params, 0)
  tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, 32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": jnp.ones((2, 8))}
  return step(state, batch)[0]  # moments that are not zero


def run_state(**changes) -> dict:
  return {"model": {"family": "gpt", "n_heads": 4, "d_model": 24}, **changes}


def test_an_older_gpt_checkpoint_restores_head_major_with_its_moments(tmp_path):
  """A checkpoint whose run state has no ``param_layout`` (an older jaxstep's) restores
  into exactly the state it was permuted from: params (a LoRA ``B`` among them) and Adam's
  moments; so does a Python-API trainer's, read by a reader that knows the model. One that
  records the layout, names another model, or whose model nobody names restores as stored."""
  cfg = models.GPTConfig(**{**CFG.__dict__, "lora": LoraConfig(rank=2)})
  state = a_trained_state(cfg)  # every leaf trains: kernel, bias and lora_b have moments
  old = old_layout(state, CFG.n_heads, CFG.d_model)
  runs = {
    1: run_state(),  # an older CLI run
    2: {"trainer": {"seed": 0}},  # a Python-API trainer's: no model named
    3: run_state(param_layout=PARAM_LAYOUT),
    4: {"model": {"family": "llama"}},
  }
  with Checkpointer(tmp_path, async_save=False, keep=len(runs)) as ckpt:
    for step, run in runs.items():
      ckpt.save(step, old, run)
  reader, knowing = Checkpointer(tmp_path), Checkpointer(tmp_path, model=run_state()["model"])
  chex.assert_trees_all_equal(reader.restore(state, step=1).state, state)
  chex.assert_trees_all_equal(knowing.restore(state, step=2).state, state)
  for leaf in ("kernel", "bias"):  # the old layout is another array: the test can fail
    qkv = (state.params["blocks"][0]["qkv"][leaf], old.params["blocks"][0]["qkv"][leaf])
    assert not np.array_equal(*qkv)
  assert state.params["blocks"][0]["qkv"]["lora"]["lora_b"].shape == (2, 3 * CFG.d_model)
  for step in (2, 3, 4):
    chex.assert_trees_all_equal(reader.restore(state, step=step).state, old)


def older_digest(params) -> str:
  """The key of precomputed reference log-probs before: every leaf's path, dtype, shape and
  bytes."""
  h = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    value = np.ascontiguousarray(np.asarray(leaf))
    h.update(f"{jax.tree_util.keystr(path)}:{value.dtype}:{value.shape}".encode())
    h.update(value.tobytes())
  return h.hexdigest()[:16]


def test_an_older_precomputed_reference_file_does_not_pass_for_these_weights():
  """The digest that keys a DPO run's precomputed reference log-probs hashes the GPT's
  column order too: a file an older jaxstep keyed for the same bytes is refused (a Llama's
  key is unchanged)."""
  from jaxstep.trainer.plan import reference_logps

  params = models.build(CFG, 0)[1]
  assert reference_logps.weights_digest(params) != older_digest(params)
  llama = models.LlamaConfig(vocab_size=32, max_seq_len=16, d_model=24, n_layers=1, n_heads=4)
  params = models.build(llama, 0)[1]
  assert reference_logps.weights_digest(params) == older_digest(params)


def test_only_a_gpt_run_state_without_the_layout_needs_the_upgrade():
  assert needs_upgrade(run_state())
  assert needs_upgrade({"model": {"n_heads": 4, "d_model": 24}})  # older than model.family
  assert not needs_upgrade(run_state(param_layout=PARAM_LAYOUT))
  assert not needs_upgrade({"model": {"family": "llama"}})
  assert not needs_upgrade({"step": 3})  # a Python-API checkpoint names no model
  assert needs_upgrade({"step": 3}, run_state()["model"])  # unless its reader knows it
  assert not needs_upgrade(None)


@pytest.mark.slow
def test_a_run_resumes_from_an_older_checkpoint_as_from_its_own(tmp_path):
  """A CLI run's checkpoint rewritten in the older layout (run state without
  ``param_layout``) resumes bitwise as the run's own checkpoint does: the same losses and
  the same final state; its next checkpoint records the current layout."""
  from conftest import make_cfg, restore_state_arrays

  from jaxstep import trainer
  from jaxstep.trainer.store.records import read_records

  common = ["train.log_every=1", "train.eval_every=0", "model.n_heads=4"]
  first = trainer.train(make_cfg(tmp_path / "a", "train.max_steps=2", *common))
  shutil.copytree(tmp_path / "a", tmp_path / "b")
  step_dir = tmp_path / "b" / "run" / "checkpoints" / "2"
  run = checkpoint_read.read_step(step_dir, arrays=False).run
  assert run["param_layout"] == PARAM_LAYOUT
  del run["param_layout"]
  shutil.rmtree(step_dir)
  with Checkpointer(step_dir.parent, async_save=False) as ckpt:
    ckpt.save(2, old_layout(first.state, 4, 32), run)
  for d in ("a", "b"):
    trainer.train(make_cfg(tmp_path / d, "train.max_steps=4", *common))
  losses = [[r["loss"] for r in read_records(tmp_path / d / "run" / "metrics.jsonl")] for d in "ab"]
  assert losses[0] == losses[1] and len(losses[0]) == 4
  (_, a), (_, b) = (restore_state_arrays(tmp_path / d / "run") for d in "ab")
  chex.assert_trees_all_equal(a, b)
  newest = checkpoint_read.read_step(step_dir.parent / "4", arrays=False).run
  assert newest["param_layout"] == PARAM_LAYOUT
