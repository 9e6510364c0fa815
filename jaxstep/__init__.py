"""jaxstep: exact token-normalized gradient accumulation for JAX training.

The package by layer:

- ``jaxstep.core``: pure JAX, no I/O — the train step, the accumulation scan, ``Session``,
  ``TrainState``, losses, optimizer, loss scaling.
- ``jaxstep.parallel``: the ``("data", "fsdp")`` mesh, sharding rules, multi-process start.
- ``jaxstep.models``: the bundled GPT, its CPU kernels, adapters for your own model.
- ``jaxstep.data``: readers, tokenizer, samples with loss masks, global batches.
- ``jaxstep.generation``: ``Generator`` (prompts → continuations, with a key/value cache).
- ``jaxstep.lmeval``: a model as an lm-evaluation-harness ``LM``, tasks run offline.
- ``jaxstep.trainer``: config, the update loop, checkpoints, resume, metrics, guards, a
  saved run read back, evaluation on any data.
- ``jaxstep.cli``: the commands (``jaxstep train``, ``generate``, ``evaluate``, ``check``,
  ``memory``, ``checkpoints``, ``plot``, ``prepare``, ``harness``); ``jaxstep/<command>.py`` lets
  ``python -m jaxstep.<command>`` run each one.

This module is the public API: the names below are what docs and examples use. Each one
is imported on first use, so ``import jaxstep`` alone imports neither JAX nor orbax, Grain,
tensorboardX or tqdm.

A command's name here is the Python function that does the same work, not the module
behind ``python -m jaxstep.<command>``: ``jaxstep.prepare`` is ``jaxstep.data.prepare``,
``jaxstep.train`` is ``jaxstep.trainer.train``, ``jaxstep.evaluate`` evaluates a saved run
on a dataset, ``jaxstep.checkpoints`` lists a run's checkpoints and ``jaxstep.plot`` writes
its loss plot; ``check``, ``generate`` and ``memory`` raise ``ImportError`` naming the
Python way.
"""

from __future__ import annotations

import importlib

from jaxstep._version import __version__ as __version__
from jaxstep.errors import (
  AccumulationError,
  BatchError,
  CheckpointError,
  ConfigError,
  DataError,
  EmptyBatchError,
  JaxstepError,
  NonFiniteError,
  PromptError,
  RunDirError,
  RunIOError,
)

__all__ = [
  "AccumulationError",
  "BatchError",
  "CheckReport",
  "Checkpointer",
  "CheckpointError",
  "ConfigError",
  "DataError",
  "EmptyBatchError",
  "Generator",
  "JaxstepError",
  "NonFiniteError",
  "OptimConfig",
  "Pretrained",
  "PromptError",
  "RunDirError",
  "RunIOError",
  "Sample",
  "SavedRun",
  "Session",
  "Stage",
  "StepReport",
  "TrainState",
  "Trainer",
  "RLTrainer",
  "Hook",
  "check_accumulation",
  "config",
  "data",
  "errors",
  "generation",
  "load_pretrained",
  "load_run",
  "make_optimizer",
  "make_schedule",
  "make_train_step",
  "masked_nll",
  "models",
  "next_token_loss",
  "parallel",
  "register_harness",
]

# name -> (module, attribute; None: the module itself), imported on first use
_LAZY = {
  "CheckReport": ("jaxstep.core.check", "CheckReport"),
  "Stage": ("jaxstep.core.check", "Stage"),
  "check_accumulation": ("jaxstep.core.check", "check_accumulation"),
  "masked_nll": ("jaxstep.core.losses", "masked_nll"),
  "next_token_loss": ("jaxstep.core.losses", "next_token_loss"),
  "OptimConfig": ("jaxstep.core.optim", "OptimConfig"),
  "make_optimizer": ("jaxstep.core.optim", "make_optimizer"),
  "make_schedule": ("jaxstep.core.optim", "make_schedule"),
  "Session": ("jaxstep.core.session", "Session"),
  "StepReport": ("jaxstep.core.session", "StepReport"),
  "TrainState": ("jaxstep.core.state", "TrainState"),
  "make_train_step": ("jaxstep.core.step", "make_train_step"),
  "Generator": ("jaxstep.generation", "Generator"),
  "Sample": ("jaxstep.generation", "Sample"),
  "Checkpointer": ("jaxstep.trainer.store.checkpoint", "Checkpointer"),
  "SavedRun": ("jaxstep.trainer.saved_run.load", "SavedRun"),
  "Trainer": ("jaxstep.trainer.trainer_run", "Trainer"),
  "RLTrainer": ("jaxstep.trainer.trainer_rl", "RLTrainer"),
  "Hook": ("jaxstep.trainer.loop.hooks", "Hook"),
  "load_run": ("jaxstep.trainer.saved_run.load", "load_run"),
  "Pretrained": ("jaxstep.models.pretrained", "Pretrained"),
  "load_pretrained": ("jaxstep.models.pretrained", "load_pretrained"),
  "config": ("jaxstep.trainer.config.loading", None),
  "register_harness": ("jaxstep.trainer.saved_run.harness", "register"),
  # the subpackages
  "cli": ("jaxstep.cli", None),
  "core": ("jaxstep.core", None),
  "data": ("jaxstep.data", None),
  "errors": ("jaxstep.errors", None),
  "generation": ("jaxstep.generation", None),
  "models": ("jaxstep.models", None),
  "parallel": ("jaxstep.parallel", None),
  "trainer": ("jaxstep.trainer", None),
  # the commands: the function that does a command's work
  "prepare": ("jaxstep.data.preparation", "prepare"),
  "train": ("jaxstep.trainer.config_run", "train"),
  "evaluate": ("jaxstep.trainer.saved_run.evaluate", "evaluate"),
  "checkpoints": ("jaxstep.trainer.store.checkpoint", "list_checkpoints"),
  "plot": ("jaxstep.trainer.tracking.loss_plot", "plot_run"),
  "export": ("jaxstep.trainer.saved_run.export", "export_run"),
}

# the commands without one function: raising ImportError (not AttributeError) keeps
# ``from jaxstep import generate`` from importing the ``python -m`` entry module instead
_NO_FUNCTION = {
  "check": "jaxstep.check_accumulation (your own loss) or the command `jaxstep check`",
  "generate": "jaxstep.Generator(...).generate or the command `jaxstep generate`",
  "memory": "jaxstep.trainer.plan.memory or the command `jaxstep memory`",
  "harness": "jaxstep.register_harness() and lm_eval.simple_evaluate(model='jaxstep', …)",
}


def __getattr__(name: str):
  if name in _NO_FUNCTION:
    raise ImportError(f"jaxstep.{name} is a command, not a function: use {_NO_FUNCTION[name]}")
  if name not in _LAZY:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  module, attribute = _LAZY[name]
  value = importlib.import_module(module)
  if attribute is not None:
    value = getattr(value, attribute)
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return sorted({*globals(), *_LAZY})
