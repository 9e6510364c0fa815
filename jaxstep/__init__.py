"""jaxstep: exact token-normalized gradient accumulation for JAX training."""

__version__ = "0.1.0"

from jaxstep import config, errors, losses, models, optim  # noqa: E402
from jaxstep.errors import (  # noqa: E402
  AccumulationError,
  BatchError,
  CheckpointError,
  ConfigError,
  DataError,
  EmptyBatchError,
  JaxstepError,
  NonFiniteError,
)
from jaxstep.session import Session, StepReport  # noqa: E402
from jaxstep.state import RunState, TrainState  # noqa: E402
from jaxstep.step import make_train_step  # noqa: E402

__all__ = [
  "AccumulationError",
  "BatchError",
  "CheckpointError",
  "ConfigError",
  "DataError",
  "EmptyBatchError",
  "JaxstepError",
  "NonFiniteError",
  "RunState",
  "Session",
  "StepReport",
  "TrainState",
  "config",
  "errors",
  "losses",
  "make_train_step",
  "models",
  "optim",
]
