"""jaxstep: exact token-normalized gradient accumulation for JAX training."""

from jaxstep import errors, losses, models, optim
from jaxstep.errors import (
  AccumulationError,
  BatchError,
  CheckpointError,
  ConfigError,
  DataError,
  EmptyBatchError,
  JaxstepError,
  NonFiniteError,
)
from jaxstep.state import TrainState
from jaxstep.step import make_train_step

__version__ = "0.1.0"

__all__ = [
  "AccumulationError",
  "BatchError",
  "CheckpointError",
  "ConfigError",
  "DataError",
  "EmptyBatchError",
  "JaxstepError",
  "TrainState",
  "errors",
  "losses",
  "make_train_step",
  "models",
  "optim",
]
