"""The seed lab: fit y = 3x + 2 with SGD + momentum through jaxstep's accumulation step.

A custom ``loss_fn`` returns the *sum* of squared errors over a micro-batch; the step divides
by the number of samples in the whole global batch (units = samples, via ``units_fn``).
Run: ``python examples/linear_regression.py``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxstep import TrainState, make_train_step

GLOBAL_BATCH_SIZE = 32  # samples per update step
GRAD_ACCUM_STEPS = 4  # micro-batches of 8 samples each


def loss_fn(params, batch, rng):
  del rng
  pred = params["w"] * batch["x"] + params["b"]
  return jnp.sum(0.5 * (pred - batch["y"]) ** 2), {}


def units_fn(batch):
  return jnp.asarray(batch["x"].shape[0], jnp.int32)  # every sample counts once


def main(num_update_steps: int = 100) -> TrainState:
  optimizer = optax.sgd(0.1, momentum=0.9)
  train_step = make_train_step(
    loss_fn, optimizer, grad_accum_steps=GRAD_ACCUM_STEPS, units_fn=units_fn
  )
  state = train_step.init({"w": jnp.float32(0.0), "b": jnp.float32(0.0)}, rng=0)
  step = jax.jit(train_step, donate_argnums=0)
  rng = np.random.default_rng(0)
  for _ in range(num_update_steps):
    x = rng.uniform(-1, 1, GLOBAL_BATCH_SIZE).astype(np.float32)
    batch = {"x": x, "y": 3 * x + 2 + rng.normal(0, 0.01, x.shape).astype(np.float32)}
    state, metrics = step(state, batch)
    print(
      f"step {int(state.step):3d}  w {float(state.params['w']):.4f}  "
      f"b {float(state.params['b']):.4f}  loss {float(metrics['loss']):.6f}"
    )
  return state


if __name__ == "__main__":
  main()
