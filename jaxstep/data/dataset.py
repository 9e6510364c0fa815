"""Train/eval splits, epoch order, global batches and the dataset fingerprint.

Units: a *sample* is one window of ``seq_len`` targets; a *global batch* is G samples (one
update step). ``steps_per_epoch = ceil(num_samples / G)``; the last batch of an epoch is
padded to G with loss_mask-0 rows (static shapes, no recompile) and still makes an update.

There is one way samples are produced: from a prepared folder (``preparation.py``) through
memory-mapped windows (``shards.py``). A raw ``data.path`` (files, a directory, a glob,
``bundled:…``) is prepared on first use into a cache folder (``$JAXSTEP_CACHE``, default
``~/.cache/jaxstep``) keyed by the inputs and settings, and read from there.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pathlib

import numpy as np

from jaxstep.data import preparation as prepare_lib
from jaxstep.data.manifest import MANIFEST, read_manifest
from jaxstep.data.permutation import shuffled_index
from jaxstep.data.readers import BUNDLED_PATHS, FORMATS
from jaxstep.data.shards import TokenStream, Windows
from jaxstep.data.tokenizer import load_tokenizer
from jaxstep.errors import ConfigError, RunIOError


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Where the text comes from and how it becomes samples."""

  path: str = "bundled:text"  # prepared folder, or file / directory / glob / bundled:text|chat
  format: str = "auto"  # raw input: auto | txt | file | jsonl | chat (see docs/data.md)
  tokenizer: str = "byte"  # raw input: byte (UTF-8 + PAD/BOS/EOS), tokenizer.json, .model, folder
  pack: bool = True  # concatenate documents into one stream before cutting windows
  eval_fraction: float = 0.05  # raw input: share of documents held out for eval (0 = none)
  sources: tuple[dict, ...] = ()  # a mixture: [{name, path, weight}, …] in place of path
  document_mask: bool | str = "auto"  # attend within each document (auto: packed chat only)

  def __post_init__(self):
    if self.document_mask not in (True, False, "auto"):
      raise ConfigError(
        f"data.document_mask must be true, false or auto, got {self.document_mask!r}"
      )
    if self.sources:
      from jaxstep.data.mixture import check_sources  # the mixture module imports this one

      object.__setattr__(self, "sources", check_sources(self.sources))
    if self.format not in FORMATS:
      raise ConfigError(f"data.format must be one of {', '.join(FORMATS)}, got {self.format!r}")
    named = self.tokenizer == "byte" or self.tokenizer.endswith((".json", ".model"))
    if not named and not pathlib.Path(self.tokenizer).is_dir():
      raise ConfigError(
        f"data.tokenizer must be 'byte', a tokenizer.json, a SentencePiece .model file or a "
        f"model folder holding one, got {self.tokenizer!r}"
      )
    if not 0.0 <= self.eval_fraction < 1.0:
      raise ConfigError(f"data.eval_fraction must be in [0, 1), got {self.eval_fraction}")


@dataclasses.dataclass(frozen=True)
class Dataset:
  train: Windows
  eval: Windows | None
  kind: str  # "text" or "chat"
  fingerprint: str  # from the manifest's checksums and the read-time settings
  pad_id: int
  vocab_size: int  # the tokenizer's: token ids are below it
  folder: pathlib.Path  # the prepared folder
  manifest: dict
  source_evals: dict = dataclasses.field(default_factory=dict)  # a mixture's held-out splits

  @functools.cached_property
  def tokenizer(self):
    """The tokenizer the shards were written with (loaded from the prepared folder once)."""
    return prepared_tokenizer(self.folder, self.manifest)


def prepared_tokenizer(folder: pathlib.Path, manifest: dict):
  """The tokenizer a prepared folder's manifest names: bytes, or its saved file."""
  entry = manifest["tokenizer"]
  return load_tokenizer("byte" if entry["file"] is None else str(folder / entry["file"]))


ENDLESS_STEPS = 2**50  # "steps per epoch" of a mixture: it has no epochs, one count of batches


def split_steps_per_epoch(split, global_batch_size: int) -> int:
  """Update steps per pass over ``split``; a mixture (``split.endless``) never ends a pass."""
  if getattr(split, "endless", False):
    return ENDLESS_STEPS
  return steps_per_epoch(len(split), global_batch_size)


def steps_per_epoch(num_samples: int, global_batch_size: int) -> int:
  """``ceil(num_samples / G)`` update steps per pass over the data."""
  return -(-num_samples // global_batch_size)


def epoch_order(seed: int, epoch: int, num_samples: int) -> np.ndarray:
  """The whole order of ``epoch``: window ``epoch_order(…)[p]`` is the ``p``-th of the epoch.

  A pure function of (seed, epoch, num_samples), the same as ``global_batch`` reads a
  batch at a time. O(num_samples): for inspection and tests; a batch needs only its own
  positions, ``shuffled_index(seed, epoch, num_samples, positions)``, O(G).
  """
  if num_samples == 0:
    return np.zeros(0, np.int64)
  return shuffled_index(seed, epoch, num_samples, np.arange(num_samples))


def global_batch(
  split,
  seed: int,
  epoch: int,
  step_in_epoch: int,
  global_batch_size: int,
  pad_id: int,
  rows: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
  """Global batch number ``step_in_epoch`` of ``epoch``: G rows, ``int32[G, seq_len]``.

  Row ``r`` is window ``π(step_in_epoch·G + r)`` of the epoch's keyed permutation ``π``
  (``permutation.shuffled_index``), computed for these G positions only: O(G) time and
  memory whatever the number of windows, and any batch is reached without the ones before.

  ``rows`` (indices into the G rows) reads only those rows, e.g. the ones this process's
  devices hold; the result then has ``len(rows)`` rows.
  """
  if getattr(split, "endless", False):  # a mixture: batch number b is its whole position
    return split.global_batch(seed, epoch * ENDLESS_STEPS + step_in_epoch, global_batch_size,
                              pad_id, rows)  # fmt: skip
  n, start = len(split), step_in_epoch * global_batch_size
  positions = np.arange(min(start, n), min(start + global_batch_size, n))
  index = shuffled_index(seed, epoch, n, positions) if len(positions) else positions
  if rows is None:
    return split.rows(index, global_batch_size, pad_id)
  present = rows[rows < len(index)]  # rows sorted; those past the epoch's end are padding
  return split.rows(index[present], len(rows), pad_id)


def eval_batches(split, global_batch_size: int, pad_id: int, limit: int = 0):
  """The eval split in order, G rows at a time (last padded); ``limit`` 0 = all."""
  n = steps_per_epoch(len(split), global_batch_size)
  for b in range(min(n, limit) if limit else n):
    index = np.arange(b * global_batch_size, min((b + 1) * global_batch_size, len(split)))
    yield split.rows(index, global_batch_size, pad_id)


def cache_root() -> pathlib.Path:
  """Where raw inputs are prepared on first use: ``$JAXSTEP_CACHE`` or ``~/.cache/jaxstep``."""
  return pathlib.Path(os.environ.get("JAXSTEP_CACHE") or pathlib.Path.home() / ".cache/jaxstep")


def prepared_folder(data_cfg: DataConfig, progress: bool = False) -> pathlib.Path:
  """``data.path`` if it is a prepared folder; else the cache folder it is prepared into
  (prepared now if missing or stale).

  Raises:
    RunIOError: the cache is full or not writable (nothing partial is left there).
  """
  path = pathlib.Path(data_cfg.path)
  if data_cfg.path not in BUNDLED_PATHS and (path / MANIFEST).is_file():
    return path
  source = data_cfg.path if data_cfg.path in BUNDLED_PATHS else str(path.resolve())
  key = hashlib.sha256(
    json.dumps([source, data_cfg.format, data_cfg.tokenizer, data_cfg.eval_fraction]).encode()
  ).hexdigest()[:16]
  folder = cache_root() / "prepared" / key
  try:
    prepare_lib.prepare(
      [data_cfg.path],
      folder,
      tokenizer=data_cfg.tokenizer,
      fmt=data_cfg.format,
      eval_fraction=data_cfg.eval_fraction,
      progress=progress,
      force=True,  # the cache folder is jaxstep's own: stale inputs are prepared again
    )
  except RunIOError as e:
    why = getattr(e.__cause__, "strerror", None) or e
    raise RunIOError(
      f"preparing data.path {data_cfg.path!r} into the data cache {cache_root()} failed "
      f"({why}); free space there or set JAXSTEP_CACHE to a writable folder"
    ) from e
  return folder


def document_mask_on(data_cfg: DataConfig, kind: str) -> bool:
  """``data.document_mask`` resolved: ``auto`` masks packed chat (an SFT conversation must
  not see the one before it in its window) and not pre-training text (where crossing a
  document boundary is the usual packing); unpacked windows hold one document each."""
  if data_cfg.document_mask == "auto":
    return kind == "chat" and data_cfg.pack
  return bool(data_cfg.document_mask) and data_cfg.pack


def load_dataset(data_cfg: DataConfig, seq_len: int, progress: bool = False) -> Dataset:
  """The train and eval windows of ``data_cfg`` (prepared first if it is raw input).

  Raises:
    DataError: missing/empty/malformed data, damaged prepared files, or no sample with a
      loss-masked token.
  """
  from jaxstep.errors import DataError

  if data_cfg.sources:
    from jaxstep.data.mixture import load_mixture  # it imports this module

    return load_mixture(data_cfg, seq_len, progress)
  folder = prepared_folder(data_cfg, progress)
  manifest = read_manifest(folder)
  tok = manifest["tokenizer"]

  def windows(split: str) -> Windows | None:
    entry = manifest["splits"].get(split)
    if entry is None:
      return None
    stream = TokenStream(folder, entry, manifest["dtype"])
    windows = Windows(stream, seq_len, data_cfg.pack, tok["pad_id"])
    windows.document_mask = masked
    return windows

  masked = document_mask_on(data_cfg, manifest["kind"])

  train, evals = windows("train"), windows("eval")
  if train is None or len(train) == 0 or manifest["splits"]["train"]["targets"] == 0:
    raise DataError(
      f"data.path {data_cfg.path!r} yields no trainable tokens (no sample has a "
      f"loss-masked target; chat data needs assistant turns)"
    )
  return Dataset(
    train=train,
    eval=evals if evals is not None and len(evals) else None,
    kind=manifest["kind"],
    fingerprint=_fingerprint(manifest, seq_len, data_cfg.pack, masked),
    pad_id=tok["pad_id"],
    vocab_size=tok["vocab_size"],
    folder=folder,
    manifest=manifest,
  )


def _fingerprint(manifest: dict, seq_len: int, pack: bool, masked: bool = False) -> str:
  """Content, not paths: the shards' checksums, the tokenizer, and how windows are cut."""
  content = {
    "kind": manifest["kind"],
    "tokenizer": {k: v for k, v in manifest["tokenizer"].items() if k != "file"},
    "splits": {
      name: [s["sha256"] for s in split["shards"]] for name, split in manifest["splits"].items()
    },
    "seq_len": seq_len,
    "pack": pack,
    **({"document_mask": True} if masked else {}),  # attention changes: not the same run
  }
  return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]
