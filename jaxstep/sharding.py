"""Many devices: a ``("data", "fsdp")`` mesh, sharding rules and global batches (DESIGN §9).

* The batch is sharded over both axes on its leading (sample) dimension.
* Parameters and optimizer state are sharded over ``fsdp`` on their largest dimension that
  the fsdp size divides (replicated where none does: scalars, small biases) and replicated
  over ``data``.
* Multi-process: every process builds the same global batch on the host (cheap, and it lets
  every process check N > 0), then hands only the rows its devices hold to
  ``jax.make_array_from_process_local_data``.
"""

from __future__ import annotations

import logging
import os

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding

from jaxstep.errors import ConfigError
from jaxstep.layout import AXES, batch_sharding, leaf_spec, tree_shardings, tree_specs

__all__ = [
  "AXES",
  "batch_sharding",
  "check_batch_divisible",
  "initialize_distributed",
  "leaf_spec",
  "make_mesh",
  "mesh_shape",
  "put_batch",
  "tree_shardings",
  "tree_specs",
]

log = logging.getLogger("jaxstep")


def mesh_shape(data: int, fsdp: int, num_devices: int) -> tuple[int, int]:
  """Resolves ``-1`` (= all remaining devices) and checks ``data × fsdp == num_devices``."""
  if (data, fsdp).count(-1) > 1 or min(data, fsdp) == 0 or min(data, fsdp) < -1:
    raise ConfigError(
      f"mesh.data and mesh.fsdp must be positive, at most one of them -1; got {data} and {fsdp}"
    )
  if data == -1:
    data = num_devices // fsdp if num_devices % fsdp == 0 else 0
  if fsdp == -1:
    fsdp = num_devices // data if num_devices % data == 0 else 0
  if data * fsdp != num_devices:
    raise ConfigError(
      f"mesh.data × mesh.fsdp must equal the {num_devices} devices; got data={data} × fsdp={fsdp}"
    )
  return data, fsdp


def make_mesh(data: int = -1, fsdp: int = 1, devices=None) -> Mesh:
  """A ``("data", "fsdp")`` mesh over ``devices`` (default: all devices of all processes)."""
  devices = list(devices if devices is not None else jax.devices())
  shape = mesh_shape(data, fsdp, len(devices))
  return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * 2, devices=devices)


def check_batch_divisible(global_batch_size: int, grad_accum_steps: int, mesh: Mesh) -> None:
  """Each micro-batch must split evenly over the devices: ``G % (devices × K) == 0``."""
  n = mesh.devices.size
  if global_batch_size % (n * grad_accum_steps):
    raise ConfigError(
      f"train.global_batch_size {global_batch_size} must be divisible by devices × "
      f"grad_accum_steps = {n} × {grad_accum_steps} = {n * grad_accum_steps} so every "
      f"micro-batch splits evenly over the mesh"
    )


def put_batch(batch: dict[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
  """A host global batch → global arrays; this process contributes only its devices' rows."""
  if sharding.is_fully_addressable:
    return jax.device_put(batch, sharding)
  g = next(iter(batch.values())).shape[0]
  index = sharding.addressable_devices_indices_map((g,))
  rows = np.unique(np.concatenate([np.arange(g)[sl[0]] for sl in index.values()]))
  return {
    k: jax.make_array_from_process_local_data(sharding, v[rows], v.shape) for k, v in batch.items()
  }


def initialize_distributed(
  coordinator: str = "", num_processes: int = 0, process_id: int = -1
) -> None:
  """``jax.distributed.initialize`` from config, ``JAXSTEP_*`` env, or cluster detection.

  Precedence per field: config value, then ``JAXSTEP_COORDINATOR`` / ``JAXSTEP_NUM_PROCESSES``
  / ``JAXSTEP_PROCESS_ID``. With no coordinator anywhere, JAX's own cluster detection runs
  only under a multi-task SLURM / Open MPI launch; otherwise this is a single process.
  """
  coordinator = coordinator or os.environ.get("JAXSTEP_COORDINATOR", "")
  num_processes = num_processes or int(os.environ.get("JAXSTEP_NUM_PROCESSES", "0"))
  if process_id < 0:
    process_id = int(os.environ.get("JAXSTEP_PROCESS_ID", "-1"))
  if coordinator:
    if num_processes <= 0 or process_id < 0:
      raise ConfigError(
        "a coordinator needs mesh.num_processes and mesh.process_id "
        "(or JAXSTEP_NUM_PROCESSES and JAXSTEP_PROCESS_ID)"
      )
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU-only hosts
    jax.distributed.initialize(coordinator, num_processes, process_id)
  elif (
    int(os.environ.get("SLURM_NTASKS", "1")) > 1
    or int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1
  ):
    jax.distributed.initialize()
  else:
    return
  log.info(
    "process %d of %d, %d local / %d global devices",
    jax.process_index(),
    jax.process_count(),
    jax.local_device_count(),
    jax.device_count(),
  )
