"""JAX's persistent compilation cache, on for every command by default.

A command spends most of a short start compiling (the harness on a 135M model: most of its
two minutes); XLA's executables are pure functions of the program, the compile options,
the devices and the jax/jaxlib versions, and JAX keys each cache entry by all of them, so a
second identical start, or a resumed run, loads them instead (MaxText keeps its
``jax_cache_dir`` for the same reason).

Where (first match): JAX's own ``JAX_COMPILATION_CACHE_DIR`` (or a cache dir the caller set
in ``jax.config``) is left as it is; the config key ``xla_cache`` of ``jaxstep train``, when
it is not ``auto``; ``$JAXSTEP_XLA_CACHE``; ``$XDG_CACHE_HOME/jaxstep/xla`` (by default
``~/.cache/jaxstep/xla``). ``off`` (or an empty value) disables it, as does JAX's
``JAX_ENABLE_COMPILATION_CACHE=false``.

Safe across processes: the cache has a size limit (``MAX_BYTES`` unless
``JAX_COMPILATION_CACHE_MAX_SIZE`` says otherwise), under which JAX takes a file lock
around every read and write of an entry and evicts the least recently used entries; only
process 0 of a multi-process job writes. An entry that cannot be read (a process killed
while writing it) is a warning and a fresh compile, never a failure; so is a cache folder
that cannot be written.
"""

from __future__ import annotations

import logging
import os
import pathlib
import tempfile

log = logging.getLogger("jaxstep")

ENV = "JAXSTEP_XLA_CACHE"
OFF = frozenset({"", "off", "none", "false", "0"})
MAX_BYTES = 4 * 2**30  # LRU-evicted above this
# programs that compile faster than this are not kept (JAX's default is 1 s; most of a small
# model's programs on a CPU compile in 0.1-1 s, and together they are most of a start)
MIN_COMPILE_S = 0.2

_ours: str | None = None  # the folder this module set, so that a later call may move it


def folder_for(setting: str = "auto") -> pathlib.Path | None:
  """The cache folder ``setting`` names: ``auto`` (``$JAXSTEP_XLA_CACHE``, else the user's
  cache dir), a path (``~`` and ``$VAR`` expanded), or None for ``off``."""
  if setting.strip().lower() == "auto":
    setting = os.environ.get(ENV, "auto")
    if setting.strip().lower() == "auto":
      base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
      return pathlib.Path(base) / "jaxstep" / "xla"
  if setting.strip().lower() in OFF:
    return None
  return pathlib.Path(os.path.expandvars(os.path.expanduser(setting.strip())))


def enable(setting: str = "auto") -> pathlib.Path | None:
  """Points JAX's persistent compilation cache at ``folder_for(setting)`` before the first
  compile and returns the folder in use (None: no cache). A cache JAX was given by its own
  settings is left alone; a folder that cannot be created or written is one warning line."""
  global _ours
  import jax

  current = jax.config.jax_compilation_cache_dir
  if not jax.config.jax_enable_compilation_cache:
    return None
  if current and current != _ours:  # JAX's own setting wins
    return pathlib.Path(current)
  folder = folder_for(setting)
  if folder is not None and str(folder) == _ours:  # set at the command's start: kept
    return folder
  if folder is None or not _writable(folder):
    if _ours is not None:
      jax.config.update("jax_compilation_cache_dir", None)
      _ours = None
    return None
  jax.config.update("jax_compilation_cache_dir", str(folder))
  if "JAX_COMPILATION_CACHE_MAX_SIZE" not in os.environ:
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
  if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_S)
  _ours = str(folder)
  log.info("compilation cache: %s (%s=off to disable)", folder, ENV)
  return folder


def _writable(folder: pathlib.Path) -> bool:
  try:
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=folder):
      pass
  except OSError as e:
    log.warning(
      "compilation cache %s cannot be written (%s); compiling from scratch (set %s to "
      "another folder, or off)",
      folder,
      e.strerror or e,
      ENV,
    )
    return False
  return True
