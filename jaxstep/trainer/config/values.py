"""Values of config keys as they come from YAML files and ``key=value`` overrides: read
with every key once per section (``read_yaml``), coerced to the field's type
(``coerce``), shown cut short in messages (``quoted``), and paths expanded as a shell
would (``expand_path``). Each failure is a ``ConfigError`` naming the key."""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import re
import reprlib
import types
import typing
from typing import Any

import yaml

from jaxstep.errors import ConfigError


class _UniqueKeyLoader(yaml.SafeLoader):
  """PyYAML's safe loader, except that a key given twice in one mapping is an error (PyYAML
  keeps the last one silently: two eval sets named ``web`` would become one). Keys a merge
  (``<<: *base``) brings in may be overridden, as YAML intends."""

  def construct_mapping(self, node, deep=False):
    seen = {}
    for key_node, _ in node.value:
      if key_node.tag == "tag:yaml.org,2002:merge":
        continue
      key = self.construct_object(key_node, deep=True)
      try:
        first = seen.setdefault(key, key_node.start_mark)
      except TypeError:  # an unhashable key: the loader's own error says so
        break
      if first is not key_node.start_mark:
        raise ConfigError(
          f"{first.name}: key {quoted(key)} is given twice in one section (lines "
          f"{first.line + 1} and {key_node.start_mark.line + 1}); keep one"
        )
    return super().construct_mapping(node, deep)


def read_yaml(text: str, name: str) -> Any:
  """The YAML document in ``text`` (read from ``name``), every key once per mapping."""
  loader = _UniqueKeyLoader(text)
  loader.name = name  # the marks in messages name the file
  try:
    return loader.get_single_data()
  finally:
    loader.dispose()


def quoted(value: Any, limit: int = 200) -> str:
  """``repr(value)`` cut to ``limit`` characters: a YAML alias can expand to gigabytes."""
  text = reprlib.Repr()
  text.maxstring = text.maxother = limit
  text.maxlist = text.maxdict = 8
  text.maxlevel = 3
  shown = text.repr(value)
  return shown if len(shown) <= limit else shown[:limit] + "…"


def coerce(key: str, value: Any, typ: Any) -> Any:
  """Converts a YAML or command-line value to the field's type, or raises ConfigError; a
  NaN or infinity anywhere in it (a list's item, a mapping's value: ``optim.groups``'
  ``lr_scale``, ``rl.reward_weights``) is refused too, naming where (``refuse_non_finite``)."""
  converted = _coerce(key, value, typ)
  refuse_non_finite(key, converted)
  return converted


def refuse_non_finite(key: str, value: Any) -> None:
  """``ConfigError`` naming the first NaN or infinite number in ``value``, walked through
  its lists and mappings (``optim.groups[0].lr_scale``): no key means either, and one
  would train a run to NaN or write it into a checkpoint."""
  if isinstance(value, float) and not math.isfinite(value):
    raise ConfigError(f"config key {key!r} must be a finite number, got {value!r}")
  if isinstance(value, dict):
    for name, item in value.items():
      refuse_non_finite(f"{key}.{name}", item)
  elif isinstance(value, list | tuple):
    for i, item in enumerate(value):
      refuse_non_finite(f"{key}[{i}]", item)


def _coerce(key: str, value: Any, typ: Any) -> Any:
  """``coerce`` without the walk for non-finite numbers inside lists and mappings."""
  allowed = typing.get_args(typ) if isinstance(typ, types.UnionType) else (typ,)
  if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
    if type(None) in allowed:
      return None
  for t in allowed:
    if typing.get_origin(t) is tuple:
      if isinstance(value, str):  # on the command line: a YAML list, or one item
        value = yaml.safe_load(value) if value.lstrip().startswith("[") else [value]
      if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        return tuple(value)
      if isinstance(value, list | tuple) and typing.get_args(t)[0] is dict:
        return tuple(value)  # a list of mappings (data.sources): its owner checks them
      numbers = isinstance(value, list | tuple) and all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in value
      )
      if numbers and typing.get_args(t)[0] is float:
        return tuple(float(v) for v in value)
      if numbers and typing.get_args(t)[0] is int and all(isinstance(v, int) for v in value):
        return tuple(value)  # layer indices (model.dense_layers)
    elif t is bool:
      if isinstance(value, bool):
        return value
      if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
        return value.lower() in ("true", "yes", "1")
    elif t is int and not isinstance(value, bool):
      if isinstance(value, int):
        return value
      if isinstance(value, str):
        try:
          return int(value)
        except ValueError:
          pass
    elif t is float and not isinstance(value, bool):
      number = None
      if isinstance(value, int | float):
        number = float(value)
      elif isinstance(value, str):
        try:
          number = float(value)
        except ValueError:
          pass
      if number is not None and not math.isfinite(number):
        raise ConfigError(f"config key {key!r} must be a finite number, got {value!r}")
      if number is not None:
        return number
    elif t is str and isinstance(value, str | int | float) and not isinstance(value, bool):
      return str(value)
    elif typing.get_origin(t) is dict:  # {name: path}: its owner checks the entries
      if isinstance(value, str) and value.lstrip().startswith("{"):  # on the command line
        value = yaml.safe_load(value)
      if isinstance(value, dict):
        return dict(value)
    elif dataclasses.is_dataclass(t):
      if isinstance(value, str) and value.lstrip().startswith("{"):  # on the command line
        value = yaml.safe_load(value)
      if isinstance(value, dict):
        return value  # a nested setting (model.rope_scaling): its owner converts and checks it
  names = " or ".join(getattr(t, "__name__", str(t)) for t in allowed)
  raise ConfigError(f"config key {key!r}: expected {names}, got {quoted(value)}")


VARIABLE = re.compile(r"\$(\w+|\{\w+\})")


def expand_path(key: str, path: str) -> str:
  """``~`` and ``$VAR`` in a path, as a shell would expand them (``bundled:…`` unchanged);
  a variable that is not set is an error, not a folder literally named ``$VAR``."""
  expanded = os.path.expandvars(path)
  unset = VARIABLE.search(expanded)
  if unset:
    raise ConfigError(
      f"{key} {path!r} names the environment variable {unset.group(0)}, which is not set; "
      f"set it or write the path out"
    )
  return os.path.expanduser(expanded)


def require_init_from(init_from: str) -> None:
  """``ConfigError`` naming ``model.init_from`` when it is set and its folder is gone
  (moved, deleted, unmounted). Checked before the rest of the config is built: the folder
  is also the run's ``data.tokenizer``, and a LoRA run's base, so every later failure
  would name a key the user never set."""
  if init_from and not pathlib.Path(init_from).is_dir():
    raise ConfigError(
      f"model.init_from {init_from} is not a folder (moved or deleted?): a run starts from "
      f"a local Hugging Face model folder, and a run trained from one (its LoRA adapters, its "
      f"tokenizer) needs it back at that path"
    )
