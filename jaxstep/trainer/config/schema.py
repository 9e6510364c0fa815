"""The whole config schema: every section's dataclass, the values its keys accept, and the
checks a value must pass to be built. Imports no other room of the trainer (a section's
rules live here, and the modules that act on a section import them from here), so loading a
config loads nothing but this and ``loading``/``values``.

Sections: ``model`` (``jaxstep.models``' GPT or Llama config), ``data``
(``jaxstep.data.DataConfig``), ``train`` (``TrainConfig``), ``optim``
(``jaxstep.core.optim.OptimConfig``), ``checkpoint``, ``mesh``, ``eval``, ``preference``,
``mlflow``, ``wandb`` and ``run_dir``. Step counts are update steps.
"""

from __future__ import annotations

import dataclasses

from jaxstep.core import geometry
from jaxstep.core.distill import DistillConfig
from jaxstep.core.optim import OptimConfig
from jaxstep.core.precision import PRECISIONS
from jaxstep.core.preference import REFERENCE_FREE, PreferenceConfig
from jaxstep.core.rl import RLConfig
from jaxstep.data import DataConfig
from jaxstep.errors import ConfigError
from jaxstep.models import GPTConfig, LlamaConfig
from jaxstep.trainer.config.distill_section import check_distill_run
from jaxstep.trainer.config.eval_section import (  # noqa: F401 - the section, and its names
  HARNESS_SET,
  HELDOUT,
  MAX_EVAL_SETS,
  EvalConfig,
  check_eval_sets,
)

NONFINITE_POLICIES = ("skip", "halt")  # skip: train on; halt: checkpoint and stop


EXTERNAL_TRACKERS = ("mlflow", "wandb")  # the trackers jaxstep.trainer.tracking drives


TRACKERS = ("jsonl", "tensorboard", *EXTERNAL_TRACKERS)  # every name train.trackers accepts


@dataclasses.dataclass(frozen=True)
class MlflowConfig:
  """Config section ``mlflow``: where an MLflow run goes when ``train.trackers`` names it."""

  tracking_uri: str = ""  # "" = a local file store in run_dir/mlruns; or http(s)://, sqlite:///
  experiment: str = "jaxstep"  # experiment name, created when missing

  def __post_init__(self):
    if not self.experiment.strip():
      raise ConfigError("mlflow.experiment must be non-empty, e.g. jaxstep")


@dataclasses.dataclass(frozen=True)
class WandbConfig:
  """Config section ``wandb``: where a W&B run goes when ``train.trackers`` names it."""

  project: str = "jaxstep"  # W&B project, created when missing
  entity: str = ""  # user or team ("" = the account's default entity)
  mode: str = "online"  # online | offline (written under run_dir/wandb; wandb sync) | disabled

  def __post_init__(self):
    if not self.project.strip():
      raise ConfigError("wandb.project must be non-empty, e.g. jaxstep")
    if self.mode not in ("online", "offline", "disabled"):
      raise ConfigError(f"wandb.mode must be online, offline or disabled, got {self.mode!r}")


def check_tracker_names(names) -> None:
  """Raises ``ConfigError`` for an unknown or repeated tracker name, or a list without
  ``jsonl``: ``metrics.jsonl`` is the run's own record that resume, plot and checkpoints
  read, so it cannot be switched off."""
  seen = set()
  for name in names:
    if name not in TRACKERS:
      raise ConfigError(f"train.trackers: unknown tracker {name!r}; known: {', '.join(TRACKERS)}")
    if name in seen:
      raise ConfigError(f"train.trackers names {name} twice")
    seen.add(name)
  if "jsonl" not in seen:
    raise ConfigError(
      "train.trackers must include jsonl: metrics.jsonl is the run's own record "
      "(resume, plot and checkpoints read it)"
    )


def parse_profile_steps(spec: str) -> tuple[int, int] | None:
  """``"A:B"`` → ``(A, B)`` with ``1 <= A <= B``; ``""`` → None; anything else a
  ``ConfigError``."""
  if not spec:
    return None
  first, sep, last = spec.partition(":")
  try:
    a, b = int(first), int(last)
  except ValueError:
    a = b = 0
  if not sep or not 1 <= a <= b:
    raise ConfigError(
      f"train.profile_steps must be 'A:B' with update steps 1 <= A <= B, got {spec!r}"
    )
  return a, b


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
  tensor: int = 1  # tensor-parallel size: each layer split over this many devices
  sequence_parallel: bool = False  # with tensor > 1: activations split over positions too
  expert: int = 1  # expert-parallel size (MoE): devices the experts split over (docs/moe.md)
  coordinator: str = ""  # host:port of process 0 for multi-host ("" = JAXSTEP_COORDINATOR)
  num_processes: int = 0  # processes in the job (0 = JAXSTEP_NUM_PROCESSES / auto)
  process_id: int = -1  # this process's index (-1 = JAXSTEP_PROCESS_ID / auto)
  cpu_devices: int = 0  # CPU-only CLI: devices (0: a core each that fits G/K; 1: frozen base)
  initialization_timeout: int = 300  # seconds to wait for the coordinator and all processes

  def __post_init__(self):
    for name in ("data", "fsdp"):
      if getattr(self, name) == 0 or getattr(self, name) < -1:
        raise ConfigError(f"mesh.{name} must be >= 1 or -1 (the rest), got {getattr(self, name)}")
    if self.data == -1 and self.fsdp == -1:
      raise ConfigError("mesh.data and mesh.fsdp cannot both be -1; set one of them")
    if self.tensor < 1:
      raise ConfigError(f"mesh.tensor must be >= 1 (1: no tensor parallelism), got {self.tensor}")
    if self.expert < 1:
      raise ConfigError(f"mesh.expert must be >= 1 (1: no expert parallelism), got {self.expert}")
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


# How the CLI's user spells G and K in messages about batch geometry.
CONFIG_NAMES_OF_G_AND_K = ("train.global_batch_size", "train.grad_accum_steps")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Batch geometry, run length and cadences. Step counts are update steps."""

  global_batch_size: int = 32  # samples per optimizer update (G)
  grad_accum_steps: int | str = 4  # micro-steps per update (K), or auto: fit memory_budget_gb
  memory_budget_gb: float = 0.0  # auto K: bytes per device (0 = 90% of the GPU's; CPU: set it)
  seq_len: int = 128  # tokens per sample (inputs); windows hold seq_len + 1 tokens
  max_steps: int = 1000  # stop after this many update steps (0 = no limit)
  epochs: int = 0  # stop after this many passes over the data (0 = no limit)
  schedule_steps: int = 0  # update steps the lr schedule spans (0 = the run's length)
  seed: int = 0  # params init, data order, dropout
  precision: str = "fp32"  # fp32 | bf16 | fp16 (low-precision compute, fp32 params + grads)
  loss_scale_init: float = 32768.0  # fp16: starting dynamic loss scale
  loss_scale_growth_interval: int = 2000  # fp16: finite updates before the scale doubles
  loss_scale_min: float = 1.0  # fp16: the scale never halves below this
  loss_scale_max: float = 16777216.0  # fp16: the scale never doubles above this (2^24)
  nonfinite: str = "skip"  # skip | halt: what to do when an update is non-finite
  max_consecutive_skips: int = 20  # halt after this many skipped updates in a row (0 = off)
  debug_nan_step: int = 0  # fault injection: make this update step's loss NaN (0 = off)
  spike_factor: float = 0.0  # skip updates with loss > factor × running median (0 = off)
  spike_window: int = 32  # applied updates in the running median
  scan_unroll: int = 1  # unroll factor of the micro-step scan (speed only)
  log_every: int = 10  # write a metrics line every this many update steps
  eval_every: int = 100  # evaluate every this many update steps (0 = only at the end)
  eval_at_start: bool = False  # also evaluate before the first update of a fresh run (step 0)
  eval_batches: int = 0  # eval global batches per evaluation (0 = the whole eval split)
  early_stopping_patience: int = 0  # stop after this many evals without improvement (0 = off)
  peak_tflops: float = 0.0  # per-device peak for MFU (0 = known GPU table / measured on CPU)
  progress: bool = True  # tqdm progress bar (only shown on a terminal)
  sample_every: int = 0  # generate from sample_prompts every this many update steps (0 = off)
  sample_prompts: tuple[str, ...] = ("the ", "38 + 61 = ")  # text prompts for those samples
  sample_max_new_tokens: int = 64  # tokens generated per sample
  profile_steps: str = ""  # "A:B": jax.profiler trace of update steps A..B in run_dir/profile
  trackers: tuple[str, ...] = ("jsonl", "tensorboard")  # + mlflow, wandb (optional extras)

  def __post_init__(self):
    if isinstance(self.grad_accum_steps, str) and self.grad_accum_steps != "auto":
      raise ConfigError(
        f"train.grad_accum_steps must be a positive integer or auto, got {self.grad_accum_steps!r}"
      )
    if self.grad_accum_steps != "auto":
      geometry.grad_accum_steps(self.grad_accum_steps)
    parse_profile_steps(self.profile_steps)
    check_tracker_names(self.trackers)
    if self.memory_budget_gb < 0:
      raise ConfigError(f"train.memory_budget_gb must be >= 0, got {self.memory_budget_gb}")
    for name in (
      "global_batch_size",
      "seq_len",
      "log_every",
      "spike_window",
      "scan_unroll",
      "sample_max_new_tokens",
    ):
      if getattr(self, name) <= 0:
        raise ConfigError(f"train.{name} must be > 0, got {getattr(self, name)}")
    for name in (
      "max_steps",
      "epochs",
      "schedule_steps",
      "eval_every",
      "eval_batches",
      "sample_every",
      "debug_nan_step",
      "early_stopping_patience",
      "max_consecutive_skips",
    ):
      if getattr(self, name) < 0:
        raise ConfigError(f"train.{name} must be >= 0, got {getattr(self, name)}")
    problem = self.grad_accum_steps != "auto" and geometry.split_problem(
      self.global_batch_size, self.grad_accum_steps, names=CONFIG_NAMES_OF_G_AND_K
    )
    if problem:
      raise ConfigError(problem)
    if self.max_steps == 0 and self.epochs == 0:
      raise ConfigError("set train.max_steps or train.epochs (both are 0: the run never ends)")
    if not 0 <= self.seed < 2**63:
      raise ConfigError(f"train.seed must be in [0, 2**63), got {self.seed}")
    if self.sample_every and not all(self.sample_prompts):
      raise ConfigError("train.sample_prompts must be a list of non-empty prompts")
    if self.precision not in PRECISIONS:
      raise ConfigError(
        f"train.precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}"
      )
    if not 0 < self.loss_scale_min <= self.loss_scale_init <= self.loss_scale_max:
      raise ConfigError("need 0 < train.loss_scale_min <= loss_scale_init <= loss_scale_max")
    if self.loss_scale_growth_interval <= 0:
      raise ConfigError("train.loss_scale_growth_interval must be > 0")
    if self.spike_factor != 0 and not self.spike_factor > 1:
      raise ConfigError(
        f"train.spike_factor must be 0 (off) or > 1 (a multiple of the median loss), got "
        f"{self.spike_factor}"
      )
    if self.peak_tflops < 0:
      raise ConfigError(f"train.peak_tflops must be >= 0, got {self.peak_tflops}")
    if self.nonfinite not in NONFINITE_POLICIES:
      raise ConfigError(
        f"train.nonfinite must be one of {', '.join(NONFINITE_POLICIES)}, got {self.nonfinite!r}"
      )


@dataclasses.dataclass(frozen=True)
class Config:
  """The whole run. Sections are attributes: ``cfg.model``, ``cfg.train``, …"""

  model: GPTConfig | LlamaConfig = GPTConfig(vocab_size=0)  # model.family picks the class
  data: DataConfig = DataConfig()
  train: TrainConfig = TrainConfig()
  optim: OptimConfig = OptimConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  mesh: MeshConfig = MeshConfig()
  eval: EvalConfig = EvalConfig()
  preference: PreferenceConfig = PreferenceConfig()
  rl: RLConfig = RLConfig()
  distill: DistillConfig = DistillConfig()
  mlflow: MlflowConfig = MlflowConfig()
  wandb: WandbConfig = WandbConfig()
  run_dir: str = "runs/default"  # outputs: metrics, TensorBoard events, config.yaml
  # compiled programs kept across starts: auto ($JAXSTEP_XLA_CACHE, else ~/.cache/jaxstep/xla),
  # a folder, or off (jaxstep.cli.compile_cache)
  xla_cache: str = "auto"

  def __post_init__(self):
    if not self.run_dir.strip():
      raise ConfigError("run_dir is empty; name the folder for the run's outputs")
    if not self.data.path.strip():
      raise ConfigError("data.path is empty; name a prepared folder, file, directory or glob")
    if self.preference.loss:
      check_preference_run(self)
    if self.rl.rewards:
      check_rl_run(self)
    if self.distill.teacher:
      check_distill_run(self)
    if self.data.sources and self.train.epochs:
      raise ConfigError(
        "train.epochs has no meaning for a mixture (data.sources): its sources cycle at their "
        "own pace; set train.max_steps instead"
      )
    if self.train.seq_len > self.model.max_seq_len and not self.model.init_from:
      raise ConfigError(
        f"train.seq_len {self.train.seq_len} exceeds model.max_seq_len "
        f"{self.model.max_seq_len}; raise model.max_seq_len"
      )


def check_rl_run(cfg: Config) -> None:
  """What an RL run (``rl.rewards`` named) cannot combine with, and its batch arithmetic."""
  r, t = cfg.rl, cfg.train
  r.check_groups(distilling=bool(cfg.distill.teacher))
  if cfg.preference.loss:
    raise ConfigError("a run is either preference (preference.loss) or RL (rl.rewards); pick one")
  if cfg.data.sources or cfg.eval.sets:
    raise ConfigError(
      "an RL run reads one prompts file (data.path): drop data.sources and eval.sets"
    )
  if t.global_batch_size % r.num_generations:
    raise ConfigError(
      f"train.global_batch_size {t.global_batch_size} counts completions, num_generations "
      f"{r.num_generations} per prompt: make it a multiple of {r.num_generations}"
    )
  if r.reward_weights and len(r.reward_weights) != len(r.rewards):
    raise ConfigError(
      f"rl.reward_weights has {len(r.reward_weights)} weights for {len(r.rewards)} rewards"
    )
  if r.reference == "adapters" and not cfg.model.lora.rank:
    raise ConfigError(
      "rl.reference=adapters is the LoRA base: set model.lora.rank > 0, or use live"
    )
  if t.seq_len <= r.max_new_tokens:
    raise ConfigError(
      f"train.seq_len {t.seq_len} must hold a prompt and rl.max_new_tokens {r.max_new_tokens}"
    )


def check_preference_run(cfg: Config) -> None:
  """What a preference run (``preference.loss`` set) cannot combine with."""
  p = cfg.preference
  if p.reference == "adapters" and not cfg.model.lora.rank:
    raise ConfigError(
      "preference.reference=adapters is the LoRA base: set model.lora.rank > 0, or use "
      "preference.reference=live (a frozen copy of the starting weights)"
    )
  if p.loss not in REFERENCE_FREE and p.reference == "none":
    raise ConfigError(
      f"preference.loss={p.loss} needs a reference: preference.reference auto, adapters (LoRA) "
      f"or live; or use a reference-free loss (simpo, orpo)"
    )
  if p.reference_file and p.reference != "precompute":
    raise ConfigError(
      "preference.reference_file is where precomputed log-probs live; set "
      "preference.reference=precompute or drop it"
    )
  if cfg.data.sources:
    raise ConfigError("a preference run reads one pairs file (data.path), not data.sources")
  if cfg.preference.max_prompt_len > cfg.train.seq_len:
    raise ConfigError(
      f"preference.max_prompt_len {cfg.preference.max_prompt_len} exceeds train.seq_len "
      f"{cfg.train.seq_len}: no completion token would fit; lower it or raise train.seq_len"
    )
