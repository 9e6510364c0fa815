"""The ``--out`` folder of ``prepare``: it is replaced as a whole, so only a new or empty
folder or a prepared one (from the same settings, or any with ``force``) is accepted, never
one inside an input; one prepare of a folder at a time; the swap that replaces it."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import shutil
import signal
import threading

from jaxstep.data import readers
from jaxstep.data.manifest import MANIFEST, manifest_files
from jaxstep.errors import DataError


def _listed_files(out: pathlib.Path) -> tuple[dict | None, set[str]]:
  """``out``'s manifest (None if it has no valid one) and the names it accounts for."""
  try:
    manifest = json.loads((out / MANIFEST).read_text())
    listed = {e["file"] for e in manifest_files(manifest)} | {MANIFEST}
    listed.add(manifest["tokenizer"].get("file") or MANIFEST)
    if isinstance(manifest["format_version"], int):
      return manifest, listed
  except (OSError, ValueError, KeyError, TypeError, AttributeError):
    pass
  return None, set()


def _foreign_files(out: pathlib.Path) -> list[str]:
  """What ``out`` holds besides a prepared folder's files (everything, if it is none)."""
  _, listed = _listed_files(out)
  return sorted(p.name for p in out.iterdir() if p.name not in listed)


def _prepared_manifest(out: pathlib.Path) -> dict | None:
  """``out``'s manifest if ``out`` is a prepared folder holding nothing else (only then
  may it be replaced as a whole), else None."""
  if not out.is_dir() or _foreign_files(out):
    return None
  return _listed_files(out)[0]


def refuse_unsafe_out(out: pathlib.Path, inputs: list[str]) -> None:
  """``out`` is replaced as a whole: refuse one inside a directory being read (equal to it
  included), a file, or a folder holding anything but a prepared folder's files."""
  real = out.resolve()
  for path in inputs:
    root = readers.walk_root(path)
    if root is not None and (real == root or root in real.parents):
      raise DataError(
        f"--out {out} is inside the input directory {path}; choose an --out outside it"
      )
  if out.exists() and not out.is_dir():
    raise DataError(f"--out {out} is a file, not a folder; choose a new or empty folder")
  foreign = _foreign_files(out) if out.is_dir() else []
  if foreign:
    shown = ", ".join(foreign[:3]) + (", …" if len(foreign) > 3 else "")
    raise DataError(
      f"--out {out} holds files that are not a prepared folder's ({shown}); it would be "
      f"replaced as a whole, so choose a new or empty folder"
    )


def refuse_input_inside_out(out: pathlib.Path, sources: list[dict]) -> None:
  real = out.resolve()
  for s in sources:
    if real in pathlib.Path(s["name"]).resolve().parents:
      raise DataError(
        f"the input {s['name']} is inside --out {out}, which is replaced; move it out first"
      )


def refuse_other_settings(out: pathlib.Path, inputs_digest: str, current: dict) -> None:
  """A prepared ``out`` from other inputs or settings is refused, naming the change."""
  old = _prepared_manifest(out)
  if old is None or old.get("inputs_digest") == inputs_digest:
    return
  changes = [
    f"{k} {old['settings'].get(k)} → {v}"
    for k, v in current["settings"].items()
    if old.get("settings", {}).get(k) != v
  ]
  was = old.get("tokenizer_source")
  if was is not None and was != current["tokenizer_source"]:
    changes.append(f"tokenizer {_short(was)} → {_short(current['tokenizer_source'])}")
  old_names = [s["name"] for s in old.get("sources", [])]
  new_names = [s["name"] for s in current["sources"]]
  if old_names != new_names:
    added = [n for n in new_names if n not in old_names]
    removed = [n for n in old_names if n not in new_names]
    what = [f"+{len(added)} files" if added else "", f"-{len(removed)} files" if removed else ""]
    changes.append(f"inputs {', '.join(w for w in what if w) or 'reordered'}")
  elif [s["bytes"] for s in old.get("sources", [])] != [s["bytes"] for s in current["sources"]]:
    changes.append("inputs changed in size")
  if not changes:
    changes.append(
      "inputs modified since (file times)" if was is not None else "tokenizer or inputs"
    )
  raise DataError(
    f"--out {out} was prepared from other inputs or settings ({'; '.join(changes)}); re-run "
    f"with --force to replace it, or choose another --out"
  )


def _short(source: str) -> str:
  return source[: len("file:") + 12] + "…" if source.startswith("file:") else source


@contextlib.contextmanager
def exclusive(out: pathlib.Path):
  """An exclusive lock on ``out``'s lock file for the block (concurrent runs wait)."""
  with open(out.parent / f".{out.name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(lock, fcntl.LOCK_UN)


def replace(out: pathlib.Path, tmp: pathlib.Path) -> None:
  """``tmp`` becomes ``out``; an older ``out`` is moved aside first and then removed (a
  reader that still has its files open keeps reading them). A Ctrl-C or SIGTERM waits
  for both moves, so there is always an ``out``; if one then stops the removal, the next
  prepare removes the old folder (``stale``)."""
  old = out.parent / f".{out.name}.old-{os.getpid()}"
  with _signals_deferred():
    if out.exists():
      out.rename(old)
    tmp.rename(out)
  shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _signals_deferred():
  """SIGINT and SIGTERM are handled after the block (a handler that raises would stop it
  halfway). Only the main thread runs handlers: in another one the block is not stopped.
  Only a signal with a Python handler (one that can raise) is deferred: touching one at
  its default would drop a handler installed outside Python, which Python does not see
  and could not put back (JAX's preemption notifier takes SIGTERM in a multi-process
  job)."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  arrived = []
  held = [s for s in (signal.SIGINT, signal.SIGTERM) if callable(signal.getsignal(s))]
  previous = [signal.signal(s, lambda signum, frame: arrived.append(signum)) for s in held]
  try:
    yield
  finally:
    for s, handler in zip(held, previous, strict=True):
      signal.signal(s, handler)
    for signum in arrived:
      signal.raise_signal(signum)


def stale(out: pathlib.Path) -> list[pathlib.Path]:
  """What stopped prepares of ``out`` left next to it: temporary and old folders."""
  return [*out.parent.glob(f".{out.name}.tmp-*"), *out.parent.glob(f".{out.name}.old-*")]
