"""Every Python snippet of docs/python-api.md runs, in order, on 4 virtual CPU devices."""

import os
import pathlib
import re
import subprocess
import sys

import pytest
from conftest import xla_flags

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "python-api.md"


def snippets(text: str) -> list[str]:
  return re.findall(r"```python\n(.*?)```", text, flags=re.S)


@pytest.mark.slow
def test_python_api_walkthrough_runs_as_written(tmp_path):
  blocks = snippets(DOC.read_text())
  assert len(blocks) >= 8
  script = tmp_path / "walkthrough.py"
  script.write_text("\n\n".join(blocks) + '\nprint("WALKTHROUGH DONE")\n')
  env = {
    **os.environ,
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=4"),
  }
  proc = subprocess.run(
    [sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "FAIL: first divergence at 'loss'" in proc.stdout
  assert "\nP('fsdp',)\n" in proc.stdout  # the model state is sharded like params
  assert "WALKTHROUGH DONE" in proc.stdout
