"""Memory ledger: the textbook mixed-precision Adam table, jaxstep's own layout, and the
compiled step's ``memory_analysis()`` (``python -m jaxstep.memory`` prints them side by side).

Textbook (ZeRO paper) layout per parameter: fp16/bf16 params 2 B + grads 2 B + fp32 master
4 B + Adam moments 4 + 4 B = 16 B. Per device with D data-parallel ranks: ZeRO-0 16P,
ZeRO-1 (4 + 12/D)P, ZeRO-2 (2 + 14/D)P, ZeRO-3 16P/D. Activations come on top and are
not divided by D.

jaxstep's layout: fp32 params 4P/F and Adam moments 8P/F persist (F = mesh.fsdp); during an
update the fp32 gradient accumulator 4P is full-size per device, the fsdp-gathered params
add 4P when F > 1, and bf16/fp16 compute adds a 2P cast copy.
"""

from __future__ import annotations

import math

from jaxstep.core.precision import PRECISIONS
from jaxstep.errors import ConfigError


def textbook_state_bytes(num_params: int, *, zero_stage: int = 0, data_parallel: int = 1) -> int:
  """Bytes per device of the textbook 16 B/param mixed-precision Adam state under ZeRO."""
  p, d = num_params, data_parallel
  if zero_stage not in (0, 1, 2, 3) or d < 1:
    raise ConfigError(f"zero_stage must be 0-3 and data_parallel >= 1, got {zero_stage}, {d}")
  replicated, sharded = {0: (16, 0), 1: (4, 12), 2: (2, 14), 3: (0, 16)}[zero_stage]
  return replicated * p + math.ceil(sharded * p / d)


def jaxstep_layout(num_params: int, *, precision: str = "fp32", fsdp: int = 1) -> dict[str, int]:
  """jaxstep's bytes per device by role (persistent state, then update-time buffers)."""
  p = num_params
  rows = {
    "params fp32 (4P/F)": math.ceil(4 * p / fsdp),
    "Adam moments fp32 (8P/F)": math.ceil(8 * p / fsdp),
    "grad accumulator fp32 (4P, during the update)": 4 * p,
  }
  if fsdp > 1:
    rows["gathered params fp32 (4P, during the update)"] = 4 * p
  if PRECISIONS[precision] is not None:
    rows[f"{precision} compute copy (2P, during the update)"] = 2 * p
  return rows


def compiled_memory(cfg) -> dict:
  """Builds the run of ``cfg`` and compiles its step: bytes per device + parameter count."""
  import jax

  from jaxstep import models
  from jaxstep.trainer.build import build

  r, state, _ = build(cfg)
  t = cfg.train
  batch = {
    k: jax.ShapeDtypeStruct((t.global_batch_size, t.seq_len), "int32")
    for k in ("inputs", "targets", "loss_mask")
  }
  mem = r.step_fn.lower(state, batch).compile().memory_analysis()
  state_bytes = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state))
  return {
    "num_params": models.num_params(state.params),
    "state_bytes": state_bytes,
    "argument_bytes": mem.argument_size_in_bytes,
    "output_bytes": mem.output_size_in_bytes,
    "temp_bytes": mem.temp_size_in_bytes,
    "devices": r.mesh.devices.size,
    "fsdp": r.mesh.shape["fsdp"],
    "data": r.mesh.shape["data"],
  }
