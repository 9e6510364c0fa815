"""next_token_loss: fp32 NLL sum over masked positions only."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxstep.core.losses import argmax_hits, next_token_loss


def test_nll_sum_counts_only_masked_positions_and_upcasts():
  logits = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 5)), jnp.bfloat16)
  targets = jnp.array([[1, 2, 3], [4, 0, 1]])
  mask = jnp.array([[1, 0, 1], [0, 0, 1]])
  loss_fn = next_token_loss(lambda params, inputs, rng, train: logits)
  loss_sum, aux = loss_fn(None, {"inputs": targets, "targets": targets, "loss_mask": mask}, None)
  nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
  assert loss_sum.dtype == jnp.float32
  assert float(loss_sum) == pytest.approx(float(nll[0, 0] + nll[0, 2] + nll[1, 2]), rel=1e-6)
  hits = (jnp.argmax(logits, -1) == targets) * mask
  assert float(aux["correct"]) == float(hits.sum())


@settings(max_examples=60, deadline=None)
@given(
  shape=st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 7)),
  levels=st.integers(1, 4),
  seed=st.integers(0, 2**16),
)
@pytest.mark.slow
def test_argmax_hits_equals_argmax_including_ties(shape, levels, seed):
  # Few distinct logit values force ties; argmax's rule is the FIRST maximal index.
  rng = np.random.default_rng(seed)
  values = np.array([-np.inf, -1.0, 0.0, 2.5])[-levels:]
  logits = jnp.asarray(rng.choice(values, size=shape), jnp.float32)
  targets = jnp.asarray(rng.integers(0, shape[-1], size=shape[:-1]), jnp.int32)
  expected = jnp.argmax(logits, axis=-1) == targets
  np.testing.assert_array_equal(argmax_hits(logits, targets), expected)
