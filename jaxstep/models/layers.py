"""Layers whose backward passes are written for XLA:CPU (measured in benchmarks/): a dense
projection, causal attention and LayerNorm. Same math as autodiff; only the operand order
of the backward's dots, or the number of passes over the activations, differs.

``dense_dot_general`` is a drop-in ``dot_general`` for ``nnx.Linear``: the forward is the
plain ``x @ W``; the backward is the textbook one, ``dx = dy @ Wᵀ`` and ``dW = xᵀ @ dy``,
written out by hand (``jax.custom_vjp``) so the weight gradient can be ordered.

Why: autodiff leaves ``dW = xᵀ @ dy`` as a dot that contracts the row (token) dimension of
BOTH operands. XLA:CPU's fast matmul paths (YNNPACK, and Eigen's untransposed kernel) want
the contraction on the lhs's last and the rhs's first dimension; Eigen runs the autodiff
form at about half its matmul rate when ``W`` is tall and below the YNN rate otherwise. So
on CPU the backward materializes the transpose of the SMALLER activation (``[rows, d_in]``
or ``[rows, d_out]``, never the ``[rows, max]`` one) and does a canonical dot: ``xᵀ @ dy``
for wide or square kernels, ``(dyᵀ @ x)ᵀ`` for tall ones (the ``[d_out, d_in]`` result is
transposed back). The same sums of the same products. ``optimization_barrier`` stops XLA's
algebraic simplifier from folding the transposes back into the dots. Measured on a 2-core
host (bundled GPT, 2 sequences × 128 tokens per device): ordering tall kernels gave the
micro-step ~10 %; routing every weight gradient this way another 1.02× (two devices) and
1.03× (one two-threaded device). On accelerators the autodiff backward is already fine,
so nothing changes there.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx


@jax.custom_vjp
def _matmul(x: jax.Array, w: jax.Array) -> jax.Array:
  return jnp.einsum("...i,io->...o", x, w)  # [..., d_in] · [d_in, d_out] -> [..., d_out]


def _matmul_fwd(x, w):
  return _matmul(x, w), (x, w)


def _matmul_bwd(residuals, dy):
  x, w = residuals
  x2 = x.reshape(-1, x.shape[-1])  # [rows, d_in]
  dy2 = dy.reshape(-1, dy.shape[-1])  # [rows, d_out]
  barrier = jax.lax.optimization_barrier
  if jax.default_backend() != "cpu":
    dw = x2.T @ dy2  # [d_in, d_out]
  elif w.shape[0] > w.shape[1]:  # tall: transpose dy (the smaller), then the small result
    dw = barrier(barrier(dy2.T) @ x2).T  # [d_out, rows] · [rows, d_in], transposed
  else:
    dw = barrier(x2.T) @ dy2  # [d_in, rows] · [rows, d_out]
  dx = (dy2 @ w.T).reshape(x.shape)
  return dx.astype(x.dtype), dw.astype(w.dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def dense_dot_general(x, w, dimension_numbers, precision=None, preferred_element_type=None, **_):
  """``lax.dot_general`` for ``nnx.Linear(dot_general=...)`` contracting x's last axis with
  a 2-D kernel's first (the only form ``nnx.Linear`` uses with its defaults); any other
  form falls back to ``lax.dot_general``."""
  (lhs_c, rhs_c), (lhs_b, rhs_b) = dimension_numbers
  plain = (
    w.ndim == 2
    and tuple(lhs_c) == (x.ndim - 1,)
    and tuple(rhs_c) == (0,)
    and not lhs_b
    and not rhs_b
    and precision is None
    and preferred_element_type is None
    and x.dtype == w.dtype
  )
  if not plain:
    return jax.lax.dot_general(
      x, w, dimension_numbers, precision=precision, preferred_element_type=preferred_element_type
    )
  return _matmul(x, w)


@jax.custom_vjp
def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
  """Causal softmax attention, ``[B, S, H, Dh]`` each -> ``[B, S, H, Dh]``.

  ``softmax(q·kᵀ / √Dh + causal mask) · v`` per head, the softmax in fp32 whatever the
  compute dtype. The backward is written out (``dp = do·vᵀ``, ``ds = p ⊙ (dp − Σ dp ⊙ p)``,
  ``dq = ds·k``, ``dk = dsᵀ·q``, ``dv = pᵀ·do``) so every dot transposes only a small
  ``[S, Dh]`` operand: autodiff lets XLA:CPU transpose the ``[S, S]`` probabilities and
  score gradients instead, and attention's fwd+bwd runs 1.15× faster this way (2 × 128
  tokens, 4 heads of 32, one core).
  """
  return _attention_fwd(q, k, v)[0]


def _attention_fwd(q, k, v):
  qh = q.transpose(0, 2, 1, 3)  # [B, H, Sq, Dh]
  kt = k.transpose(0, 2, 3, 1)  # [B, H, Dh, Sk]
  vh = v.transpose(0, 2, 1, 3)  # [B, H, Sk, Dh]
  s = q.shape[1]
  scores = jnp.einsum("bhqd,bhdk->bhqk", qh, kt).astype(jnp.float32) / math.sqrt(q.shape[-1])
  causal = jnp.tril(jnp.ones((s, s), bool))
  p = jax.nn.softmax(jnp.where(causal, scores, jnp.finfo(jnp.float32).min), axis=-1)
  out = jnp.einsum("bhqk,bhkd->bhqd", p.astype(v.dtype), vh)
  return out.transpose(0, 2, 1, 3), (qh, kt, vh, p)


def _attention_bwd(residuals, do):
  qh, kt, vh, p = residuals  # p: fp32 probabilities [B, H, Sq, Sk], 0 where masked
  doh = do.transpose(0, 2, 1, 3)  # [B, H, Sq, Dh]
  dp = jnp.einsum("bhqd,bhdk->bhqk", doh, vh.transpose(0, 1, 3, 2)).astype(jnp.float32)
  dvt = jnp.einsum("bhdq,bhqk->bhdk", doh.transpose(0, 1, 3, 2), p.astype(do.dtype))
  ds = p * (dp - jnp.sum(dp * p, axis=-1, keepdims=True)) / math.sqrt(qh.shape[-1])
  ds = ds.astype(qh.dtype)  # d(q·kᵀ); masked entries are 0 since p is
  dq = jnp.einsum("bhqk,bhkd->bhqd", ds, kt.transpose(0, 1, 3, 2))
  dkt = jnp.einsum("bhdq,bhqk->bhdk", qh.transpose(0, 1, 3, 2), ds)
  return dq.transpose(0, 2, 1, 3), dkt.transpose(0, 3, 1, 2), dvt.transpose(0, 3, 1, 2)


causal_attention.defvjp(_attention_fwd, _attention_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, epsilon: float) -> jax.Array:
  """``(x − mean) / √(var + ε) · scale + bias`` over the last axis, statistics in fp32.

  The backward is the closed form ``dx = rstd · (g − mean(g) − x̂ · mean(g · x̂))`` with
  ``g = dy · scale``: two row reductions, where autodiff of flax's ``LayerNorm`` (fast
  variance ``E[x²] − E[x]²``) makes XLA:CPU run several more small kernels; 1.016× per
  bundled-GPT step. x, scale and bias share one dtype, which the output keeps.
  """
  return _layer_norm_fwd(x, scale, bias, epsilon)[0]


def _layer_norm_fwd(x, scale, bias, epsilon):
  xf = x.astype(jnp.float32)
  centered = xf - jnp.mean(xf, axis=-1, keepdims=True)
  rstd = jax.lax.rsqrt(jnp.mean(centered * centered, axis=-1, keepdims=True) + epsilon)
  xhat = centered * rstd
  y = xhat * scale.astype(jnp.float32) + bias.astype(jnp.float32)
  return y.astype(x.dtype), (xhat, rstd, scale, bias)


def _layer_norm_bwd(epsilon, residuals, dy):
  xhat, rstd, scale, bias = residuals
  dyf = dy.astype(jnp.float32)
  g = dyf * scale.astype(jnp.float32)
  dx = rstd * (
    g - jnp.mean(g, axis=-1, keepdims=True) - xhat * jnp.mean(g * xhat, axis=-1, keepdims=True)
  )
  rows = tuple(range(dy.ndim - 1))
  dscale = jnp.sum(dyf * xhat, axis=rows).astype(scale.dtype)
  dbias = jnp.sum(dyf, axis=rows).astype(bias.dtype)
  return dx.astype(dy.dtype), dscale, dbias


layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


class LayerNorm(nnx.LayerNorm):
  """``nnx.LayerNorm`` (same parameters, same checkpoints) calling ``layer_norm`` when
  configured as the bundled GPT uses it (last axis, scale and bias, no cross-device
  statistics); any other configuration runs flax's own."""

  def __call__(self, x, *, mask=None):
    plain = (
      mask is None
      and self.scale is not None
      and self.bias is not None
      and self.reduction_axes in (-1, (-1,))
      and self.feature_axes in (-1, (-1,))
      and self.axis_name is None
      and self.dtype is None
    )
    if not plain:
      return super().__call__(x, mask=mask)
    x, scale, bias = self.promote_dtype((x, self.scale[...], self.bias[...]), dtype=None)
    return layer_norm(x, scale, bias, self.epsilon)
