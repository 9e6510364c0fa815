"""Many devices: the ``("data", "fsdp")`` mesh, where every array lies on it, and the
multi-process start. The rules (pure functions) live in ``jaxstep.core.layout``; ``mesh``
builds meshes and feeds batches; ``cpu_devices`` splits a CPU-only host into virtual devices;
``launchers`` reads a multi-process job from its launcher's environment (SLURM, Open MPI,
Kubernetes, Cloud TPU) and ``distributed`` starts it."""

from jaxstep.core.layout import (
  AXES,
  batch_sharding,
  batch_shards,
  leaf_spec,
  tree_shardings,
  tree_specs,
)
from jaxstep.parallel.distributed import initialize_distributed
from jaxstep.parallel.mesh import gather_rows, local_rows, make_mesh, mesh_shape, put_batch

__all__ = [
  "AXES",
  "batch_sharding",
  "batch_shards",
  "initialize_distributed",
  "leaf_spec",
  "gather_rows",
  "local_rows",
  "make_mesh",
  "mesh_shape",
  "put_batch",
  "tree_shardings",
  "tree_specs",
]
