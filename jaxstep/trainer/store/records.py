"""The files a run keeps, as every jaxstep output writes and reads them: JSON lines in strict
JSON (a non-finite float is written as the string ``"nan"``/``"inf"``, which ``float()``
still parses), readers that survive the cut last line a killed process leaves, rewrites
that a kill cannot cut (``write_atomic``), and ``.npz`` side files read whole so that a cut
or changed one is one ``ValueError`` (``read_npz``)."""

from __future__ import annotations

import json
import math
import os
import pathlib
import tempfile
import zipfile
import zlib

import numpy as np


def _clean(value):
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)
  if isinstance(value, dict):
    return {k: _clean(v) for k, v in value.items()}
  if isinstance(value, list | tuple):
    return [_clean(v) for v in value]
  return value


def dumps(record) -> str:
  """``record`` as one line of strict JSON (no bare ``NaN``/``Infinity``)."""
  return json.dumps(_clean(record), allow_nan=False)


def append(path: pathlib.Path, record: dict) -> None:
  """Appends ``record`` as one JSON line."""
  with path.open("a") as f:
    f.write(dumps(record) + "\n")


def read_records(path: pathlib.Path) -> list[dict]:
  """The records of a ``.jsonl`` file (none if it is missing), skipping blank lines, a line
  cut short by a kill, and bytes that are not UTF-8."""
  if not path.exists():
    return []
  records = []
  for line in path.read_text(errors="replace").splitlines():
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      continue
    if isinstance(record, dict):
      records.append(record)
  return records


def write_atomic(path: pathlib.Path, text: str | bytes) -> None:
  """Replaces ``path`` by ``text`` (or bytes) so that a kill at any moment leaves the old file or
  the new one, never a cut one: written to a temporary file beside it, flushed to disk,
  renamed over it (atomic on POSIX), and the folder flushed so the rename itself survives a
  crash. A failed write removes the temporary file and leaves ``path`` as it was."""
  path = pathlib.Path(path)
  fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
  try:
    with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    pathlib.Path(tmp).unlink(missing_ok=True)
    raise
  folder = os.open(path.parent, os.O_RDONLY)
  try:
    os.fsync(folder)
  finally:
    os.close(folder)


def truncate_records(path: pathlib.Path, last_step: int) -> None:
  """Keeps the records with ``step <= last_step`` (a resumed run rewrites the rest, so no
  step appears twice); the rewrite is atomic, so a kill during it loses no history."""
  if path.exists():
    keep = [r for r in read_records(path) if r.get("step", 0) <= last_step]
    write_atomic(path, "".join(dumps(r) + "\n" for r in keep))


def recorded_end(run_dir: pathlib.Path, default_set: str) -> tuple[dict, dict[str, dict]]:
  """What a finished run recorded last: its last ``metrics.jsonl`` line and the last
  ``eval.jsonl`` line of each eval set (a line without ``set`` is ``default_set``'s)."""
  last = (read_records(run_dir / "metrics.jsonl") or [{}])[-1]
  evals: dict[str, dict] = {}
  for record in read_records(run_dir / "eval.jsonl"):
    evals[record.get("set", default_set)] = record
  return last, evals


# What np.load raises on an .npz cut short or with bytes changed, besides OSError and
# ValueError (a cut or changed .npy header): a missing end record, a header that disagrees or
# a CRC-32 that fails (zipfile.BadZipFile), a file cut before its first bytes (EOFError), a
# flipped compression method (NotImplementedError) or encryption flag (RuntimeError), a
# compressed member's broken stream (zlib.error).
_NPZ_DAMAGE = (
  ValueError,
  EOFError,
  KeyError,
  zipfile.BadZipFile,
  zlib.error,
  NotImplementedError,
  RuntimeError,
)


def read_npz(path: pathlib.Path, names: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
  """Every array of the ``.npz`` file at ``path``, by name, each read to its end.

  Reading a member to its end is what makes zipfile check its CRC-32: ``np.savez`` stores
  members uncompressed, so bytes changed inside an array's data break nothing else, and a
  reader that stopped early (or mapped the file) would take them as numbers.

  Raises:
    OSError: the file cannot be opened or read (missing, a directory, no permission).
    ValueError: it is not a whole ``.npz`` holding ``names`` (cut short, bytes changed,
      another kind of file); the message says what failed.
  """
  try:
    # opened here: np.load leaves a file it opened itself open when the zip is damaged
    with open(path, "rb") as file:
      stored = np.load(file)
      if not isinstance(stored, np.lib.npyio.NpzFile):  # an .npy file: one array
        raise ValueError("one .npy array")
      with stored:
        arrays = {name: stored[name] for name in stored.files}
  except OSError:
    raise
  except _NPZ_DAMAGE as e:
    raise ValueError(f"not a whole .npz file: {type(e).__name__}: {e}") from e
  missing = [name for name in names if name not in arrays]
  if missing:
    raise ValueError(f"not a whole .npz file: {', '.join(missing)} missing")
  return arrays
