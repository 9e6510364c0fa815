"""An MoE model, same global batch and seed: one device vs meshes of 8 virtual CPU devices.

Run with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``. Prints one JSON line per
(mesh, K, scope) with the worst relative errors after 3 AdamW updates against one device
with K = 1 (the loss, the load-balancing loss, the gradient norm, every parameter leaf) and
how the first layer's stacked experts are laid out. Meshes are (data, fsdp, expert, tensor).
"""

import json
import sys

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jaxstep import make_train_step, models, parallel
from jaxstep.core import router_loss
from jaxstep.models.llama import LlamaConfig

BASE = dict(
  vocab_size=32, max_seq_len=8, d_model=16, n_layers=2, n_heads=2, intermediate_size=24,
  num_experts=8, experts_per_token=2, moe_intermediate_size=8, router_aux_loss=0.5,
  router_z_loss=0.1,
)  # fmt: skip
G, S = 32, 8


def batches():
  rng = np.random.default_rng(0)
  out = []
  for _ in range(3):
    tokens = rng.integers(0, 32, size=(G, S + 1), dtype=np.int32)
    mask = (rng.random((G, S)) < rng.choice([0.1, 0.9], size=(G, 1))).astype(np.int32)
    mask[: G // 8] = 0  # the first device's rows of an (8, 1) mesh hold no tokens at all
    out.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": mask})
  return out


def run(cfg, mesh, k):
  apply_fn, params = models.build(cfg, 0)
  opt = optax.adamw(1e-2)
  step = make_train_step(
    router_loss.next_token_loss(apply_fn, cfg), opt, grad_accum_steps=k, mesh=mesh
  )
  state = step.init(params, 0)
  terms = k * (parallel.batch_shards(mesh) if mesh is not None else 1)
  step = router_loss.with_router_metrics(step, cfg, terms)
  if mesh is None:
    step, put = jax.jit(step), lambda b: b  # noqa: E731
  else:
    state_sh = parallel.tree_shardings(state, mesh)
    step = jax.jit(
      step,
      in_shardings=(state_sh, parallel.batch_sharding(mesh)),
      out_shardings=(state_sh, NamedSharding(mesh, PartitionSpec())),
    )
    put = lambda b: parallel.put_batch(b, parallel.batch_sharding(mesh))  # noqa: E731
  metrics, spec = [], None
  if mesh is not None:
    spec = str(state.params["blocks"][0]["mlp"]["experts"]["gate_proj"].sharding.spec)
  for b in batches():
    state, m = step(state, put(b))
    metrics.append({key: float(m[key]) for key in ("loss", "moe/lbl", "grad_norm")})
  return jax.device_get(state.params), metrics, spec


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-12))


MESHES = [  # (data, fsdp, expert, tensor)
  (8, 1, 1, 1), (2, 4, 1, 1), (2, 2, 1, 2),
  (1, 1, 8, 1), (2, 1, 4, 1), (1, 2, 4, 1), (2, 2, 2, 1), (2, 1, 2, 2),
]  # fmt: skip
# K = 4 on every mesh; K = 1 (no routing prepass: the counts come from the step's own
# forward) where the experts are split, and on one mesh without; the per-micro-batch scope,
# which must differ, on a mesh of each kind
CASES = {
  "global": [(m, 4) for m in MESHES] + [(m, 1) for m in MESHES if m[2] > 1 or m == (8, 1, 1, 1)],
  "micro_batch": [((8, 1, 1, 1), 4), ((2, 1, 4, 1), 1), ((2, 1, 4, 1), 4)],
  # the global LBL with a capacity: each device's dispatch sized by it (moe.rows_bound)
  "capacity": [((1, 1, 8, 1), 4), ((2, 2, 2, 1), 1)],
}
SETTINGS = {
  "global": {"lbl_scope": "global"},
  "micro_batch": {"lbl_scope": "micro_batch"},
  "capacity": {"lbl_scope": "global", "capacity_factor": 1.0},
}


def main():
  for scope in sys.argv[1:] or tuple(CASES):
    cfg = LlamaConfig(**BASE, **SETTINGS[scope])
    ref_params, ref_metrics, _ = run(cfg, None, 1)
    for (data, fsdp, expert, tensor), k in CASES[scope]:
      mesh = parallel.make_mesh(data, fsdp, tensor=tensor, expert=expert)
      params, metrics, spec = run(cfg, mesh, k)
      errors = {
        key: max(rel(m[key], r[key]) for m, r in zip(metrics, ref_metrics, strict=True))
        for key in ("loss", "moe/lbl", "grad_norm")
      }
      leaves = zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True)
      errors["params"] = max(rel(a, b) for a, b in leaves)
      mesh = [data, fsdp, expert, tensor]
      row = {"scope": scope, "mesh": mesh, "k": k, "experts_spec": spec, **errors}
      print(json.dumps(row))
      sys.stdout.flush()


if __name__ == "__main__":
  main()
