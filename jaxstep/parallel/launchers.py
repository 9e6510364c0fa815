"""Which cluster launcher started this process, read from its environment alone.

``detect`` recognizes the launchers JAX's own cluster detection knows (SLURM, Open MPI,
Kubernetes indexed Jobs and JobSets, Cloud TPU pods) and returns what
``jax.distributed.initialize`` needs: process id and count, the coordinator address JAX
would derive (same rule, same port), and the devices this process drives. That last field
is why jaxstep does not leave it all to JAX: under SLURM and Open MPI JAX restricts every
process to one GPU (``[local rank]``), which is right for one task per GPU but leaves 7 of 8
GPUs idle with one task per node (and fails outright when SLURM binds one GPU per task).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping

from jaxstep.errors import ConfigError

# The port JAX picks from a job id lies in [61440, 65535]; JAX_COORDINATOR_PORT overrides.
_PORT_BASE, _PORT_SPAN = 65535 - 2**12 + 1, 2**12
TPU_PORT = 8482  # JAX's fixed coordinator port on Cloud TPU


@dataclasses.dataclass(frozen=True)
class Launch:
  """One process of a multi-process job as its launcher describes it.

  ``num_processes`` / ``coordinator`` are ``None`` where only JAX can find them (a
  Kubernetes Job's size and coordinator come from the cluster's API). ``local_device_ids``
  ``None`` means every device the process sees; a tuple restricts it to those.
  """

  name: str
  process_id: int | None
  num_processes: int | None
  coordinator: str | None
  local_device_ids: tuple[int, ...] | None = None


def detect(env: Mapping[str, str] = os.environ) -> Launch | None:
  """The launcher of a multi-process job, or ``None`` for a single process.

  Checked in JAX's order (Open MPI before SLURM: ``mpirun`` inside an allocation sees both).
  """
  for probe in (_openmpi, _slurm, _tpu_pod, _kubernetes):
    launch = probe(env)
    if launch is not None:
      return launch
  return None


def env_int(env: Mapping[str, str], *names: str, default: int | None = None) -> int | None:
  """The first of ``names`` set to an integer; ``ConfigError`` naming it if it is not one."""
  for name in names:
    value = env.get(name, "").strip()
    if value:
      try:
        return int(value)
      except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer") from None
  return default


def _port(env: Mapping[str, str], job_id: int) -> str:
  return env.get("JAX_COORDINATOR_PORT") or str(job_id % _PORT_SPAN + _PORT_BASE)


def _slurm(env: Mapping[str, str]) -> Launch | None:
  """``srun`` with more than one task: id, count and local id are SLURM's own; the
  coordinator is the step's first node (as JAX's ``SlurmCluster`` picks it)."""
  count = env_int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", default=1)
  if count <= 1 or "SLURM_PROCID" not in env or "SLURM_JOB_ID" not in env:
    return None
  nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")
  job = env_int(env, "SLURM_JOB_ID")
  coordinator = f"{first_host(nodes)}:{_port(env, job)}" if nodes else None
  local = env_int(env, "SLURM_LOCALID", default=0)
  tasks = slurm_tasks_on_node(env)
  devices = device_ids(local, tasks, visible_gpus(env), "SLURM")
  return Launch("slurm", env_int(env, "SLURM_PROCID"), count, coordinator, devices)


def first_host(nodelist: str) -> str:
  """The first host of a SLURM node list: ``node[001-004],x`` → ``node001``."""
  head = re.match(r"([^,\[]*)(?:\[([^,\-\]]*))?", nodelist.strip())
  return head.group(1) + (head.group(2) or "")


def slurm_tasks_on_node(env: Mapping[str, str]) -> int | None:
  """Tasks SLURM runs on this node: ``SLURM_NTASKS_PER_NODE``, else this node's entry
  (``SLURM_NODEID``) of ``SLURM_STEP_TASKS_PER_NODE`` / ``SLURM_TASKS_PER_NODE``
  (``2(x3),1`` = 2, 2, 2, 1)."""
  explicit = env_int(env, "SLURM_NTASKS_PER_NODE")
  if explicit:
    return explicit
  spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "")
  per_node = []
  for count, times in re.findall(r"(\d+)(?:\(x(\d+)\))?", spec):
    per_node += [int(count)] * int(times or 1)
  node = env_int(env, "SLURM_NODEID", default=0)
  return per_node[node] if 0 <= node < len(per_node) else None


def visible_gpus(env: Mapping[str, str]) -> int | None:
  """How many GPUs this process sees, or ``None`` when nothing says.

  ``CUDA_VISIBLE_DEVICES`` (or ROCm's) is what the process really sees; SLURM's
  ``SLURM_STEP_GPUS`` / ``SLURM_JOB_GPUS`` (ids) and ``SLURM_GPUS_ON_NODE`` (a count)
  describe the node's allocation.
  """
  for name in ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):
    if name in env:
      ids = [i for i in env[name].split(",") if i.strip() and i.strip() != "-1"]
      return 0 if "NoDevFiles" in env[name] else len(ids)
  for name in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
    if env.get(name, "").strip():
      return len(env[name].split(","))
  return env_int(env, "SLURM_GPUS_ON_NODE")


def device_ids(
  local: int, tasks: int | None, gpus: int | None, launcher: str
) -> tuple[int, ...] | None:
  """The GPUs of the process with local rank ``local`` of ``tasks`` on its node that sees
  ``gpus`` GPUs: all of them when it is the node's only task or sees one GPU (the launcher
  bound it), an equal share otherwise (``[local]`` with one task per GPU). Unknown counts
  keep JAX's rule (one GPU per task, ``[local]``) when several tasks share a node."""
  if tasks is None or tasks <= 1 or gpus is not None and gpus <= 1:
    return None
  if gpus is None:
    return (local,)
  if gpus % tasks:
    raise ConfigError(
      f"{launcher} runs {tasks} tasks on this node and each sees {gpus} GPUs, which do not "
      f"split evenly; run one task per node or one task per GPU"
    )
  share = gpus // tasks
  return tuple(range(local * share, (local + 1) * share))


def _openmpi(env: Mapping[str, str]) -> Launch | None:
  """``mpirun`` with more than one rank. The coordinator is the launcher's address from
  ``OMPI_MCA_orte_hnp_uri`` (as JAX's ``OmpiCluster`` reads it); Open MPI 5 no longer sets
  it, and then a coordinator must be given (``mesh.coordinator`` or
  ``JAXSTEP_COORDINATOR``)."""
  count = env_int(env, "OMPI_COMM_WORLD_SIZE", default=1)
  if count <= 1:
    return None
  coordinator = None
  uri = env.get("OMPI_MCA_orte_hnp_uri", "")
  host = re.search(r"tcp://(.+?)[,:]|tcp6://\[(.+?)[,\]]", uri)
  if host and uri.split(".", 1)[0].isdigit():
    job = int(uri.split(".", 1)[0]) // 2**12  # Open MPI's job ids are multiples of 2**12
    coordinator = f"{host.group(1) or host.group(2)}:{_port(env, job)}"
  local = env_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", default=0)
  tasks = env_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE")
  devices = device_ids(local, tasks, visible_gpus(env), "Open MPI")
  return Launch("openmpi", env_int(env, "OMPI_COMM_WORLD_RANK"), count, coordinator, devices)


def _tpu_pod(env: Mapping[str, str]) -> Launch | None:
  """A Cloud TPU pod or multislice job on GKE (JobSet): the workers of this slice in
  ``TPU_WORKER_HOSTNAMES`` (or ``TPU_PROCESS_ADDRESSES``), ``TPU_WORKER_ID``, and the
  slices in ``MEGASCALE_*``; the coordinator is the megascale coordinator or the first
  worker, on JAX's TPU port. A TPU process drives all its chips."""
  workers = env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES")
  if not workers or "TPU_WORKER_ID" not in env:
    return None
  hosts = workers.split(",")
  slices = env_int(env, "MEGASCALE_NUM_SLICES", default=1)
  if len(hosts) * slices <= 1:
    return None
  process = env_int(env, "TPU_WORKER_ID") + env_int(env, "MEGASCALE_SLICE_ID", default=0) * len(
    hosts
  )
  host = (env.get("MEGASCALE_COORDINATOR_ADDRESS") or hosts[0]).split(":")[0]
  port = env.get("JAX_COORDINATOR_PORT") or str(TPU_PORT)
  return Launch("cloud-tpu", process, len(hosts) * slices, f"{host}:{port}")


def _kubernetes(env: Mapping[str, str]) -> Launch | None:
  """A pod of an indexed Kubernetes Job (alone or in a JobSet): its index is
  ``JOB_COMPLETION_INDEX``; the job's size and its coordinator (pod 0 through the headless
  service) come from the Kubernetes API, so JAX finds them (``jax[k8s]``)."""
  if "KUBERNETES_SERVICE_HOST" not in env or "JOB_COMPLETION_INDEX" not in env:
    return None
  return Launch("kubernetes", env_int(env, "JOB_COMPLETION_INDEX"), None, None)
