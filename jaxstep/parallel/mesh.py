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
from jaxstep.core.layout import AXES, EXPERT, TENSOR, batch_shards, rows_here
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


def make_mesh(
  data: int = -1, fsdp: int = 1, devices=None, *, tensor: int = 1, expert: int = 1
) -> Mesh:
  """A ``("data", "fsdp")`` mesh over ``devices`` (default: all devices of all processes),
  with an ``"expert"`` axis when ``expert`` > 1 (an MoE model's experts split over it) and
  a ``"tensor"`` one when ``tensor`` > 1, whose groups are neighbouring devices (within a
  host where it can: ``jax.make_mesh`` orders them); ``data``/``fsdp`` -1 take the devices
  left after the others."""
  devices = list(devices if devices is not None else jax.devices())
  for name, size in (("tensor", tensor), ("expert", expert), ("tensor × expert", tensor * expert)):
    if size < 1 or len(devices) % size:
      divisors = (d for d in range(1, len(devices) + 1) if len(devices) % d == 0)
      raise ConfigError(
        f"mesh.{name}={size} does not divide the {len(devices)} device(s) here; make it one "
        f"of {', '.join(map(str, divisors))}"
      )
  shape = mesh_shape(data, fsdp, len(devices) // (tensor * expert))
  extra = [(EXPERT, expert)] * (expert > 1) + [(TENSOR, tensor)] * (tensor > 1)
  axes = (*AXES, *(name for name, _ in extra))
  sizes = (*shape, *(size for _, size in extra))
  return jax.make_mesh(sizes, axes, axis_types=(AxisType.Auto,) * len(axes), devices=devices)


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
