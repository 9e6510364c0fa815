"""Local data → fixed-shape samples with loss masks → global batches.

``readers`` (files → documents), ``tokenizer``, ``samples`` (documents → tokens with target
flags), ``prepare`` (→ shards + manifest), ``shards`` (memory-mapped windows with loss
masks), ``dataset`` (splits, epoch order, global batches), ``loader`` (global batches read
ahead by Grain) and ``corpus`` (regenerates the bundled corpus in ``corpus/``).
"""

from jaxstep.data.dataset import (
  DataConfig,
  Dataset,
  epoch_order,
  eval_batches,
  global_batch,
  load_dataset,
  prepared_tokenizer,
  steps_per_epoch,
)
from jaxstep.data.loader import BatchLoader
from jaxstep.data.prepare import prepare, read_manifest
from jaxstep.data.shards import Windows
from jaxstep.data.tokenizer import ByteTokenizer, load_tokenizer, train_bpe

__all__ = [
  "BatchLoader",
  "ByteTokenizer",
  "DataConfig",
  "Dataset",
  "epoch_order",
  "eval_batches",
  "global_batch",
  "load_dataset",
  "load_tokenizer",
  "prepare",
  "prepared_tokenizer",
  "read_manifest",
  "steps_per_epoch",
  "train_bpe",
  "Windows",
]
