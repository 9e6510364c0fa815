"""Your own NNX model — a small CNN with dropout and BatchNorm — trained by ``jaxstep.Trainer``:
the run driver of ``jaxstep train`` (checkpoints, resume after any kill, eval sets, metrics,
TensorBoard, trackers, hooks) for a model jaxstep did not ship.

The data is a Grain dataset of 8×8 pictures made on the spot (no downloads): a horizontal
bar, a vertical bar, a diagonal or an anti-diagonal, with noise. Run it, stop it any way you
like (Ctrl-C, kill -9), and run the same command again: it continues where its last
checkpoint was, data position included.

  python examples/trainer_own_model.py RUN_DIR [--steps N] [--trackers jsonl,tensorboard,mlflow]
"""

import argparse
import logging
import pathlib

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxstep
from jaxstep import models

GLOBAL_BATCH_SIZE, GRAD_ACCUM_STEPS = 32, 4


class SmallCNN(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.conv = nnx.Conv(1, 8, kernel_size=(3, 3), rngs=rngs)
    self.bn = nnx.BatchNorm(8, use_running_average=False, rngs=rngs)
    self.drop = nnx.Dropout(0.2, rngs=rngs)
    self.head = nnx.Linear(8 * 8 * 8, 4, rngs=rngs)

  def __call__(self, images):  # [B, 8, 8, 1] -> [B, 4]
    x = self.drop(nnx.relu(self.bn(self.conv(images))))
    return self.head(x.reshape(x.shape[0], -1))


def picture(index: int) -> dict[str, np.ndarray]:
  """Sample ``index``: a pure function of it, so every epoch and every resume sees the same."""
  rng = np.random.default_rng(index)
  label = int(rng.integers(0, 4))
  image = rng.normal(0, 0.5, (8, 8, 1)).astype(np.float32)
  row, col = int(rng.integers(0, 8)), np.arange(8)
  if label == 0:
    image[row, :, 0] += 2
  elif label == 1:
    image[:, row, 0] += 2
  elif label == 2:
    image[col, col, 0] += 2
  else:
    image[col, 7 - col, 0] += 2
  return {"images": image, "labels": np.int32(label), "loss_mask": np.float32(1.0)}


def pictures(first: int, count: int, seed: int | None = None) -> grain.MapDataset:
  """Samples ``first … first + count - 1`` as global batches; shuffled each epoch when
  ``seed`` is given (training), in order otherwise (evaluation)."""
  ds = grain.MapDataset.range(first, first + count)
  if seed is not None:
    ds = ds.shuffle(seed=seed)
  return ds.map(picture).batch(GLOBAL_BATCH_SIZE, drop_remainder=True)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("run_dir")
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--trackers", default="jsonl,tensorboard")
  args = p.parse_args(argv)
  logging.basicConfig(
    level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S", force=True
  )

  model = models.from_nnx(SmallCNN(nnx.Rngs(0)))

  def loss_fn(params, batch, rng, model_state, train=True):
    logits, model_state = model.apply_fn(
      params, batch["images"], rng=rng, train=train, model_state=model_state
    )
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
    mask = batch["loss_mask"]
    correct = jnp.sum((jnp.argmax(logits, -1) == batch["labels"]) * mask)
    return jnp.sum(nll * mask), {"correct": correct}, model_state

  def eval_loss_fn(params, batch, model_state):  # dropout off, BatchNorm's running stats
    return loss_fn(params, batch, None, model_state, train=False)[:2]

  trainer = jaxstep.Trainer(
    loss_fn,
    model.params,
    jaxstep.OptimConfig(lr=3e-3, warmup_steps=10, weight_decay=0.0),
    model_state=model.model_state,
    train_data=pictures(0, 2048, seed=0).repeat(),  # endless: the run stops at max_steps
    eval_sets={"heldout": pictures(10_000, 256), "hard": pictures(20_000, 128)},
    eval_loss_fn=eval_loss_fn,
    run_dir=args.run_dir,
    train={
      "global_batch_size": GLOBAL_BATCH_SIZE,
      "grad_accum_steps": GRAD_ACCUM_STEPS,
      "max_steps": args.steps,
      "log_every": 1,
      "eval_every": 20,
      "trackers": args.trackers.split(","),
      "progress": False,
    },
    checkpoint={"every": 10, "keep": 2},
  )

  def accuracy(loop):  # a hook of your own: every 20 update steps, after that evaluation
    record = loop.evals.get("heldout")
    if record and record["step"] == loop.step:
      acc = record["eval_correct"] / record["eval_tokens"]
      print(f"step {loop.step}: heldout accuracy {acc:.3f}", flush=True)
      if acc > 0.999:
        loop.stop(f"heldout accuracy {acc:.3f} at update step {loop.step}")

  trainer.add_hook(accuracy, every=20)
  result = trainer.fit()
  flat = {"/".join(map(str, k)): np.asarray(v) for k, v in _leaves(result.state.params)}
  np.savez(pathlib.Path(args.run_dir) / "final_params.npz", **flat)
  print(f"done: {result.stop_reason}", flush=True)
  return result


def _leaves(tree):
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    yield [getattr(k, "key", getattr(k, "idx", k)) for k in path], leaf


if __name__ == "__main__":
  main()
