"""Many devices: the ``("data", "fsdp")`` mesh, where every array lies on it, and the
multi-process start. ``layout`` holds the rules as pure functions; ``mesh`` builds meshes
and feeds batches; ``cpu_devices`` splits a CPU-only host into virtual devices."""

from jaxstep.parallel.distributed import initialize_distributed
from jaxstep.parallel.layout import AXES, batch_sharding, leaf_spec, tree_shardings, tree_specs
from jaxstep.parallel.mesh import local_rows, make_mesh, mesh_shape, put_batch

__all__ = [
  "AXES",
  "batch_sharding",
  "initialize_distributed",
  "leaf_spec",
  "local_rows",
  "make_mesh",
  "mesh_shape",
  "put_batch",
  "tree_shardings",
  "tree_specs",
]
