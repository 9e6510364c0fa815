"""Multi-process start: ``jax.distributed.initialize`` from config, environment or the
cluster launcher, with a bounded wait for the coordinator that ends in a readable error."""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping

import jax

from jaxstep.errors import ConfigError, first_line
from jaxstep.parallel import launchers
from jaxstep.parallel.cpu_devices import ACCELERATOR_PLUGINS

log = logging.getLogger("jaxstep")
PROBE_INTERVAL = 0.5  # seconds between connection attempts to the coordinator

PORT_FIX = "choose a free port in mesh.coordinator"  # a busy port the config chose
COORDINATOR_VARIABLES = ("JAXSTEP_COORDINATOR", "JAX_COORDINATOR_ADDRESS")  # jaxstep's, JAX's


def initialize_distributed(
  coordinator: str = "",
  num_processes: int = 0,
  process_id: int = -1,
  initialization_timeout: int = 300,
  env: Mapping[str, str] | None = None,
) -> None:
  """``jax.distributed.initialize`` from config, ``JAXSTEP_*`` env, or the cluster launcher.

  Precedence per field: config value, then ``JAXSTEP_COORDINATOR`` / ``JAXSTEP_NUM_PROCESSES``
  / ``JAXSTEP_PROCESS_ID``, then JAX's own ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES``
  / ``JAX_PROCESS_ID`` (what JAX documents for a manual launch), then the launcher
  ``launchers.detect`` recognizes (SLURM, Open MPI, a Kubernetes Job, a Cloud TPU pod); a
  variable that is not an integer is a ``ConfigError`` naming it. No coordinator and no
  multi-process launcher: a single process, nothing is started. The devices a process
  drives always follow the launcher's layout (all of a node's GPUs with one task per node).

  A process other than 0 first waits up to ``initialization_timeout`` seconds for the
  coordinator's port to accept a connection and raises ``ConfigError`` if it never does:
  JAX itself would abort the whole process (no Python exception) when its own wait runs out.
  """
  env = os.environ if env is None else env
  source = "mesh.coordinator" if coordinator else ""
  for name in COORDINATOR_VARIABLES:
    if not coordinator and env.get(name, "").strip():
      coordinator, source = env[name].strip(), name
  if not num_processes:
    num_processes = launchers.env_int(env, "JAXSTEP_NUM_PROCESSES", "JAX_NUM_PROCESSES", default=0)
  if process_id < 0:
    process_id = launchers.env_int(env, "JAXSTEP_PROCESS_ID", "JAX_PROCESS_ID", default=-1)
  launch = launchers.detect(env)
  if not coordinator and launch is None:
    return
  if not coordinator and launch.coordinator is None:
    _initialize_through_jax(launch, initialization_timeout)
    _log_started(launch.name)
    return
  source = source or launch.name
  coordinator = coordinator or launch.coordinator
  if launch:  # the launcher fills what config and environment leave out
    num_processes = num_processes or launch.num_processes or 0
    if process_id < 0 and launch.process_id is not None:
      process_id = launch.process_id
  devices = launch.local_device_ids if launch else None
  if source == "mesh.coordinator":
    port_fix = PORT_FIX
  elif source in COORDINATOR_VARIABLES:
    port_fix = f"choose a free port in {source}"
  else:
    port_fix = (
      f"set JAX_COORDINATOR_PORT to a free port (or mesh.coordinator) for this {source} job"
    )
  _initialize_with_coordinator(
    coordinator, num_processes, process_id, initialization_timeout, devices, port_fix
  )
  _log_started(source)


def _log_started(source: str) -> None:
  """One line: who started the job, this process's place in it, and its devices."""
  log.info(
    "%s: process %d of %d, %d local / %d global devices",
    source,
    jax.process_index(),
    jax.process_count(),
    jax.local_device_count(),
    jax.device_count(),
  )


NO_COORDINATOR = {  # a launcher that should name process 0's host, but does not
  "openmpi": "this Open MPI launch does not say where its launcher runs (Open MPI 5 no longer "
  "sets OMPI_MCA_orte_hnp_uri); set mesh.coordinator or JAXSTEP_COORDINATOR to host:port "
  "of rank 0's host",
  "slurm": "SLURM runs several tasks but names no node list (SLURM_STEP_NODELIST, "
  "SLURM_JOB_NODELIST); start the command with srun, or set mesh.coordinator or "
  "JAXSTEP_COORDINATOR",
}


def _initialize_through_jax(launch: launchers.Launch, timeout: int) -> None:
  """A launcher whose job size and coordinator only JAX can find (Kubernetes: through the
  cluster's API): JAX's own detection does it all."""
  if launch.name in NO_COORDINATOR:
    raise ConfigError(NO_COORDINATOR[launch.name])
  if launch.name == "kubernetes" and importlib.util.find_spec("kubernetes") is None:
    raise ConfigError(
      "a Kubernetes Job was detected (JOB_COMPLETION_INDEX), but finding its size and "
      "coordinator needs the kubernetes package: pip install 'jax[k8s]', or set "
      "JAXSTEP_COORDINATOR, JAXSTEP_NUM_PROCESSES and JAXSTEP_PROCESS_ID"
    )
  if uses_gloo():
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  line = (
    f"error: process {launch.process_id} of the {launch.name} job waited {timeout} s for "
    f"the others to join; check that every pod runs, or raise mesh.initialization_timeout"
  )
  try:
    with _ends_the_process_after(timeout, line):  # JAX's own end is an abort (exit 134)
      jax.distributed.initialize(
        local_device_ids=launch.local_device_ids and list(launch.local_device_ids),
        initialization_timeout=timeout + JAX_GRACE_S,
      )
  except (RuntimeError, ValueError) as e:
    raise ConfigError(
      f"process {launch.process_id} of the {launch.name} job could not start the "
      f"multi-process job ({first_line(e)})"
    ) from None


def _initialize_with_coordinator(
  coordinator: str,
  num_processes: int,
  process_id: int,
  timeout: int,
  devices: tuple[int, ...] | None = None,
  port_fix: str = PORT_FIX,
) -> None:
  """Checks the three fields, waits for the coordinator (processes other than 0), picks the
  CPU transport, and starts ``jax.distributed`` on ``devices`` (``None``: all this process
  sees); ``port_fix`` is the advice for a busy port (where the port came from). JAX's own
  cluster detection is off here: every value is known, and under SLURM or Open MPI it would
  restrict the process to one GPU."""
  if num_processes <= 0 or process_id < 0:
    raise ConfigError(
      "a coordinator needs mesh.num_processes and mesh.process_id "
      "(or JAXSTEP_NUM_PROCESSES and JAXSTEP_PROCESS_ID)"
    )
  if process_id >= num_processes:
    raise ConfigError(
      f"mesh.process_id {process_id} must be below mesh.num_processes {num_processes}"
    )
  address = parse_coordinator(coordinator)
  deadline = time.monotonic() + timeout  # one bound for the probe and the join together
  if process_id == 0:
    refuse_a_busy_port(address[1], coordinator, port_fix)
    log.info(
      "process 0: coordinator on %s, waiting up to %d s for %d processes to join",
      coordinator,
      timeout,
      num_processes,
    )
  else:
    wait_for_coordinator(address, timeout, process_id)
  if uses_gloo():
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  line = (
    f"error: process {process_id} waited {timeout} s for all {num_processes} processes to "
    f"join the coordinator {coordinator}; start every process with the same "
    f"mesh.coordinator and mesh.num_processes, or raise mesh.initialization_timeout"
  )
  left = max(deadline - time.monotonic(), 1.0)
  with _ends_the_process_after(left, line):
    try:
      jax.distributed.initialize(
        coordinator,
        num_processes,
        process_id,
        local_device_ids=None if devices is None else list(devices),
        cluster_detection_method="deactivate",
        initialization_timeout=int(left) + JAX_GRACE_S,
      )
    except Exception as e:  # noqa: BLE001 - JAX's runtime errors: one line, not a stack
      advice = f"; {port_fix}" if process_id == 0 else ""
      raise ConfigError(
        f"process {process_id} could not start the multi-process job at {coordinator} "
        f"({first_line(e)}){advice}"
      ) from None


def refuse_a_busy_port(port: int, coordinator: str, fix: str = PORT_FIX) -> None:
  """``ConfigError`` if another program already listens on ``port``: process 0 serves the
  coordinator there on every interface, and JAX's runtime crashes (signal 11) on a busy
  port instead of raising. Both families are tried: an IPv6 socket may not see an IPv4
  listener (``bindv6only``); a family this host lacks is passed over."""
  for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
    try:
      with socket.socket(family) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
          probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        probe.bind((host, port))
    except OSError as e:
      if e.errno == errno.EADDRINUSE:
        raise ConfigError(
          f"process 0 could not start the multi-process job at {coordinator} (port {port} "
          f"is in use); {fix}"
        ) from None


JAX_GRACE_S = 10  # JAX's own wait outlasts ours by this much, so ours ends it readably


@contextlib.contextmanager
def _ends_the_process_after(seconds: float, line: str):
  """Ends the process with ``line`` on stderr and exit 2 if the block runs ``seconds``.

  ``jax.distributed.initialize`` blocks in C++ (without the GIL) until every process has
  joined; when its own timeout runs out it aborts the process with a C++ stack (exit 134),
  which no Python code can catch. The process cannot go on either way; this ends it first,
  with one line that says what to check.
  """

  lock, done = threading.Lock(), []

  def give_up():
    with lock:  # the block may have ended just now: then the process goes on
      if done:
        return
      sys.stderr.write(line + "\n")
      sys.stderr.flush()
      os._exit(2)

  timer = threading.Timer(seconds, give_up)
  timer.daemon = True
  timer.start()
  try:
    yield
  finally:
    with lock:
      done.append(True)
    timer.cancel()


def parse_coordinator(coordinator: str) -> tuple[str, int]:
  """``(host, port)`` of ``host:port`` (IPv6 as ``[addr]:port``), else ``ConfigError``."""
  raw, sep, port = coordinator.strip().rpartition(":")
  host = raw.removeprefix("[").removesuffix("]")
  bare_ipv6 = ":" in raw and host == raw
  if not sep or not host or bare_ipv6 or not port.isdigit() or not 0 < int(port) < 65536:
    raise ConfigError(
      f"mesh.coordinator must be host:port with a port in 1-65535 "
      f"(e.g. host0:12345), got {coordinator!r}"
    )
  return host, int(port)


def wait_for_coordinator(address: tuple[str, int], timeout: float, process_id: int) -> None:
  """Returns once ``address`` accepts a TCP connection; retries until ``timeout`` seconds
  have passed, then raises ``ConfigError`` naming the address and what to check."""
  start = time.monotonic()
  deadline = start + timeout
  while True:
    remaining = deadline - time.monotonic()
    try:
      with socket.create_connection(address, timeout=max(min(remaining, 2.0), 0.1)):
        return
    except OSError as e:
      reason = e.strerror or str(e) or type(e).__name__
    remaining = deadline - time.monotonic()
    if remaining <= 0:
      break
    time.sleep(min(PROBE_INTERVAL, remaining))
  host, port = address
  shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
  raise ConfigError(
    f"process {process_id} could not reach the coordinator {shown} in "
    f"{time.monotonic() - start:.0f} s ({reason}); check that process 0 was started with the "
    f"same mesh.coordinator, that this address and port are reachable from this host, or "
    f"raise mesh.initialization_timeout"
  )


def uses_gloo(platforms: str | None = None) -> bool:
  """Whether processes talk through gloo, the CPU transport: only when JAX runs on the CPU.

  ``platforms`` (default ``jax.config.jax_platforms``, which ``JAX_PLATFORMS`` sets) decides
  by its first entry; unset, JAX runs on the CPU exactly when no accelerator plugin (CUDA,
  ROCm, TPU) is installed. Decided without starting a backend, which must not start before
  ``jax.distributed.initialize``. GPU and TPU hosts keep their own transport (NCCL, ICI).
  """
  if platforms is None:
    platforms = _platforms()
  if platforms.strip():
    return platforms.split(",")[0].strip() == "cpu"
  return not any(importlib.util.find_spec(p) for p in ACCELERATOR_PLUGINS)


def _platforms() -> str:
  """``jax_platforms`` as set (``JAX_PLATFORMS``), ``""`` when unset."""
  return jax.config.jax_platforms or ""
