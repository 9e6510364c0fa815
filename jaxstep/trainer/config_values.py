"""Values of config keys as they come from YAML files and ``key=value`` overrides: coerced
to the field's type (``coerce``), shown cut short in messages (``quoted``), and paths
expanded as a shell would (``expand_path``). Each failure is a ``ConfigError`` naming the
key."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import reprlib
import types
import typing
from typing import Any

import yaml

from jaxstep.errors import ConfigError


def quoted(value: Any, limit: int = 200) -> str:
  """``repr(value)`` cut to ``limit`` characters: a YAML alias can expand to gigabytes."""
  text = reprlib.Repr()
  text.maxstring = text.maxother = limit
  text.maxlist = text.maxdict = 8
  text.maxlevel = 3
  shown = text.repr(value)
  return shown if len(shown) <= limit else shown[:limit] + "…"


def coerce(key: str, value: Any, typ: Any) -> Any:
  """Converts a YAML or command-line value to the field's type, or raises ConfigError."""
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
