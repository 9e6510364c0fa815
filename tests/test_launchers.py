"""Cluster launchers: what ``launchers.detect`` reads from each launcher's environment, what
``initialize_distributed`` then hands ``jax.distributed.initialize`` (mocked here), and the
same as JAX's own detection where JAX can tell from the environment."""

import json
import os
import socket
import subprocess
import sys

import pytest
from conftest import xla_flags
from jax._src import clusters

from jaxstep.errors import ConfigError
from jaxstep.parallel import distributed, launchers
from jaxstep.parallel.launchers import Launch

USES_GLOO = distributed.uses_gloo  # the real one: the fixture below mocks it
EIGHT_GPUS = "0,1,2,3,4,5,6,7"
SLURM_PER_NODE = {  # sbatch --nodes=4 --ntasks-per-node=1 --gpus-per-node=8: the 3rd node
  "SLURM_JOB_ID": "4242",
  "SLURM_NTASKS": "4",
  "SLURM_PROCID": "2",
  "SLURM_LOCALID": "0",
  "SLURM_NODEID": "2",
  "SLURM_STEP_NODELIST": "gpu[007-010]",
  "SLURM_TASKS_PER_NODE": "1(x4)",
  "SLURM_GPUS_ON_NODE": "8",
  "CUDA_VISIBLE_DEVICES": EIGHT_GPUS,
}
SLURM_PER_GPU = {  # --nodes=2 --ntasks-per-node=8 --gres=gpu:8: task 3 of the 2nd node
  **SLURM_PER_NODE,
  "SLURM_NTASKS": "16",
  "SLURM_PROCID": "11",
  "SLURM_LOCALID": "3",
  "SLURM_NODEID": "1",
  "SLURM_STEP_NODELIST": "gpu[007-008]",
  "SLURM_TASKS_PER_NODE": "8(x2)",
}
OMPI_URI = "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911"
OPENMPI = {  # mpirun -np 8 on 2 hosts of 4 GPUs, one rank per GPU
  "OMPI_MCA_orte_hnp_uri": OMPI_URI,
  "OMPI_COMM_WORLD_SIZE": "8",
  "OMPI_COMM_WORLD_RANK": "5",
  "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
  "OMPI_COMM_WORLD_LOCAL_RANK": "1",
  "CUDA_VISIBLE_DEVICES": "0,1,2,3",
}
JOBSET = {  # a JobSet's indexed Job: pod 1
  "KUBERNETES_SERVICE_HOST": "10.0.0.1",
  "JOB_COMPLETION_INDEX": "1",
  "JOBSET_NAME": "jaxstep-gpt",
  "HOSTNAME": "jaxstep-gpt-workers-0-1-x7k2p",
  "CUDA_VISIBLE_DEVICES": EIGHT_GPUS,
}
TPU_POD = {  # GKE TPU slice of 4 hosts (JobSet)
  "TPU_WORKER_HOSTNAMES": "t-0.tpu,t-1.tpu,t-2.tpu,t-3.tpu",
  "TPU_WORKER_ID": "2",
}


@pytest.mark.parametrize(
  ("env", "expected"),
  [
    (SLURM_PER_NODE, Launch("slurm", 2, 4, "gpu007:61586", None)),
    (SLURM_PER_GPU, Launch("slurm", 11, 16, "gpu007:61586", (3,))),
    (OPENMPI, Launch("openmpi", 5, 8, "10.96.0.1:62624", (1,))),
    (JOBSET, Launch("kubernetes", 1, None, None, None)),
    (TPU_POD, Launch("cloud-tpu", 2, 4, "t-0.tpu:8482", None)),
  ],
  ids=["slurm-task-per-node", "slurm-task-per-gpu", "openmpi", "jobset", "tpu-pod"],
)
def test_each_launcher_is_detected_from_its_environment(env, expected):
  assert launchers.detect(env) == expected


@pytest.mark.parametrize(
  "env",
  [
    {},
    {"SLURM_JOB_ID": "1", "SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"},
    {"OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0"},
    {"KUBERNETES_SERVICE_HOST": "10.0.0.1"},  # any pod, not an indexed Job
    {"TPU_WORKER_HOSTNAMES": "t-0", "TPU_WORKER_ID": "0"},  # one TPU host
  ],
)
def test_a_single_process_has_no_launcher(env):
  assert launchers.detect(env) is None


@pytest.mark.parametrize(
  ("tasks", "gpus", "local", "expected"),
  [
    (1, 8, 0, None),  # one task per node: all 8
    (8, 8, 3, (3,)),  # one task per GPU
    (2, 8, 1, (4, 5, 6, 7)),  # two tasks per node: half each
    (8, 1, 3, None),  # srun --gpus-per-task=1: each task sees only its own GPU
    (8, None, 3, (3,)),  # nothing says: JAX's one GPU per task
    (1, None, 0, None),
  ],
)
def test_a_process_drives_its_share_of_the_node_gpus(tasks, gpus, local, expected):
  assert launchers.device_ids(local, tasks, gpus, "SLURM") == expected


def test_an_uneven_gpu_split_names_the_numbers():
  with pytest.raises(ConfigError, match="3 tasks on this node and each sees 8 GPUs"):
    launchers.device_ids(0, 3, 8, "SLURM")


@pytest.mark.parametrize(
  ("spec", "node", "tasks"), [("2(x3),1", "1", 2), ("2(x3),1", "3", 1), ("4", "0", 4)]
)
def test_slurm_tasks_per_node_follow_this_node(spec, node, tasks):
  env = {"SLURM_STEP_TASKS_PER_NODE": spec, "SLURM_NODEID": node}
  assert launchers.slurm_tasks_on_node(env) == tasks


def test_slurm_binding_one_gpu_per_task_uses_that_gpu():
  env = {**SLURM_PER_GPU, "CUDA_VISIBLE_DEVICES": "3", "SLURM_NTASKS_PER_NODE": "8"}
  assert launchers.detect(env).local_device_ids is None


@pytest.mark.parametrize(
  ("nodes", "host"),
  [("node001", "node001"), ("node001,host2", "node001"), ("n[001-015],h2", "n001"),
   ("n[001,007-015]", "n001"), ("localhost", "localhost")],
)  # fmt: skip
def test_the_coordinator_host_is_the_first_slurm_node(nodes, host):
  assert launchers.first_host(nodes) == host


@pytest.mark.parametrize(
  ("env", "cluster"),
  [
    (SLURM_PER_GPU, clusters.SlurmCluster),
    ({**SLURM_PER_NODE, "JAX_COORDINATOR_PORT": "1234"}, clusters.SlurmCluster),
    (OPENMPI, clusters.OmpiCluster),
  ],
)
def test_the_coordinator_and_ranks_are_the_ones_jax_detects(monkeypatch, env, cluster):
  monkeypatch.setattr(os, "environ", dict(env))
  assert cluster.is_env_present()
  launch = launchers.detect(env)
  port = env.get("JAX_COORDINATOR_PORT")
  assert launch.coordinator == cluster.get_coordinator_address(None, port)
  assert (launch.process_id, launch.num_processes) == (
    cluster.get_process_id(),
    cluster.get_process_count(),
  )


def test_a_tpu_pod_is_numbered_as_jax_numbers_it(monkeypatch):
  env = {**TPU_POD, "MEGASCALE_NUM_SLICES": "2", "MEGASCALE_SLICE_ID": "1"}
  monkeypatch.setattr(os, "environ", dict(env))
  tpu = clusters.GkeTpuCluster
  launch = launchers.detect(env)
  assert (launch.process_id, launch.num_processes) == (tpu.get_process_id(), 8) == (6, 8)


class Recorder:
  """Stands in for ``jax.distributed.initialize``: keeps the arguments of every call."""

  def __init__(self):
    self.calls = []

  def __call__(self, *args, **kwargs):
    self.calls.append((args, kwargs))


@pytest.fixture
def start(monkeypatch):
  """``initialize_distributed(env=…)`` with JAX's start, the network waits, the transport
  choice and the devices line mocked; returns the recorded ``jax.distributed.initialize``."""
  record = Recorder()
  monkeypatch.setattr(distributed.jax.distributed, "initialize", record)
  monkeypatch.setattr(distributed, "wait_for_coordinator", lambda *a: None)
  monkeypatch.setattr(distributed, "refuse_a_busy_port", lambda *a: None)
  monkeypatch.setattr(distributed, "uses_gloo", lambda: False)
  monkeypatch.setattr(distributed, "_log_started", lambda source: None)

  def run(env, **config):
    distributed.initialize_distributed(initialization_timeout=7, env=env, **config)
    return record.calls

  return run


def test_slurm_one_task_per_node_drives_all_eight_gpus(start):
  [(args, kwargs)] = start(SLURM_PER_NODE)
  assert args == ("gpu007:61586", 4, 2)
  assert kwargs["local_device_ids"] is None  # not [SLURM_LOCALID]: all visible GPUs
  assert kwargs["cluster_detection_method"] == "deactivate"  # JAX would pick [0]


def test_a_busy_port_under_slurm_names_the_variable_that_moves_it(monkeypatch):
  """The port came from the job id (or ``JAX_COORDINATOR_PORT``), not from the config: the
  advice names the environment variable to set."""
  monkeypatch.setattr(distributed, "uses_gloo", lambda: False)
  with socket.socket() as busy:
    busy.bind(("", 0))
    busy.listen()
    port = busy.getsockname()[1]
    env = {**SLURM_PER_NODE, "SLURM_PROCID": "0", "JAX_COORDINATOR_PORT": str(port)}
    with pytest.raises(ConfigError, match=f"port {port} is in use.*set JAX_COORDINATOR_PORT"):
      distributed.initialize_distributed(initialization_timeout=7, env=env)


def test_slurm_one_task_per_gpu_drives_its_own_gpu(start):
  [(args, kwargs)] = start(SLURM_PER_GPU)
  assert args == ("gpu007:61586", 16, 11) and kwargs["local_device_ids"] == [3]


def test_open_mpi_one_rank_per_gpu(start):
  [(args, kwargs)] = start(OPENMPI)
  assert args == ("10.96.0.1:62624", 8, 5) and kwargs["local_device_ids"] == [1]


def test_a_jobset_pod_leaves_size_and_coordinator_to_jax(start, monkeypatch):
  monkeypatch.setattr(distributed.importlib.util, "find_spec", lambda name: object())
  [(args, kwargs)] = start(JOBSET)
  assert args == () and kwargs == {"local_device_ids": None, "initialization_timeout": 17}


def test_a_jobset_pod_without_the_kubernetes_package_says_what_to_install(start, monkeypatch):
  monkeypatch.setattr(distributed.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(ConfigError, match=r"jax\[k8s\]"):
    start(JOBSET)


def test_a_tpu_pod_drives_all_its_chips(start):
  [(args, kwargs)] = start(TPU_POD)
  assert args == ("t-0.tpu:8482", 4, 2) and kwargs["local_device_ids"] is None


def test_open_mpi_5_without_a_launcher_address_asks_for_a_coordinator(start):
  env = {k: v for k, v in OPENMPI.items() if k != "OMPI_MCA_orte_hnp_uri"}
  with pytest.raises(ConfigError, match="JAXSTEP_COORDINATOR"):
    start(env)
  [(args, kwargs)] = start({**env, "JAXSTEP_COORDINATOR": "rank0:5555"})
  assert args == ("rank0:5555", 8, 5) and kwargs["local_device_ids"] == [1]


def test_a_slurm_task_without_a_node_list_asks_for_srun(start):
  env = {k: v for k, v in SLURM_PER_NODE.items() if k != "SLURM_STEP_NODELIST"}
  with pytest.raises(ConfigError, match="start the command with srun"):
    start(env)


def test_the_start_is_one_line_naming_the_launcher(caplog):
  with caplog.at_level("INFO", logger="jaxstep"):
    distributed._log_started("slurm")
  n = distributed.jax.device_count()
  assert caplog.messages == [f"slurm: process 0 of 1, {n} local / {n} global devices"]


def test_a_single_process_starts_nothing(start):
  assert start({}) == []


def test_the_config_coordinator_overrides_the_launcher(start):
  env = {**SLURM_PER_GPU, "JAXSTEP_COORDINATOR": "env-host:1", "JAXSTEP_NUM_PROCESSES": "3"}
  [(args, kwargs)] = start(env, coordinator="cfg-host:2", process_id=1)
  assert args == ("cfg-host:2", 3, 1) and kwargs["local_device_ids"] == [3]


JAXSTEP_ONLY = {
  "JAXSTEP_COORDINATOR": "h:1",
  "JAXSTEP_NUM_PROCESSES": "2",
  "JAXSTEP_PROCESS_ID": "1",
}


@pytest.mark.parametrize("env", [SLURM_PER_NODE, OPENMPI, TPU_POD, JOBSET, JAXSTEP_ONLY])
def test_the_initialization_timeout_reaches_jax_on_every_path(start, env, monkeypatch):
  monkeypatch.setattr(distributed.importlib.util, "find_spec", lambda name: object())
  [(_, kwargs)] = start(env)
  # the bounded wait gives JAX its own timeout plus a grace, so ours ends the wait readably
  assert 7 <= kwargs["initialization_timeout"] <= 7 + distributed.JAX_GRACE_S


@pytest.mark.parametrize(("platform", "gloo"), [("cuda", False), ("tpu", False), ("cpu", True)])
def test_gloo_is_chosen_only_on_the_cpu_platform(start, monkeypatch, platform, gloo):
  monkeypatch.setattr(distributed, "uses_gloo", USES_GLOO)
  monkeypatch.setattr(distributed, "_platforms", lambda: platform)
  updates = []
  monkeypatch.setattr(distributed.jax.config, "update", lambda *a: updates.append(a))
  start(SLURM_PER_NODE)
  assert (("jax_cpu_collectives_implementation", "gloo") in updates) is gloo


TINY = [
  "--config",
  "tiny",
  "train.max_steps=3",
  "train.log_every=1",
  "train.progress=false",
  "train.eval_every=0",
  "train.sample_every=0",
]


def read_lines(path):
  return [json.loads(line) for line in path.read_text().splitlines()]


def clean_env(devices: int) -> dict:
  """This environment without any launcher's or jaxstep's job variables, on ``devices``
  CPU devices."""
  prefixes = ("SLURM_", "OMPI_", "PMIX_", "JAX_COORDINATOR", "TPU_", "MEGASCALE_")
  jaxstep = ("JAXSTEP_COORDINATOR", "JAXSTEP_NUM_PROCESSES", "JAXSTEP_PROCESS_ID")
  env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes) and k not in jaxstep}
  env.pop("KUBERNETES_SERVICE_HOST", None)  # JAXSTEP_CACHE stays: the test session's cache
  xla = xla_flags(f"--xla_force_host_platform_device_count={devices}")
  return {**env, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla}


def slurm_port() -> int:
  """A free port among those JAX derives from a SLURM job id ([61440, 65535])."""
  for port in range(61440 + os.getpid() % 4096, 65536):
    with socket.socket() as s:
      try:
        s.bind(("", port))
      except OSError:
        continue
      return port
  pytest.skip("no free port in 61440-65535")


def srun_env(job_id: int, task: int) -> dict:
  """What ``srun --ntasks=2`` on one node sets for task ``task`` (no JAXSTEP_*)."""
  return {
    **clean_env(2),
    "SLURM_JOB_ID": str(job_id),
    "SLURM_NTASKS": "2",
    "SLURM_PROCID": str(task),
    "SLURM_LOCALID": str(task),
    "SLURM_NODEID": "0",
    "SLURM_STEP_NODELIST": "localhost",
    "SLURM_JOB_NODELIST": "localhost",
    "SLURM_TASKS_PER_NODE": "2",
  }


@pytest.mark.slow
def test_a_two_task_slurm_job_matches_one_process(tmp_path):
  run = [sys.executable, "-m", "jaxstep.train", *TINY]
  single = subprocess.run(
    [*run, f"run_dir={tmp_path / 'single'}"],
    env=clean_env(1),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert single.returncode == 0, single.stderr[-3000:]
  job_id = slurm_port() - 61440 + 4096  # JAX's port: job id % 4096 + 61440
  tasks = [
    subprocess.Popen(
      [*run, f"run_dir={tmp_path / 'multi'}", "mesh.initialization_timeout=120"],
      env=srun_env(job_id, task),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for task in range(2)
  ]
  outs = [t.communicate(timeout=300) for t in tasks]
  for t, (_, err) in zip(tasks, outs, strict=True):
    assert t.returncode == 0, err[-3000:]
  assert "slurm: process 0 of 2, 2 local / 4 global devices" in outs[0][1]
  assert "slurm: process 1 of 2, 2 local / 4 global devices" in outs[1][1]
  a = read_lines(tmp_path / "single" / "metrics.jsonl")
  b = read_lines(tmp_path / "multi" / "metrics.jsonl")
  assert [r["step"] for r in b] == [1, 2, 3]
  for x, y in zip(a, b, strict=True):
    assert x["tokens"] == y["tokens"]
    assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)


def test_jaxs_own_launch_variables_start_the_job(start):
  """A manual launch as JAX documents it: JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
  JAX_PROCESS_ID (jaxstep's own JAXSTEP_* win where both are set)."""
  env = {"JAX_COORDINATOR_ADDRESS": "host0:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
  [(args, _)] = start(env)
  assert args == ("host0:1234", 4, 3)
  [_, (args, _)] = start({**env, "JAXSTEP_NUM_PROCESSES": "2", "JAXSTEP_PROCESS_ID": "1"})
  assert args == ("host0:1234", 2, 1)


@pytest.mark.parametrize(
  "name", ["JAXSTEP_NUM_PROCESSES", "JAXSTEP_PROCESS_ID", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"]
)
def test_a_launch_variable_that_is_not_a_number_is_named(start, name):
  env = {"JAXSTEP_COORDINATOR": "host0:1234", name: "two"}
  with pytest.raises(ConfigError, match=f"{name}='two' is not an integer"):
    start(env)
