"""Per-device memory of params + optimizer state under fsdp = 1, 2, 4, 8.

Runs in a worker with 8 virtual CPU devices; reads ``memory_analysis()`` of the compiled
train step (argument bytes = state + batch per device) and the bytes of the state's own
shards on device 0.
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jaxstep import TrainState, make_train_step, models, parallel
from jaxstep.core.losses import next_token_loss
from jaxstep.core.optim import OptimConfig, make_optimizer


def fsdp_memory(spec: dict):
  cfg = models.GPTConfig(**spec.get("model", {}))
  g, s, k = spec.get("global_batch_size", 16), cfg.max_seq_len, spec.get("k", 2)
  rows = []
  for fsdp in (1, 2, 4, 8):
    mesh = parallel.make_mesh(jax.device_count() // fsdp, fsdp)
    apply_fn, params = models.build(cfg, 0)
    opt = make_optimizer(OptimConfig(), 100)
    state = TrainState.create(params=params, optimizer=opt, rng=0)
    sh = parallel.tree_shardings(state, mesh)
    state = jax.device_put(state, sh)
    step = make_train_step(next_token_loss(apply_fn), opt, grad_accum_steps=k, mesh=mesh)
    batch = {n: jax.ShapeDtypeStruct((g, s), "int32") for n in ("inputs", "targets", "loss_mask")}
    compiled = (
      jax.jit(
        step,
        in_shardings=(sh, parallel.batch_sharding(mesh)),
        out_shardings=(sh, NamedSharding(mesh, PartitionSpec())),
        donate_argnums=0,
      )
      .lower(state, batch)
      .compile()
    )
    mem = compiled.memory_analysis()
    dev0 = jax.devices()[0]
    state_bytes = sum(
      shard.data.nbytes
      for x in jax.tree.leaves(state)
      for shard in x.addressable_shards
      if shard.device == dev0
    )
    rows.append(
      {
        "fsdp": fsdp,
        "data": jax.device_count() // fsdp,
        "state_bytes_per_device": state_bytes,
        "argument_bytes": mem.argument_size_in_bytes,
        "temp_bytes": mem.temp_size_in_bytes,
        "output_bytes": mem.output_size_in_bytes,
      }
    )
  full = rows[0]["state_bytes_per_device"]
  for r in rows:
    r["state_ratio_vs_fsdp1"] = r["state_bytes_per_device"] / full
  return {"rows": rows, "num_params": models.num_params(params)}, lambda: {}


CONTENDERS = {"fsdp_memory": fsdp_memory}
