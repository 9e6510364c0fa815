"""Saves or restores a TrainState under however many devices this process has.

``python reshard.py save|restore DIR``; run with
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` to vary the layout. Leaves are
sharded over all devices on their first divisible dimension, replicated otherwise.
"""

import sys

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxstep import TrainState
from jaxstep.trainer.store.checkpoint import Checkpointer


def layout(x, mesh):
  n = mesh.devices.size
  for dim, size in enumerate(x.shape):
    if size % n == 0:
      spec = [None] * x.ndim
      spec[dim] = "fsdp"
      return NamedSharding(mesh, PartitionSpec(*spec))
  return NamedSharding(mesh, PartitionSpec())


def build():
  mesh = Mesh(np.array(jax.devices()), ("fsdp",))
  rng = np.random.default_rng(0)
  params = {
    "w": rng.normal(size=(16, 8)).astype(np.float32),
    "b": rng.normal(size=(3,)).astype(np.float32),
  }
  state = TrainState.create(params=params, optimizer=optax.adamw(1e-3), rng=0)
  state = state.replace(opt_state=jax.tree.map(lambda x: x + 1, state.opt_state))
  return jax.tree.map(lambda x: jax.device_put(x, layout(np.asarray(x), mesh)), state)


def main(mode, directory):
  state = build()
  if mode == "save":
    with Checkpointer(directory) as ckpt:
      ckpt.save(1, state, {"global_batch_size": 8})
    return
  with Checkpointer(directory) as ckpt:
    restored, metadata, _ = ckpt.restore(state)
  assert metadata == {"global_batch_size": 8}
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert got.sharding == want.sharding, (got.sharding, want.sharding)
  print(
    f"restored on {jax.device_count()} devices; w sharded over "
    f"{len(restored.params['w'].sharding.device_set)}"
  )


if __name__ == "__main__":
  main(*sys.argv[1:])
