"""Local data → fixed-shape samples with loss masks → global batches (DESIGN §6)."""

from jaxstep.data.dataset import (
  Dataset,
  Split,
  epoch_order,
  eval_batches,
  global_batch,
  load_dataset,
  steps_per_epoch,
)
from jaxstep.data.tokenizer import ByteTokenizer

__all__ = [
  "ByteTokenizer",
  "Dataset",
  "Split",
  "epoch_order",
  "eval_batches",
  "global_batch",
  "load_dataset",
  "steps_per_epoch",
]
