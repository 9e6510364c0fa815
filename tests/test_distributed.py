"""Multi-process start: the bounded wait for the coordinator, its readable error, the
coordinator address's parsing, and when processes talk through gloo."""

import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxstep.errors import ConfigError, RunDirError
from jaxstep.parallel import distributed
from jaxstep.trainer.config import loading as config_lib


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


class FakeJob:
  """Process ``index`` of a 2-process job whose collectives are faked: the broadcast hands
  over ``sent`` (process 0's own bytes when ``None``), the all-gather adds ``peer``, the
  other process's ``ok flag + host name`` row."""

  def __init__(self, monkeypatch, index: int, peer: bytes, sent: bytes | None = None):
    from jax.experimental import multihost_utils

    from jaxstep.trainer.store import run_dir as run_dir_lib

    monkeypatch.setattr(run_dir_lib.jax, "process_count", lambda: 2)
    monkeypatch.setattr(run_dir_lib.jax, "process_index", lambda: index)
    monkeypatch.setattr(run_dir_lib, "SHARED_WAIT_S", 0.3)
    fake = np.frombuffer(sent.ljust(32), np.uint8) if sent is not None else None
    monkeypatch.setattr(
      multihost_utils, "broadcast_one_to_all", lambda x: x if fake is None else fake
    )
    row = np.frombuffer(peer.ljust(64), np.uint8)
    rows = (lambda x: [x, row]) if index == 0 else (lambda x: [row, x])
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: np.stack(rows(x)))
    self.check = run_dir_lib.check_shared


def test_a_host_that_does_not_see_run_dir_stops_the_job_naming_it(monkeypatch, tmp_path):
  check = FakeJob(monkeypatch, 0, peer=b"0host-b").check
  with pytest.raises(RunDirError, match=r"process 1 \(host-b\) cannot read what process 0"):
    check(tmp_path / "run")
  assert not (tmp_path / "run").exists()  # the token and the folder it made are gone


def test_a_trainer_whose_hosts_do_not_share_run_dir_stops_before_writing(monkeypatch, tmp_path):
  import jax.numpy as jnp
  import optax

  import jaxstep

  FakeJob(monkeypatch, 0, peer=b"0host-b")
  trainer = jaxstep.Trainer(
    lambda params, batch, rng: (jnp.sum(params["w"] * batch["x"]), {}),
    {"w": jnp.zeros(2)},
    optax.sgd(0.1),
    train_data=[{"x": np.ones((4, 2), np.float32)}],
    run_dir=tmp_path / "run",
    train={"global_batch_size": 4, "max_steps": 1, "progress": False},
  )
  with pytest.raises(RunDirError, match=r"process 1 \(host-b\) cannot read what process 0"):
    trainer.fit()
  assert not (tmp_path / "run").exists()


def test_a_shared_run_dir_passes_and_keeps_only_what_was_there(monkeypatch, tmp_path):
  (tmp_path / "run").mkdir()
  (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
  FakeJob(monkeypatch, 0, peer=b"1host-b").check(tmp_path / "run")
  assert [p.name for p in (tmp_path / "run").iterdir()] == ["metrics.jsonl"]


def test_a_process_that_cannot_read_the_token_writes_nothing(monkeypatch, tmp_path):
  check = FakeJob(monkeypatch, 1, peer=b"1host-a", sent=b"a" * 32).check
  start = time.monotonic()
  with pytest.raises(RunDirError, match=r"process 1 \(.+\) cannot read .* process 0 \(host-a\)"):
    check(tmp_path / "elsewhere")
  assert time.monotonic() - start < 3 and not (tmp_path / "elsewhere").exists()


def test_one_process_checks_nothing(tmp_path):
  from jaxstep.trainer.store import run_dir as run_dir_lib

  run_dir_lib.check_shared(tmp_path / "run")
  assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_processes_that_see_different_run_dirs_are_refused(tmp_path):
  """As if each host had its own disk: every process exits 2 with the same line, and
  neither run_dir is left behind."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_"))}
  procs = [
    subprocess.Popen(
      [
        sys.executable,
        "-m",
        "jaxstep",
        "train",
        "train.max_steps=1",
        f"run_dir={tmp_path / f'host{i}'}",
      ],
      env={
        **env,
        "JAX_PLATFORMS": "cpu",
        "JAXSTEP_COORDINATOR": f"127.0.0.1:{port}",
        "JAXSTEP_NUM_PROCESSES": "2",
        "JAXSTEP_PROCESS_ID": str(i),
      },
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(2)
  ]
  outs = [p.communicate(timeout=180) for p in procs]
  for p, (_, err) in zip(procs, outs, strict=True):
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert p.returncode == 2 and len(errors) == 1, err[-3000:]
    assert f"run_dir {tmp_path / 'host'}" in errors[0]
    assert "is not on storage every host shares: process 1 (" in errors[0]
    assert "Traceback" not in err
  assert not (tmp_path / "host0").exists() and not (tmp_path / "host1").exists()
