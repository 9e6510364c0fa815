"""Sharding rules as pure functions (no I/O): how params, optimizer state and batches lie
on a ``("data", "fsdp")`` mesh. ``jaxstep.parallel.mesh`` builds meshes and feeds batches."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXES = ("data", "fsdp")


def leaf_spec(shape: tuple[int, ...], fsdp_size: int) -> PartitionSpec:
  """``fsdp`` on the largest dimension ``fsdp_size`` divides (first on ties), else replicated."""
  if fsdp_size > 1:
    dims = [d for d in range(len(shape)) if shape[d] % fsdp_size == 0]
    if dims:
      best = max(dims, key=lambda d: (shape[d], -d))
      return PartitionSpec(*[("fsdp" if d == best else None) for d in range(len(shape))])
  return PartitionSpec()


def tree_specs(tree, mesh: Mesh):
  """``leaf_spec`` for every array leaf of ``tree`` (params, opt_state, a whole TrainState)."""
  return jax.tree.map(lambda x: leaf_spec(np.shape(x), mesh.shape["fsdp"]), tree)


def tree_shardings(tree, mesh: Mesh):
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec), tree_specs(tree, mesh))


def rows_here(sharding: NamedSharding, n: int) -> np.ndarray:
  """The rows of an ``n``-row array laid out by ``sharding`` that this process's devices
  hold, sorted."""
  index = sharding.addressable_devices_indices_map((n,))
  return np.unique(np.concatenate([np.arange(n)[sl[0]] for sl in index.values()]))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (sample) dimension over every device: ``P(("data", "fsdp"))``."""
  return NamedSharding(mesh, PartitionSpec(AXES))
