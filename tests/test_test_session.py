"""The README's test line as a user runs it again and again: what one session leaves."""

import os
import pathlib
import subprocess
import sys

import pytest

SESSION_VARIABLES = ("JAXSTEP_CACHE", "JAX_COMPILATION_CACHE_DIR", "JAXSTEP_XLA_CACHE")


@pytest.mark.slow
@pytest.mark.parametrize("workers", ["0", "2"])
def test_a_test_session_removes_the_caches_it_made(tmp_path, workers):
  """A session prepares data and compiles programs into folders of its own (~170 MB for both
  tiers); they are removed when it ends, with or without pytest-xdist's workers, whose
  processes use the first process's folders."""
  tmp = tmp_path / "tmp"
  tmp.mkdir()
  env = {k: v for k, v in os.environ.items() if k not in SESSION_VARIABLES}
  env["TMPDIR"] = str(tmp)
  test = f"{pathlib.Path(__file__).parent / 'test_layout.py'}::test_every_trainer_module_is_short"
  command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", workers, test]
  done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
  assert "1 passed" in done.stdout
  assert [p.name for p in tmp.iterdir() if p.name.startswith("jaxstep-")] == []
