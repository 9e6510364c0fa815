"""The run directory's lock and the folders it refuses, in-process (the commands' own runs
against these rules are in test_run_dir_rules.py)."""

import errno
import os

import pytest

from jaxstep.errors import RunDirError, RunIOError
from jaxstep.models import export_folder
from jaxstep.trainer.store import run_dir as run_dir_lib


@pytest.mark.parametrize("marker", ["model.safetensors", "pytorch_model.bin", export_folder.MARKER])
def test_a_model_folder_is_refused_as_a_run_dir_with_nothing_written(tmp_path, marker):
  (tmp_path / "config.json").write_text("{}")
  (tmp_path / marker).write_text("{}")
  before = sorted(p.name for p in tmp_path.iterdir())
  with pytest.raises(RunDirError, match=f"run_dir {tmp_path} is a model folder"):
    with run_dir_lib.locked(tmp_path):
      pass
  assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_folder_with_a_config_json_alone_is_a_run_dir_like_any_other(tmp_path):
  (tmp_path / "config.json").write_text("{}")  # e.g. a tool's settings
  with run_dir_lib.locked(tmp_path) as run_dir:
    assert (run_dir / run_dir_lib.LOCK).is_file()


def test_a_full_disk_at_the_lock_file_is_a_failed_write(tmp_path, monkeypatch):
  """A 100 %-full disk still creates the empty lock file (an inode) and then refuses its
  first bytes: that is exit 74's failed write, not a traceback; the folder it created goes."""

  def full(fd, data, offset):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  monkeypatch.setattr(run_dir_lib.os, "pwrite", full)
  with pytest.raises(RunIOError, match="cannot be used \\(No space left on device\\)"):
    with run_dir_lib.locked(tmp_path / "run"):
      pass
  assert not (tmp_path / "run").exists()
