"""``train.grad_accum_steps: auto``: the smallest K whose compiled train step fits a memory
budget, found without running anything.

For a global batch of G samples on D data-parallel devices the candidates are the K with
``G % (K·D) == 0``, ascending. A larger K means a smaller micro-batch, so fewer activation
bytes: "fits" is monotone in K, and a binary search over the candidates compiles at most
``⌈log2(#candidates)⌉ + 1`` steps (``jit(step).lower(state, batch).compile()`` on abstract
inputs, then ``memory_analysis()``). A step's bytes per device are ``arguments + outputs −
aliased (the donated state) + temporaries``. No step runs out of memory and restarts, so
no update is lost; a resumed run may choose another K for the same G, which changes no
update (the micro-batches of one global batch are summed exactly).

The budget is ``train.memory_budget_gb`` (GiB, 2^30 bytes, per device) if set, else 90 %
of the device's ``memory_stats()["bytes_limit"]`` on a GPU; on a CPU the key is required.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import jax

from jaxstep.core import device_memory
from jaxstep.errors import ConfigError

log = logging.getLogger("jaxstep")
GIB = 2**30
DEVICE_SHARE = 0.9  # of a GPU's bytes_limit: room for XLA's own buffers and fragmentation


def candidates(global_batch_size: int, devices: int) -> list[int]:
  """Every K that splits G into equal micro-batches over ``devices``, ascending."""
  return [k for k in range(1, global_batch_size + 1) if global_batch_size % (k * devices) == 0]


def compiled_bytes(compiled) -> int:
  """Peak bytes per device of a compiled step: arguments + outputs − aliased + temporaries."""
  m = compiled.memory_analysis()
  return (
    m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
  )


def budget_bytes(memory_budget_gb: float, device=None) -> int:
  """The budget per device in bytes (see the module docstring)."""
  if memory_budget_gb:
    return int(memory_budget_gb * GIB)
  device = device or jax.local_devices()[0]
  limit = device_memory.gpu_bytes_limit(device)
  if limit is None:
    raise ConfigError(
      f"train.grad_accum_steps=auto on {device.platform} needs train.memory_budget_gb "
      f"(GiB per device the train step may use)"
    )
  return int(limit * DEVICE_SHARE)


def search(ks: list[int], bytes_of: Callable[[int], int], budget: int):
  """The smallest ``k`` in ``ks`` with ``bytes_of(k) <= budget`` by binary search, and the
  ``(k, bytes)`` pairs it compiled, in order. ``ConfigError`` when none fits."""
  table: list[tuple[int, int]] = []
  lo, hi = 0, len(ks)  # the answer's index is in [lo, hi]; hi = len(ks): none fits
  while lo < hi:
    mid = (lo + hi) // 2
    table.append((ks[mid], bytes_of(ks[mid])))
    if table[-1][1] <= budget:
      hi = mid
    else:
      lo = mid + 1
  if lo == len(ks):
    k, need = ks[-1], dict(table)[ks[-1]]
    raise ConfigError(
      f"no train.grad_accum_steps fits {budget / GIB:.2f} GiB per device: even K={k} "
      f"(micro-batches of the fewest samples) needs {need / GIB:.2f} GiB; raise "
      f"train.memory_budget_gb, use model.remat=block, or shrink the model or seq_len"
    )
  return ks[lo], table


def choose(
  global_batch_size: int, devices: int, compile_k: Callable[[int], object], budget: int
) -> tuple[int, list[tuple[int, int]]]:
  """The K for ``auto`` and the ``(K, bytes)`` compiled, logging both."""
  ks = candidates(global_batch_size, devices)
  k, table = search(ks, lambda k: compiled_bytes(compile_k(k)), budget)
  rows = ", ".join(
    f"K={c}: {b / GIB:.3f} GiB ({'fits' if b <= budget else 'over'})" for c, b in sorted(table)
  )
  log.info(
    "grad_accum_steps=auto: budget %.3f GiB per device; compiled %s → K=%d (micro-batch of "
    "%d samples per device)",
    budget / GIB,
    rows,
    k,
    global_batch_size // (k * devices),
  )
  return k, sorted(table)
