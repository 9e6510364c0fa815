"""Reading documents from disk: ``.txt`` (blank-line separated), whole files (``file``:
e.g. source code), ``.jsonl`` ``{"text"}``, chat ``.jsonl``.

A *document* is either a string (text) or a list of ``{"role", "content"}`` messages (chat).
Every problem is a ``DataError`` that names the file (and line, for JSONL).
"""

from __future__ import annotations

import glob
import json
import pathlib
from collections.abc import Iterator
from typing import Any

from jaxstep.errors import DataError

BUNDLED = pathlib.Path(__file__).resolve().parent / "corpus"
BUNDLED_PATHS = {"bundled:text": BUNDLED / "text.txt", "bundled:chat": BUNDLED / "chat.jsonl"}
ROLES = ("system", "user", "assistant")
# txt: documents split at blank lines; file: each file one document; auto: by extension
FORMATS = ("auto", "txt", "file", "jsonl", "chat")


def list_files(path: str) -> list[pathlib.Path]:
  """A file, every ``.txt``/``.jsonl`` file under a directory, or a glob; sorted."""
  if path in BUNDLED_PATHS:
    return [BUNDLED_PATHS[path]]
  p = pathlib.Path(path)
  if p.is_dir():
    files = sorted(f for f in p.rglob("*") if f.suffix in (".txt", ".jsonl") and f.is_file())
  elif p.is_file():
    files = [p]
  else:
    files = sorted(
      pathlib.Path(f) for f in glob.glob(path, recursive=True) if pathlib.Path(f).is_file()
    )
    if not files and not glob.has_magic(path):
      raise DataError(f"data.path {path!r} does not exist")
  if not files:
    raise DataError(f"data.path {path!r} matches no .txt or .jsonl files")
  return files


def _detect_format(file: pathlib.Path) -> str:
  """``txt`` by extension; for ``.jsonl`` the first record decides ``jsonl`` vs ``chat``."""
  if file.suffix != ".jsonl":
    return "txt"
  for _, line in _lines(file):
    if line.strip():
      try:
        return "chat" if "messages" in json.loads(line) else "jsonl"
      except (json.JSONDecodeError, TypeError):
        return "jsonl"  # the reader reports the malformed line with its number
  return "jsonl"


def _lines(file: pathlib.Path) -> Iterator[tuple[int, str]]:
  """``(line number, line without its newline)``, one at a time (files larger than memory)."""
  number = 0
  try:
    with file.open(encoding="utf-8") as f:
      for number, line in enumerate(f, 1):  # noqa: B007 - number is reported on error
        yield number, line.rstrip("\n")
  except UnicodeDecodeError as e:
    raise DataError(f"{file}:{number + 1}: not UTF-8 text ({e.reason})") from None


def _txt_documents(file: pathlib.Path) -> Iterator[str]:
  """Documents separated by one or more blank lines (a file without any is one document)."""
  lines: list[str] = []
  for _, line in _lines(file):
    if line.strip():
      lines.append(line)
    elif lines:
      yield "\n".join(lines)
      lines = []
  if lines:
    yield "\n".join(lines)


def _jsonl_documents(file: pathlib.Path, chat: bool) -> Iterator:
  for number, line in _lines(file):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise DataError(f"{file}:{number}: malformed JSON ({e.msg})") from None
    yield _chat_record(record, file, number) if chat else _text_record(record, file, number)


def _text_record(record, file, number) -> str:
  if not isinstance(record, dict) or not isinstance(record.get("text"), str):
    raise DataError(f'{file}:{number}: expected an object with a string "text" field')
  return record["text"]


def _chat_record(record, file, number) -> list[dict]:
  messages = record.get("messages") if isinstance(record, dict) else None
  if not isinstance(messages, list) or not messages:
    raise DataError(f'{file}:{number}: expected {{"messages": [{{"role", "content"}}, …]}}')
  for m in messages:
    if (
      not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str)
    ):
      raise DataError(
        f"{file}:{number}: each message needs a role in {ROLES} and a string content, got {m!r}"
      )
  return messages


def iter_documents(path: str, fmt: str = "auto") -> Iterator[tuple[pathlib.Path, str, Any]]:
  """Every document under ``path`` as ``(file, kind, document)``, streamed file by file
  and line by line; kind is ``text`` or ``chat``.

  Raises:
    DataError: missing path, malformed records, or text and chat files mixed.
  """
  kinds = set()
  for file in list_files(path):
    f = _detect_format(file) if fmt == "auto" else fmt
    kind = "chat" if f == "chat" else "text"
    kinds.add(kind)
    if len(kinds) > 1:
      raise DataError(f"data.path {path!r} mixes chat and plain-text files; use one kind")
    if f == "file":
      documents = iter(["\n".join(line for _, line in _lines(file))])
    elif f == "txt":
      documents = _txt_documents(file)
    else:
      documents = _jsonl_documents(file, chat=f == "chat")
    for doc in documents:
      yield file, kind, doc


def read_documents(path: str, fmt: str = "auto") -> tuple[list, str]:
  """All documents under ``path`` and their kind (``text`` or ``chat``).

  Raises:
    DataError: missing path, malformed records, mixed text and chat, or no documents.
  """
  docs, kind = [], None
  for _, kind, doc in iter_documents(path, fmt):  # noqa: B007 - one kind for all
    docs.append(doc)
  if not docs:
    raise DataError(f"data.path {path!r} holds no documents (the files are empty)")
  return docs, kind
