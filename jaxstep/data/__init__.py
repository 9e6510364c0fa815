"""Local data → fixed-shape samples with loss masks → global batches.

``readers`` (files → documents), ``tokenizer``, ``samples`` (documents → windows with loss
masks), ``dataset`` (splits, epoch order, global batches) and ``corpus`` (regenerates the
bundled corpus in ``corpus/``).
"""

from jaxstep.data.dataset import (
  DataConfig,
  Dataset,
  Split,
  epoch_order,
  eval_batches,
  global_batch,
  load_dataset,
  steps_per_epoch,
)
from jaxstep.data.tokenizer import ByteTokenizer, load_tokenizer, train_bpe

__all__ = [
  "ByteTokenizer",
  "DataConfig",
  "Dataset",
  "Split",
  "epoch_order",
  "eval_batches",
  "global_batch",
  "load_dataset",
  "load_tokenizer",
  "steps_per_epoch",
  "train_bpe",
]
