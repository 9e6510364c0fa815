"""Same global batch, same seed: 1 device vs meshes of 8 virtual CPU devices.

Run with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``. Prints one JSON line per
(mesh, K) with the worst relative parameter error after 3 updates, the shardings seen, and
the collectives found inside the scan's while body of the compiled step.
"""

import json
import pathlib
import re
import sys

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jaxstep import TrainState, make_train_step, models, parallel
from jaxstep.core.losses import next_token_loss
from jaxstep.core.optim import OptimConfig, make_optimizer
from jaxstep.models import gpt

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks.scaling import COMPUTATION, loop_computations  # noqa: E402

CFG = models.GPTConfig(vocab_size=32, max_seq_len=8, d_model=32, n_layers=1, n_heads=2)
G, S = 32, 8
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


def batches():
  rng = np.random.default_rng(0)
  out = []
  for _ in range(3):
    tokens = rng.integers(0, 32, size=(G, S + 1), dtype=np.int32)
    mask = (rng.random((G, S)) < rng.choice([0.1, 0.9], size=(G, 1))).astype(np.int32)
    mask[: G // 8] = 0  # device 0's shard of a (8, 1) mesh holds no tokens at all
    out.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": mask})
  return out


def loop_collectives(hlo: str) -> dict:
  """How many of each collective the computations reachable from a while loop hold."""
  comps = dict(COMPUTATION.findall(hlo))
  text = "\n".join(comps[n] for n in loop_computations(hlo))
  return {c: len(re.findall(rf"\b{c}(?:-start)?\(", text)) for c in COLLECTIVES}


def make_opt(name):
  if name == "sgd":  # update linear in the gradient: every leaf must match
    return optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1, momentum=0.9))
  return make_optimizer(OptimConfig(lr=1e-2, warmup_steps=0), 10)


def run(mesh, k, opt_name="adamw", layout_mesh=None):
  """3 updates; ``layout_mesh`` without ``mesh`` = plain jit over a sharded layout."""
  apply_fn, params = models.build(CFG, 0)
  opt = make_opt(opt_name)
  step = make_train_step(next_token_loss(apply_fn), opt, grad_accum_steps=k, mesh=mesh)
  mesh = mesh or layout_mesh
  state = TrainState.create(params=params, optimizer=opt, rng=0)
  if mesh is None:
    step = jax.jit(step, donate_argnums=0)
    state = jax.device_put(state, jax.devices()[0])
    put = lambda b: jax.device_put(b, jax.devices()[0])  # noqa: E731
  else:
    state_sh = parallel.tree_shardings(state, mesh)
    step = jax.jit(
      step,
      in_shardings=(state_sh, parallel.batch_sharding(mesh)),
      out_shardings=(state_sh, NamedSharding(mesh, PartitionSpec())),
      donate_argnums=0,
    )
    state = jax.device_put(state, state_sh)
    put = lambda b: parallel.put_batch(b, parallel.batch_sharding(mesh))  # noqa: E731
  hlo = step.lower(state, put(batches()[0])).compile().as_text()
  for b in batches():
    state, metrics = step(state, put(b))
  return state, metrics, hlo


def adamw_leaf_errors(params, ref):
  """Per-leaf error, leaving out the key third of the qkv bias: its exact gradient is zero
  (softmax ignores a per-row shift of the scores), so its float gradient is pure rounding
  noise, and Adam scales noise up to full ±lr steps in a different direction per layout."""
  d = CFG.d_model

  def keep(path, x):
    if "qkv" in jax.tree_util.keystr(path) and np.ndim(x) == 1:  # head-major: to [q | k | v]
      return np.delete(gpt.qkv_major(np.asarray(x), CFG.n_heads), np.s_[d : 2 * d])
    return x

  a = jax.tree_util.tree_map_with_path(keep, params)
  b = jax.tree_util.tree_map_with_path(keep, ref)
  return max(rel(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def all_reduce_operands(hlo: str) -> list[int]:
  """Operand count of every all-reduce in the program (a tuple all-reduce has several)."""
  calls = (re.search(r" all-reduce(?:-start)?\(([^)]*)\)", line) for line in hlo.splitlines())
  return [len(re.findall(r"%[\w.\-]+", c.group(1))) for c in calls if c]


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main():
  for k in (1, 4):
    ref, ref_metrics, _ = run(None, k)
    sgd_ref, _, _ = run(None, k, "sgd")
    for shape in ((8, 1), (1, 8), (2, 4)):
      mesh = parallel.make_mesh(*shape)
      state, metrics, hlo = run(mesh, k)
      sgd_state, _, _ = run(mesh, k, "sgd")
      sgd_errs = [
        rel(a, b)
        for a, b in zip(
          jax.tree.leaves(sgd_state.params), jax.tree.leaves(sgd_ref.params), strict=True
        )
      ]
      qkv = state.params["blocks"][0]["qkv"]["kernel"]
      mu = state.opt_state[1].inner_state[0].mu["blocks"][0]["qkv"]["kernel"]
      print(
        json.dumps(
          {
            "mesh": shape,
            "k": k,
            "sgd_max_leaf_rel_err": max(sgd_errs),
            "adamw_max_leaf_rel_err": adamw_leaf_errors(state.params, ref.params),
            "loss_rel_err": rel(metrics["loss"], ref_metrics["loss"]),
            "tokens": int(metrics["tokens"]),
            "ref_tokens": int(ref_metrics["tokens"]),
            "qkv_spec": list(qkv.sharding.spec),
            "mu_spec": list(mu.sharding.spec),
            "qkv_shard_shape": list(qkv.addressable_shards[0].data.shape),
            "bias_spec": list(state.params["ln_f"]["bias"].sharding.spec),
            "step_spec": list(state.step.sharding.spec),
            "loop_collectives": loop_collectives(hlo),
            "all_reduce_operands": all_reduce_operands(hlo),
          }
        ),
        flush=True,
      )


def plain_jit_contrast():
  """What XLA does without shard_map: collectives inside the micro-step loop."""
  for shape in ((8, 1), (1, 8)):
    _, _, hlo = run(None, 4, layout_mesh=parallel.make_mesh(*shape))
    print(json.dumps({"plain_jit_mesh": shape, "loop_collectives": loop_collectives(hlo)}))


if __name__ == "__main__":
  plain_jit_contrast()
  main()
