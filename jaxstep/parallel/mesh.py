"""The ``("data", "fsdp")`` mesh and global batches on it.

* The batch is sharded over both axes on its leading (sample) dimension.
* Parameters and optimizer state follow ``layout``'s rules: sharded over ``fsdp`` on their
  largest dimension the fsdp size divides, replicated over ``data``.
* Multi-process: every process builds the same global batch on the host (cheap, and it lets
  every process check N > 0), then hands only the rows its devices hold to
  ``jax.make_array_from_process_local_data``.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding

from jaxstep.errors import BatchError, ConfigError
from jaxstep.parallel.layout import AXES


def mesh_shape(data: int, fsdp: int, num_devices: int) -> tuple[int, int]:
  """Resolves ``-1`` (= all remaining devices) and checks ``data × fsdp == num_devices``."""
  if (data, fsdp).count(-1) > 1 or min(data, fsdp) == 0 or min(data, fsdp) < -1:
    raise ConfigError(
      f"the mesh's data and fsdp sizes must be positive, at most one of them -1; got "
      f"data={data} and fsdp={fsdp}"
    )
  if data == -1:
    data = num_devices // fsdp if num_devices % fsdp == 0 else 0
  if fsdp == -1:
    fsdp = num_devices // data if num_devices % data == 0 else 0
  if data * fsdp != num_devices:
    raise ConfigError(
      f"the mesh's data × fsdp must equal the {num_devices} devices; got data={data} × fsdp={fsdp}"
    )
  return data, fsdp


def make_mesh(data: int = -1, fsdp: int = 1, devices=None) -> Mesh:
  """A ``("data", "fsdp")`` mesh over ``devices`` (default: all devices of all processes)."""
  devices = list(devices if devices is not None else jax.devices())
  shape = mesh_shape(data, fsdp, len(devices))
  return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * 2, devices=devices)


def put_batch(batch: dict[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
  """A host global batch → global arrays; this process contributes only its devices' rows.

  Raises:
    BatchError: the rows (G) do not split evenly over the mesh's devices.
  """
  g = next(iter(batch.values())).shape[0]
  devices = sharding.mesh.devices.size
  if g % devices:
    raise BatchError(
      f"a global batch of {g} samples does not split evenly over {devices} devices; "
      f"use a multiple of {devices}"
    )
  if sharding.is_fully_addressable:
    return jax.device_put(batch, sharding)
  index = sharding.addressable_devices_indices_map((g,))
  rows = np.unique(np.concatenate([np.arange(g)[sl[0]] for sl in index.values()]))
  return {
    k: jax.make_array_from_process_local_data(sharding, v[rows], v.shape) for k, v in batch.items()
  }
