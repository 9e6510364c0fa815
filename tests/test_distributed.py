"""Multi-process start: the bounded wait for the coordinator, its readable error, the
coordinator address's parsing, and when processes talk through gloo."""

import os
import socket
import subprocess
import sys
import time

import pytest

from jaxstep.errors import ConfigError
from jaxstep.parallel import distributed
from jaxstep.trainer import config as config_lib


def closed_port() -> int:
  """A local port nothing listens on: bound once, then released."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_an_unreachable_coordinator_is_an_error_after_the_timeout():
  port = closed_port()
  start = time.monotonic()
  with pytest.raises(ConfigError) as e:
    distributed.wait_for_coordinator(("127.0.0.1", port), 1, process_id=1)
  assert 0.9 < time.monotonic() - start < 3
  message = str(e.value)
  assert f"127.0.0.1:{port}" in message and "process 1" in message
  assert "mesh.initialization_timeout" in message and "process 0" in message


def test_a_listening_coordinator_is_reached_at_once():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    s.listen()
    start = time.monotonic()
    distributed.wait_for_coordinator(s.getsockname(), 30, process_id=1)
  assert time.monotonic() - start < 2


@pytest.mark.parametrize(
  ("coordinator", "address"),
  [("host0:12345", ("host0", 12345)), ("[::1]:80", ("::1", 80)), (" 10.0.0.1:1 ", ("10.0.0.1", 1))],
)
def test_a_coordinator_is_host_and_port(coordinator, address):
  assert distributed.parse_coordinator(coordinator) == address


@pytest.mark.parametrize(
  "coordinator", ["host0", "host0:", ":123", "host0:port", "h:0", "h:70000", "::1"]
)
def test_a_malformed_coordinator_names_the_key(coordinator):
  with pytest.raises(ConfigError, match="mesh.coordinator"):
    distributed.parse_coordinator(coordinator)


def test_a_malformed_coordinator_fails_before_any_wait():
  with pytest.raises(ConfigError, match="mesh.coordinator"):
    distributed.initialize_distributed("host0", 2, 1, initialization_timeout=60)


def test_a_process_id_beyond_the_job_names_both_keys():
  with pytest.raises(ConfigError, match="mesh.process_id 2 .* mesh.num_processes 2"):
    distributed.initialize_distributed("host0:1", 2, 2, initialization_timeout=60)


@pytest.mark.parametrize("value", ["0", "-5"])
def test_the_initialization_timeout_must_be_positive(value):
  with pytest.raises(ConfigError, match="mesh.initialization_timeout"):
    config_lib.load(None, [f"mesh.initialization_timeout={value}"])


def test_the_initialization_timeout_has_a_default_and_an_override():
  assert config_lib.load(None).mesh.initialization_timeout == 300
  cfg = config_lib.load(None, ["mesh.initialization_timeout=7"])
  assert cfg.mesh.initialization_timeout == 7


@pytest.mark.parametrize(
  ("platforms", "gloo"),
  [
    ("cpu", True),
    ("cpu,cuda", True),
    ("cuda", False),
    ("gpu", False),
    ("cuda,cpu", False),
    ("tpu", False),
  ],
)
def test_gloo_only_when_jax_runs_on_the_cpu(platforms, gloo):
  assert distributed.uses_gloo(platforms) is gloo


def test_gloo_follows_the_installed_plugins_when_no_platform_is_named(monkeypatch):
  monkeypatch.setattr(distributed.importlib.util, "find_spec", lambda name: None)
  assert distributed.uses_gloo("") is True
  monkeypatch.setattr(
    distributed.importlib.util, "find_spec", lambda name: name == "jax_cuda12_plugin"
  )
  assert distributed.uses_gloo("") is False


def train_as(tmp_path, coordinator: str, process_id: int, timeout: int = 3):
  """``jaxstep train`` as one process of a 2-process job; ``(proc, seconds, error lines)``."""
  start = time.monotonic()
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "jaxstep",
      "train",
      f"mesh.coordinator={coordinator}",
      "mesh.num_processes=2",
      f"mesh.process_id={process_id}",
      f"mesh.initialization_timeout={timeout}",
      f"run_dir={tmp_path / 'run'}",
    ],
    capture_output=True,
    text=True,
    timeout=90,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
  return proc, time.monotonic() - start, errors


@pytest.mark.slow
def test_train_without_a_coordinator_exits_2_with_one_line(tmp_path):
  port = closed_port()
  proc, seconds, errors = train_as(tmp_path, f"127.0.0.1:{port}", 1, timeout=2)
  assert seconds < 30 and proc.returncode == 2, proc.stderr
  assert len(errors) == 1 and f"127.0.0.1:{port}" in errors[0], proc.stderr
  assert "Traceback" not in proc.stderr
  assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_process_0_whose_peers_never_join_exits_2_with_one_line(tmp_path):
  """JAX's own timeout aborts the process with a C++ stack (exit 134); jaxstep ends it
  first, readably."""
  port = closed_port()
  proc, seconds, errors = train_as(tmp_path, f"127.0.0.1:{port}", 0)
  assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
  assert f"waited 3 s for all 2 processes to join the coordinator 127.0.0.1:{port}" in errors[0]
  assert "mesh.initialization_timeout" in errors[0]
  assert "Traceback" not in proc.stderr and "Check failure" not in proc.stderr
  assert seconds < 40 and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_process_0_on_a_busy_port_exits_2_naming_it(tmp_path):
  with socket.socket() as busy:
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    proc, _, errors = train_as(tmp_path, f"127.0.0.1:{port}", 0)
  assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
  assert f"could not start the multi-process job at 127.0.0.1:{port}" in errors[0]
  assert "choose a free port in mesh.coordinator" in errors[0]
  assert "Traceback" not in proc.stderr
