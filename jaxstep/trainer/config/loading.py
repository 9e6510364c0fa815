"""Run configuration: frozen dataclasses, YAML files and dotted ``key=value`` overrides.

``load(path, overrides)`` starts from the dataclass defaults, applies the YAML file (a
*partial* config is fine: missing keys keep their defaults), then the overrides, and
validates. Unknown keys name the nearest valid key; wrong types name key, value and type.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
import os
import pathlib
import typing
from typing import Any

import yaml

from jaxstep.errors import ConfigError
from jaxstep.models import FAMILIES, family_of, hf_config, hf_gpt2
from jaxstep.trainer.config.schema import (  # the schema's names, as every caller reads them
  Config,
)
from jaxstep.trainer.config.values import (
  coerce,
  expand_path,
  quoted,
  read_yaml,
  require_init_from,
)

log = logging.getLogger(__name__)

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[2] / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "tiny.yaml"


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
  return list(_keys(cls, prefix))


# a class's field types, resolved once: its annotations are strings (``from __future__ import
# annotations``), and resolving them compiles each anew
_hints = functools.cache(typing.get_type_hints)


@functools.cache
def _keys(cls, prefix: str) -> tuple[str, ...]:
  """``valid_keys``, computed once per section."""
  keys = []
  if cls is Config:
    model = dict.fromkeys(k for family in FAMILIES for k in model_keys(family))
    keys = [f"model.{k}" for k in model]
  hints = _hints(cls)
  for f in dataclasses.fields(cls):
    if cls is Config and f.name == "model":
      continue
    sub = hints[f.name]
    if dataclasses.is_dataclass(sub):
      keys += _keys(sub, f"{prefix}{_key(f)}.")
    else:
      keys.append(f"{prefix}{_key(f)}")
  return tuple(keys)


def _unknown(key: str) -> ConfigError:
  near = difflib.get_close_matches(key, valid_keys(), n=1, cutoff=0.5)
  hint = f"; did you mean {near[0]!r}?" if near else ""
  return ConfigError(f"unknown config key {key!r}{hint}")


def build_section(default, values: dict[str, Any], prefix: str = ""):
  """``default`` (a config dataclass instance) with ``values`` set: a partial section keeps
  the defaults of the keys it does not name, its owner's defaults included."""
  cls = type(default)
  hints = _hints(cls)
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
      kwargs[name] = build_section(getattr(default, name), value, f"{key}.")
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
  return build_section(default if isinstance(default, cls) else cls(vocab_size=0), values, "model.")


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
  given, keys = {}, None
  for item in overrides:
    key, sep, value = item.partition("=")
    if not sep or not key:
      raise ConfigError(f"override {item!r} is not of the form key=value")
    key = key.strip()
    keys = keys or set(valid_keys())
    if key not in keys:
      raise _unknown(key)
    if key in given:
      log.warning("%s is given twice on the command line: %s wins over %s", key, item, given[key])
    given[key] = item
    _set_dotted(tree, key, value)
  model = tree.get("model")
  if isinstance(model, dict) and isinstance(model.get("init_from"), str):
    require_init_from(expand_path("model.init_from", model["init_from"]))
  try:
    cfg = build_section(Config(), tree)
  except TypeError as e:  # a dataclass refused a value coerce let through
    raise ConfigError(str(e)) from None
  return _expand_paths(_frozen_base_depth(cfg, model or {}))  # model: a mapping, or absent


# A pretrained folder under a frozen base (LoRA, optim.trainable): the depth settings the
# run gets unless the config names them. Only the adapters have gradients, so recomputing
# each block in the backward pass costs little, and on XLA:CPU remat saves memory only
# with scanned layers; measured on a 135 M folder (docs/performance.md), both together make
# the LoRA run leaner *and* faster: one compiled block instead of thirty, no saved
# activations. TRL, MaxText and Levanter make the same choice by default.
FROZEN_BASE_DEPTH = {"scan_layers": True, "remat": "block"}


def frozen_base(cfg: Config) -> bool:
  """Whether only part of the model trains: LoRA adapters or ``optim.trainable``."""
  return bool(cfg.model.lora.rank or cfg.optim.trainable)


def _frozen_base_depth(cfg: Config, given: dict) -> Config:
  """``cfg`` with ``FROZEN_BASE_DEPTH`` for each key the model section does not set, when
  the run starts from ``model.init_from`` with a frozen base."""
  if not cfg.model.init_from or not frozen_base(cfg):
    return cfg
  depth = {k: v for k, v in FROZEN_BASE_DEPTH.items() if k not in given}
  if "scan_layers" in depth and _mixed_layers(cfg.model.init_from):
    del depth["scan_layers"]  # blocks that differ cannot be one scanned stack
  return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **depth))


def _mixed_layers(folder: str) -> bool:
  """Whether the model folder's blocks differ (dense and mixture-of-experts MLPs, layers
  with and without rotary embeddings; a folder that cannot be read says no here: reading
  it later gives its error)."""
  from jaxstep.models import hf_config

  try:
    model = hf_config.model_config(hf_config.read_config(expand_path("model.init_from", folder)))
  except ConfigError:
    return False
  return getattr(model, "blocks_differ", False)


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
    distill=dataclasses.replace(
      cfg.distill, teacher=expand_path("distill.teacher", cfg.distill.teacher)
    ),
  )


def dump(cfg: Config) -> str:
  """The resolved config as YAML (what ``run_dir/config.yaml`` holds)."""
  return yaml.safe_dump(to_dict(cfg), sort_keys=False)
