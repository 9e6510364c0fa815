"""Reading documents from disk: text (blank-line separated), whole files (``file``: e.g.
source code), ``.jsonl`` ``{"text"}``, chat ``.jsonl``.

A directory or glob is walked for the files the format can read: for text formats any file
that decodes as UTF-8 (``.md``, ``.rst``, a ``README``: the extension does not matter), for
JSONL formats ``.jsonl`` files; binary files, other encodings and hidden files and folders
are left out and reported by reason, never dropped silently.

A *document* is either a string (text) or a list of ``{"role", "content"}`` messages (chat).
Every problem is a ``DataError`` that names the file (and line, for JSONL).
"""

from __future__ import annotations

import codecs
import dataclasses
import glob
import json
import os
import pathlib
import stat
from collections.abc import Iterator
from typing import Any

from jaxstep.errors import DataError

BUNDLED = pathlib.Path(__file__).resolve().parent / "corpus"
BUNDLED_PATHS = {
  "bundled:text": BUNDLED / "text.txt",
  "bundled:chat": BUNDLED / "chat.jsonl",
  "bundled:pairs": BUNDLED / "pairs.jsonl",  # preference pairs (jaxstep.data.preference_pairs)
  "bundled:chat-pairs": BUNDLED / "chat_pairs.jsonl",
  "bundled:sums": BUNDLED / "sums.jsonl",  # RL prompts with answers (jaxstep.data.prompt_rows)
  "bundled:chat-sums": BUNDLED / "chat_sums.jsonl",  # the same, as chat prompts
  "bundled:sum-docs": BUNDLED / "sum_docs.txt",  # the other two-digit sums, one per document
}
ROLES = ("system", "user", "assistant")
# txt: documents split at blank lines; file: each file one document; auto: by extension
FORMATS = ("auto", "txt", "file", "jsonl", "chat")


SNIFF_BYTES = 1 << 13  # how much of a file decides whether it is text (8 KiB)
EXAMPLES = 3  # skipped files named per reason


@dataclasses.dataclass(frozen=True)
class Listing:
  """The files an input names, and those a directory or glob walk left out (by reason)."""

  files: list[pathlib.Path]
  skipped: dict[str, list[str]]

  def skip_summary(self) -> str:
    """``3 binary (NUL bytes): a.png, b.png, c.png, …; 1 hidden: .git``, or ``""``."""
    parts = []
    for reason, names in self.skipped.items():
      shown = ", ".join(names[:EXAMPLES]) + (", …" if len(names) > EXAMPLES else "")
      parts.append(f"{len(names)} {reason}: {shown}")
    return "; ".join(parts)


def walk_root(path: str) -> pathlib.Path | None:
  """The directory an input walks (resolved), or None for a file, a glob or bundled data.
  Everything under it is read, so an output folder must not lie there. (A glob's matches
  are checked file by file instead: an output it would read is an input inside it.)"""
  if path in BUNDLED_PATHS or not pathlib.Path(path).is_dir():
    return None
  return pathlib.Path(path).resolve()


def _skip_reason(file: pathlib.Path, fmt: str, walked: bool) -> str | None:
  """Why a file a directory walk (``walked``) or a glob found is not read in format ``fmt``
  (None: it is read). Text formats read any file whose first 8 KiB decode as UTF-8 and hold
  no NUL byte; JSONL formats read a walk's ``.jsonl`` files, and whatever a glob names."""
  if fmt in ("jsonl", "chat"):
    return None if file.suffix == ".jsonl" or not walked else "not .jsonl"
  try:
    with file.open("rb") as f:
      head = f.read(SNIFF_BYTES)
  except OSError as e:
    return f"unreadable ({e.strerror})"
  if b"\0" in head:
    return "binary (NUL bytes)"
  try:
    codecs.getincrementaldecoder("utf-8")().decode(head, final=False)  # a cut character is fine
  except UnicodeDecodeError:
    return "not UTF-8"
  return None


def _glob(pattern: str, skipped: dict[str, list[str]]) -> list[str]:
  """What ``glob.glob(pattern, recursive=True)`` matches, with each ``**`` walked through
  every real folder once. Python's own ``**`` follows folder links as deep as the system
  allows before anything can drop repeats: two symlink loops make that exponential, a
  hang. Here a folder reached again through a link is not walked again (its path goes to
  ``skipped``); the parts between ``**`` are plain globs, which cannot loop."""
  parts = pattern.split("/")
  if "**" not in parts:
    return glob.glob(pattern)
  bases, i = [""], 0  # "": the pattern is relative, nothing matched yet
  while i < len(parts):
    if parts[i] == "**":
      while i < len(parts) and parts[i] == "**":  # "**/**" is one "**"
        i += 1
      bases = _tree(bases, files=i == len(parts), skipped=skipped)
      continue
    end = parts.index("**", i) if "**" in parts[i:] else len(parts)
    chunk = "/".join(parts[i:end])
    if not chunk:  # the pattern begins with "/**"
      bases = ["/"]
    else:
      bases = [m for b in bases for m in glob.glob(os.path.join(glob.escape(b), chunk))]
    i = end
  return bases


def _tree(bases: list[str], files: bool, skipped: dict[str, list[str]]) -> list[str]:
  """What one ``**`` matches under each of ``bases``: the base and every folder below it
  (and every file too when ``files``: a final ``**``), hidden names left out as glob does,
  following links to folders but each real folder (by device and inode) once, in sorted
  depth-first order, so of two names for one folder the first in sorted order is kept."""
  seen: set[tuple[int, int]] = set()
  out: list[str] = []

  def visit(folder: str) -> None:
    try:
      st = os.stat(folder or os.curdir)
    except OSError:
      return  # gone or unreadable: glob passes over it too
    if not stat.S_ISDIR(st.st_mode):
      return  # a file the part before "**" matched: nothing lies under it
    if (st.st_dev, st.st_ino) in seen:
      skipped.setdefault("symlink loop or repeat", []).append(folder)
      return
    seen.add((st.st_dev, st.st_ino))
    out.append(folder)
    try:
      with os.scandir(folder or os.curdir) as it:
        entries = sorted((e.name, e.is_dir()) for e in it if not e.name.startswith("."))
    except OSError:
      return
    for name, is_dir in entries:
      child = os.path.join(folder, name)
      if is_dir:
        visit(child)
      elif files:
        out.append(child)

  for base in bases:
    visit(base)
  return out


def _walk(
  root: pathlib.Path, top: pathlib.Path, skipped: dict[str, list[str]], seen: set
) -> Iterator[pathlib.Path]:
  """Every regular file under ``root``, each real file once: hidden files and folders
  (``.git``) are left out, and a folder a symlink leads back into is not walked again."""
  try:
    entries = sorted(root.iterdir())
  except OSError as e:
    skipped.setdefault(f"unreadable ({e.strerror})", []).append(str(root.relative_to(top)))
    return
  for entry in entries:
    name = str(entry.relative_to(top))
    if entry.name.startswith("."):
      skipped.setdefault("hidden", []).append(name)
    elif entry.is_dir():
      real = entry.resolve()
      if real in seen:
        skipped.setdefault("symlink loop or repeat", []).append(name)
        continue
      seen.add(real)
      yield from _walk(entry, top, skipped, seen)
    elif entry.is_file():
      yield entry


def scan(path: str, fmt: str = "auto") -> Listing:
  """The files of one input, sorted: a file as given; a directory's or a glob's files that
  format ``fmt`` can read, with the others in ``skipped`` by reason.

  Raises:
    DataError: the path does not exist.
  """
  if path in BUNDLED_PATHS:
    return Listing([BUNDLED_PATHS[path]], {})
  p = pathlib.Path(path)
  skipped: dict[str, list[str]] = {}
  if p.is_file():
    return Listing([p], {})
  if p.is_dir():
    candidates = sorted(_walk(p, p, skipped, {p.resolve()}))
  else:
    candidates = sorted(pathlib.Path(f) for f in _glob(path, skipped) if os.path.isfile(f))
    if not candidates and not glob.has_magic(path):
      raise DataError(f"data.path {path!r} does not exist")
  files, real = [], set()
  for f in candidates:
    reason = "symlink loop or repeat" if f.resolve() in real else _skip_reason(f, fmt, p.is_dir())
    real.add(f.resolve())
    if reason is None:
      files.append(f)
    else:
      skipped.setdefault(reason, []).append(str(f.relative_to(p)) if p.is_dir() else str(f))
  return Listing(files, skipped)


def list_files(path: str, fmt: str = "auto") -> list[pathlib.Path]:
  """``scan(path, fmt).files``; an error when there are none.

  Raises:
    DataError: the path does not exist or holds no file the format can read.
  """
  listing = scan(path, fmt)
  if not listing.files:
    why = f" (skipped {listing.skip_summary()})" if listing.skipped else ""
    raise DataError(f"data.path {path!r} holds no readable files for format {fmt}{why}")
  return listing.files


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
  try:
    with file.open(encoding="utf-8") as f:
      for number, line in enumerate(f, 1):
        yield number, line.rstrip("\n")
  except UnicodeDecodeError as e:
    # text mode decodes a block of lines at once: the lines read so far do not say where
    raise DataError(f"{file}:{_first_bad_line(file)}: not UTF-8 text ({e.reason})") from None


def _first_bad_line(file: pathlib.Path) -> int:
  """The number (1-based) of the first line of ``file`` that does not decode as UTF-8. A
  newline byte is never part of a multi-byte character, so lines decode on their own."""
  number = 0
  with file.open("rb") as f:
    for number, raw in enumerate(f, 1):
      try:
        raw.decode("utf-8")
      except UnicodeDecodeError:
        return number
  return number  # not reached while the file is as it was when the decode failed


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


def iter_documents(
  path: str, fmt: str = "auto", files: list[pathlib.Path] | None = None
) -> Iterator[tuple[pathlib.Path, str, Any]]:
  """Every document under ``path`` as ``(file, kind, document)``, streamed file by file
  and line by line; kind is ``text`` or ``chat``. ``files``: ``path``'s files when already
  listed (a walk is listed once).

  Raises:
    DataError: missing path, malformed records, or text and chat files mixed.
  """
  kinds = set()
  for file in list_files(path, fmt) if files is None else files:
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
