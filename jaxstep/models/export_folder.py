"""The folder a model or adapter export writes, and the rules that keep a user's models safe.

A folder is written whole or not at all: every file (weights, config, tokenizer files, the
marker) goes into a staging folder beside the target, ``.<name>.partial-<pid>-<random>``,
and one rename publishes it. A process killed on the way leaves only its staging folder,
which the next export to the same target removes (its pid is no longer running), never
a target that looks complete without being so.

An existing target is replaced only when jaxstep wrote it: it holds ``MARKER``
(``jaxstep_export.json``: what was written, from which run and step) and nothing that the
marker does not list. A folder with files of anyone else (a downloaded model, a fine-tune
from another tool, notes) is refused with nothing written, and so is a protected folder
(the run's own base model, whatever it holds): an export must never replace the weights
that a run, or its user, still needs.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping

from jaxstep.errors import WRITE_REFUSED, ConfigError, RunIOError

MARKER = "jaxstep_export.json"
Protected = Mapping[str | pathlib.Path, str] | None
PARTIAL = ".partial-"


def _owned_files(folder: pathlib.Path) -> set[str] | None:
  """The names ``folder``'s marker lists (with the marker itself), None without one."""
  try:
    listed = json.loads((folder / MARKER).read_text())["files"]
    if isinstance(listed, list) and all(isinstance(name, str) for name in listed):
      return {*listed, MARKER}
  except (OSError, ValueError, KeyError, TypeError):
    pass
  return None


def check_target(folder: pathlib.Path, protected: Protected = None) -> None:
  """``ConfigError`` unless ``folder`` may be written: absent, an empty folder, or one that
  jaxstep wrote (its marker lists every file in it), and none of ``protected`` (a path →
  what it is to the caller, e.g. "the run's base model (model.init_from)")."""
  folder = pathlib.Path(folder)
  alternative = f"give a new or empty folder (e.g. {folder.with_name(folder.name + '-export')})"
  for path, what in (protected or {}).items():
    if path and folder.exists() and folder.resolve() == pathlib.Path(path).expanduser().resolve():
      raise ConfigError(
        f"{folder} is {what}: writing there would replace the files it needs, so nothing "
        f"was written; {alternative}"
      )
  if not folder.exists():
    return
  if not folder.is_dir():
    raise ConfigError(f"{folder} exists and is not a folder: nothing was written; {alternative}")
  names = sorted(p.name for p in folder.iterdir())
  owned = _owned_files(folder)
  foreign = names if owned is None else [n for n in names if n not in owned]
  if foreign:
    shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
    raise ConfigError(
      f"{folder} holds files jaxstep did not write ({shown}): it is not an earlier export, "
      f"so nothing was written there; {alternative}"
    )


def stage(folder: pathlib.Path) -> pathlib.Path:
  """A new staging folder beside ``folder`` (created with its parents), after removing the
  staging folders of exports to ``folder`` whose process is gone."""
  folder.parent.mkdir(parents=True, exist_ok=True)
  clean_leftovers(folder)
  prefix = f".{folder.name}{PARTIAL}{os.getpid()}-"
  return pathlib.Path(tempfile.mkdtemp(dir=folder.parent, prefix=prefix))


def clean_leftovers(folder: pathlib.Path) -> None:
  """Removes ``.<name>.partial-<pid>-*`` folders beside ``folder`` whose pid is not running."""
  for entry in folder.parent.glob(f".{folder.name}{PARTIAL}*"):
    pid = entry.name[len(folder.name) + 1 + len(PARTIAL) :].split("-", 1)[0]
    if pid.isdigit() and not _running(int(pid)):
      shutil.rmtree(entry, ignore_errors=True)


def _running(pid: int) -> bool:
  if pid == os.getpid():
    return True
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's process
    return True
  return True


def publish(staging: pathlib.Path, folder: pathlib.Path, provenance: dict) -> None:
  """Writes the marker (``provenance`` and the staged files' names) into ``staging`` and
  renames it to ``folder``; an earlier export there is swapped out and removed after."""
  files = sorted(p.name for p in staging.iterdir())
  marker = {"written_by": "jaxstep", **provenance, "files": files}
  (staging / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
  if not folder.exists():
    os.rename(staging, folder)
    return
  old = staging.with_name(staging.name + ".old")
  os.rename(folder, old)
  try:
    os.rename(staging, folder)
  except BaseException:
    os.rename(old, folder)
    raise
  shutil.rmtree(old)


def write(
  folder: str | pathlib.Path,
  fill: Callable[[pathlib.Path], None],
  *,
  provenance: dict,
  protected: Protected = None,
  extra_files: Iterable[str | pathlib.Path] = (),
) -> pathlib.Path:
  """Checks ``folder`` (``check_target``), lets ``fill`` write the files into a staging
  folder, copies ``extra_files`` (tokenizer files) beside them and publishes the whole;
  returns ``folder``. On any failure the staging folder is removed and ``folder`` is as
  it was."""
  folder = pathlib.Path(folder)
  check_target(folder, protected)
  try:
    staging = stage(folder)
  except OSError as e:
    if e.errno in WRITE_REFUSED:
      raise _failed_write(folder, e) from None
    raise
  try:
    fill(staging)
    for file in map(pathlib.Path, extra_files):
      shutil.copy2(file, staging / file.name)
    publish(staging, folder, provenance)
  except BaseException as e:
    shutil.rmtree(staging, ignore_errors=True)
    if isinstance(e, OSError) and e.errno in WRITE_REFUSED:
      raise _failed_write(folder, e) from None
    raise
  return folder


def _failed_write(folder: pathlib.Path, e: OSError) -> RunIOError:
  """A write the disk refused (full, read-only, no permission): exit 74's error."""
  return RunIOError(
    f"writing {folder} failed ({e.strerror or e}); nothing was left there: make room or "
    f"choose a writable folder, then export again"
  )
