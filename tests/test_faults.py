"""Faults a hostile-but-realistic user meets (the rest of the fault suite: full disks and
failing writes in ``test_disk_faults.py``, damaged checkpoints in ``test_corruption.py``,
run directories and resume rules in ``test_run_dir_rules.py``): invalid values, unreadable
files, unusable run directories, a stop on one host of many, runaway skips. Each must end
in one ``error:`` line, a documented exit code, no hang, and nothing lost."""

import os
import pathlib

import pytest
from conftest import can_mount, make_cfg, xla_flags
from fault_helpers import IO_EXIT, SMALL, one_error, train_main

from jaxstep.cli import train as train_cli

# Each of these trains, kills or mounts: the whole file is in the slow tier (CI runs it).
pytestmark = pytest.mark.slow


INVALID = {
  "optim.lr=nan": "'optim.lr' must be a finite number",
  "optim.lr=inf": "'optim.lr' must be a finite number",
  "optim.b2=1.5": "optim.b2 must be in [0, 1)",
  "optim.eps=-1": "optim.eps must be > 0",
  "optim.weight_decay=-5": "optim.weight_decay must be >= 0",
  "train.spike_factor=-1": "train.spike_factor must be 0 (off) or > 1",
  "mesh.cpu_devices=-2": "mesh.cpu_devices must be >= 0",
  "mesh.data=0": "mesh.data must be >= 1 or -1",
  "train.max_consecutive_skips=-1": "train.max_consecutive_skips must be >= 0",
  "run_dir=": "run_dir is empty",
  "data.path=": "data.path is empty",
}


@pytest.mark.parametrize("override", sorted(INVALID))
def test_an_invalid_value_exits_2_naming_the_key_and_writes_nothing(
  tmp_path, monkeypatch, capsys, override
):
  monkeypatch.chdir(tmp_path)
  args = [override] if override.startswith("run_dir") else [override, "run_dir=r"]
  assert train_cli.main(args) == 2
  assert INVALID[override] in one_error(capsys)
  assert list(tmp_path.iterdir()) == []


def test_an_unreadable_config_file_is_one_line(tmp_path, capsys):
  assert train_cli.main(["--config", str(tmp_path)]) == 2
  assert "cannot be read (Is a directory)" in one_error(capsys)
  bad = tmp_path / "latin1.yaml"
  bad.write_bytes(b"train:\n  seed: \xff\n")
  assert train_cli.main(["--config", str(bad)]) == 2
  assert "latin1.yaml: not UTF-8 text" in one_error(capsys)
  from jaxstep.cli import memory

  assert memory.main(["--config", str(bad)]) == 2
  assert "latin1.yaml: not UTF-8 text" in one_error(capsys)


def test_home_and_environment_variables_expand_in_paths(tmp_path, monkeypatch):
  from jaxstep.trainer.config import loading as config_lib

  monkeypatch.setenv("HOME", str(tmp_path))
  monkeypatch.setenv("RUNS", "/data/runs")
  cfg = config_lib.load(None, ["run_dir=~/a", "data.path=$RUNS/corpus.txt"])
  assert cfg.run_dir == f"{tmp_path}/a" and cfg.data.path == "/data/runs/corpus.txt"
  yaml_file = tmp_path / "c.yaml"
  yaml_file.write_text("run_dir: ~/from-yaml\n")
  assert config_lib.load(yaml_file).run_dir == f"{tmp_path}/from-yaml"


def test_a_non_utf8_jsonl_file_is_a_data_error(tmp_path, capsys):
  bad = tmp_path / "bad.jsonl"
  bad.write_bytes(b'{"text": "caf\xe9"}\n')
  assert train_cli.main([f"data.path={bad}", f"run_dir={tmp_path / 'r'}"]) == 2
  assert "bad.jsonl:1: not UTF-8 text" in one_error(capsys)
  assert not (tmp_path / "r").exists()
  from jaxstep.cli import check

  assert check.main([f"data.path={bad}"]) == 2
  assert "bad.jsonl:1: not UTF-8 text" in one_error(capsys)


def test_runaway_skips_halt_with_the_last_good_state(tmp_path, capsys):
  assert train_main(tmp_path, "optim.lr=1e6", "train.max_consecutive_skips=3") == 1
  line = one_error(capsys)
  assert "3 updates in a row were skipped" in line and "train.max_consecutive_skips=0" in line
  from jaxstep.trainer.store.records import read_records

  records = read_records(tmp_path / "run" / "metrics.jsonl")
  assert records[-1]["step"] < 12 and [r["updated"] for r in records[-3:]] == [False] * 3


def test_sigterm_on_one_host_stops_every_host_at_the_same_step(tmp_path):
  """Two processes on 127.0.0.1; only process 1 gets SIGTERM. JAX's preemption sync point
  picks one update step: both save it and exit 143 (a host stopping alone would leave the
  other blocked in the next collective)."""
  import re
  import signal
  import subprocess
  import sys
  import time

  from test_sharding import free_port, process_env

  from jaxstep.trainer.store.records import read_records

  make_cfg(tmp_path)
  run_dir, port = tmp_path / "run", free_port()
  procs = [
    subprocess.Popen(
      [
        sys.executable,
        "-m",
        "jaxstep.train",
        *SMALL,
        "train.max_steps=100000",
        "train.log_every=1",
        "train.eval_every=0",
        "checkpoint.every=0",
        "train.global_batch_size=8",
        "train.grad_accum_steps=2",
        f"data.path={tmp_path / 'corpus.txt'}",
        f"run_dir={run_dir}",
      ],
      env=process_env(port, i, devices=1),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(2)
  ]
  try:
    deadline = time.time() + 240
    while len(read_records(run_dir / "metrics.jsonl")) < 3:
      assert time.time() < deadline and all(p.poll() is None for p in procs)
      time.sleep(0.2)
    os.kill(procs[1].pid, signal.SIGTERM)
    outs = [p.communicate(timeout=240) for p in procs]
  finally:
    for p in procs:
      p.kill()
  steps = []
  for p, (_, err) in zip(procs, outs, strict=True):
    assert p.returncode == 128 + signal.SIGTERM, err[-3000:]
    steps.append(int(re.search(r"stopped by SIGTERM at update step (\d+)", err).group(1)))
  assert steps[0] == steps[1] and (run_dir / "checkpoints" / str(steps[0])).is_dir()


@pytest.mark.parametrize("where", ["a_file", "proc", "read_only"])
def test_an_unusable_run_dir_is_one_line(tmp_path, capsys, where, request):
  if where == "a_file":
    run_dir = tmp_path / "file"
    run_dir.write_text("not a directory")
  elif where == "proc":
    run_dir = pathlib.Path("/proc/jaxstep-run")
  else:
    if not can_mount():
      pytest.skip("mounting a tmpfs needs root")
    mount = request.getfixturevalue("tmpfs")
    point = mount("1m")
    mount.read_only(point)
    run_dir = point / "run"
  code = IO_EXIT if where == "read_only" else 2  # the disk refused a write: as in a run
  assert train_main(tmp_path, f"run_dir={run_dir}") == code
  assert f"run_dir {run_dir} cannot be used" in one_error(capsys)


def test_memory_accepts_the_fsdp_mesh_that_train_accepts():
  import subprocess
  import sys

  if (os.cpu_count() or 1) < 2:
    pytest.skip("needs 2 cores for 2 CPU devices")
  env = {**os.environ, "XLA_FLAGS": xla_flags()}  # no device count: the CLI splits the CPU
  proc = subprocess.run(
    [sys.executable, "-m", "jaxstep.memory", "mesh.fsdp=2"],
    capture_output=True,
    text=True,
    timeout=300,
    env={**env, "JAX_PLATFORMS": "cpu"},
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "mesh data=1 fsdp=2" in proc.stdout
