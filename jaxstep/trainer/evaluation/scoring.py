"""The one scoring loop every evaluation goes through: during training (the bundled model's
held-out split and eval sets, a ``Trainer``'s eval sets with the user's loss) and after it
(``jaxstep evaluate`` on a saved run).

An evaluation is a sum over batches: each batch's device computation returns sums (NLL,
tokens, bytes, a user's aux), and the host adds them in float64, so the result does not
depend on the batch size or how many batches there are. Batches are dispatched a few ahead
of the host (``in_flight``): the device never waits on the host's additions, and a large
eval split never queues thousands of computations at once.
"""

from __future__ import annotations

import collections
import math

import jax
import numpy as np

EVAL_IN_FLIGHT = 4  # eval batches dispatched ahead of the host


def in_flight(outputs, limit: int = EVAL_IN_FLIGHT):
  """The host values of ``outputs`` (an iterator that dispatches one device computation
  per item), with at most ``limit`` dispatched ahead of the host: dispatching a whole large
  eval split at once (thousands of batches) starves XLA:CPU's collective rendezvous of
  threads and the process aborts after its 40 s timeout; a short queue keeps the device
  busy all the same."""
  pending = collections.deque()
  for out in outputs:
    pending.append(out)
    if len(pending) >= limit:
      yield jax.device_get(pending.popleft())
  while pending:
    yield jax.device_get(pending.popleft())


def summed(outputs, limit: int = EVAL_IN_FLIGHT):
  """Σ over ``outputs`` (each a pytree of device scalars, dispatched by iterating) of every
  leaf, as float64 on the host, ``limit`` batches in flight; None when there were none."""
  total = None
  for out in in_flight(outputs, limit):
    host = jax.tree.map(lambda x: np.asarray(x, np.float64), out)
    total = host if total is None else jax.tree.map(np.add, total, host)
  return total


def eval_record(nll: float, tokens: float, num_bytes: float, prefix: str = "eval_") -> dict:
  """Loss (mean NLL per masked target token), perplexity and bits per byte (the NLL in bits
  over the UTF-8 bytes those targets stand for) from the sums over the targets."""
  loss = nll / max(tokens, 1.0)
  return {
    f"{prefix}loss": loss,
    f"{prefix}ppl": math.exp(min(loss, 50.0)),
    f"{prefix}bpb": nll / (math.log(2) * num_bytes) if num_bytes else float("nan"),
    f"{prefix}tokens": int(tokens),
    f"{prefix}bytes": int(num_bytes),
  }
