"""jaxstep: exact token-normalized gradient accumulation for JAX training.

The package by layer:

- ``jaxstep.core``: pure JAX, no I/O — the train step, the accumulation scan, ``Session``,
  ``TrainState``, losses, optimizer, loss scaling.
- ``jaxstep.parallel``: the ``("data", "fsdp")`` mesh, sharding rules, multi-process start.
- ``jaxstep.models``: the bundled GPT, its CPU kernels, adapters for your own model.
- ``jaxstep.data``: readers, tokenizer, samples with loss masks, global batches.
- ``jaxstep.generation``: ``Generator`` (prompts → continuations, with a key/value cache).
- ``jaxstep.trainer``: config, the update loop, checkpoints, resume, metrics, guards, a
  saved run read back, evaluation on any data.
- ``jaxstep.cli``: the commands (``jaxstep train``, ``generate``, ``evaluate``, ``check``,
  ``memory``, ``checkpoints``, ``plot``, ``prepare``); ``jaxstep/<command>.py`` lets
  ``python -m jaxstep.<command>`` run each one.

This module is the public API: the names below are what docs and examples use.
"""

__version__ = "0.1.0"

from jaxstep import data, errors, generation, models, parallel  # noqa: E402
from jaxstep.core.check import CheckReport, Stage, check_accumulation  # noqa: E402
from jaxstep.core.losses import masked_nll, next_token_loss  # noqa: E402
from jaxstep.core.optim import OptimConfig, make_optimizer, make_schedule  # noqa: E402
from jaxstep.core.session import Session, StepReport  # noqa: E402
from jaxstep.core.state import TrainState  # noqa: E402
from jaxstep.core.step import make_train_step  # noqa: E402
from jaxstep.errors import (  # noqa: E402
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
from jaxstep.generation import Generator, Sample  # noqa: E402
from jaxstep.trainer import config  # noqa: E402
from jaxstep.trainer.checkpoint import Checkpointer  # noqa: E402
from jaxstep.trainer.saved_run import SavedRun, load_run  # noqa: E402

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
  "PromptError",
  "RunDirError",
  "RunIOError",
  "Sample",
  "SavedRun",
  "Session",
  "Stage",
  "StepReport",
  "TrainState",
  "check_accumulation",
  "config",
  "data",
  "errors",
  "generation",
  "load_run",
  "make_optimizer",
  "make_schedule",
  "make_train_step",
  "masked_nll",
  "models",
  "next_token_loss",
  "parallel",
]
