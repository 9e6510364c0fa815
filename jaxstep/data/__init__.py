"""Local data → fixed-shape samples with loss masks → global batches.

``readers`` (files → documents), ``tokenizer`` (the tokenizer classes), ``hf_folder`` (a
model folder's tokenizer), ``tokenizer_loading`` (``load_tokenizer``: a tokenizer from a
spec or a folder), ``byte_folder`` (the byte tokenizer as a Hugging Face one, for an
export), ``samples`` (documents → tokens with target flags), ``preparation`` (``prepare``: →
shards), ``manifest`` (what a prepared folder records, read back checked), ``out_folder``
(which ``--out`` may be replaced), ``shards`` (memory-mapped windows with loss masks),
``data_config`` (``DataConfig``), ``single_corpus`` (one corpus → a ``Dataset``),
``mixture`` (several corpora mixed by weight), ``dataset`` (``load_dataset``, which picks
one of those two; epoch order, global batches), ``preference_pairs`` (a JSONL file of
preference pairs → arrays), ``pair_dataset`` (a preference run's train and held-out pairs),
``loader`` (global batches read ahead by Grain) and ``corpus`` (regenerates the bundled
corpus in ``corpus/``).

``BatchLoader`` is imported on first use, so that importing this package does not import
Grain.
"""

import importlib

from jaxstep.data.data_config import DataConfig
from jaxstep.data.dataset import (
  epoch_order,
  eval_batches,
  global_batch,
  load_dataset,
  split_steps_per_epoch,
  steps_per_epoch,
)
from jaxstep.data.manifest import read_manifest
from jaxstep.data.pair_dataset import PairDataset, load_pair_dataset
from jaxstep.data.preparation import prepare
from jaxstep.data.prompt_rows import PromptDataset, load_prompt_dataset
from jaxstep.data.shards import Windows
from jaxstep.data.single_corpus import Dataset
from jaxstep.data.tokenizer import ByteTokenizer, train_bpe
from jaxstep.data.tokenizer_loading import load_tokenizer, prepared_tokenizer

__all__ = [
  "BatchLoader",
  "ByteTokenizer",
  "DataConfig",
  "Dataset",
  "epoch_order",
  "eval_batches",
  "global_batch",
  "load_dataset",
  "load_pair_dataset",
  "load_prompt_dataset",
  "PromptDataset",
  "PairDataset",
  "load_tokenizer",
  "prepare",
  "prepared_tokenizer",
  "read_manifest",
  "split_steps_per_epoch",
  "steps_per_epoch",
  "train_bpe",
  "Windows",
]

_LAZY = {"BatchLoader": "jaxstep.data.loader"}  # name -> its module, imported on first use


def __getattr__(name: str):
  if name not in _LAZY:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  value = getattr(importlib.import_module(_LAZY[name]), name)
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return sorted({*globals(), *_LAZY})
