"""Supervised fine-tuning on chat data: the loss counts assistant tokens only.

Prints one conversation with the counted targets in [brackets], the share of tokens that
count, then trains a few steps. Run: ``python examples/sft_chat.py``.
"""

import jax
import numpy as np

from jaxstep import (
  OptimConfig,
  data,
  make_optimizer,
  make_train_step,
  models,
  next_token_loss,
)

SEQ_LEN = 96


def show_sample(dataset) -> str:
  """The first training sample with every loss-counted target in brackets."""
  tok = data.ByteTokenizer()
  first = dataset.train.rows([0], 1, dataset.pad_id)
  targets, mask = first["targets"][0], first["loss_mask"][0]
  pieces = []
  for t, m in zip(targets, mask, strict=True):
    text = "<eos>" if t == tok.EOS else tok.decode([t])
    pieces.append(f"[{text}]" if m else text)
  return "".join(pieces)


def main(num_update_steps: int = 40) -> tuple[float, float]:
  dataset = data.load_dataset(data.DataConfig(path="bundled:chat", pack=False), SEQ_LEN)
  model_cfg = models.GPTConfig(max_seq_len=SEQ_LEN, vocab_size=dataset.vocab_size)
  print(show_sample(dataset))
  every = dataset.train.rows(range(len(dataset.train)), len(dataset.train), dataset.pad_id)
  real = every["targets"] != dataset.pad_id
  share = every["loss_mask"].sum() / real.sum()
  print(f"{share:.1%} of real tokens are assistant targets; only those enter the loss")
  apply_fn, params = models.build(model_cfg, rng=0)
  optimizer = make_optimizer(OptimConfig(lr=3e-3, warmup_steps=5), num_update_steps)
  train_step = make_train_step(next_token_loss(apply_fn), optimizer, grad_accum_steps=4)
  state = train_step.init(params, rng=0)
  step = jax.jit(train_step, donate_argnums=0)
  spe = data.steps_per_epoch(len(dataset.train), 32)
  losses = []
  for s in range(num_update_steps):
    batch = data.global_batch(dataset.train, 0, s // spe, s % spe, 32, dataset.pad_id)
    state, metrics = step(state, batch)
    assert int(metrics["tokens"]) == int(np.sum(batch["loss_mask"]))
    losses.append(float(metrics["loss"]))
  print(f"assistant-token loss: {losses[0]:.3f} -> {losses[-1]:.3f}")
  return losses[0], losses[-1]


if __name__ == "__main__":
  main()
