"""next_token_loss: fp32 NLL sum over masked positions only."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxstep.losses import next_token_loss


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
