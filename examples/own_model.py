"""Your own NNX model — dropout and BatchNorm included — trained with K=4 micro-steps on
4 (virtual) devices, checkpointed, and resumed bitwise.

The data is a small image set made on the spot (no downloads): 8×8 pictures of a
horizontal bar, a vertical bar, a diagonal or an anti-diagonal, with noise. Run:
``python examples/own_model.py [STEPS]``; on a CPU-only host it splits the CPU into 4
virtual devices first.
"""

import os
import sys
import tempfile

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
  )

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxstep  # noqa: E402
from jaxstep import models, parallel  # noqa: E402

GLOBAL_BATCH_SIZE, GRAD_ACCUM_STEPS = 64, 4  # 4 micro-batches of 16 = 4 per device


class SmallCNN(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.conv = nnx.Conv(1, 8, kernel_size=(3, 3), rngs=rngs)
    self.bn = nnx.BatchNorm(8, use_running_average=False, rngs=rngs)
    self.drop = nnx.Dropout(0.2, rngs=rngs)
    self.head = nnx.Linear(8 * 8 * 8, 4, rngs=rngs)

  def __call__(self, images):  # [B, 8, 8, 1] -> [B, 4]
    x = self.drop(nnx.relu(self.bn(self.conv(images))))
    return self.head(x.reshape(x.shape[0], -1))


def pictures(step: int) -> dict[str, np.ndarray]:
  """Global batch number ``step``: a pure function of it, so a resumed run sees the same."""
  rng = np.random.default_rng(step)
  labels = rng.integers(0, 4, GLOBAL_BATCH_SIZE)
  images = rng.normal(0, 0.5, (GLOBAL_BATCH_SIZE, 8, 8, 1)).astype(np.float32)
  row, col = rng.integers(0, 8, GLOBAL_BATCH_SIZE), np.arange(8)
  for i, label in enumerate(labels):
    if label == 0:
      images[i, row[i], :, 0] += 2
    elif label == 1:
      images[i, :, row[i], 0] += 2
    elif label == 2:
      images[i, col, col, 0] += 2
    else:
      images[i, col, 7 - col, 0] += 2
  return {"images": images, "labels": labels.astype(np.int32), "loss_mask": np.ones(64)}


def main(num_update_steps: int = 40) -> dict:
  model = models.from_nnx(SmallCNN(nnx.Rngs(0)))

  def loss_fn(params, batch, rng, model_state):
    logits, model_state = model.apply_fn(
      params, batch["images"], rng=rng, train=True, model_state=model_state
    )
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
    hits = jnp.argmax(logits, -1) == batch["labels"]
    return jnp.sum(nll * batch["loss_mask"]), {"correct": jnp.sum(hits)}, model_state

  mesh = parallel.make_mesh(data=4)
  train_step = jaxstep.make_train_step(
    loss_fn, optax.adamw(3e-3), grad_accum_steps=GRAD_ACCUM_STEPS, mesh=mesh
  )
  step = jax.jit(train_step, donate_argnums=0)

  def fresh_state():
    return train_step.init(model.params, rng=0, model_state=model.model_state)

  def train(state, first, last):
    for s in range(first, last):
      batch = parallel.put_batch(pictures(s), parallel.batch_sharding(mesh))
      state, metrics = step(state, batch)
      if (s + 1) % 10 == 0:
        accuracy = float(metrics["correct"]) / float(metrics["tokens"])
        print(f"update {s + 1}: loss {float(metrics['loss']):.3f}, accuracy {accuracy:.2f}")
    return state, metrics

  straight, metrics = train(fresh_state(), 0, num_update_steps)

  half = num_update_steps // 2
  first_half, _ = train(fresh_state(), 0, half)
  with tempfile.TemporaryDirectory(prefix="own-model-") as ckpt_dir:
    with jaxstep.Checkpointer(ckpt_dir) as ckpt:
      ckpt.save(half, first_half, {"next_batch": half})
    with jaxstep.Checkpointer(ckpt_dir) as ckpt:
      restored, metadata, _ = ckpt.restore(fresh_state())
  resumed, _ = train(restored, metadata["next_batch"], num_update_steps)

  pairs = zip(jax.tree.leaves(resumed), jax.tree.leaves(straight), strict=True)
  same = all(bool(jnp.all(a == b)) for a, b in pairs)
  print(f"{jax.device_count()} devices; resumed at update {half}: bitwise identical = {same}")
  return {
    "accuracy": float(metrics["correct"]) / float(metrics["tokens"]),
    "bitwise_identical": same,
    "devices": jax.device_count(),
  }


if __name__ == "__main__":
  main(*(int(a) for a in sys.argv[1:]))
