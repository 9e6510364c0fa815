"""The config sections beside ``train`` and the model: checkpoints, the mesh, evaluation
sets (the trackers' sections live with the trackers)."""

from __future__ import annotations

import dataclasses

from jaxstep.errors import ConfigError
from jaxstep.trainer import eval_sets

MAX_CPU_DEVICES = 1024  # XLA's host platform crashes natively long before 100,000 devices


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """orbax checkpoints under ``run_dir/checkpoints``; counts are update steps."""

  every: int = 100  # save every this many update steps (0 = only the final save)
  keep: int = 3  # keep the newest this many checkpoints
  async_: bool = dataclasses.field(
    default=True, metadata={"key": "async"}
  )  # save in the background
  allow_data_change: bool = False  # resume even if the dataset fingerprint changed
  allow_schedule_change: bool = False  # resume with a re-planned lr schedule length

  def __post_init__(self):
    if self.every < 0 or self.keep < 1:
      raise ConfigError(
        f"checkpoint.every must be >= 0 and checkpoint.keep >= 1, got {self.every} and {self.keep}"
      )


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Devices and processes. The batch is split over data × fsdp; params over fsdp."""

  data: int = -1  # data-parallel size (-1 = all devices not used by fsdp)
  fsdp: int = 1  # parameter-sharding size (-1 = all devices not used by data)
  coordinator: str = ""  # host:port of process 0 for multi-host ("" = JAXSTEP_COORDINATOR)
  num_processes: int = 0  # processes in the job (0 = JAXSTEP_NUM_PROCESSES / auto)
  process_id: int = -1  # this process's index (-1 = JAXSTEP_PROCESS_ID / auto)
  cpu_devices: int = 0  # CLI on a CPU-only host: virtual devices (0 = per core that fits G/K)
  initialization_timeout: int = 300  # seconds to wait for the coordinator and all processes

  def __post_init__(self):
    for name in ("data", "fsdp"):
      if getattr(self, name) == 0 or getattr(self, name) < -1:
        raise ConfigError(f"mesh.{name} must be >= 1 or -1 (the rest), got {getattr(self, name)}")
    if self.data == -1 and self.fsdp == -1:
      raise ConfigError("mesh.data and mesh.fsdp cannot both be -1; set one of them")
    for name in ("num_processes", "cpu_devices"):
      if getattr(self, name) < 0:
        raise ConfigError(f"mesh.{name} must be >= 0, got {getattr(self, name)}")
    if self.cpu_devices > MAX_CPU_DEVICES:
      raise ConfigError(
        f"mesh.cpu_devices must be at most {MAX_CPU_DEVICES} (virtual devices of one host), "
        f"got {self.cpu_devices}"
      )
    if self.process_id < -1:
      raise ConfigError(f"mesh.process_id must be >= 0 or -1 (auto), got {self.process_id}")
    if self.initialization_timeout <= 0:
      raise ConfigError(
        f"mesh.initialization_timeout must be > 0 seconds, got {self.initialization_timeout}"
      )


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """Named evaluation sets besides the held-out split, scored at ``train.eval_every``."""

  sets: dict[str, str] = dataclasses.field(default_factory=dict)  # {name: path}, like data.path

  def __post_init__(self):
    object.__setattr__(self, "sets", eval_sets.check_sets(self.sets))
