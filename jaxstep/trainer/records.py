"""JSON lines as every jaxstep output writes and reads them: strict JSON (a non-finite float
is written as the string ``"nan"``/``"inf"``, which ``float()`` still parses), and readers
that survive the cut last line a killed process leaves."""

from __future__ import annotations

import json
import math
import pathlib


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


def truncate_records(path: pathlib.Path, last_step: int) -> None:
  """Keeps the records with ``step <= last_step`` (a resumed run rewrites the rest, so no
  step appears twice)."""
  if path.exists():
    keep = [r for r in read_records(path) if r.get("step", 0) <= last_step]
    path.write_text("".join(dumps(r) + "\n" for r in keep))
