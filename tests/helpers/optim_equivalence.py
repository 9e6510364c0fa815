"""Each ``optim.name`` on 4 virtual CPU devices (fsdp 4, and data 2 × fsdp 2) against one
device: the worst relative parameter error after 3 updates of a Llama, one JSON line per
(optimizer, mesh). Run with ``XLA_FLAGS=--xla_force_host_platform_device_count=4``."""

import json

import jax
import numpy as np

from jaxstep import make_train_step, models, parallel
from jaxstep.core.losses import next_token_loss
from jaxstep.core.optim import OPTIMIZERS, OptimConfig, make_optimizer

CFG = models.LlamaConfig(vocab_size=32, max_seq_len=8, d_model=16, n_layers=2, n_heads=2)


def run(name, mesh):
  apply_fn, params = models.build(CFG, 0)
  opt = make_optimizer(OptimConfig(name=name, lr=0.01, warmup_steps=0), 10)
  step = make_train_step(next_token_loss(apply_fn), opt, grad_accum_steps=2, mesh=mesh)
  state = step.init(params, 0)
  rng = np.random.default_rng(0)
  for _ in range(3):
    tokens = rng.integers(0, 32, size=(16, 9), dtype=np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": np.ones((16, 8))}
    if mesh is not None:
      batch = parallel.put_batch(batch, parallel.batch_sharding(mesh))
    state, _ = jax.jit(step)(state, batch)
  return state.params


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


if __name__ == "__main__":
  for name in OPTIMIZERS:
    ref = run(name, None)
    for shape in ((1, 4), (2, 2)):
      got = run(name, parallel.make_mesh(*shape))
      pairs = zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True)
      print(json.dumps({"optimizer": name, "mesh": shape, "err": max(rel(a, b) for a, b in pairs)}))
