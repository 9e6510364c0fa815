"""Run configuration: frozen dataclasses, YAML files and dotted ``key=value`` overrides.

``load(path, overrides)`` starts from the dataclass defaults, applies the YAML file (a
*partial* config is fine: missing keys keep their defaults), then the overrides, and
validates. Unknown keys name the nearest valid key; wrong types name key, value and type.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import pathlib
import typing
from typing import Any

import yaml

from jaxstep.core import geometry
from jaxstep.core.optim import OptimConfig
from jaxstep.core.precision import PRECISIONS
from jaxstep.data import DataConfig
from jaxstep.errors import ConfigError
from jaxstep.models import FAMILIES, GPTConfig, LlamaConfig, family_of, hf_config, hf_gpt2
from jaxstep.trainer import profiling, trackers
from jaxstep.trainer.config_values import (
  coerce,
  expand_path,
  quoted,
  read_yaml,
  require_init_from,
)
from jaxstep.trainer.guards import NONFINITE_POLICIES
from jaxstep.trainer.sections import CheckpointConfig, EvalConfig, MeshConfig
from jaxstep.trainer.trackers import MlflowConfig, WandbConfig

log = logging.getLogger(__name__)

CONFIG_DIR = pathlib.Path(__file__).resolve().parent.parent / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "tiny.yaml"


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
    profiling.parse_steps(self.profile_steps)
    trackers.check_names(self.trackers)
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
  mlflow: MlflowConfig = MlflowConfig()
  wandb: WandbConfig = WandbConfig()
  run_dir: str = "runs/default"  # outputs: metrics, TensorBoard events, config.yaml

  def __post_init__(self):
    if not self.run_dir.strip():
      raise ConfigError("run_dir is empty; name the folder for the run's outputs")
    if not self.data.path.strip():
      raise ConfigError("data.path is empty; name a prepared folder, file, directory or glob")
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


def _key(field: dataclasses.Field) -> str:
  """The config key of a field (``async_`` is spelled ``async`` in files and overrides)."""
  return field.metadata.get("key", field.name)


def to_dict(cfg) -> dict[str, Any]:
  """Nested plain dict (YAML/JSON-able) of a config dataclass, keyed by config keys; a
  model section starts with its ``family``."""
  tree = {"family": family_of(cfg)} if isinstance(cfg, tuple(FAMILIES.values())) else {}
  for f in dataclasses.fields(cfg):
    v = getattr(cfg, f.name)
    tree[_key(f)] = (
      to_dict(v) if dataclasses.is_dataclass(v) else list(v) if isinstance(v, tuple) else v
    )
  return tree


def model_keys(family: str) -> list[str]:
  """The keys a model section of ``family`` takes (``family`` itself among them; a nested
  section's as ``lora.rank``)."""
  return ["family", *valid_keys(FAMILIES[family])]


def valid_keys(cls=Config, prefix="") -> list[str]:
  """Every dotted key of the schema, e.g. ``train.global_batch_size``; the model section's
  are those of every family."""
  if cls is Config and not prefix:
    model = dict.fromkeys(k for family in FAMILIES for k in model_keys(family))
    return [f"model.{k}" for k in model] + valid_keys(_Sections)
  keys = []
  for f in dataclasses.fields(cls):
    sub = typing.get_type_hints(cls)[f.name]
    if dataclasses.is_dataclass(sub):
      keys += valid_keys(sub, f"{prefix}{_key(f)}.")
    else:
      keys.append(f"{prefix}{_key(f)}")
  return keys


@dataclasses.dataclass(frozen=True)
class _Sections:
  """``Config`` without its model section: the schema ``valid_keys`` walks."""

  data: DataConfig = DataConfig()
  train: TrainConfig = TrainConfig()
  optim: OptimConfig = OptimConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  mesh: MeshConfig = MeshConfig()
  eval: EvalConfig = EvalConfig()
  mlflow: MlflowConfig = MlflowConfig()
  wandb: WandbConfig = WandbConfig()
  run_dir: str = ""


def _unknown(key: str) -> ConfigError:
  near = difflib.get_close_matches(key, valid_keys(), n=1, cutoff=0.5)
  hint = f"; did you mean {near[0]!r}?" if near else ""
  return ConfigError(f"unknown config key {key!r}{hint}")


def _build(default, values: dict[str, Any], prefix: str = ""):
  """``default`` (a config dataclass instance) with ``values`` set: a partial section keeps
  the defaults of the keys it does not name, its owner's defaults included."""
  cls = type(default)
  hints = typing.get_type_hints(cls)
  names = {_key(f): f.name for f in dataclasses.fields(cls)}
  kwargs = {}
  for config_key, value in values.items():
    key = f"{prefix}{config_key}"
    if config_key not in names:
      raise _unknown(key)
    name = names[config_key]
    if key == "model":
      kwargs[name] = _build_model(default.model, value)
    elif dataclasses.is_dataclass(hints[name]):
      if not isinstance(value, dict):
        raise ConfigError(
          f"config key {key!r} is a section; give it a mapping, got {quoted(value)}"
        )
      kwargs[name] = _build(getattr(default, name), value, f"{key}.")
    else:
      kwargs[name] = coerce(key, value, hints[name])
  return dataclasses.replace(default, **kwargs)


def _folder_family(folder) -> str | None:
  """The family of a ``model.init_from`` folder's architecture (so the section's other keys,
  ``model.lora.targets`` among them, are checked against the right model); None when the
  folder does not say (``init_from.resolve`` reports that later, in one line)."""
  if not folder:
    return None
  try:
    hf = hf_config.read_config(os.path.expanduser(os.path.expandvars(str(folder))))
    arch = hf_config.architecture(hf)
  except ConfigError:
    return None
  return "gpt" if arch == hf_gpt2.ARCHITECTURE else "llama"


def _build_model(default, values: Any):
  """The model section: ``model.family`` (default: the family of ``default``) picks the
  config class; the other keys must be that family's."""
  if not isinstance(values, dict):
    raise ConfigError(f"config key 'model' is a section; give it a mapping, got {quoted(values)}")
  values = dict(values)
  folder = values.get("init_from") if "family" not in values else None
  of_folder = _folder_family(folder)
  family = str(values.pop("family", of_folder or family_of(default)))
  if family not in FAMILIES:
    raise ConfigError(f"model.family must be one of {', '.join(FAMILIES)}, got {family!r}")
  cls = FAMILIES[family]
  tops = {k.split(".")[0] for k in model_keys(family)}
  foreign = [k for k in values if k not in tops and f"model.{k}" in valid_keys()]
  if foreign:
    owners = [name for name in FAMILIES if foreign[0] in model_keys(name)]
    fix = f"model.init_from is a {family} model" if of_folder else "set model.family"
    raise ConfigError(
      f"model.{foreign[0]} is a setting of model.family {' or '.join(owners)}, not of "
      f"{family}; {fix}: drop the key"
    )
  return _build(default if isinstance(default, cls) else cls(vocab_size=0), values, "model.")


def _set_dotted(tree: dict, key: str, value: Any) -> None:
  *parents, leaf = key.split(".")
  node = tree
  for p in parents:
    node = node.setdefault(p, {})
    if not isinstance(node, dict):
      raise _unknown(key)
  node[leaf] = value


def _resolve_path(path: str | pathlib.Path | None) -> pathlib.Path:
  """A config file path; a bare name like ``tiny`` means the bundled ``configs/tiny.yaml``."""
  if path is None:
    return DEFAULT_CONFIG
  p = pathlib.Path(path)
  if not p.exists() and (CONFIG_DIR / f"{path}.yaml").exists():
    return CONFIG_DIR / f"{path}.yaml"
  if not p.exists():
    raise ConfigError(
      f"config file {str(path)!r} does not exist "
      f"(bundled: {', '.join(sorted(x.stem for x in CONFIG_DIR.glob('*.yaml')))})"
    )
  return p


def load(path: str | pathlib.Path | None = None, overrides=()) -> Config:
  """Loads a config: defaults ← YAML file ← ``key=value`` overrides, then validates.

  Args:
    path: a YAML file, a bundled config name (``tiny``), or None for the bundled default.
    overrides: strings ``"train.global_batch_size=32"`` (dotted keys, values coerced to the
      field's type).

  Raises:
    ConfigError: unknown key (with the nearest valid one), wrong type, invalid value.
  """
  file = _resolve_path(path)
  try:
    tree = read_yaml(file.read_text(encoding="utf-8"), str(file)) or {}
  except yaml.YAMLError as e:
    raise ConfigError(f"{file}: not valid YAML ({e})".replace("\n", " ")) from None
  except UnicodeDecodeError as e:
    raise ConfigError(f"{file}: not UTF-8 text ({e.reason} at byte {e.start})") from None
  except OSError as e:
    raise ConfigError(f"config file {str(file)!r} cannot be read ({e.strerror})") from None
  if not isinstance(tree, dict):
    raise ConfigError(f"{file}: the top level must be a mapping of sections")
  given = {}
  for item in overrides:
    key, sep, value = item.partition("=")
    if not sep or not key:
      raise ConfigError(f"override {item!r} is not of the form key=value")
    key = key.strip()
    if key not in valid_keys():
      raise _unknown(key)
    if key in given:
      log.warning("%s is given twice on the command line: %s wins over %s", key, item, given[key])
    given[key] = item
    _set_dotted(tree, key, value)
  model = tree.get("model")
  if isinstance(model, dict) and isinstance(model.get("init_from"), str):
    require_init_from(expand_path("model.init_from", model["init_from"]))
  try:
    cfg = _build(Config(), tree)
  except TypeError as e:  # a dataclass refused a value coerce let through
    raise ConfigError(str(e)) from None
  return _expand_paths(cfg)


def _expand_paths(cfg: Config) -> Config:
  """The config with ``~`` and environment variables expanded in every path key."""
  data = dataclasses.replace(
    cfg.data,
    path=expand_path("data.path", cfg.data.path),
    tokenizer=expand_path("data.tokenizer", cfg.data.tokenizer),
  )
  model = dataclasses.replace(
    cfg.model, init_from=expand_path("model.init_from", cfg.model.init_from)
  )
  sets = {name: expand_path(f"eval.sets.{name}", path) for name, path in cfg.eval.sets.items()}
  sources = tuple(
    {**e, "path": expand_path(f"data.sources {e['name']!r} path", e["path"])}
    for e in cfg.data.sources
  )
  data = dataclasses.replace(data, sources=sources)
  return dataclasses.replace(
    cfg,
    run_dir=expand_path("run_dir", cfg.run_dir),
    data=data,
    model=model,
    eval=dataclasses.replace(cfg.eval, sets=sets),
  )


def dump(cfg: Config) -> str:
  """The resolved config as YAML (what ``run_dir/config.yaml`` holds)."""
  return yaml.safe_dump(to_dict(cfg), sort_keys=False)
