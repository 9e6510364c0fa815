"""What one device can hold, and the one way a command refuses a count that cannot fit it
(a batch size, a number of samples) before anything of that size is allocated."""

from __future__ import annotations

import math
import os

import jax

from jaxstep.errors import ConfigError


def gpu_bytes_limit(device=None) -> int | None:
  """A GPU's ``bytes_limit`` (what XLA's allocator may use); None on other platforms."""
  device = device or jax.local_devices()[0]
  stats = device.memory_stats() if device.platform == "gpu" else None
  return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def device_memory_bytes(device=None) -> int:
  """What one device can hold: a GPU's ``bytes_limit``; elsewhere the host's physical memory
  (a CPU's virtual devices share it, so this is generous for each)."""
  limit = gpu_bytes_limit(device)
  return limit if limit is not None else os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def bytes_per_device(tree) -> int:
  """Bytes of ``tree``'s arrays on one device: each leaf's shard (the whole leaf unless it
  is split over devices, as a tensor mesh splits the params)."""
  total = 0
  for x in jax.tree.leaves(tree):
    sharding = getattr(x, "sharding", None)
    if sharding is None:
      total += getattr(x, "nbytes", 0)
    else:
      total += math.prod(sharding.shard_shape(x.shape)) * x.dtype.itemsize
  return total


def _gib(num_bytes: int) -> str:
  """``num_bytes`` in GiB with one decimal; whole GiB past a float's range, so that any
  count a command line can spell prints."""
  return f"{num_bytes / 2**30:,.1f}" if num_bytes < 2**900 else f"{num_bytes // 2**30:,}"


def refuse_count_over_memory(
  option: str, value: int, unit_bytes: int, fixed_bytes: int, memory_bytes: int, what: str
) -> None:
  """``ConfigError`` when ``fixed_bytes + value × unit_bytes`` (a command's estimate: what it
  holds anyway plus what each of ``value`` units adds) exceeds ``memory_bytes``, raised before
  anything of that size is allocated: it names ``option``, the estimate (of ``what``), the
  limit and the largest value that fits. Python ints: an absurd value cannot overflow here."""
  need = fixed_bytes + value * unit_bytes
  if need <= memory_bytes:
    return
  largest = (memory_bytes - fixed_bytes) // unit_bytes if memory_bytes > fixed_bytes else 0
  fits = f"the largest {option} that fits is {largest:,}" if largest else "not even 1 fits"
  raise ConfigError(
    f"{option} {value:,} needs about {_gib(need)} GiB ({what}), more than the "
    f"{_gib(memory_bytes)} GiB one device holds; {fits}"
  )
