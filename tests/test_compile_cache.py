"""The commands' persistent compilation cache: where it lives, and a second identical start
compiling nothing new."""

import os
import pathlib
import subprocess
import sys

import pytest
from conftest import SMALL_MODEL, make_cfg

from jaxstep.cli import compile_cache


def test_the_cache_folder_follows_the_setting_the_variable_and_the_users_cache_dir(
  tmp_path, monkeypatch
):
  monkeypatch.delenv(compile_cache.ENV, raising=False)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert compile_cache.folder_for("auto") == tmp_path / "xdg" / "jaxstep" / "xla"
  monkeypatch.delenv("XDG_CACHE_HOME")
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert compile_cache.folder_for() == tmp_path / "home" / ".cache" / "jaxstep" / "xla"
  monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "env"))
  assert compile_cache.folder_for("auto") == tmp_path / "env"
  monkeypatch.setenv("HERE", str(tmp_path))
  assert compile_cache.folder_for("$HERE/mine") == tmp_path / "mine"  # the key wins
  for off in ("off", "OFF", "", "none", "0"):
    assert compile_cache.folder_for(off) is None
  monkeypatch.setenv(compile_cache.ENV, "off")
  assert compile_cache.folder_for("auto") is None


def _entries(folder: pathlib.Path) -> set[str]:
  return {p.name for p in folder.glob("*-cache")} if folder.exists() else set()


def _train(tmp_path, run: str, *overrides, cache_env=None) -> subprocess.CompletedProcess:
  env = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT"))
  }
  env.pop(compile_cache.ENV, None)
  env.update(cache_env or {}, HOME=str(tmp_path / "home"), XDG_CACHE_HOME="")
  # every program kept, however fast it compiled: which ones pass the threshold varies
  env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  argv = [*SMALL_MODEL, f"data.path={tmp_path / 'corpus.txt'}", f"run_dir={tmp_path / run}"]
  cmd = [sys.executable, "-m", "jaxstep.train", *argv, "train.max_steps=1", *overrides]
  return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_second_identical_start_compiles_nothing_new(tmp_path):
  """The first ``train`` fills the cache under the user's cache dir; a second run of the
  same config (another run_dir) finds every program there: no entry is added. ``xla_cache``
  moves it; ``JAXSTEP_XLA_CACHE=off`` writes none."""
  make_cfg(tmp_path)
  folder = tmp_path / "home" / ".cache" / "jaxstep" / "xla"
  first = _train(tmp_path, "a")
  assert first.returncode == 0, first.stderr[-2000:]
  written = _entries(folder)
  assert len(written) >= 3, sorted(folder.iterdir()) if folder.exists() else "no cache folder"
  second = _train(tmp_path, "b")
  assert second.returncode == 0, second.stderr[-2000:]
  assert _entries(folder) == written
  moved = _train(tmp_path, "c", f"xla_cache={tmp_path / 'moved'}")
  assert moved.returncode == 0 and len(_entries(tmp_path / "moved")) >= 3, moved.stderr[-2000:]
  assert _entries(folder) == written  # nothing of that run went to the default folder
  off = _train(tmp_path, "d", "train.seq_len=8", cache_env={compile_cache.ENV: "off"})
  assert off.returncode == 0, off.stderr[-2000:]
  assert _entries(folder) == written  # the shorter windows' programs were not kept
