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

from jaxstep.core import geometry
from jaxstep.core.layout import AXES, TENSOR, batch_shards, rows_here
from jaxstep.errors import BatchError, ConfigError


def mesh_shape(data: int, fsdp: int, num_devices: int) -> tuple[int, int]:
  """Resolves ``-1`` (= all remaining devices) and checks ``data × fsdp == num_devices``."""
  if (data, fsdp).count(-1) > 1 or min(data, fsdp) == 0 or min(data, fsdp) < -1:
    raise ConfigError(
      f"the mesh's data and fsdp sizes must be positive, at most one of them -1; got "
      f"data={data} and fsdp={fsdp}"
    )
  fixed = fsdp if data == -1 else data if fsdp == -1 else None
  if fixed is not None and num_devices % fixed:
    name = "fsdp" if data == -1 else "data"
    raise ConfigError(
      f"mesh.{name}={fixed} does not divide the {num_devices} device(s) here; set mesh.{name} "
      f"to a divisor of {num_devices}"
    )
  if data == -1:
    data = num_devices // fsdp
  if fsdp == -1:
    fsdp = num_devices // data
  if data * fsdp != num_devices:
    raise ConfigError(
      f"the mesh's data × fsdp must equal the {num_devices} devices; got data={data} × fsdp={fsdp}"
    )
  return data, fsdp


def make_mesh(data: int = -1, fsdp: int = 1, devices=None, *, tensor: int = 1) -> Mesh:
  """A ``("data", "fsdp")`` mesh over ``devices`` (default: all devices of all processes),
  or with ``tensor`` > 1 a ``("data", "fsdp", "tensor")`` one whose tensor groups are
  neighbouring devices (within a host where it can: ``jax.make_mesh`` orders them);
  ``data``/``fsdp`` -1 take the devices left after the other two."""
  devices = list(devices if devices is not None else jax.devices())
  if tensor < 1 or len(devices) % tensor:
    raise ConfigError(
      f"mesh.tensor={tensor} does not divide the {len(devices)} device(s) here; set it to "
      f"one of {', '.join(str(d) for d in range(1, len(devices) + 1) if len(devices) % d == 0)}"
    )
  shape = mesh_shape(data, fsdp, len(devices) // tensor)
  if tensor == 1:
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * 2, devices=devices)
  axes = (*AXES, TENSOR)
  return jax.make_mesh((*shape, tensor), axes, axis_types=(AxisType.Auto,) * 3, devices=devices)


def local_rows(sharding: NamedSharding, global_batch_size: int) -> np.ndarray | None:
  """The rows of a G-row global batch that this process's devices hold (sorted), or None
  when this process holds them all (one process)."""
  return None if sharding.is_fully_addressable else rows_here(sharding, global_batch_size)


def gather_rows(values: np.ndarray, rows: np.ndarray, n: int) -> np.ndarray:
  """The ``n`` rows of a global batch from every process's ``values`` (its ``rows``, as
  ``local_rows`` gives them; every process holds as many): what each host computed on its
  own rows (rewards, lengths), put together in row order on every host."""
  from jax.experimental import multihost_utils

  values = np.asarray(values)
  stacked = np.asarray(multihost_utils.process_allgather(values))
  where = np.asarray(multihost_utils.process_allgather(np.asarray(rows, np.int64)))
  out = np.empty((n, *values.shape[1:]), values.dtype)
  out[where.reshape(-1)] = stacked.reshape(-1, *values.shape[1:])
  return out


def put_batch(
  batch: dict[str, np.ndarray],
  sharding: NamedSharding,
  global_batch_size: int | None = None,
  *,
  grad_accum_steps: int | None = None,
) -> dict[str, jax.Array]:
  """A host batch → global arrays of ``global_batch_size`` rows (default: the batch's own).

  ``batch`` holds either all G rows or only this process's ``local_rows``; either way this
  process contributes only its devices' rows. ``grad_accum_steps`` (K), when given, is
  checked too: the step needs G to be a multiple of devices × K.

  Raises:
    BatchError: the rows (G) do not split evenly over the devices (× K); the message states
      the whole rule (``geometry.split_problem``).
  """
  rows = next(iter(batch.values())).shape[0]
  g = global_batch_size or rows
  devices = batch_shards(sharding.mesh)
  problem = geometry.split_problem(
    g, grad_accum_steps, devices, names=("a global batch of", "grad_accum_steps")
  )
  if problem:
    raise BatchError(problem)
  if sharding.is_fully_addressable:
    return jax.device_put(batch, sharding)
  local = local_rows(sharding, g)
  if rows == g:
    batch = {k: v[local] for k, v in batch.items()}
  return {
    k: jax.make_array_from_process_local_data(sharding, v, (g, *v.shape[1:]))
    for k, v in batch.items()
  }
