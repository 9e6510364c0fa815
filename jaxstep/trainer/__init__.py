"""The run driver behind ``jaxstep train`` and ``jaxstep.Trainer``: config → data, mesh and
jitted step → one update loop with hooks for checkpoints, metrics, evaluation, guards,
callbacks and trackers.

``config`` and ``sections`` (the schema and YAML loading), ``plan`` (every derived value
resolved once: vocabulary, K, run and schedule length, mesh), ``steps`` (the jitted train
and eval steps of a config), ``assemble`` (``build``: everything built once), ``driver``
(the one update loop, ``Loop``), ``hooks`` (what a hook is and when it is called),
``run_hooks`` (the built-in hooks both clients use), ``loop`` (``train``: the bundled
models' client), ``fit`` / ``fit_eval`` / ``sources`` (``Trainer``: any model's client, its
eval sets and data sources), ``eval_sets`` (named eval sets of a config), ``trackers`` and
``tracker_backends`` (MLflow, W&B), ``run_state`` (the host-side position), ``checkpoint``,
``checkpoint_read`` and ``resume`` (orbax saves, the one verified read path, restore and
reconcile), ``run_dir`` (the output folder), ``records`` (kept files: JSON lines, atomic
rewrites), ``metrics`` (JSONL, TensorBoard, progress, one-update-late read-back),
``guards`` (skipped updates), ``callbacks``, ``signals`` (SIGTERM/SIGINT), ``perf`` (MFU),
``memory`` (the ledger) and ``loss_plot``.
"""

from __future__ import annotations

import importlib
import importlib.util

# Loaded on first use: ``config`` (and so every ``--help`` and config error) must not wait
# for jax, orbax and TensorBoard to import.
_LAZY = {
  "Callback": "jaxstep.trainer.callbacks",
  "EarlyStopping": "jaxstep.trainer.callbacks",
  "TrainerControl": "jaxstep.trainer.callbacks",
  "Run": "jaxstep.trainer.assemble",
  "build": "jaxstep.trainer.assemble",
  "RunState": "jaxstep.trainer.run_state",
  "TrainResult": "jaxstep.trainer.loop",
  "evaluate": "jaxstep.trainer.loop",
  "train": "jaxstep.trainer.loop",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
  """An export above, or a submodule (``jaxstep.trainer.loop``) imported on first use."""
  if name in _LAZY:
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
  if importlib.util.find_spec(f"{__name__}.{name}") is None:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  return importlib.import_module(f"{__name__}.{name}")


def __dir__() -> list[str]:
  return sorted({*globals(), *_LAZY})
