"""A non-text loss with its own units: importance-weighted regression.

Each sample carries a weight; the objective is ``Σ wᵢ·(f(xᵢ) − yᵢ)² / Σ wᵢ`` over the
global batch. ``units_fn`` returns Σ w, so the step normalizes by the global weight — and K
micro-batches give the same update as one big batch even though the weights are uneven.
Run: ``python examples/custom_loss.py``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxstep import make_train_step


def loss_fn(params, batch, rng):
  del rng
  hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])  # [G/K, 16]
  pred = hidden @ params["w2"]  # [G/K]
  return jnp.sum(batch["weight"] * (pred - batch["y"]) ** 2), {}


def units_fn(batch):
  return jnp.sum(batch["weight"])  # the normalization unit is "weight", not tokens


def make_batch(rng, g=64):
  x = rng.normal(size=(g, 3)).astype(np.float32)
  y = np.sin(x.sum(-1)).astype(np.float32)
  weight = rng.choice([0.0, 0.5, 4.0], size=g).astype(np.float32)  # very uneven
  return {"x": x, "y": y, "weight": weight}


def main(num_update_steps: int = 200):
  rng = np.random.default_rng(0)
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  params = {
    "w1": jax.random.normal(k1, (3, 16)) * 0.5,
    "b1": jnp.zeros(16),
    "w2": jax.random.normal(k2, (16,)) * 0.1,
  }
  optimizer = optax.adam(1e-2)
  train_steps = {
    k: make_train_step(loss_fn, optimizer, grad_accum_steps=k, units_fn=units_fn) for k in (1, 8)
  }
  states = {k: train_step.init(params, rng=0) for k, train_step in train_steps.items()}
  steps = {k: jax.jit(train_step) for k, train_step in train_steps.items()}
  for s in range(num_update_steps):
    batch = make_batch(rng)
    for k in steps:
      states[k], metrics = steps[k](states[k], batch)
    if (s + 1) % 50 == 0:
      print(f"update {s + 1}: weighted mse {float(metrics['loss']):.4f}")
  gap = max(
    float(jnp.max(jnp.abs(a - b)))
    for a, b in zip(
      jax.tree.leaves(states[1].params), jax.tree.leaves(states[8].params), strict=True
    )
  )
  print(f"max |params(K=1) - params(K=8)| after {num_update_steps} updates: {gap:.2e}")
  return float(metrics["loss"]), gap


if __name__ == "__main__":
  main()
