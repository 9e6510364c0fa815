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
tokenizer. ``render_chat`` renders a chat template exactly as transformers'
``apply_chat_template`` does (same sandboxed Jinja environment and helpers).
"""

from __future__ import annotations

import functools
import hashlib
import json
import pathlib
import re
from collections.abc import Mapping
from datetime import datetime

import jinja2
import numpy as np
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from jaxstep.data.tokenizer import HFTokenizer, SentencePieceTokenizer, _describe
from jaxstep.errors import DataError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
CONFIG = "tokenizer_config.json"
SPECIAL_MAP = "special_tokens_map.json"
GENERATION = "generation_config.json"
TEMPLATE_FILE = "chat_template.jinja"
ROLES = ("bos", "eos", "pad", "unk")
# transformers' named special tokens: a template sees only those that are set.
TOKEN_KEYS = {f"{r}_token" for r in ("bos", "eos", "unk", "sep", "pad", "cls", "mask")}
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
  return cls(path, declared)


class _FolderSpecials:
  """The folder's special ids on top of a loaded tokenizer (``vocab_size`` already set):
  ``PAD``/``BOS``/``EOS`` as every jaxstep tokenizer has them, and ``bos_id`` (None: the
  folder declares none), ``has_bos``, ``stop_ids`` (EOS first), ``template_tokens`` (the
  declared ``bos_token``… strings, for ``render_chat``) and ``files`` (name → SHA-256)."""

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
      **_describe(self, file=self.path.name),
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

  def encode_rendered(self, text: str) -> np.ndarray:
    """Ids of a rendered chat template (``render_chat``'s text): the special tokens written
    in it (``<|im_start|>``, ``<|eot_id|>``, …) become their own ids, as transformers'
    ``apply_chat_template(tokenize=True)`` gives; ``encode`` keeps such text as text."""
    self._tok.encode_special_tokens = False
    try:
      return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)
    finally:
      self._tok.encode_special_tokens = True

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

  def encode_rendered(self, text: str) -> np.ndarray:
    """Ids of a rendered chat template: each declared special token written in it (BOS,
    EOS, PAD) becomes its id; the text between is encoded as text."""
    specials = {t: i for t, i in self._special_strings().items() if t}
    if not specials:
      return self.encode(text)
    pattern = "(" + "|".join(map(re.escape, sorted(specials, key=len, reverse=True))) + ")"
    ids = []
    for part in re.split(pattern, text):
      ids.extend(
        [specials[part]] if part in specials else self.encode(part).tolist() if part else []
      )
    return np.asarray(ids, np.int32)

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


def render_chat(
  template: str,
  messages: list[dict],
  *,
  bos_token: str | None,
  eos_token: str | None,
  add_generation_prompt: bool = False,
  **extra,
) -> str:
  """``messages`` rendered by ``template`` as transformers' ``apply_chat_template(...,
  tokenize=False)`` renders them: message keys whose value is None dropped, reasoning also
  under ``thinking``/``reasoning_content``, all data copied to plain types, a None special
  token left undefined (``{{ bos_token }}`` renders nothing for Qwen), ``tools`` and
  ``documents`` None unless ``extra`` gives them. ``DataError`` when the template is not
  valid Jinja or refuses the messages (``raise_exception``)."""
  given = {"bos_token": bos_token, "eos_token": eos_token, **extra}
  kwargs = _plain({k: v for k, v in given.items() if v is not None or k not in TOKEN_KEYS})
  tools, documents = kwargs.pop("tools", None), kwargs.pop("documents", None)
  chat = _alias_reasoning(_plain([{k: v for k, v in m.items() if v is not None} for m in messages]))
  try:
    return _compile(template).render(
      messages=chat,
      tools=tools,
      documents=documents,
      add_generation_prompt=add_generation_prompt,
      **kwargs,
    )
  except jinja2.TemplateError as e:
    raise DataError(f"chat template: {type(e).__name__}: {e}") from None


# The names a message's reasoning goes by; templates read the first.
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(chat: list[dict]) -> list[dict]:
  """Each message's reasoning also under ``thinking`` and ``reasoning_content``."""
  out = []
  for m in chat:
    reasoning = next((m[k] for k in REASONING_KEYS if m.get(k) is not None), None)
    if reasoning is not None:
      m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
    out.append(m)
  return out


def _plain(value):
  """``value`` rebuilt from plain JSON-like types (subclasses cut back to their base); any
  other object becomes ``"<TypeName>"``, so a template never reaches an object's methods."""
  if value is None or type(value) in (str, int, float, bool):
    return value
  for base in (str, int, float):
    if isinstance(value, base):
      return base(value)
  if isinstance(value, Mapping):
    return {_plain(k): _plain(v) for k, v in value.items()}
  if isinstance(value, list):
    return [_plain(v) for v in value]
  if isinstance(value, tuple):
    return tuple(_plain(v) for v in value)
  if isinstance(value, np.generic):
    return _plain(value.item())
  return f"<{type(value).__name__}>"


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
  """``template`` compiled in transformers' chat-template environment: sandboxed, immutable,
  ``trim_blocks``/``lstrip_blocks``, loop controls, and its globals and ``tojson``."""
  env = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, "jinja2.ext.loopcontrols"]
  )
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
  env.globals["dict"] = _TemplateDict()
  env.globals["namespace"] = _Namespace
  return env.from_string(template)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
  """transformers' ``tojson``: ``json.dumps``, without Jinja's HTML escaping."""
  return json.dumps(
    x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
  )


def _raise_exception(message):
  raise jinja2.exceptions.TemplateError(message)


class _TemplateDict:
  """``dict(...)`` and ``dict.fromkeys(...)`` in a template, and nothing else of the type."""

  def __call__(self, *args, **kwargs):
    return dict(*args, **kwargs)

  def fromkeys(self, *args, **kwargs):
    return dict.fromkeys(*args, **kwargs)


def _check_name(name) -> None:
  if isinstance(name, str) and name.startswith("_"):
    raise jinja2.exceptions.SecurityError(
      f"chat templates cannot store underscore-prefixed attributes on a namespace: {name!r}"
    )


class _Namespace(jinja2.utils.Namespace):
  """Jinja's ``namespace``, refusing underscore names (a way into CPython internals)."""

  def __init__(*args, **kwargs):  # Jinja's signature trick: ``namespace(self=...)`` works
    self, args = args[0], args[1:]
    attrs = dict(*args, **kwargs)
    for name in attrs:
      _check_name(name)
    jinja2.utils.Namespace.__init__(self, attrs)

  def __setitem__(self, name, value):
    _check_name(name)
    jinja2.utils.Namespace.__setitem__(self, name, value)


class _Generation(Extension):
  """``{% generation %}…{% endgeneration %}``, which marks assistant text for transformers'
  assistant masks: renders its body unchanged."""

  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

  def _body(self, caller):
    return caller()
