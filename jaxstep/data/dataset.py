"""Train/eval splits, epoch order, global batches and the dataset fingerprint.

Units: a *sample* is one window of ``seq_len`` targets; a *global batch* is G samples (one
update step). ``steps_per_epoch = ceil(num_samples / G)``; the last batch of an epoch is
padded to G with loss_mask-0 rows (static shapes, no recompile) and still makes an update.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np

from jaxstep.data.readers import read_documents
from jaxstep.data.samples import make_samples
from jaxstep.data.tokenizer import load_tokenizer
from jaxstep.errors import ConfigError, DataError

SPLIT_SEED = 1234  # fixed: the held-out documents do not move when train.seed changes


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Where the text comes from and how it becomes samples."""

  path: str = "bundled:text"  # file, directory or glob; bundled:text | bundled:chat
  format: str = "auto"  # auto | txt | jsonl | chat (auto: by extension and first record)
  tokenizer: str = "byte"  # byte (UTF-8 + PAD/BOS/EOS), a tokenizer.json or a .model file
  pack: bool = True  # concatenate documents into one stream before cutting windows
  eval_fraction: float = 0.05  # fraction of documents held out for eval (0 = no eval set)

  def __post_init__(self):
    if self.format not in ("auto", "txt", "jsonl", "chat"):
      raise ConfigError(f"data.format must be auto, txt, jsonl or chat, got {self.format!r}")
    if self.tokenizer != "byte" and not self.tokenizer.endswith((".json", ".model")):
      raise ConfigError(
        f"data.tokenizer must be 'byte', a tokenizer.json or a SentencePiece .model file, "
        f"got {self.tokenizer!r}"
      )
    if not 0.0 <= self.eval_fraction < 1.0:
      raise ConfigError(f"data.eval_fraction must be in [0, 1), got {self.eval_fraction}")


@dataclasses.dataclass(frozen=True)
class Split:
  """Samples as int32 arrays ``[num_samples, seq_len]``."""

  inputs: np.ndarray
  targets: np.ndarray
  loss_mask: np.ndarray

  def __len__(self) -> int:
    return len(self.inputs)

  def rows(self, index: np.ndarray, global_batch_size: int, pad_id: int) -> dict:
    """The samples at ``index`` padded to G rows with PAD tokens and loss_mask 0."""
    pad = global_batch_size - len(index)
    out = {}
    for name in ("inputs", "targets", "loss_mask"):
      part = getattr(self, name)[index]
      fill = 0 if name == "loss_mask" else pad_id
      out[name] = np.concatenate([part, np.full((pad, part.shape[1]), fill, np.int32)])
    return out


@dataclasses.dataclass(frozen=True)
class Dataset:
  train: Split
  eval: Split | None
  kind: str  # "text" or "chat"
  fingerprint: str  # sha256 of the tokenized samples + data config
  pad_id: int


def steps_per_epoch(num_samples: int, global_batch_size: int) -> int:
  """``ceil(num_samples / G)`` update steps per pass over the data."""
  return -(-num_samples // global_batch_size)


def epoch_order(seed: int, epoch: int, num_samples: int) -> np.ndarray:
  """The permutation of sample indices for ``epoch``, a pure function of (seed, epoch)."""
  return np.random.default_rng([seed, epoch]).permutation(num_samples)


def global_batch(
  split: Split, seed: int, epoch: int, step_in_epoch: int, global_batch_size: int, pad_id: int
) -> dict[str, np.ndarray]:
  """Global batch number ``step_in_epoch`` of ``epoch``: G rows, ``int32[G, seq_len]``."""
  order = epoch_order(seed, epoch, len(split))
  start = step_in_epoch * global_batch_size
  return split.rows(order[start : start + global_batch_size], global_batch_size, pad_id)


def eval_batches(split: Split, global_batch_size: int, pad_id: int, limit: int = 0):
  """The eval split in file order, G rows at a time (last padded); ``limit`` 0 = all."""
  n = steps_per_epoch(len(split), global_batch_size)
  for b in range(min(n, limit) if limit else n):
    index = np.arange(b * global_batch_size, min((b + 1) * global_batch_size, len(split)))
    yield split.rows(index, global_batch_size, pad_id)


def _fingerprint(samples: dict, data_config: dict, seq_len: int) -> str:
  """sha256 of the samples and the data config; the path is left out (content decides)."""
  settings = {k: v for k, v in data_config.items() if k != "path"}
  h = hashlib.sha256(json.dumps({**settings, "seq_len": seq_len}, sort_keys=True).encode())
  for name in ("inputs", "targets", "loss_mask"):
    h.update(np.ascontiguousarray(samples[name]).tobytes())
  return h.hexdigest()[:16]


def load_dataset(data_cfg: DataConfig, seq_len: int, vocab_size: int) -> Dataset:
  """Reads, tokenizes and cuts the data of ``data_cfg``.

  Documents (not windows) are split into train/eval so no text leaks between them.

  Raises:
    DataError: missing/empty/malformed data, a token id ≥ ``vocab_size``, or no sample
      with a loss-masked token.
  """
  tok = load_tokenizer(data_cfg.tokenizer)
  docs, kind = read_documents(data_cfg.path, data_cfg.format)
  n_eval = round(len(docs) * data_cfg.eval_fraction)
  if data_cfg.eval_fraction > 0 and len(docs) > 1:
    n_eval = min(max(n_eval, 1), len(docs) - 1)
  else:
    n_eval = 0
  order = np.random.default_rng(SPLIT_SEED).permutation(len(docs))
  eval_docs = [docs[i] for i in sorted(order[:n_eval])]
  train_docs = [docs[i] for i in sorted(order[n_eval:])]
  train = make_samples(train_docs, kind, seq_len, tok, data_cfg.pack)
  if len(train["inputs"]) == 0 or train["loss_mask"].sum() == 0:
    raise DataError(
      f"data.path {data_cfg.path!r} yields no trainable tokens (no sample has a loss-masked target)"
    )
  top = int(max(train["inputs"].max(), train["targets"].max()))
  if top >= vocab_size:
    raise DataError(
      f"token id {top} is outside the model vocabulary (model.vocab_size "
      f"{vocab_size}); set model.vocab_size >= {tok.vocab_size}"
    )
  evals = make_samples(eval_docs, kind, seq_len, tok, data_cfg.pack) if eval_docs else None
  fp = _fingerprint(train, dataclasses.asdict(data_cfg), seq_len)
  return Dataset(
    train=Split(**train),
    eval=Split(**evals) if evals else None,
    kind=kind,
    fingerprint=fp,
    pad_id=tok.PAD,
  )
