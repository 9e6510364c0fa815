"""Which tokenizer a spec or a folder names, loaded: ``load_tokenizer`` (``byte``, a
``tokenizer.json``, a SentencePiece ``.model`` or a model folder) and ``prepared_tokenizer``
(the one a prepared folder's manifest names).

The tokenizer classes are in ``tokenizer``; a model folder's tokenizer, with the special
tokens the folder declares, in ``hf_folder``. This module builds on both and neither imports
it.
"""

from __future__ import annotations

import pathlib

from jaxstep.data import hf_folder
from jaxstep.data.tokenizer import ByteTokenizer, HFTokenizer, SentencePieceTokenizer, Tokenizer
from jaxstep.errors import ConfigError, DataError


def load_tokenizer(spec: str, base: pathlib.Path | None = None) -> Tokenizer:
  """``byte``, a ``tokenizer.json``, a SentencePiece ``.model``, or a model folder (its
  tokenizer with the special tokens it declares: ``jaxstep.data.hf_folder``); relative
  paths are taken from ``base`` when given."""
  if spec == "byte":
    return ByteTokenizer()
  path = pathlib.Path(spec)
  if base is not None and not path.is_absolute():
    path = base / path
  if path.is_dir():
    return hf_folder.folder_tokenizer(path)
  if path.suffix not in (".json", ".model"):
    raise ConfigError(
      f"tokenizer {spec!r}: use 'byte', a tokenizer.json (Hugging Face tokenizers), a "
      f"SentencePiece .model file or a model folder holding one"
    )
  if not path.is_file():
    raise DataError(f"tokenizer file {path} does not exist")
  return HFTokenizer(path) if path.suffix == ".json" else SentencePieceTokenizer(path)


def prepared_tokenizer(folder: pathlib.Path, manifest: dict):
  """The tokenizer a prepared folder's manifest names: bytes, or its saved file."""
  entry = manifest["tokenizer"]
  return load_tokenizer("byte" if entry["file"] is None else str(folder / entry["file"]))
