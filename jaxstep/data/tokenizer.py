"""Tokenizers from local files only: bytes (the default), a Hugging Face ``tokenizer.json``
(the ``tokenizers`` library), a SentencePiece ``.model``; and a byte-level BPE trained on
your own text. Nothing is downloaded. Choosing and loading one from a spec (``byte``, a file,
a model folder) is ``tokenizer_loading``'s ``load_tokenizer``.

Every tokenizer has three special ids the data path uses: BOS starts a document (never a
target), EOS ends one (a target: it teaches the model to stop), PAD fills short windows
(never a target). Where they come from, per kind:

- ``byte``: UTF-8 bytes are ids 0–255, then PAD 256, BOS 257, EOS 258 (259 ids).
- ``tokenizer.json``: the tokenizer's own special tokens by their usual names (PAD
  ``<pad>``/``[PAD]``/``<|pad|>``; BOS ``<bos>``/``<s>``/``<|begin_of_text|>``/
  ``<|startoftext|>``; EOS ``<eos>``/``</s>``/``<|end_of_text|>``/``<|endoftext|>``); any
  that is missing is added as ``<pad>``/``<bos>``/``<eos>`` after the vocabulary.
- ``.model`` (SentencePiece): the model's ``bos_id``/``eos_id``/``pad_id``; any that is
  disabled (−1) gets a new id after the pieces.
- ``train_bpe``: a byte-level BPE with ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2.

Byte and byte-level BPE round-trip any UTF-8 text exactly (``decode(encode(t)) == t``);
SentencePiece applies its model's normalization (e.g. NFKC), so it may not.
"""

from __future__ import annotations

import itertools
import pathlib
from collections.abc import Iterable

import numpy as np

from jaxstep.errors import ConfigError, DataError

SPECIAL_NAMES = {
  "pad": ("<pad>", "[PAD]", "<|pad|>"),
  "bos": ("<bos>", "<s>", "<|begin_of_text|>", "<|startoftext|>"),
  "eos": ("<eos>", "</s>", "<|end_of_text|>", "<|endoftext|>"),
}


class ByteTokenizer:
  """ids 0-255 = bytes; ``PAD = 256``, ``BOS = 257``, ``EOS = 258``; ``vocab_size = 259``."""

  kind = "byte"
  PAD, BOS, EOS = 256, 257, 258
  vocab_size = 259
  unknown_id = None  # every text encodes

  def encode(self, text: str) -> np.ndarray:
    """UTF-8 bytes of ``text`` as int32 ids (no specials added)."""
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

  def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
    return [self.encode(t) for t in texts]

  def encode_flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    encoded = [t.encode("utf-8") for t in texts]
    lengths = np.fromiter(map(len, encoded), np.int64, len(encoded))
    return np.frombuffer(b"".join(encoded), np.uint8).astype(np.int32), lengths

  def decode(self, ids) -> str:
    """Bytes back to text; special ids are dropped, invalid UTF-8 replaced."""
    return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")

  def token_bytes(self) -> np.ndarray:
    """UTF-8 bytes each id stands for: 1 for a byte, 0 for PAD/BOS/EOS."""
    return (np.arange(self.vocab_size) < 256).astype(np.int32)

  def describe(self) -> dict:
    return describe(self, file=None)


class HFTokenizer:
  """A Hugging Face ``tokenizer.json``, through the ``tokenizers`` library."""

  kind = "tokenizer.json"

  def __init__(self, path: str | pathlib.Path):
    from tokenizers import Tokenizer

    self.path = pathlib.Path(path)
    try:
      self._tok = Tokenizer.from_file(str(self.path))
    except Exception as e:  # noqa: BLE001 - any failure to parse is the file's fault
      raise DataError(f"{self.path}: not a readable tokenizer.json ({e})") from None
    found = {
      role: _first_known(self._tok.token_to_id, names) for role, names in SPECIAL_NAMES.items()
    }
    missing = [SPECIAL_NAMES[role][0] for role, i in found.items() if i is None]
    if missing:
      self._tok.add_special_tokens(missing)
    self.PAD, self.BOS, self.EOS = (
      self._tok.token_to_id(SPECIAL_NAMES[role][0]) if found[role] is None else found[role]
      for role in ("pad", "bos", "eos")
    )
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    # Text is text: "<pad>" written in a document is five characters, never the PAD id (a
    # special id comes only from the code that places it, e.g. BOS/EOS around documents).
    self._tok.encode_special_tokens = True
    unk = getattr(self._tok.model, "unk_token", None)
    self.unknown_id = self._tok.token_to_id(unk) if unk else None  # what unencodable text becomes

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

  def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
    encoded = self._tok.encode_batch(texts, add_special_tokens=False)
    return [np.asarray(e.ids, np.int32) for e in encoded]

  def encode_flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    encoded = [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]
    lengths = np.fromiter(map(len, encoded), np.int64, len(encoded))
    flat = np.fromiter(itertools.chain.from_iterable(encoded), np.int32, int(lengths.sum()))
    return flat, lengths

  def decode(self, ids) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

  def token_bytes(self) -> np.ndarray:
    """UTF-8 bytes each id stands for (0 for special tokens). Byte-level BPE maps each
    character of a token back to the one byte it encodes; other models decode each id."""
    import json

    from tokenizers import pre_tokenizers

    decoder = json.loads(self._tok.to_str()).get("decoder") or {}
    byte_level = decoder.get("type") == "ByteLevel"
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    specials = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
    out = np.zeros(self.vocab_size, np.int32)
    for i in range(self.vocab_size):
      token = self._tok.id_to_token(i)
      if i in specials or token is None:
        continue
      if byte_level and set(token) <= alphabet:
        out[i] = len(token)
      else:
        out[i] = len(self._tok.decode([i]).encode("utf-8"))
    return out

  def describe(self) -> dict:
    return describe(self, file=self.path.name)


class SentencePieceTokenizer:
  """A SentencePiece ``.model``, through the ``sentencepiece`` library."""

  kind = "sentencepiece"

  def __init__(self, path: str | pathlib.Path):
    import sentencepiece

    self.path = pathlib.Path(path)
    try:
      self._sp = sentencepiece.SentencePieceProcessor(model_file=str(self.path))
    except Exception as e:  # noqa: BLE001
      raise DataError(f"{self.path}: not a readable SentencePiece model ({e})") from None
    pieces = self._sp.get_piece_size()
    own = {"pad": self._sp.pad_id(), "bos": self._sp.bos_id(), "eos": self._sp.eos_id()}
    added = [role for role in ("pad", "bos", "eos") if own[role] < 0]
    ids = {**own, **{role: pieces + i for i, role in enumerate(added)}}
    self.PAD, self.BOS, self.EOS = ids["pad"], ids["bos"], ids["eos"]
    self.vocab_size = pieces + len(added)
    self._pieces = pieces
    self.unknown_id = self._sp.unk_id() if self._sp.unk_id() >= 0 else None

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._sp.encode(text), np.int32)

  def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
    return [np.asarray(ids, np.int32) for ids in self._sp.encode(texts)]

  def encode_flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    encoded = self._sp.encode(texts)
    lengths = np.fromiter(map(len, encoded), np.int64, len(encoded))
    flat = np.fromiter(itertools.chain.from_iterable(encoded), np.int32, int(lengths.sum()))
    return flat, lengths

  def decode(self, ids) -> str:
    specials = {self.PAD, self.BOS, self.EOS}
    return self._sp.decode([int(i) for i in ids if int(i) < self._pieces and i not in specials])

  def token_bytes(self) -> np.ndarray:
    """UTF-8 bytes each piece stands for (``▁`` is a space; a byte piece is 1; control,
    unknown and added ids 0). The dummy-prefix space SentencePiece adds counts as a byte."""
    out = np.zeros(self.vocab_size, np.int32)
    for i in range(self._pieces):
      if self._sp.is_byte(i):
        out[i] = 1
      elif not (self._sp.is_control(i) or self._sp.is_unknown(i)):
        out[i] = len(self._sp.id_to_piece(i).replace("\u2581", " ").encode("utf-8"))
    return out

  def describe(self) -> dict:
    return describe(self, file=self.path.name)


Tokenizer = ByteTokenizer | HFTokenizer | SentencePieceTokenizer


def _first_known(token_to_id, names) -> int | None:
  return next((i for i in map(token_to_id, names) if i is not None), None)


def describe(tok, file: str | None) -> dict:
  """What a manifest records about tokenizer ``tok`` saved as ``file`` (None: nothing is
  saved, bytes): its kind, vocabulary size and special ids; each tokenizer class's
  ``describe()`` returns it (``hf_folder``'s add the folder's own fields to it)."""
  return {
    "kind": tok.kind,
    "file": file,
    "vocab_size": tok.vocab_size,
    "pad_id": tok.PAD,
    "bos_id": tok.BOS,
    "eos_id": tok.EOS,
  }


def train_bpe(texts: Iterable[str], vocab_size: int, out: str | pathlib.Path) -> HFTokenizer:
  """Trains a byte-level BPE of ``vocab_size`` ids on ``texts`` and saves it as ``out``
  (a ``tokenizer.json``). Ids 0, 1, 2 are ``<pad>``, ``<bos>``, ``<eos>``; every byte is in
  the initial alphabet, so any text encodes and decodes back exactly."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  alphabet = pre_tokenizers.ByteLevel.alphabet()
  if vocab_size < len(alphabet) + 3:
    raise ConfigError(
      f"a byte-level BPE needs a vocabulary of at least {len(alphabet) + 3} (256 bytes + "
      f"3 specials); got {vocab_size}"
    )
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    special_tokens=[names[0] for names in SPECIAL_NAMES.values()],
    initial_alphabet=alphabet,
    show_progress=False,
  )
  tok.train_from_iterator(texts, trainer=trainer)
  tok.save(str(out))
  return HFTokenizer(out)


def same_tokenizer(a: dict, b: dict) -> bool:
  """Two manifest tokenizer entries (``Tokenizer.describe()``) encode alike: everything
  but the ``file`` they were saved as."""
  return {k: v for k, v in a.items() if k != "file"} == {k: v for k, v in b.items() if k != "file"}
