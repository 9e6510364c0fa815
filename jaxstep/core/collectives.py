"""The collectives of the sharded step (``accumulate.sharded_accumulate``): gathering the
fsdp-sharded parameters once per update, and the update's one reduction of the gradients
and metric sums over every device's rows (data, fsdp and expert axes; a tensor axis is left
to the compiler)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree
from jax.sharding import PartitionSpec as P

from jaxstep.core.layout import EXPERT, TENSOR


def over_rows(collective, x, axes: tuple[str, ...]):
  """``collective(x, axes)`` over the axes longer than 1 (none: ``x``). XLA rejects an
  all-reduce over only size-1 manual axes when another axis (tensor) is left automatic."""
  axes = tuple(a for a in axes if jax.lax.axis_size(a) > 1)
  return collective(x, axes) if axes else x


def _fsdp_dim(spec: P) -> int | None:
  return next((d for d, name in enumerate(spec) if name == "fsdp"), None)


def _on_tensor_shards(fn, x, spec: P):
  """``fn(x)`` on each device's own tensor shard of ``x`` (a ``shard_map`` manual over
  ``tensor``, nested in the step's): a collective over fsdp or data then moves 1/tensor of
  the leaf, where the compiler would otherwise gather it whole over ``tensor`` first."""
  if TENSOR not in spec:
    return fn(x)
  inner = P(*[TENSOR if a == TENSOR else None for a in spec])
  return jax.shard_map(
    fn, in_specs=inner, out_specs=inner, axis_names=frozenset({TENSOR}), check_vma=False
  )(x)


def gather(x, spec: P):
  dim = _fsdp_dim(spec)
  if dim is None:
    return x
  return _on_tensor_shards(lambda v: jax.lax.all_gather(v, "fsdp", axis=dim, tiled=True), x, spec)


def average(x, spec: P, axes: tuple[str, ...]):
  """A full model-state leaf that differs per device → its mean (max for non-floating
  leaves) over every device holding the same part of it (an expert-split leaf, e.g. a live
  reference's experts, not over ``expert``: those devices hold other experts), then this
  device's fsdp shard of it."""
  rows = _rows_of(spec, axes)
  if jnp.issubdtype(x.dtype, jnp.floating):
    x = over_rows(jax.lax.pmean, x, rows)
  else:
    x = over_rows(jax.lax.pmax, x, rows)
  dim = _fsdp_dim(spec)
  if dim is None:
    return x
  size = x.shape[dim] // jax.lax.axis_size("fsdp")
  return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index("fsdp") * size, size, dim)


def _scatter(x, dim: int, rows: tuple[str, ...]):
  """The fsdp reduce-scatter of a gradient leaf, then the all-reduce of its shard over the
  other ``rows`` axes."""
  shard = jax.lax.psum_scatter(x, "fsdp", scatter_dimension=dim, tiled=True)
  return over_rows(jax.lax.psum, shard, tuple(a for a in rows if a != "fsdp"))


def _rows_of(spec: P, axes: tuple[str, ...]) -> tuple[str, ...]:
  """The batch axes a gradient leaf laid out by ``spec`` is summed over: all of them, but
  for an expert-split leaf (each expert device holds other experts) not ``expert``."""
  return tuple(a for a in axes if a != EXPERT) if EXPERT in spec else axes


def reduce(grads, sums, param_specs, axes: tuple[str, ...]):
  """The update's reduction: ``(grads, *sums)`` summed over every device's rows.

  Replicated gradient leaves and the metric sums travel as ONE flat fp32 buffer through
  one ``psum``: gloo (the multi-process CPU transport) runs a tuple all-reduce of many
  operands far slower than one buffer of the same size (docs/performance.md).
  fsdp-sharded leaves: ``psum_scatter`` over fsdp first, then ``psum`` over data of each
  device's 1/fsdp shard: the data all-reduce carries 1/fsdp of the gradient, not all of it.
  Leaves split over a tensor or the expert axis are summed each on its own (a flat buffer
  would gather them whole); an expert-split leaf is not summed over ``expert``.
  """
  leaves, treedef = jax.tree.flatten(grads)
  specs = treedef.flatten_up_to(param_specs)
  dims = [_fsdp_dim(spec) for spec in specs]
  own = [TENSOR in spec or EXPERT in spec for spec in specs]  # summed each on its own
  for i, dim in enumerate(dims):
    if dim is None and own[i]:
      psum = functools.partial(over_rows, jax.lax.psum, axes=_rows_of(specs[i], axes))
      leaves[i] = _on_tensor_shards(psum, leaves[i], specs[i])
  replicated = [i for i, dim in enumerate(dims) if dim is None and not own[i]]
  flat, unravel = ravel_pytree(([leaves[i] for i in replicated], sums))
  summed, sums = unravel(over_rows(jax.lax.psum, flat, axes))
  for i, g in zip(replicated, summed, strict=True):
    leaves[i] = g
  for i, dim in enumerate(dims):
    if dim is not None:
      scatter = functools.partial(_scatter, dim=dim, rows=_rows_of(specs[i], axes))
      leaves[i] = _on_tensor_shards(scatter, leaves[i], specs[i])
  return jax.tree.unflatten(treedef, leaves), *sums
