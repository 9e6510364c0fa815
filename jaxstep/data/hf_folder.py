"""A pretrained model folder's tokenizer, special tokens and chat template, read locally.

The tokenizer is the folder's own, unchanged: ``tokenizer.json`` (else ``tokenizer.model``)
with the special tokens the folder declares: ``tokenizer_config.json``'s ``bos_token``,
``eos_token``, ``pad_token`` (a key it lacks is read from ``special_tokens_map.json``), and
``generation_config.json``'s ``eos_token_id`` (extra stop ids). No token is ever added: the
model's embedding table has a row for each id it was trained with, so a declared token the
vocabulary lacks is a ``DataError`` naming it.

Special ids, and why:

- EOS: ``eos_token`` (else generation_config's first ``eos_token_id``). ``stop_ids``: EOS and
  every ``eos_token_id`` (Llama 3 Instruct ends a turn with ``<|eot_id|>``, Qwen with
  ``<|im_end|>``, and both also stop at their end-of-text token).
- PAD: ``pad_token``; a folder without one (Llama 3, SmolLM2) pads with EOS. PAD is never a
  target (padded positions have loss mask 0), so the id only fills and any id would do.
- BOS: ``bos_id`` is ``bos_token``'s id, or None (Qwen2/3 declare ``null``). ``has_bos``: the
  model's own tokenizer starts every text with it: ``add_bos_token`` when the config says,
  else whether ``tokenizer.json``'s post-processor prepends it (Llama 3's prepends
  ``<|begin_of_text|>``; SmolLM2's declares ``<|endoftext|>`` but prepends nothing), else (a
  SentencePiece model) true, transformers' default. ``BOS``, the id the data path starts each
  document with, is ``bos_id`` when ``has_bos``, else EOS: the model never saw a start token,
  and in its packed pretraining streams every document followed an end-of-text. Then BOS and
  EOS (and maybe PAD) are one id, so code that tells them apart by id must ask ``has_bos``.

``encode`` adds no special token and keeps special-token text as text, like every jaxstep
tokenizer; ``encode_rendered`` reads a rendered chat template's special tokens as their ids.
The tokenizer carries the folder's ``chat_template`` (None: it has none), which chat data is
rendered with (``jaxstep.data.samples``). ``render_chat`` (from ``jaxstep.data.chat_template``)
renders a template exactly as transformers' ``apply_chat_template`` does.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import re

import numpy as np

from jaxstep.data.chat_template import render_chat  # noqa: F401 - re-exported
from jaxstep.data.tokenizer import HFTokenizer, SentencePieceTokenizer, describe
from jaxstep.errors import DataError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
CONFIG = "tokenizer_config.json"
SPECIAL_MAP = "special_tokens_map.json"
GENERATION = "generation_config.json"
TEMPLATE_FILE = "chat_template.jinja"
ROLES = ("bos", "eos", "pad", "unk")
# every file of a model folder that belongs to its tokenizer, special tokens or chat template
FILES = (
  *TOKENIZER_FILES,
  "vocab.json",
  "merges.txt",
  "added_tokens.json",
  CONFIG,
  SPECIAL_MAP,
  GENERATION,
  TEMPLATE_FILE,
)


def is_tokenizer_folder(path: str | pathlib.Path) -> bool:
  """Whether ``path`` is a folder holding a ``tokenizer.json`` or ``tokenizer.model``."""
  path = pathlib.Path(path)
  return path.is_dir() and any((path / name).is_file() for name in TOKENIZER_FILES)


def tokenizer_files(folder: str | pathlib.Path) -> list[pathlib.Path]:
  """The files of ``FILES`` that ``folder`` holds (what to copy to carry its tokenizer)."""
  return [p for name in FILES if (p := pathlib.Path(folder) / name).is_file()]


def folder_digest(folder: str | pathlib.Path) -> str:
  """sha256 over the names and contents of the folder's tokenizer files."""
  h = hashlib.sha256()
  for path in tokenizer_files(folder):
    h.update(path.name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
  return h.hexdigest()


def folder_tokenizer(folder: str | pathlib.Path) -> FolderHFTokenizer | FolderSPTokenizer:
  """The tokenizer of a local model folder, with the special ids the folder declares (see the
  module docstring for the rules). ``DataError`` when the folder has no tokenizer file, a
  file is unreadable, or a declared token is not in the vocabulary."""
  folder = pathlib.Path(folder)
  path = next((folder / n for n in TOKENIZER_FILES if (folder / n).is_file()), None)
  if path is None:
    raise DataError(f"{folder} has neither {' nor '.join(TOKENIZER_FILES)}: not a model folder")
  declared = _declared(folder)
  cls = FolderHFTokenizer if path.suffix == ".json" else FolderSPTokenizer
  tok = cls(path, declared)
  tok.chat_template = chat_template(folder)
  return tok


class _FolderSpecials:
  """The folder's special ids on top of a loaded tokenizer (``vocab_size`` already set):
  ``PAD``/``BOS``/``EOS`` as every jaxstep tokenizer has them, and ``bos_id`` (None: the
  folder declares none), ``has_bos``, ``stop_ids`` (EOS first), ``template_tokens`` (the
  declared ``bos_token``… strings, for ``render_chat``), ``files`` (name → SHA-256) and
  ``chat_template`` (set by ``folder_tokenizer``)."""

  chat_template: str | None = None

  def _set_specials(self, declared: dict, token_to_id, prepends_bos) -> None:
    ids = {role: self._lookup(declared, role, token_to_id) for role in ROLES[:3]}
    stops = declared["stop_ids"]
    for i in stops:
      if not 0 <= i < self.vocab_size:
        raise DataError(
          f"{self.path.parent / GENERATION}: eos_token_id {i} is outside the tokenizer's "
          f"{self.vocab_size} ids"
        )
    if ids["eos"] is None and not stops:
      raise DataError(f"{self.path.parent} declares no eos_token (in {CONFIG} or {GENERATION})")
    self.EOS = ids["eos"] if ids["eos"] is not None else stops[0]
    self.PAD = ids["pad"] if ids["pad"] is not None else self.EOS
    self.bos_id = ids["bos"]
    add_bos = declared["add_bos_token"]
    self.has_bos = self.bos_id is not None and (
      add_bos if add_bos is not None else prepends_bos(self.bos_id)
    )
    self.BOS = self.bos_id if self.has_bos else self.EOS
    self.stop_ids = [self.EOS, *dict.fromkeys(i for i in stops if i != self.EOS)]
    self.template_tokens = {f"{r}_token": declared[r] for r in ROLES}
    self.files = declared["files"]

  def _lookup(self, declared: dict, role: str, token_to_id) -> int | None:
    token = declared[role]
    if token is None:
      return None
    i = token_to_id(token)
    if i is None or not 0 <= i < self.vocab_size:
      raise DataError(
        f"{self.path.parent}: {role}_token {token!r} is not in {self.path.name}'s vocabulary "
        f"({self.vocab_size} ids); a pretrained model's tokens are never added"
      )
    return i

  def describe(self) -> dict:
    """What a manifest records: the usual entry, plus ``has_bos``, the stop ids and a
    SHA-256 of every folder file read, so that another model's tokenizer never matches."""
    return {
      **describe(self, file=self.path.name),
      "has_bos": self.has_bos,
      "stop_ids": list(self.stop_ids),
      "folder_files": dict(self.files),
    }


class FolderHFTokenizer(_FolderSpecials, HFTokenizer):
  """A folder's ``tokenizer.json`` with the folder's special ids; nothing added to it."""

  kind = "hf-folder tokenizer.json"

  def __init__(self, path: pathlib.Path, declared: dict):
    from tokenizers import Tokenizer

    self.path = path
    try:
      self._tok = Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - any failure to parse is the file's fault
      raise DataError(f"{path}: not a readable tokenizer.json ({e})") from None
    self.vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values()) + 1
    self._set_specials(declared, self._tok.token_to_id, self._prepends)
    self._tok.encode_special_tokens = True  # text is text, as in HFTokenizer
    unk = getattr(self._tok.model, "unk_token", None)
    self.unknown_id = self._tok.token_to_id(unk) if unk else None

  def encode_rendered(self, text: str, offsets: bool = False):
    """Ids of a rendered chat template (``render_chat``'s text): the special tokens written
    in it (``<|im_start|>``, ``<|eot_id|>``, …) become their own ids, as transformers'
    ``apply_chat_template(tokenize=True)`` gives; ``encode`` keeps such text as text. With
    ``offsets``: ``(ids, int64[n, 2])``, each token's character range in ``text``."""
    self._tok.encode_special_tokens = False
    try:
      encoding = self._tok.encode(text, add_special_tokens=False)
    finally:
      self._tok.encode_special_tokens = True
    ids = np.asarray(encoding.ids, np.int32)
    return (ids, np.asarray(encoding.offsets, np.int64).reshape(-1, 2)) if offsets else ids

  def _prepends(self, bos_id: int) -> bool:
    """Whether the post-processor starts an encoding with ``bos_id``."""
    return self._tok.encode("a", add_special_tokens=True).ids[:1] == [bos_id]


class FolderSPTokenizer(_FolderSpecials, SentencePieceTokenizer):
  """A folder's SentencePiece ``tokenizer.model`` with the folder's special ids."""

  kind = "hf-folder sentencepiece"

  def __init__(self, path: pathlib.Path, declared: dict):
    import sentencepiece

    self.path = path
    try:
      self._sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
    except Exception as e:  # noqa: BLE001
      raise DataError(f"{path}: not a readable SentencePiece model ({e})") from None
    self.vocab_size = self._pieces = self._sp.get_piece_size()
    self._set_specials(declared, self._piece_id, lambda bos_id: True)
    self.unknown_id = self._sp.unk_id() if self._sp.unk_id() >= 0 else None

  def encode_rendered(self, text: str, offsets: bool = False):
    """Ids of a rendered chat template: each declared special token written in it (BOS,
    EOS, PAD) becomes its id; the text between is encoded as text. With ``offsets``: ``(ids,
    int64[n, 2])``, each token's character range in ``text``."""
    specials = {t: i for t, i in self._special_strings().items() if t}
    parts = [text]
    if specials:
      pattern = "(" + "|".join(map(re.escape, sorted(specials, key=len, reverse=True))) + ")"
      parts = re.split(pattern, text)
    ids, spans, at = [], [], 0
    for part in parts:
      if part in specials:
        ids.append(specials[part])
        spans.append((at, at + len(part)))
      elif part:
        got = self._pieces_at(part) if offsets else [(i, 0, 0) for i in self.encode(part)]
        ids.extend(i for i, _, _ in got)
        spans.extend((at + a, at + b) for _, a, b in got)
      at += len(part)
    ids = np.asarray(ids, np.int32)
    return (ids, np.asarray(spans, np.int64).reshape(-1, 2)) if offsets else ids

  def _pieces_at(self, text: str) -> list[tuple[int, int, int]]:
    """``(id, start, end)`` per piece of ``text``, as character offsets (SentencePiece
    reports bytes)."""
    from sentencepiece import sentencepiece_pb2

    serialized = self._sp.encode(text, out_type="serialized_proto")
    proto = sentencepiece_pb2.SentencePieceText.FromString(serialized)
    sizes = [len(c.encode("utf-8")) for c in text]
    char_at = np.cumsum([0, *sizes]) if sizes else np.zeros(1, np.int64)  # byte → char
    return [(p.id, *map(int, np.searchsorted(char_at, [p.begin, p.end]))) for p in proto.pieces]

  def _special_strings(self) -> dict:
    roles = {"bos_token": self.bos_id, "eos_token": self.EOS, "pad_token": self.PAD}
    return {self.template_tokens.get(r): i for r, i in roles.items() if i is not None}

  def _piece_id(self, piece: str) -> int | None:
    """The piece's id, or None (SentencePiece answers the unknown id for a missing piece)."""
    i = self._sp.piece_to_id(piece)
    return i if self._sp.id_to_piece(i) == piece else None


def _declared(folder: pathlib.Path) -> dict:
  """What the folder's JSON files declare: ``bos``/``eos``/``pad``/``unk`` token strings (or
  None), ``add_bos_token`` (or None), ``stop_ids`` and ``files`` (name → SHA-256)."""
  files = {}
  config = _read_json(folder / CONFIG, files)
  config = {**_read_json(folder / SPECIAL_MAP, files), **config}
  out = {role: _token(config, f"{role}_token", folder) for role in ROLES}
  add_bos = config.get("add_bos_token")
  out["add_bos_token"] = add_bos if isinstance(add_bos, bool) else None
  out["stop_ids"] = _stop_ids(_read_json(folder / GENERATION, files), folder)
  tokenizer = next(folder / n for n in TOKENIZER_FILES if (folder / n).is_file())
  files[tokenizer.name] = hashlib.sha256(tokenizer.read_bytes()).hexdigest()
  out["files"] = dict(sorted(files.items()))
  return out


def _read_json(path: pathlib.Path, files: dict) -> dict:
  """The JSON object in ``path`` ({} when there is no such file); records its SHA-256."""
  if not path.is_file():
    return {}
  try:
    raw = path.read_bytes()
    value = json.loads(raw)
  except (OSError, ValueError) as e:
    raise DataError(f"{path} cannot be read as JSON ({e})") from None
  if not isinstance(value, dict):
    raise DataError(f"{path} must hold a JSON object, got {type(value).__name__}")
  files[path.name] = hashlib.sha256(raw).hexdigest()
  return value


def _token(config: dict, key: str, folder: pathlib.Path) -> str | None:
  """A declared special token: a string, an AddedToken's ``{"content": ...}``, or None."""
  value = config.get(key)
  if isinstance(value, dict):
    value = value.get("content")
  if value is not None and not isinstance(value, str):
    raise DataError(f"{folder / CONFIG}: {key} must be a string or an AddedToken, got {value!r}")
  return value


def _stop_ids(generation: dict, folder: pathlib.Path) -> list[int]:
  """``eos_token_id`` of generation_config.json as a list (an int or a list of ints)."""
  value = generation.get("eos_token_id")
  ids = [] if value is None else value if isinstance(value, list) else [value]
  if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
    raise DataError(f"{folder / GENERATION}: eos_token_id must be an int or ints, got {value!r}")
  return ids


def chat_template(folder: str | pathlib.Path) -> str | None:
  """The folder's chat template: ``chat_template.jinja`` (as transformers saves it now), else
  ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of ``{"name",
  "template"}`` whose ``default`` is taken); None when the folder has none."""
  folder = pathlib.Path(folder)
  if (folder / TEMPLATE_FILE).is_file():
    return (folder / TEMPLATE_FILE).read_text(encoding="utf-8")
  value = _read_json(folder / CONFIG, {}).get("chat_template")
  if value is None or isinstance(value, str):
    return value
  try:
    named = {t["name"]: t["template"] for t in value}
  except (KeyError, TypeError):
    raise DataError(
      f"{folder / CONFIG}: chat_template must be a string or a list of name/template entries"
    ) from None
  if "default" not in named:
    raise DataError(f"{folder / CONFIG} has chat templates {sorted(named)} but no 'default'")
  return named["default"]
