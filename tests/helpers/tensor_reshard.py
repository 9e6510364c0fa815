"""Saves a grouped-query Llama's train state laid out on one mesh, or restores it onto
another and checks it bitwise: ``python tensor_reshard.py save|restore DIR DATA FSDP
TENSOR`` (run with enough virtual CPU devices for the mesh)."""

import sys

import jax
import numpy as np
import optax

from jaxstep import make_train_step, models, parallel
from jaxstep.core.losses import next_token_loss
from jaxstep.trainer.store.checkpoint import Checkpointer

CFG = models.LlamaConfig(
  vocab_size=32, max_seq_len=8, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2
)


def state_on(data: int, fsdp: int, tensor: int):
  """The same state (init from seed 0, the moments moved off zero) on a mesh of that shape."""
  devices = jax.devices()[: data * fsdp * tensor]
  mesh = parallel.make_mesh(data, fsdp, devices, tensor=tensor) if len(devices) > 1 else None
  apply_fn, params = models.build(CFG, 0)
  step = make_train_step(
    next_token_loss(apply_fn), optax.adamw(1e-3), grad_accum_steps=1, mesh=mesh
  )
  state = step.init(params, 0)
  return state.replace(opt_state=jax.tree.map(lambda x: x + 1, state.opt_state))


def main(mode, directory, *shape):
  state = state_on(*map(int, shape))
  with Checkpointer(directory) as ckpt:
    if mode == "save":
      ckpt.save(1, state, {})
      return
    restored = ckpt.restore(state).state
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert got.sharding.is_equivalent_to(want.sharding, got.ndim), (got.sharding, want.sharding)
  q = restored.params["blocks"][0]["q_proj"]["kernel"]
  print("restored", list(q.sharding.spec) if hasattr(q.sharding, "spec") else [])


if __name__ == "__main__":
  main(*sys.argv[1:])
