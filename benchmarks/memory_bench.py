"""Per-device memory of params + optimizer state under fsdp = 1, 2, 4, 8 (a worker with 8
virtual CPU devices: ``memory_analysis()`` of the compiled train step, argument bytes =
state + batch per device, and the bytes of the state's own shards on device 0); and compile
time and temporaries against depth, scanned vs unrolled blocks, per remat policy.
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


def _compiled_step(model: dict, layers: int, k: int, micro: int):
  """Lowers and compiles the train step of a GPT with ``layers`` blocks: ``(seconds,
  temp bytes)``, caches cleared first so the compile is real."""
  import time

  import jax.numpy as jnp

  cfg = models.GPTConfig(**{**model, "n_layers": layers})
  apply_fn, params = models.build(cfg, 0, abstract=True)
  opt = make_optimizer(OptimConfig(), 100)
  step = make_train_step(next_token_loss(apply_fn), opt, grad_accum_steps=k)
  state = jax.eval_shape(step.init, params, jax.random.PRNGKey(0))
  batch = {
    n: jax.ShapeDtypeStruct((micro * k, cfg.max_seq_len), jnp.int32)
    for n in ("inputs", "targets", "loss_mask")
  }
  jax.clear_caches()
  t = time.perf_counter()
  compiled = jax.jit(step, donate_argnums=0).lower(state, batch).compile()
  return time.perf_counter() - t, compiled.memory_analysis().temp_size_in_bytes


def depth(spec: dict):
  """Compile seconds (best of ``repeats``, trace + lower + compile) and temp bytes at
  ``shallow`` and ``deep`` blocks, scanned and unrolled, for each remat policy."""
  jax.jit(lambda x: x + 1).lower(1.0).compile()  # backend warm-up, not counted
  rows = []
  for scan in (True, False):
    for remat in spec["remats"]:
      model = {**spec["model"], "scan_layers": scan, "remat": remat}
      row = {"scan_layers": scan, "remat": remat}
      for name, layers in (("shallow", spec["shallow"]), ("deep", spec["deep"])):
        runs = [
          _compiled_step(model, layers, spec["k"], spec["micro"]) for _ in range(spec["repeats"])
        ]
        row[f"{name}_compile_s"] = min(r[0] for r in runs)
        row[f"{name}_temp_bytes"] = runs[0][1]
      row["compile_ratio"] = row["deep_compile_s"] / row["shallow_compile_s"]
      rows.append(row)
  return {"rows": rows}, lambda: {}


CONTENDERS = {"fsdp_memory": fsdp_memory, "depth": depth}
