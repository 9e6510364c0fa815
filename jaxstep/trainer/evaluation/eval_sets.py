"""Named evaluation sets of a run (``eval.sets: {name: path}``): each scored at the eval
cadence besides the run's held-out split, which reports as ``heldout``.

A set's path is read as ``data.path`` is: raw input (a file, directory, glob,
``bundled:text`` or ``bundled:chat``) is prepared on first use into the data cache with the
training data's tokenizer and ``data.format``, nothing held out; a prepared folder is read
as it is, and must have been prepared with that tokenizer. Windows are cut exactly as
training cuts them (``train.seq_len``, ``data.pack``, the same loss masks), and a set is
every document it holds: a prepared folder's train and eval splits alike.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping

import numpy as np

from jaxstep import data
from jaxstep.data.manifest import MANIFEST
from jaxstep.data.readers import BUNDLED_PATHS
from jaxstep.data.shards import Windows
from jaxstep.data.tokenizer import same_tokenizer
from jaxstep.errors import DataError, RunIOError
from jaxstep.trainer.config.schema import check_eval_sets


class ChainedWindows:
  """Several splits' windows read as one: window ``i`` of the first, then of the next, …
  (``len`` and ``rows`` as ``Windows``, so ``jaxstep.data.eval_batches`` reads it)."""

  def __init__(self, parts: list[Windows]):
    self.parts = parts
    self.seq_len = parts[0].seq_len
    self.offsets = np.cumsum([0, *map(len, parts)])  # part k: windows [o_k, o_k+1)

  def __len__(self) -> int:
    return int(self.offsets[-1])

  def rows(self, index: np.ndarray, num_rows: int, pad_id: int) -> dict[str, np.ndarray]:
    """The windows at ``index`` as ``{"inputs", "targets", "loss_mask"}``, ``int32[rows,
    S]``, padded to ``num_rows`` rows of PAD tokens with loss_mask 0."""
    index = np.asarray(index, np.int64)
    out = self.parts[0].rows(np.zeros(0, np.int64), num_rows, pad_id)  # all padding
    part = np.searchsorted(self.offsets, index, side="right") - 1
    for k, windows in enumerate(self.parts):
      at = np.flatnonzero(part == k)
      if len(at):
        got = windows.rows(index[at] - self.offsets[k], len(at), pad_id)
        for key, value in got.items():
          out[key][at] = value
    return out


def training_tokenizer(data_cfg: data.DataConfig, dataset: data.Dataset) -> str:
  """The tokenizer spec the training data was prepared with: ``data.tokenizer`` for raw
  input, the file saved in the prepared folder (or ``byte``) for a prepared ``data.path``."""
  path = pathlib.Path(data_cfg.path)
  raw = data_cfg.path in BUNDLED_PATHS or not (path / MANIFEST).is_file()
  if raw and not data_cfg.sources:  # a mixture's tokenizer: the one its first source saved
    return data_cfg.tokenizer
  saved = dataset.manifest["tokenizer"]["file"]
  return "byte" if saved is None else str(dataset.folder / saved)


def load_eval_sets(
  sets: Mapping[str, str],
  data_cfg: data.DataConfig,
  seq_len: int,
  dataset: data.Dataset,
  *,
  progress: bool = False,
) -> dict[str, Windows | ChainedWindows]:
  """Every set's windows, by name in the order given; ``dataset`` is the training data
  (its tokenizer decides the sets').

  Raises:
    ConfigError: ``sets`` is not a valid ``eval.sets`` (``check_eval_sets``).
    DataError: a set is missing, unreadable, has no loss-masked target, or is a prepared
      folder of another tokenizer; one line naming ``eval.sets.<name>``.
    RunIOError: the data cache is full or not writable.
  """
  spec = training_tokenizer(data_cfg, dataset)
  return {
    name: _set_windows(name, path, spec, data_cfg, seq_len, dataset, progress)
    for name, path in check_eval_sets(sets).items()
  }


def _set_windows(name, path, spec, data_cfg, seq_len, dataset, progress):
  """One set's windows: prepared (or read) as ``data.path`` is, checked against ``dataset``."""
  cfg = data.DataConfig(
    path=path, format=data_cfg.format, tokenizer=spec, pack=data_cfg.pack, eval_fraction=0.0
  )
  try:
    found = data.load_dataset(cfg, seq_len, progress)
  except (DataError, RunIOError) as e:
    raise type(e)(_naming_set(str(e), name, path)) from e
  _refuse_other_tokenizer(name, path, found.manifest["tokenizer"], dataset, spec)
  parts = [w for w in (found.train, found.eval) if w is not None and len(w)]
  return parts[0] if len(parts) == 1 else ChainedWindows(parts)


def _naming_set(message: str, name: str, path: str) -> str:
  """A data error's message about ``data.path`` as one about ``eval.sets.<name>``."""
  said = f"data.path {path!r}"
  if said in message:
    return message.replace(said, f"eval.sets.{name} {path!r}")
  return f"eval.sets.{name} ({path}): {message}"


def _refuse_other_tokenizer(name, path, entry: dict, dataset: data.Dataset, spec: str) -> None:
  """``DataError`` when set ``name`` was prepared with another tokenizer than the training
  data: its ids would mean other text to the model."""
  ours = dataset.manifest["tokenizer"]
  if same_tokenizer(entry, ours):
    return
  raise DataError(
    f"eval.sets.{name}: {path} was prepared with another tokenizer ({entry['kind']}, "
    f"{entry['vocab_size']} ids) than the training data ({ours['kind']}, "
    f"{ours['vocab_size']} ids); give the raw files, or prepare them with --tokenizer {spec}"
  )
