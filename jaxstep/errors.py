"""Every exception jaxstep raises on purpose, in one place.

Each subclasses ``ValueError`` (bad input) or ``RuntimeError`` (bad state) as well as
``JaxstepError``, so callers can catch either the specific class or the broad one. Messages
say what to change, not only what went wrong.
"""

import errno


def first_line(error: BaseException) -> str:
  """``Type: first line`` of an error from a library (orbax, tensorstore, JAX's runtime),
  whose messages carry stacks and dumps below it; at most 200 characters of the line."""
  text = str(error).strip().splitlines()
  return f"{type(error).__name__}: {text[0][:200] if text else ''}"


class JaxstepError(Exception):
  """Base class of all jaxstep errors."""


class ConfigError(JaxstepError, ValueError):
  """A config key or a library option is invalid (typo, wrong type, inconsistent numbers)."""


class BatchError(JaxstepError, ValueError):
  """A batch or model input has the wrong structure or shape."""


class EmptyBatchError(BatchError):
  """A global batch holds zero normalization units (e.g. no loss-masked tokens)."""


class DataError(JaxstepError, ValueError):
  """A dataset is missing, empty, malformed, or has token ids outside the vocabulary."""


class PromptError(JaxstepError, ValueError):
  """A generation prompt is empty, too long for the model, or not encodable."""


class RunDirError(JaxstepError, FileNotFoundError):
  """A run directory lacks what a command reads (metrics, checkpoints)."""


# the errnos of a write the disk refused: exit 74 like a failed write of a run, not bad input
WRITE_REFUSED = frozenset({errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT})


class RunIOError(JaxstepError, OSError):
  """Writing the run's outputs failed (disk full, read-only or removed directory); the
  newest complete checkpoint is intact."""


class CheckpointError(JaxstepError, RuntimeError):
  """Checkpoints exist but cannot be restored, or do not match the current run."""


class WorkerError(JaxstepError, RuntimeError):
  """A worker process died (killed by a signal, e.g. out of memory); its work is lost."""


class AccumulationError(JaxstepError, RuntimeError):
  """A Session's half-finished accumulation was invalidated and must be reset."""


class NonFiniteError(JaxstepError, RuntimeError):
  """An update was non-finite and ``train.nonfinite`` is ``halt``."""


class Interrupted(JaxstepError, RuntimeError):
  """SIGTERM/SIGINT arrived; a checkpoint was written at the last update boundary."""

  def __init__(self, message: str, signum: int):
    super().__init__(message)
    self.signum = signum


class RewardError(JaxstepError, RuntimeError):
  """An RL reward function failed on a completion: it raised, its score is no number, or it
  did not return within ``rl.reward_timeout``."""
