"""The bundled NNX GPT: shapes, causality, tying, FLOPs, from_nnx, and that it learns."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxstep import BatchError, ConfigError, TrainState, make_train_step, models
from jaxstep.core.losses import next_token_loss
from jaxstep.core.optim import OptimConfig, make_optimizer

SMALL = models.GPTConfig(vocab_size=16, max_seq_len=16, d_model=32, n_layers=2, n_heads=4)


@functools.cache
def built(cfg):
  """``models.build(cfg, 0)`` once per module, its apply function jitted."""
  apply_fn, params = models.build(cfg, 0)
  return jax.jit(apply_fn, static_argnames="train"), params


def test_logits_shape_and_dtype():
  apply_fn, params = built(SMALL)
  logits = apply_fn(params, jnp.zeros((3, 7), jnp.int32))
  assert logits.shape == (3, 7, 16) and logits.dtype == jnp.float32


def test_attention_is_causal():
  apply_fn, params = built(SMALL)
  a = jnp.array([[1, 2, 3, 4, 5, 6]])
  b = a.at[0, 4:].set(9)  # change only the future of position 3
  # bitwise: the same program on the same earlier tokens, the masked keys adding exact zeros
  np.testing.assert_array_equal(apply_fn(params, a)[0, :4], apply_fn(params, b)[0, :4])
  assert not np.allclose(apply_fn(params, a)[0, 4:], apply_fn(params, b)[0, 4:])


@pytest.mark.parametrize("tie", [True, False])
def test_tied_head_has_no_separate_weights(tie):
  cfg = models.GPTConfig(**{**SMALL.__dict__, "tie_embeddings": tie})
  _, params = built(cfg)
  assert ("head" in params) is (not tie)
  extra = 0 if tie else cfg.d_model * cfg.vocab_size
  _, tied = built(SMALL)
  assert models.num_params(params) == models.num_params(tied) + extra


def test_flops_per_token_matches_perf_notes_model():
  # vocab 256, d 128, 2 layers, S 128 → 6 × 425,984 + attention ≈ 2.95 MFLOP.
  cfg = models.GPTConfig(vocab_size=256, d_model=128, n_layers=2, n_heads=4)
  assert cfg.matmul_params() == 425_984
  assert cfg.flops_per_token(128) == pytest.approx(2.949e6, rel=1e-3)


def test_dropout_is_active_only_in_training_and_follows_the_rng():
  cfg = models.GPTConfig(**{**SMALL.__dict__, "dropout": 0.5})
  apply_fn, params = built(cfg)
  x = jnp.array([[1, 2, 3, 4]])
  np.testing.assert_array_equal(apply_fn(params, x), apply_fn(params, x, train=False))
  k1, k2 = jax.random.PRNGKey(1), jax.random.PRNGKey(2)
  train = lambda k: apply_fn(params, x, rng=k, train=True)  # noqa: E731
  np.testing.assert_array_equal(train(k1), train(k1))
  assert not np.allclose(train(k1), train(k2))


def test_from_nnx_adapts_a_plain_module():
  class Bigram(nnx.Module):
    def __init__(self, rngs):
      self.table = nnx.Embed(5, 5, rngs=rngs)

    def __call__(self, inputs):
      return self.table(inputs)

  apply_fn, params, model_state = models.from_nnx(Bigram(nnx.Rngs(0)))
  assert jax.tree.structure(params) == jax.tree.structure({"table": {"embedding": 0}})
  assert model_state == {}
  out, new_state = apply_fn(params, jnp.array([[1, 2]]), rng=jax.random.PRNGKey(0), train=True)
  np.testing.assert_array_equal(out[0, 0], params["table"]["embedding"][1])
  assert new_state == {}


def test_sequence_longer_than_max_seq_len_is_a_clear_error():
  apply_fn, params = built(SMALL)
  with pytest.raises(BatchError, match="exceeds model.max_seq_len 16"):
    apply_fn(params, jnp.zeros((1, 17), jnp.int32))


def test_heads_must_divide_width():
  with pytest.raises(ConfigError, match="not divisible by model.n_heads"):
    models.GPTConfig(d_model=30, n_heads=4)


@pytest.mark.slow
def test_tiny_gpt_learns_a_periodic_sequence():
  rng = np.random.default_rng(0)
  apply_fn, params = models.build(SMALL, 0)
  optimizer = make_optimizer(OptimConfig(lr=3e-3, schedule="constant", warmup_steps=5), 100)
  step = jax.jit(
    make_train_step(next_token_loss(apply_fn), optimizer, grad_accum_steps=2), donate_argnums=0
  )
  state = TrainState.create(params=params, optimizer=optimizer, rng=0)
  period = np.array([3, 1, 4, 1, 5, 9, 2, 6])
  losses = []
  for _ in range(100):
    offsets = rng.integers(0, 8, size=8)
    seq = period[(offsets[:, None] + np.arange(13)[None]) % 8]
    batch = {
      "inputs": jnp.asarray(seq[:, :-1]),
      "targets": jnp.asarray(seq[:, 1:]),
      "loss_mask": jnp.ones((8, 12), jnp.int32),
    }
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  assert losses[0] > 2.0 and np.mean(losses[-10:]) < 0.5, (losses[0], losses[-10:])


def test_one_decoder_is_built_per_config_even_one_given_lists_from_python():
  """``models.decoder`` is cached per config (a harness run's scorer and generator share
  one); a LoRA config given its targets as a list, as Python code may, is one too."""
  from jaxstep.models.lora import LoraConfig

  cfg = models.GPTConfig(n_layers=1, lora=LoraConfig(rank=2, targets=["qkv"]))
  assert cfg.lora.targets == ("qkv",)
  assert models.decoder(cfg) is models.decoder(models.GPTConfig(n_layers=1, lora=cfg.lora))
