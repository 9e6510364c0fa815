"""Many devices: mesh rules, equality with one device, one reduction per update, errors.

Multi-device runs happen in subprocesses with
``XLA_FLAGS=--xla_force_host_platform_device_count=N``.
"""

import socket
import subprocess
import sys

import pytest
from conftest import SMALL_MODEL, devices_env, make_cfg, read_lines
from jax.sharding import PartitionSpec as P

from jaxstep import ConfigError
from jaxstep.core.geometry import split_problem
from jaxstep.parallel import leaf_spec, mesh_shape


@pytest.mark.parametrize(
  "data, fsdp, expected", [(-1, 1, (8, 1)), (2, -1, (2, 4)), (1, 8, (1, 8)), (4, 2, (4, 2))]
)
def test_mesh_shape_resolves_minus_one(data, fsdp, expected):
  assert mesh_shape(data, fsdp, 8) == expected


@pytest.mark.parametrize("data, fsdp", [(3, 2), (-1, 3), (-1, -1), (0, 8)])
def test_invalid_mesh_is_a_config_error(data, fsdp):
  with pytest.raises(ConfigError, match="mesh"):
    mesh_shape(data, fsdp, 8)


def test_leaf_spec_takes_the_largest_divisible_dim():
  assert leaf_spec((64, 256), 8) == P(None, "fsdp")
  assert leaf_spec((256, 64), 8) == P("fsdp", None)
  assert leaf_spec((6, 10), 4) == P()  # nothing divides: replicated
  assert leaf_spec((), 4) == P()  # scalars
  assert leaf_spec((64, 256), 1) == P()  # no fsdp axis: replicated


def test_batch_must_split_over_devices_times_k():
  assert split_problem(32, 4, 8) is None
  problem = split_problem(16, 4, 8)
  assert "16 is not divisible by devices × grad_accum_steps = 8 × 4 = 32" in problem
  assert "multiple of 32" in problem


@pytest.fixture(scope="module")
def equivalence():
  from conftest import helper_lines

  lines = helper_lines("mesh_equivalence.py", devices=8, timeout=600)
  return [r for r in lines if "mesh" in r], [r for r in lines if "plain_jit_mesh" in r]


@pytest.mark.slow
def test_meshes_match_one_device_with_uneven_masks(equivalence):
  equivalence, _ = equivalence
  assert len(equivalence) == 6  # meshes (8,1), (1,8), (2,4) × K 1, 4
  for r in equivalence:
    assert r["tokens"] == r["ref_tokens"]  # N is the global count, not per device
    assert r["sgd_max_leaf_rel_err"] <= 1e-5, r  # every parameter leaf
    assert r["adamw_max_leaf_rel_err"] <= 1e-5, r  # all but the zero-gradient key bias
    assert r["loss_rel_err"] <= 1e-5, r


@pytest.mark.slow  # shares the 8-device run
def test_params_and_optimizer_state_follow_the_sharding_rules(equivalence):
  equivalence, _ = equivalence
  specs = {tuple(r["mesh"]): r for r in equivalence if r["k"] == 4}
  # qkv kernel [32, 96]: fsdp goes on the larger dim 96; mu mirrors the params
  assert specs[(1, 8)]["qkv_spec"] == [None, "fsdp"]
  assert specs[(1, 8)]["qkv_shard_shape"] == [32, 12]
  assert specs[(2, 4)]["qkv_shard_shape"] == [32, 24]
  assert specs[(1, 8)]["mu_spec"] == specs[(1, 8)]["qkv_spec"]
  assert specs[(8, 1)]["qkv_spec"] == []  # no fsdp: replicated over data
  assert all(r["step_spec"] == [] for r in equivalence)
  assert specs[(1, 8)]["bias_spec"] == ["fsdp"]  # 32 divides by 8


@pytest.mark.slow  # shares the 8-device run
def test_no_collective_inside_the_micro_step_loop(equivalence):
  # Gradients are reduced (and fsdp params gathered) once per update, after/before the scan.
  sharded, plain = equivalence
  for r in sharded:
    assert sum(r["loop_collectives"].values()) == 0, r
  # The detector sees them where they are: plain jit reduces inside every micro-step, and
  # with fsdp also re-gathers parameters there.
  by_mesh = {tuple(r["plain_jit_mesh"]): r["loop_collectives"] for r in plain}
  assert by_mesh[(8, 1)]["all-reduce"] >= 1
  assert by_mesh[(1, 8)]["all-gather"] >= 1


@pytest.mark.slow  # shares the 8-device run
def test_replicated_gradients_and_metrics_are_reduced_as_one_flat_buffer(equivalence):
  # gloo runs a tuple all-reduce of 30 operands ~23x slower than one buffer of the same size
  sharded, _ = equivalence
  data_parallel = [r for r in sharded if tuple(r["mesh"]) == (8, 1)]
  for r in data_parallel:
    assert r["all_reduce_operands"] and all(n == 1 for n in r["all_reduce_operands"]), r
    assert len(r["all_reduce_operands"]) <= 2, r  # the token count N, then everything else


def process_env(port: int, process_id: int, devices: int) -> dict:
  """The environment of process ``process_id`` of a 2-process job on 127.0.0.1."""
  return {
    **devices_env(devices),
    "JAXSTEP_COORDINATOR": f"127.0.0.1:{port}",
    "JAXSTEP_NUM_PROCESSES": "2",
    "JAXSTEP_PROCESS_ID": str(process_id),
  }


def one_and_two_processes(args, tmp_path, one_devices: int = 4) -> list[str]:
  """``jaxstep.train args`` as one process on ``one_devices`` CPU devices (``tmp_path/one``),
  then as 2 processes × 2 devices on 127.0.0.1 (``tmp_path/two``); asserts every run exits
  0 and returns the two processes' stderr."""
  train = [sys.executable, "-m", "jaxstep.train", *args]
  one = subprocess.run(
    [*train, f"mesh.cpu_devices={one_devices}", f"run_dir={tmp_path / 'one'}"],
    env=devices_env(one_devices),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert one.returncode == 0, one.stderr[-3000:]
  port = free_port()
  procs = [
    subprocess.Popen(
      [*train, "mesh.cpu_devices=2", f"run_dir={tmp_path / 'two'}"],
      env=process_env(port, i, devices=2),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(2)
  ]
  outs = [p.communicate(timeout=300) for p in procs]
  for p, (_, err) in zip(procs, outs, strict=True):
    assert p.returncode == 0, err[-3000:]
  return [err for _, err in outs]


def free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_match_a_single_process_run(tmp_path):
  make_cfg(tmp_path)
  args = [
    *SMALL_MODEL,
    "train.max_steps=3",
    "train.log_every=1",
    "train.global_batch_size=8",
    "train.grad_accum_steps=2",
    f"data.path={tmp_path / 'corpus.txt'}",
  ]
  errs = one_and_two_processes(args, tmp_path, one_devices=1)
  assert "process 0 of 2, 2 local / 4 global devices" in errs[0]
  a = read_lines(tmp_path / "one" / "metrics.jsonl")
  b = read_lines(tmp_path / "two" / "metrics.jsonl")  # written by process 0 only
  assert [r["step"] for r in b] == [1, 2, 3]
  for x, y in zip(a, b, strict=True):
    assert x["tokens"] == y["tokens"]
    assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)


MESH_SPLIT_CHECK = """
import jax, jax.numpy as jnp, optax
from jaxstep import BatchError, make_train_step, parallel

def loss_fn(params, batch, rng):
  return jnp.sum(batch["loss_mask"] * (params["w"] * batch["x"]) ** 2), {}

mesh = parallel.make_mesh()
train_step = make_train_step(loss_fn, optax.sgd(0.1), grad_accum_steps=4, mesh=mesh)
state = train_step.init({"w": jnp.ones(())}, 0)
for g in (6, 8):
  batch = {"x": jnp.ones(g), "loss_mask": jnp.ones(g)}
  try:
    jax.jit(train_step)(state, parallel.put_batch(batch, parallel.batch_sharding(mesh)))
  except BatchError as e:
    print("BatchError:", e)
"""


PUT_BATCH_CHECK = """
import jax.numpy as jnp
from jaxstep import BatchError, parallel

mesh = parallel.make_mesh()
for g, k in ((6, None), (12, 2)):
  try:
    batch = {"x": jnp.ones(g)}
    parallel.put_batch(batch, parallel.batch_sharding(mesh), grad_accum_steps=k)
  except BatchError as e:
    print("BatchError:", e)
"""

BATCH_CHECKS = {"step": MESH_SPLIT_CHECK, "put_batch": PUT_BATCH_CHECK}
CHECK_STARTS = "check: "


@pytest.fixture(scope="module")
def batch_errors_on_4_devices() -> dict[str, list[str]]:
  """The lines each of ``BATCH_CHECKS`` prints, by name: the checks run one after the other,
  each in a namespace of its own, in one fresh process on 4 virtual CPU devices."""
  code = (
    f"for name, check in {BATCH_CHECKS!r}.items():\n"
    f"  print({CHECK_STARTS!r} + name)\n"
    "  exec(check, {})\n"
  )
  proc = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=devices_env(4)
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  printed, lines = {}, []
  for line in proc.stdout.strip().splitlines():
    if line.startswith(CHECK_STARTS):
      lines = printed.setdefault(line.removeprefix(CHECK_STARTS), [])
    else:
      lines.append(line)
  assert list(printed) == list(BATCH_CHECKS), proc.stdout
  return printed


def test_step_on_a_mesh_names_the_numbers_when_g_does_not_split_over_devices_times_k(
  batch_errors_on_4_devices,
):
  lines = batch_errors_on_4_devices["step"]
  assert len(lines) == 2 and all(x.startswith("BatchError:") for x in lines), lines
  assert "a global batch of 6 does not split evenly over 4 devices" in lines[0]
  assert "multiple of devices × grad_accum_steps = 4 × K" in lines[0]
  assert "8 is not divisible by devices × grad_accum_steps = 4 × 4 = 16" in lines[1]
  assert not any("train." in x for x in lines)  # a library error names numbers, not CLI keys


def test_the_batch_split_rule_is_complete_when_k_is_not_known_yet():
  """``put_batch`` sees G and the devices but not K: it states the whole rule (a multiple
  of devices × K), not a multiple of the devices that the step would then refuse."""
  problem = split_problem(6, None, 4, names=("a global batch of", "grad_accum_steps"))
  assert "6 does not split evenly over 4 devices" in problem
  assert "multiple of devices × grad_accum_steps = 4 × K" in problem
  assert "pick a multiple of 4;" not in problem and not problem.endswith("multiple of 4")
  assert split_problem(8, None, 4) is None  # K decides the rest, and the step checks it


def test_put_batch_states_the_devices_times_k_rule(batch_errors_on_4_devices):
  lines = batch_errors_on_4_devices["put_batch"]
  assert len(lines) == 2, lines
  assert "4 × K" in lines[0] and "use a multiple of 4" not in lines[0]
  assert "12 is not divisible by devices × grad_accum_steps = 4 × 2 = 8" in lines[1]
