"""Layers whose backward passes are written for XLA:CPU: a dense projection, causal
attention and LayerNorm. Same math as autodiff; only the operand order of the backward's
dots, the number of passes over the activations, or (attention) the fully masked score
blocks left out, differs. Each was found by profiling the bundled GPT's step; what each
is worth is measured in docs/performance.md.

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
algebraic simplifier from folding the transposes back into the dots. On accelerators the
autodiff backward is already fine, so nothing changes there.
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def causal_attention(
  q: jax.Array, k: jax.Array, v: jax.Array, window: int = 0, cap: float = 0.0
) -> jax.Array:
  """Causal softmax attention: ``q [B, S, H, Dh]``, ``k``, ``v [B, S, KV, Dh]`` with ``KV``
  dividing ``H`` -> ``[B, S, H, Dh]``; query head ``h`` reads key/value head
  ``h // (H / KV)`` (grouped-query attention; ``KV = H`` is plain multi-head). ``window``
  > 0: sliding-window attention, query ``i`` sees keys ``i − window < j ≤ i`` (transformers'
  ``sliding_window``: ``window`` keys, itself included), and a block's keys left of every
  row's window are never computed either. ``cap`` > 0: each scaled score ``s`` becomes
  ``cap · tanh(s / cap)`` before the mask (Gemma 2's attention soft-capping; the backward
  multiplies by ``1 − tanh²``, kept per block beside the probabilities).

  ``softmax(q·kᵀ / √Dh + causal mask) · v`` per head, the softmax in fp32 whatever the
  compute dtype. Three things differ from autodiff of the plain einsum, not the math:

  - The query rows go in blocks (``query_blocks``) and block ``[lo, hi)`` only meets keys
    ``[0, hi)``: the fully masked scores right of the diagonal block are never computed,
    (nb + 1) / (2 nb) of the S² work is (3/4 at 128 tokens, 9/16 from 1024 on).
  - The ``H / KV`` query heads of a group are stacked as rows of one matrix against their
    shared key/value head: the keys and values are never repeated, the dots are larger, and
    the backward's ``dk``, ``dv`` sum over the group inside their dots.
  - The backward is written out (``dp = do·vᵀ``, ``ds = p ⊙ (dp − Σ dp ⊙ p)``, ``dq =
    ds·k``, ``dk = dsᵀ·q``, ``dv = pᵀ·do``, summed over the query blocks) so every dot
    transposes only a small ``[S, Dh]`` operand: autodiff lets XLA:CPU transpose the
    ``[S, S]`` probabilities and score gradients instead.
  """
  return _attention_fwd(q, k, v, None, window, cap)[0]


def query_blocks(s: int) -> list[tuple[int, int]]:
  """Query-row blocks ``[lo, hi)`` for causal attention over ``s`` tokens: 64 rows each
  from 128 tokens on (at most 8 blocks: the per-block kernels are small), two halves below
  128. The last block may be shorter."""
  block = max(64, -(-s // 8)) if s >= 128 else max(-(-s // 2), 1)
  return [(lo, min(lo + block, s)) for lo in range(0, s, block)]


def _grouped(x: jax.Array, kv: int) -> jax.Array:
  """``[B, S, H, Dh]`` -> ``[B, KV, G, S, Dh]``: each key/value head's ``G = H / KV`` query
  heads (``h = n·G + g``)."""
  b, s, h, dh = x.shape
  return x.reshape(b, s, kv, h // kv, dh).transpose(0, 2, 3, 1, 4)


def _ungrouped(x: jax.Array) -> jax.Array:
  """``_grouped``'s inverse: ``[B, KV, G, S, Dh]`` -> ``[B, S, KV·G, Dh]``."""
  b, kv, g, s, dh = x.shape
  return x.transpose(0, 3, 1, 2, 4).reshape(b, s, kv * g, dh)


def _rows(x: jax.Array, lo: int, hi: int) -> jax.Array:
  """Query rows ``[lo, hi)`` of grouped ``[B, KV, G, S, Dh]``, the group's heads stacked:
  ``[B, KV, G·(hi - lo), Dh]``."""
  b, kv, g, _, dh = x.shape
  return x[:, :, :, lo:hi].reshape(b, kv, g * (hi - lo), dh)


def _keys(lo: int, hi: int, window: int) -> int:
  """The first key any query row of block ``[lo, hi)`` sees (0 without a window)."""
  return max(0, lo - window + 1) if window else 0


def _attention_fwd(q, k, v, segment_ids=None, window=0, cap=0.0):
  if q.shape[2] % k.shape[2]:
    raise ValueError(f"{k.shape[2]} key/value heads do not divide {q.shape[2]} query heads")
  kv, g = k.shape[2], q.shape[2] // k.shape[2]
  qg = _grouped(q, kv)  # [B, KV, G, Sq, Dh]
  kt = k.transpose(0, 2, 3, 1)  # [B, KV, Dh, Sk]
  vh = v.transpose(0, 2, 1, 3)  # [B, KV, Sk, Dh]
  outs, probs, slopes = [], [], []
  for lo, hi in query_blocks(q.shape[1]):  # keys [first, hi): the rest masked for all rows
    first = _keys(lo, hi, window)
    scores = jnp.einsum("bnqd,bndk->bnqk", _rows(qg, lo, hi), kt[..., first:hi])
    scores = scores.astype(jnp.float32) / math.sqrt(q.shape[-1])
    if cap:  # soft-capped: d(capped)/d(score) = 1 − tanh², for the backward
      t = jnp.tanh(scores / cap)
      scores, slope = cap * t, 1.0 - t * t
      slopes.append(slope)
    rows, keys = jnp.arange(lo, hi)[:, None], jnp.arange(first, hi)[None, :]
    allowed = keys <= rows  # [hi - lo, hi - first]
    if window:
      allowed = allowed & (keys > rows - window)
    if segment_ids is not None:  # [B, hi - lo, hi - first]: causal and the same document
      allowed = allowed & (segment_ids[:, lo:hi, None] == segment_ids[:, None, first:hi])
    allowed = jnp.tile(allowed, (g, 1))  # the group's heads are stacked row blocks
    allowed = allowed[:, None] if segment_ids is not None else allowed
    p = jax.nn.softmax(jnp.where(allowed, scores, jnp.finfo(jnp.float32).min), axis=-1)
    out = jnp.einsum("bnqk,bnkd->bnqd", p.astype(v.dtype), vh[:, :, first:hi])
    outs.append(out.reshape(*qg.shape[:3], hi - lo, -1))
    probs.append(p)
  out = _ungrouped(jnp.concatenate(outs, axis=3))
  return out, (qg, kt, vh, tuple(probs), tuple(slopes))


def _attention_bwd(residuals, do):
  qg, kt, vh, probs, slopes = residuals  # probs: fp32 [B, KV, G·(hi-lo), hi-first], 0 masked
  s, f32 = qg.shape[3], jnp.float32
  dog = _grouped(do, qg.shape[1])  # [B, KV, G, Sq, Dh]
  dqs, dkt, dvt = [], jnp.zeros(kt.shape, f32), jnp.zeros(kt.shape, f32)
  for i, ((lo, hi), p) in enumerate(zip(query_blocks(s), probs, strict=True)):
    first = hi - p.shape[-1]  # the block's first key (a window's)
    do_b, q_b, pad = _rows(dog, lo, hi), _rows(qg, lo, hi), [(0, 0)] * 3 + [(first, s - hi)]
    v_b = vh[:, :, first:hi].transpose(0, 1, 3, 2)
    dp = jnp.einsum("bnqd,bndk->bnqk", do_b, v_b).astype(f32)
    dv_b = jnp.einsum(
      "bndq,bnqk->bndk", do_b.transpose(0, 1, 3, 2), p.astype(do.dtype), preferred_element_type=f32
    )
    ds = p * (dp - jnp.sum(dp * p, axis=-1, keepdims=True)) / math.sqrt(qg.shape[-1])
    if slopes:  # through the soft-cap
      ds = ds * slopes[i]
    ds = ds.astype(qg.dtype)  # d(q·kᵀ); masked entries are 0 since p is
    dq_b = jnp.einsum("bnqk,bnkd->bnqd", ds, kt[..., first:hi].transpose(0, 1, 3, 2))
    dqs.append(dq_b.reshape(*qg.shape[:3], hi - lo, -1))
    dk_b = jnp.einsum("bndq,bnqk->bndk", q_b.transpose(0, 1, 3, 2), ds, preferred_element_type=f32)
    dkt, dvt = dkt + jnp.pad(dk_b, pad), dvt + jnp.pad(dv_b, pad)
  dq = _ungrouped(jnp.concatenate(dqs, axis=3))
  dk, dv = dkt.astype(kt.dtype), dvt.astype(vh.dtype)
  return dq, dk.transpose(0, 3, 1, 2), dv.transpose(0, 3, 1, 2)


def _causal_fwd(q, k, v, window, cap):
  return _attention_fwd(q, k, v, None, window, cap)


def _causal_bwd(window, cap, residuals, do):
  del window, cap  # each block's keys are read off its probabilities' width
  return _attention_bwd(residuals, do)


causal_attention.defvjp(_causal_fwd, _causal_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def segment_causal_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  segment_ids: jax.Array,
  window: int = 0,
  cap: float = 0.0,
) -> jax.Array:
  """``causal_attention`` within documents: query ``i`` sees key ``j`` iff ``j ≤ i`` and
  ``segment_ids[b, i] == segment_ids[b, j]`` (``segment_ids`` ``int32[B, S]``, as
  ``Windows.rows(..., document_mask=True)`` makes them). Shapes, grouping, ``window`` and
  ``cap`` as ``causal_attention``'s.

  The same blocks, arithmetic and backward as ``causal_attention``: the segment test joins
  the causal one inside each block, and the backward needs no mask of its own because the
  masked probabilities are exactly 0 (``exp`` of the fp32 minimum minus the row max
  underflows), which zeroes their score gradients as it does the causal ones. Every query
  sees at least itself, so no row is fully masked. Blocks whose keys are all in other
  documents are still computed: which ones they are depends on the data, and skipping
  them would need dynamic shapes; the saving is the causal one (and the window's) only.
  """
  return _attention_fwd(q, k, v, segment_ids, window, cap)[0]


def _segment_attention_fwd(q, k, v, segment_ids, window, cap):
  return _attention_fwd(q, k, v, segment_ids, window, cap)


def _segment_attention_bwd(window, cap, residuals, do):
  return (*_attention_bwd(residuals, do), None)  # segment ids: integers, no cotangent


segment_causal_attention.defvjp(_segment_attention_fwd, _segment_attention_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, epsilon: float) -> jax.Array:
  """``(x − mean) / √(var + ε) · scale + bias`` over the last axis, statistics in fp32.

  The backward is the closed form ``dx = rstd · (g − mean(g) − x̂ · mean(g · x̂))`` with
  ``g = dy · scale``: two row reductions, where autodiff of flax's ``LayerNorm`` (fast
  variance ``E[x²] − E[x]²``) makes XLA:CPU run several more small kernels. x, scale and
  bias share one dtype, which the output keeps.
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
