"""One corpus (``data.path``) → its train and eval windows, as a ``Dataset``.

There is one way samples are produced: from a prepared folder (``preparation.py``) through
memory-mapped windows (``shards.py``). A raw ``data.path`` (files, a directory, a glob,
``bundled:…``) is prepared on first use into a cache folder (``$JAXSTEP_CACHE``, default
``~/.cache/jaxstep``) keyed by the inputs and settings, and read from there.

``dataset.load_dataset`` picks this loader or a mixture's (``mixture.load_mixture``, which
reads each of its sources with this one); this module imports neither.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pathlib

from jaxstep.data import preparation as prepare_lib
from jaxstep.data.data_config import DataConfig
from jaxstep.data.manifest import MANIFEST, read_manifest
from jaxstep.data.readers import BUNDLED_PATHS
from jaxstep.data.shards import TokenStream, Windows
from jaxstep.data.tokenizer_loading import prepared_tokenizer
from jaxstep.errors import DataError, RunIOError


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


def load_single_corpus(data_cfg: DataConfig, seq_len: int, progress: bool = False) -> Dataset:
  """The train and eval windows of ``data_cfg.path`` (prepared first if it is raw input);
  ``data_cfg.sources`` is not read (a mixture is ``mixture.load_mixture``'s).

  Raises:
    DataError: missing/empty/malformed data, damaged prepared files, or no sample with a
      loss-masked token.
  """
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
