"""Numbers read from a model folder's ``config.json``, checked for their type: a value such
as ``"hidden_size": "thirty-two"`` is one ``ConfigError`` naming the file, the key and the
value, not a traceback from ``int()`` deep in the model's construction."""

from __future__ import annotations

import math

from jaxstep.errors import ConfigError

_MISSING = object()


def integer(hf: dict, key: str, where: str, default=_MISSING) -> int:
  """``hf[key]`` as an int (an integral JSON number); ``default`` when absent or null."""
  value = _value(hf, key, where, default)
  if isinstance(value, float) and value.is_integer():
    value = int(value)
  if isinstance(value, bool) or not isinstance(value, int):
    raise ConfigError(f"{where}: {key!r} must be an integer, got {value!r}")
  return value


def real(hf: dict, key: str, where: str, default=_MISSING) -> float:
  """``hf[key]`` as a finite float (any JSON number); ``default`` when absent or null."""
  value = _value(hf, key, where, default)
  if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
    raise ConfigError(f"{where}: {key!r} must be a number, got {value!r}")
  return float(value)


def _value(hf: dict, key: str, where: str, default):
  value = hf.get(key)
  if value is None:
    if default is _MISSING:
      raise ConfigError(f"{where} has no {key!r}")
    return default
  return value
