"""The batch-geometry rules, written once: what K may be and how G must divide.

G (global batch size) is samples per update; K (``grad_accum_steps``) micro-batches of G/K
samples each; with D devices each micro-batch is split into D equal shards, so G must be a
multiple of D × K. The config, the step, the mesh check and the CPU device count all ask
these functions.
"""

from __future__ import annotations

import operator

import numpy as np

from jaxstep.errors import ConfigError


def grad_accum_steps(k) -> int:
  """``k`` as a Python int if it is a positive integer of any integer type (``int``, numpy
  or concrete JAX integer scalars), else ``ConfigError``. Bools and floats are not counts."""
  try:
    n = None if isinstance(k, bool | np.bool_) else operator.index(k)
  except TypeError:
    n = None
  if n is None or n <= 0:
    raise ConfigError(f"grad_accum_steps must be a positive integer, got {k!r}")
  return n


def divides(global_batch_size: int, grad_accum_steps: int, devices: int = 1) -> bool:
  """True when G splits into K equal micro-batches, each into ``devices`` equal shards."""
  return global_batch_size % (devices * grad_accum_steps) == 0


def split_problem(
  global_batch_size: int,
  grad_accum_steps: int | None,
  devices: int = 1,
  *,
  names: tuple[str, str] = ("the global batch size", "grad_accum_steps"),
) -> str | None:
  """Why G cannot be split (the numbers and what to change), or None if it can.

  The rule: G must be a multiple of devices × K (K equal micro-batches, each split evenly
  over the devices). ``grad_accum_steps`` None means K is not known yet (a batch placed
  on the devices before the step sees it): then only the devices are checked, and the
  message still states the whole rule, since any G the devices divide may yet fail for K.
  ``names`` says how the caller's user spells G and K (config keys for the CLI).
  """
  g_name, k_name = names
  if grad_accum_steps is None:
    if global_batch_size % devices == 0:
      return None
    return (
      f"{g_name} {global_batch_size} does not split evenly over {devices} devices; each of "
      f"the K micro-batches must, so G (samples per update) must be a multiple of devices × "
      f"{k_name} = "
      f"{devices} × K ({', '.join(str(devices * k) for k in (1, 2, 4))}, … for K = 1, 2, 4, …)"
    )
  if divides(global_batch_size, grad_accum_steps, devices):
    return None
  n = devices * grad_accum_steps
  if devices == 1:
    return (
      f"{g_name} {global_batch_size} is not divisible by {k_name} {grad_accum_steps}; "
      f"micro-batches must be equal, so pick a multiple of {grad_accum_steps}"
    )
  return (
    f"{g_name} {global_batch_size} is not divisible by devices × {k_name} = "
    f"{devices} × {grad_accum_steps} = {n}; every micro-batch must split evenly over the "
    f"devices, so pick a multiple of {n}"
  )
