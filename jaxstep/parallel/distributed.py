"""Multi-process start: ``jax.distributed.initialize`` from config, environment or the
cluster launcher."""

from __future__ import annotations

import logging
import os

import jax

from jaxstep.errors import ConfigError

log = logging.getLogger("jaxstep")


def initialize_distributed(
  coordinator: str = "", num_processes: int = 0, process_id: int = -1
) -> None:
  """``jax.distributed.initialize`` from config, ``JAXSTEP_*`` env, or cluster detection.

  Precedence per field: config value, then ``JAXSTEP_COORDINATOR`` / ``JAXSTEP_NUM_PROCESSES``
  / ``JAXSTEP_PROCESS_ID``. With no coordinator anywhere, JAX's own cluster detection runs
  only under a multi-task SLURM / Open MPI launch; otherwise this is a single process.
  """
  coordinator = coordinator or os.environ.get("JAXSTEP_COORDINATOR", "")
  num_processes = num_processes or int(os.environ.get("JAXSTEP_NUM_PROCESSES", "0"))
  if process_id < 0:
    process_id = int(os.environ.get("JAXSTEP_PROCESS_ID", "-1"))
  if coordinator:
    if num_processes <= 0 or process_id < 0:
      raise ConfigError(
        "a coordinator needs mesh.num_processes and mesh.process_id "
        "(or JAXSTEP_NUM_PROCESSES and JAXSTEP_PROCESS_ID)"
      )
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU-only hosts
    jax.distributed.initialize(coordinator, num_processes, process_id)
  elif (
    int(os.environ.get("SLURM_NTASKS", "1")) > 1
    or int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1
  ):
    jax.distributed.initialize()
  else:
    return
  log.info(
    "process %d of %d, %d local / %d global devices",
    jax.process_index(),
    jax.process_count(),
    jax.local_device_count(),
    jax.device_count(),
  )
