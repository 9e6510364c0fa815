"""Grouped matrix products for mixture-of-experts layers: rows sorted by expert, each group
of rows multiplied by its own expert's weights, no per-expert Python loop.

``grouped_matmul(x, w, tile_groups, impl)``: ``x [R, d]`` holds the routed tokens sorted by
expert; ``w [E, d, f]``; the result ``[R, f]`` has row ``r`` = ``x[r] @ w[group(r)]``.

Two implementations compute the same product:

- ``ragged``: ``jax.lax.ragged_dot`` over unpadded groups, the anchors' grouped matmul
  (MaxText's and Tunix's, on TPU through Megablox). On XLA:CPU it lowers to a masked product
  against *every* expert: E times the FLOPs.
- ``tiles``: groups padded to a whole number of ``tile`` rows; a ``lax.scan`` multiplies one
  tile by its expert's ``[d, f]`` matrix per iteration, and the backward pass (a custom VJP)
  runs the same scan for ``dx`` and adds each tile's ``xᵀ·dy`` into its expert's slot of
  ``dw`` in place. FLOPs are the routed rows' plus at most ``E × (tile − 1)`` padding rows:
  what a grouped kernel costs, on any backend. The default (``auto``).

Both take the same dispatch (``moe.dispatch``); ``tile = 1`` is the unpadded layout that
``ragged`` reads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

IMPLS = ("auto", "tiles", "ragged")


def resolve(impl: str) -> str:
  """``auto`` → ``tiles``. ``ragged_dot`` computes every expert on XLA:CPU (measured), and
  its XLA:GPU lowering in this jaxlib is reported to expand into zero-padded dense products
  too (not measured here): ``ragged`` is there to choose once a backend's grouped kernel is
  measured to win."""
  return "tiles" if impl == "auto" else impl


def tile_rows(assignments: int, experts: int) -> int:
  """Rows per tile for ``assignments`` routed rows over ``experts``: the largest power of two
  up to half the mean group, within [8, 256]. Padding adds at most ``E × (tile − 1)`` rows
  (half the routed rows at most), while each tile's product costs a loop step: on XLA:CPU a
  product of 2,560 rows runs in 9.0 ms as tiles of 32, 7.1 ms of 64 and 4.5 ms of 128,
  against 2.6 ms in one piece (docs/moe.md)."""
  mean = max(assignments // max(experts, 1), 1)
  size = 8
  while size * 2 <= min(mean // 2, 256):
    size *= 2
  return size


@jax.custom_vjp
def tiled_matmul(x: jax.Array, w: jax.Array, tile_groups: jax.Array, used: jax.Array) -> jax.Array:
  """``x [n·t, d]`` (``n`` tiles of ``t`` rows), ``w [E, d, f]``, ``tile_groups int32[n]``
  (each tile's expert), ``used``: how many tiles hold rows (the rest are skipped, left
  zero) → ``[n·t, f]``: tile ``j`` times ``w[tile_groups[j]]``."""
  return _forward(x, w, tile_groups, used)


def _tiles(x: jax.Array, n: int) -> jax.Array:
  return x.reshape(n, x.shape[0] // n, x.shape[1])


def _forward(x, w, tile_groups, used):
  n = tile_groups.shape[0]
  empty = jnp.zeros((x.shape[0] // n, w.shape[2]), x.dtype)

  def one(_, xs):
    tile, g, j = xs
    return None, jax.lax.cond(j < used, lambda: (tile @ w[g]).astype(x.dtype), lambda: empty)

  _, y = jax.lax.scan(one, None, (_tiles(x, n), tile_groups, jnp.arange(n)))
  return y.reshape(x.shape[0], w.shape[2])


def _fwd(x, w, tile_groups, used):
  return _forward(x, w, tile_groups, used), (x, w, tile_groups, used)


def _bwd(res, dy):
  """``dx`` tile by tile (``dy · w[g]ᵀ``) and ``dw[g] += xᵀ · dy`` into one ``[E, d, f]``
  carry, updated in place: no per-tile ``[E, d, f]`` temporary."""
  x, w, tile_groups, used = res
  n = tile_groups.shape[0]
  empty = jnp.zeros((x.shape[0] // n, x.shape[1]), x.dtype)

  def one(dw, xs):
    tile, dtile, g, j = xs

    def compute(dw):
      dw = dw.at[g].add(jnp.matmul(tile.T, dtile, preferred_element_type=jnp.float32))
      return dw, (dtile @ w[g].T).astype(x.dtype)

    return jax.lax.cond(j < used, compute, lambda dw: (dw, empty), dw)

  xs = (_tiles(x, n), _tiles(dy, n), tile_groups, jnp.arange(n))
  dw, dx = jax.lax.scan(one, jnp.zeros(w.shape, jnp.float32), xs)
  zero = lambda a: jnp.zeros(a.shape, jax.dtypes.float0)  # noqa: E731
  return dx.reshape(x.shape), dw.astype(w.dtype), zero(tile_groups), zero(used)


tiled_matmul.defvjp(_fwd, _bwd)


def grouped_matmul(x, w, group_sizes, tile_groups, impl: str) -> jax.Array:
  """``x [R, d] @ w[group]`` per row: ``ragged`` from ``group_sizes int32[E]`` (rows of
  group ``e`` contiguous, in expert order, rows past the last group left zero), ``tiles``
  from ``tile_groups int32[R / t]`` (the tiles past ``Σ group_sizes`` skipped)."""
  if impl == "ragged":
    return jax.lax.ragged_dot(x, w, group_sizes)
  tile = x.shape[0] // tile_groups.shape[0]
  used = (jnp.sum(group_sizes) + tile - 1) // tile
  return tiled_matmul(x, w, tile_groups, used.astype(jnp.int32))


@jax.custom_vjp
def take_rows(x: jax.Array, index: jax.Array, back: jax.Array) -> jax.Array:
  """``x [n, d]`` → ``[len(index), d]``, row ``i`` = ``x[index[i]]`` (``index[i] = n``: a
  zero row). ``back int32[n, m]`` inverts ``index``: the ``m`` rows of the result each row
  of ``x`` went to (``len(index)``: none). The backward pass is then a gather and a sum over
  ``m`` (``dx[j] = Σ_l dy[back[j, l]]``) where autodiff's would scatter-add ``dy`` into
  ``x``'s rows: the same sums, cheaper on XLA:CPU (a layer of the ``moe`` benchmark, fwd +
  bwd: 55 → 50 ms; docs/performance.md). Used in both directions of a layer's dispatch:
  tokens → expert-sorted rows (``back`` = each token's k rows) and rows → assignments
  (``back`` = each row's assignment). A custom VJP: reverse mode only (``jax.jvp`` of an
  MoE model raises), as ``tiled_matmul``."""
  return _take(x, index)


def _take(x, index):
  return jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])[index]


def _take_fwd(x, index, back):
  return _take(x, index), (index, back)


def _take_bwd(res, dy):
  index, back = res
  dx = jnp.sum(_take(dy, back.reshape(-1)).reshape(*back.shape, dy.shape[1]), axis=1)
  zero = lambda a: jnp.zeros(a.shape, jax.dtypes.float0)  # noqa: E731
  return dx, zero(index), zero(back)


take_rows.defvjp(_take_fwd, _take_bwd)
