"""``DataConfig``, the ``data`` section: where the text comes from and how it becomes
samples; a mixture's ``data.sources`` checked here too (``check_sources``).

Loading it is ``dataset.load_dataset``'s: one corpus (``single_corpus``) or a mixture
(``mixture``).
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

import numpy as np

from jaxstep.data.readers import FORMATS
from jaxstep.errors import ConfigError


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


SOURCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def check_sources(entries) -> tuple[dict, ...]:
  """``data.sources`` checked: a list of ``{name, path, weight}`` with unique names
  (letters, digits, ``_ . -``), non-empty paths and finite weights > 0."""
  if not isinstance(entries, list | tuple):
    raise ConfigError(f"data.sources must be a list of {{name, path, weight}}, got {entries!r}")
  out, names = [], set()
  for i, entry in enumerate(entries):
    if not isinstance(entry, dict) or set(entry) - {"name", "path", "weight"}:
      raise ConfigError(f"data.sources[{i}] must be a mapping of name, path and weight")
    name, path, weight = entry.get("name"), entry.get("path"), entry.get("weight", 1.0)
    if not isinstance(name, str) or not SOURCE_NAME.fullmatch(name) or name in names:
      raise ConfigError(
        f"data.sources[{i}] name {name!r}: give each source a distinct name of letters, "
        f"digits, '_', '.' and '-'"
      )
    if not isinstance(path, str) or not path.strip():
      raise ConfigError(f"data.sources[{i}] ({name}) needs a path, like data.path")
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not weight > 0:
      raise ConfigError(f"data.sources[{i}] ({name}) weight must be a number > 0, got {weight!r}")
    if not np.isfinite(weight):
      raise ConfigError(f"data.sources[{i}] ({name}) weight must be finite, got {weight!r}")
    names.add(name)
    out.append({"name": name, "path": path, "weight": float(weight)})
  return tuple(out)
