"""The hand-written dense, attention and LayerNorm backwards equal autodiff of the plain math."""

import math

import chex
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from tolerance import assert_close, assert_far, planted

from jaxstep import models
from jaxstep.models import backends, cpu_kernels
from jaxstep.models.cpu_kernels import causal_attention, dense_dot_general, query_blocks


@nnx.jit
def forward(layer, x):
  """``layer(x)`` as one compiled program."""
  return layer(x)


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
  assert gxc.dtype == x.dtype
  if dtype == jnp.bfloat16:
    tol = 2e-2
    chex.assert_trees_all_close(forward(custom, x), forward(plain, x), rtol=tol, atol=tol)
    chex.assert_trees_all_close(nnx.state(gc), nnx.state(gp), rtol=tol, atol=tol)
    chex.assert_trees_all_close(gxc, gxp, rtol=tol, atol=tol)
    return
  terms = max(d_in, d_out, 3 * 5)  # x·W sums d_in, dx sums d_out, dW sums the 15 rows
  assert_close(forward(custom, x), forward(plain, x), terms=terms)
  assert_close(nnx.state(gc), nnx.state(gp), terms=terms)
  assert_close(gxc, gxp, terms=terms)
  # the margin: a weight gradient pairing each row's activations with another row's dy
  (g_mispaired, _) = grad(plain, x[:, ::-1])
  assert_far(nnx.state(g_mispaired), nnx.state(gp), terms=terms)


def test_other_contractions_fall_back_to_lax():
  x, w = jnp.ones((4, 3)), jnp.ones((4, 5))
  dims = (((0,), (0,)), ((), ()))  # contracts x's FIRST axis: not the Linear form
  chex.assert_trees_all_equal(dense_dot_general(x, w, dims), jax.lax.dot_general(x, w, dims))


@pytest.mark.slow
def test_gpt_gradient_matches_the_autodiff_model(monkeypatch):
  """The bundled GPT with the custom backwards vs the same weights with plain nnx.Linear,
  plain einsum attention and flax's LayerNorm."""
  cfg = models.GPTConfig(vocab_size=16, max_seq_len=8, d_model=16, n_layers=1, n_heads=2)
  apply_fn, params = models.build(cfg, 0)
  tokens = jax.random.randint(jax.random.key(3), (2, 8), 0, 16)

  def loss(apply, p):
    return jnp.mean(jax.nn.log_softmax(apply(p, tokens))[..., 0])

  ref_module = models.GPT(cfg, rngs=nnx.Rngs(params=0))
  for _, node in nnx.iter_graph(ref_module):
    if isinstance(node, nnx.Linear):
      node.dot_general = jax.lax.dot_general  # flax's default
  ref = models.from_nnx(ref_module)
  chex.assert_trees_all_equal(ref.params, params)  # the same seed: the same weights

  def ref_apply(p, inputs):
    return ref.apply_fn(p, inputs)[0]

  custom = jax.grad(lambda p: loss(apply_fn, p))(params)
  with monkeypatch.context() as patch:
    patch.setattr(cpu_kernels, "causal_attention", reference_attention)
    patch.setattr(cpu_kernels.LayerNorm, "__call__", nnx.LayerNorm.__call__)
    expected = jax.grad(lambda p: loss(ref_apply, p))(params)
    # the margin: the same reference without the causal mask
    patch.setattr(cpu_kernels, "causal_attention", full_attention)
    non_causal = jax.grad(lambda p: loss(ref_apply, p))(params)
  terms = 4 * 16  # the longest sum: the MLP's down projection (4 × d_model)
  assert_close(custom, expected, terms=terms)
  assert_far(non_causal, expected, terms=terms)


def reference_attention(q, k, v, window=0, cap=0.0):
  """The plain einsum causal attention (fp32 softmax) that autodiff differentiates (the
  GPT has no window and no soft-cap: the kernel's signature, their defaults)."""
  assert not window and not cap
  s, dh = q.shape[1], q.shape[-1]
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(dh)
  scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def full_attention(q, k, v, window=0, cap=0.0):
  """``reference_attention`` without the causal mask: a deliberately wrong variant."""
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(q.shape[-1])
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1).astype(v.dtype), v)


# [B, S, H, Dh]: query blocks of 4 + 4, 3 + 2, one row, 64 + 64, and 4 × 64 + 44 rows
ATTENTION_SHAPES = [(2, 8, 2, 4), (1, 5, 3, 8), (3, 1, 1, 2), (1, 128, 2, 8), (1, 300, 1, 4)]


@pytest.mark.parametrize("shape", ATTENTION_SHAPES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.slow
def test_attention_value_and_grads_match_autodiff(shape, dtype):
  q, k, v = (jax.random.normal(jax.random.key(i), shape, dtype) for i in range(3))
  probe = jax.random.normal(jax.random.key(9), shape, jnp.float32)

  def objective(fn):
    return lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * probe)

  grads = jax.jit(jax.grad(objective(causal_attention), argnums=(0, 1, 2)))(q, k, v)
  expected = jax.grad(objective(reference_attention), argnums=(0, 1, 2))(q, k, v)
  assert [g.dtype for g in grads] == [dtype] * 3
  if dtype == jnp.bfloat16:
    tol = 3e-2
    chex.assert_trees_all_close(
      causal_attention(q, k, v), reference_attention(q, k, v), rtol=tol, atol=tol
    )
    chex.assert_trees_all_close(grads, expected, rtol=tol, atol=tol)
    return
  terms = max(shape[1], shape[-1])  # a softmax over the keys, or q·k over Dh
  assert_close(causal_attention(q, k, v), reference_attention(q, k, v), terms=terms)
  assert_close(grads, expected, terms=terms)
  # the margin: attention without the causal mask (one token: nothing to mask, so 1 % off)
  wrong = full_attention if shape[1] > 1 else lambda *a: planted(reference_attention(*a))
  assert_far(wrong(q, k, v), reference_attention(q, k, v), terms=terms)


@pytest.mark.parametrize(
  ("groups", "segments", "s"),
  [(2, False, 8), (3, True, 8), pytest.param(2, True, 300, marks=pytest.mark.slow)],
)
def test_grouped_heads_equal_the_repeated_heads(groups, segments, s):
  """Grouped-query attention (``KV`` key/value heads shared by ``H / KV`` query heads each)
  equals attention over the key/value heads repeated to ``H`` (query head ``h`` reading
  head ``h // groups``), value and gradients, on both the blocked kernel and ``xla``; the
  keys' and values' gradients sum over their group."""
  b, kv, dh = 2, 2, 4  # 8 tokens: two query blocks of 4 rows; 300: 4 × 64 + 44
  q = jax.random.normal(jax.random.key(0), (b, s, kv * groups, dh))
  k, v = (jax.random.normal(jax.random.key(i), (b, s, kv, dh)) for i in (1, 2))
  starts = jax.random.bernoulli(jax.random.key(3), 0.3, (b, s))
  seg = jnp.cumsum(starts, axis=1) if segments else None
  probe = jax.random.normal(jax.random.key(9), q.shape)

  def repeated(q, k, v):
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    return backends.causal_attention(q, k, v, "xla", segment_ids=seg)

  def value_and_grads(fn):
    return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(fn(*a) * probe), argnums=(0, 1, 2)))

  want = value_and_grads(repeated)(q, k, v)
  # a softmax over s keys; dk and dv sum over the group's s queries of each head
  terms = groups * s
  for kernel in ("blocked", "xla"):
    got = value_and_grads(
      lambda q, k, v: backends.causal_attention(q, k, v, kernel, segment_ids=seg)  # noqa: B023
    )(q, k, v)
    assert_close(got[0], want[0], terms=s * q.size)  # Σ probe · out over q.size entries
    assert_close(got[1], want[1], terms=terms)
    assert got[1][1].shape == k.shape  # d(loss)/dk: one gradient per key/value head

  # the margin: heads grouped the other way (query head h reading head h % KV)
  def tiled(q, k, v):
    k, v = jnp.tile(k, (1, 1, groups, 1)), jnp.tile(v, (1, 1, groups, 1))
    return backends.causal_attention(q, k, v, "xla", segment_ids=seg)

  assert_far(value_and_grads(tiled)(q, k, v)[1], want[1], terms=terms)


def test_attention_is_causal():
  """Changing a later token's k/v leaves every earlier output and its gradient unchanged."""
  q, k, v = (jax.random.normal(jax.random.key(i), (1, 6, 2, 4)) for i in range(3))
  k2, v2 = k.at[:, 4:].add(1.0), v.at[:, 4:].add(1.0)
  # bitwise: the same program, and the masked keys add exact zeros
  attend = jax.jit(causal_attention)
  chex.assert_trees_all_equal(attend(q, k, v)[:, :4], attend(q, k2, v2)[:, :4])
  early = lambda q, k, v: jnp.sum(causal_attention(q, k, v)[:, :4])  # noqa: E731
  assert float(jnp.abs(jax.jit(jax.grad(early, argnums=1))(q, k, v)[:, 4:]).max()) == 0.0


@pytest.mark.parametrize("s", [1, 2, 5, 8, 127, 128, 300, 1024, 4099])
def test_query_blocks_cover_every_row_once(s):
  blocks = query_blocks(s)
  assert blocks[0][0] == 0 and blocks[-1][1] == s
  assert all(hi == lo for (_, hi), (lo, _) in zip(blocks[:-1], blocks[1:], strict=True))
  assert all(hi > lo for lo, hi in blocks) and len(blocks) <= 8


def test_attention_never_computes_the_masked_block():
  """At 128 tokens the scores are a 64 × 64 and a 64 × 128 block: no dot of the forward or
  backward makes the full 128 × 128 score matrix, whose upper-right quarter is masked."""
  q = jnp.ones((1, 128, 2, 8))
  jaxpr = jax.make_jaxpr(jax.grad(lambda q: jnp.sum(causal_attention(q, q, q))))(q).jaxpr
  trailing = [tuple(e.outvars[0].aval.shape[-2:]) for e in _dots(jaxpr)]
  assert (64, 64) in trailing and (64, 128) in trailing
  assert (128, 128) not in trailing


def _dots(jaxpr):
  """Every dot_general in a jaxpr, nested ones (custom_vjp, pjit, scan) included."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      yield eqn
    for value in eqn.params.values():
      inner = getattr(value, "jaxpr", value)
      if hasattr(inner, "eqns"):
        yield from _dots(inner)


def test_every_gpt_gradient_dot_is_canonical_on_cpu():
  """The layout the custom backwards exist for: each dot contracts the lhs's LAST dim with
  the rhs's first non-batch dim (what YNNPACK and Eigen's fast kernel take). Autodiff of
  ``x @ W`` or of einsum attention contracts the token dim of both operands instead."""
  cfg = models.GPTConfig(
    vocab_size=16, max_seq_len=8, d_model=16, n_layers=1, n_heads=2, tie_embeddings=False
  )
  apply_fn, params = models.build(cfg, 0, abstract=True)  # only the program is read
  tokens = jnp.zeros((2, 8), jnp.int32)
  jaxpr = jax.make_jaxpr(jax.grad(lambda p: jnp.sum(apply_fn(p, tokens))))(params).jaxpr
  dots = list(_dots(jaxpr))
  assert len(dots) >= 20  # 6 projections x 3 dots + 2 x 3 attention dots
  for eqn in dots:
    (lhs_c, rhs_c), (_, rhs_b) = eqn.params["dimension_numbers"]
    lhs_ndim = eqn.invars[0].aval.ndim
    assert tuple(lhs_c) == (lhs_ndim - 1,) and tuple(rhs_c) == (len(rhs_b),), eqn


@pytest.mark.parametrize(
  "dtype, param_dtype",
  [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.bfloat16), (jnp.bfloat16, jnp.float32)],
)
def test_layer_norm_value_and_grads_match_flax(dtype, param_dtype):
  # bf16 params: the step casts params to the compute dtype at the model boundary.
  flax_ln = nnx.LayerNorm(16, param_dtype=param_dtype, rngs=nnx.Rngs(0))
  ours = cpu_kernels.LayerNorm(16, param_dtype=param_dtype, rngs=nnx.Rngs(0))
  scale = (jax.random.normal(jax.random.key(4), (16,)) + 1.0).astype(param_dtype)
  bias = jax.random.normal(jax.random.key(5), (16,)).astype(param_dtype)
  ours.scale[...] = flax_ln.scale[...] = scale
  ours.bias[...] = flax_ln.bias[...] = bias
  x = (3.0 * jax.random.normal(jax.random.key(6), (2, 5, 16)) + 1.5).astype(dtype)
  probe = jax.random.normal(jax.random.key(7), (2, 5, 16), jnp.float32)

  def objective(layer, x):
    return jnp.sum(layer(x).astype(jnp.float32) * probe)

  grad = jax.jit(nnx.grad(objective, argnums=(0, 1)))
  (g_ours, gx_ours), (g_flax, gx_flax) = grad(ours, x), grad(flax_ln, x)
  y_ours, y_flax = forward(ours, x), forward(flax_ln, x)
  assert y_ours.dtype == y_flax.dtype
  assert gx_ours.dtype == dtype
  if not dtype == param_dtype == jnp.float32:
    tol = 3e-2
    chex.assert_trees_all_close(y_ours, y_flax, rtol=tol, atol=tol)
    chex.assert_trees_all_close(nnx.state(g_ours), nnx.state(g_flax), rtol=tol, atol=tol)
    chex.assert_trees_all_close(gx_ours, gx_flax, rtol=tol, atol=tol)
    return
  terms = 16  # the statistics over the 16 features (the scale's gradient: 10 rows)
  assert_close(y_ours, y_flax, terms=terms)
  assert_close(nnx.state(g_ours), nnx.state(g_flax), terms=terms)
  assert_close(gx_ours, gx_flax, terms=terms)

  @jax.jit
  def unbiased(x):
    centered = x - x.mean(-1, keepdims=True)
    return centered / jnp.sqrt(centered.var(-1, ddof=1, keepdims=True) + flax_ln.epsilon)

  # the margin: the unbiased variance (÷ 15, not ÷ 16) is far outside the tolerance
  assert_far(unbiased(x) * scale + bias, y_flax, terms=terms)


def test_layer_norm_other_configurations_run_flax():
  ln = cpu_kernels.LayerNorm(4, use_bias=False, rngs=nnx.Rngs(0))
  x = jnp.arange(8.0).reshape(2, 4)
  flax_ln = nnx.LayerNorm(4, use_bias=False, rngs=nnx.Rngs(0))
  chex.assert_trees_all_equal(forward(ln, x), forward(flax_ln, x))  # flax's own code: bitwise
