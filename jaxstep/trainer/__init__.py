"""The run driver behind ``jaxstep train`` and ``jaxstep.Trainer``: config → data, mesh and
jitted step → one update loop with hooks for checkpoints, metrics, evaluation, guards,
callbacks and trackers.

Rooms, in the order a run's data flows through them (``docs/design.md`` has the map and
what each may import): ``config`` (the schema and YAML loading), ``plan`` (derived values,
the jitted steps, everything built once), ``store`` (run dir, records, checkpoints, the one
resume), ``loop`` (the ``Loop``, hooks, the one loop assembly), ``tracking`` (metrics, MFU,
trackers, plots, profiles), ``evaluation`` (eval sets, the one scoring loop, samples) and
``saved_run`` (a finished run loaded, scored, exported). The two clients on top:
``config_run`` (``train``: a config's model and data) and ``trainer_run`` with
``trainer_data`` and ``trainer_eval`` (``Trainer``: any model).
"""

from __future__ import annotations

import importlib
import importlib.util

# Loaded on first use: ``config`` (and so every ``--help`` and config error) must not wait
# for jax, orbax and TensorBoard to import.
_LAZY = {
  "Callback": "jaxstep.trainer.loop.callbacks",
  "EarlyStopping": "jaxstep.trainer.loop.callbacks",
  "TrainerControl": "jaxstep.trainer.loop.callbacks",
  "Run": "jaxstep.trainer.plan.build",
  "build": "jaxstep.trainer.plan.build",
  "RunState": "jaxstep.trainer.store.run_state",
  "TrainResult": "jaxstep.trainer.config_run",
  "evaluate": "jaxstep.trainer.config_run",
  "train": "jaxstep.trainer.config_run",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
  """An export above, or a submodule (``jaxstep.trainer.config_run``) imported on first use."""
  if name in _LAZY:
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
  if importlib.util.find_spec(f"{__name__}.{name}") is None:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  return importlib.import_module(f"{__name__}.{name}")


def __dir__() -> list[str]:
  return sorted({*globals(), *_LAZY})
