"""The hand-written dense backward equals autodiff of the plain matmul."""

import chex
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxstep import models
from jaxstep.models.layers import dense_dot_general


def _plain_and_custom(d_in, d_out):
  plain = nnx.Linear(d_in, d_out, rngs=nnx.Rngs(0))
  return plain, nnx.Linear(d_in, d_out, dot_general=dense_dot_general, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("d_in, d_out", [(8, 32), (32, 8), (16, 16)])  # wide, tall, square
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_value_and_grads_match_autodiff(d_in, d_out, dtype):
  plain, custom = _plain_and_custom(d_in, d_out)
  x = jax.random.normal(jax.random.key(1), (3, 5, d_in), dtype)
  probe = jax.random.normal(jax.random.key(2), (3, 5, d_out), jnp.float32)

  def objective(layer, x):
    return jnp.sum(layer(x).astype(jnp.float32) * probe)

  grad = jax.jit(nnx.grad(objective, argnums=(0, 1)))
  (gp, gxp), (gc, gxc) = grad(plain, x), grad(custom, x)
  tol = 1e-6 if dtype == jnp.float32 else 2e-2
  chex.assert_trees_all_close(custom(x), plain(x), rtol=tol, atol=tol)
  chex.assert_trees_all_close(nnx.state(gc), nnx.state(gp), rtol=tol, atol=tol)
  chex.assert_trees_all_close(gxc, gxp, rtol=tol, atol=tol)
  assert gxc.dtype == x.dtype


def test_other_contractions_fall_back_to_lax():
  x, w = jnp.ones((4, 3)), jnp.ones((4, 5))
  dims = (((0,), (0,)), ((), ()))  # contracts x's FIRST axis: not the Linear form
  chex.assert_trees_all_close(dense_dot_general(x, w, dims), jax.lax.dot_general(x, w, dims))


def test_gpt_gradient_matches_the_autodiff_model():
  """The bundled GPT with the custom backward vs the same weights with plain nnx.Linear."""
  cfg = models.GPTConfig(vocab_size=16, max_seq_len=8, d_model=16, n_layers=1, n_heads=2)
  apply_fn, params = models.build(cfg, 0)
  tokens = jax.random.randint(jax.random.key(3), (2, 8), 0, 16)

  def loss(apply, p):
    return jnp.mean(jax.nn.log_softmax(apply(p, tokens))[..., 0])

  ref_module = models.GPT(cfg, rngs=nnx.Rngs(params=0))
  for _, node in nnx.iter_graph(ref_module):
    if isinstance(node, nnx.Linear):
      node.dot_general = jax.lax.dot_general  # flax's default
  ref_apply, ref_params = models.from_nnx(ref_module)
  chex.assert_trees_all_close(ref_params, params)
  chex.assert_trees_all_close(
    jax.grad(lambda p: loss(apply_fn, p))(params),
    jax.grad(lambda p: loss(ref_apply, p))(params),
    rtol=1e-5,
    atol=1e-6,
  )
