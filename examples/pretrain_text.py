"""Pretrain the bundled GPT on your own text file with the Python API.

The state is threaded functionally: ``state, metrics = step(state, batch)``; nothing is
hidden in objects. Run: ``python examples/pretrain_text.py [FILE.txt|.jsonl] [STEPS]``.
"""

import sys

import jax

from jaxstep import (
  OptimConfig,
  data,
  make_optimizer,
  make_train_step,
  models,
  next_token_loss,
)

GLOBAL_BATCH_SIZE, GRAD_ACCUM_STEPS, SEQ_LEN = 16, 4, 64


def main(path: str = "bundled:text", num_update_steps: int = 60) -> list[float]:
  dataset = data.load_dataset(data.DataConfig(path=path), SEQ_LEN)
  model_cfg = models.GPTConfig(max_seq_len=SEQ_LEN, vocab_size=dataset.vocab_size)
  apply_fn, params = models.build(model_cfg, rng=0)
  optimizer = make_optimizer(OptimConfig(lr=3e-3, warmup_steps=10), num_update_steps)
  train_step = make_train_step(
    next_token_loss(apply_fn), optimizer, grad_accum_steps=GRAD_ACCUM_STEPS
  )
  state = train_step.init(params, rng=0)
  step = jax.jit(train_step, donate_argnums=0)
  spe = data.steps_per_epoch(len(dataset.train), GLOBAL_BATCH_SIZE)
  losses = []
  for update_step in range(num_update_steps):
    epoch, step_in_epoch = divmod(update_step, spe)
    batch = data.global_batch(
      dataset.train, 0, epoch, step_in_epoch, GLOBAL_BATCH_SIZE, dataset.pad_id
    )
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
    if (update_step + 1) % 10 == 0:
      print(
        f"update {update_step + 1}: loss {losses[-1]:.3f} over {int(metrics['tokens'])} "
        f"tokens, lr {float(metrics['lr']):.2e}"
      )
  return losses


if __name__ == "__main__":
  main(*(sys.argv[1:2] or ["bundled:text"]), *map(int, sys.argv[2:3]))
