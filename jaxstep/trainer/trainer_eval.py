"""Scoring a ``jaxstep.Trainer``'s eval sets with the user's own loss."""

from __future__ import annotations

import jax

from jaxstep import parallel
from jaxstep.errors import BatchError
from jaxstep.trainer import trainer_data as sources
from jaxstep.trainer.evaluation.scoring import summed

RESERVED = ("loss", "tokens")  # the sums every set reports; an aux of these names is kept apart


def check_first_batches(sets: dict, mesh=None) -> None:
  """``BatchError`` naming the set if its first batch is not a dict, or (with a mesh) its
  rows do not split over the mesh's devices: found at the start of the run, not at its
  first evaluation an hour in. Reads one batch per set."""
  devices = 1 if mesh is None else parallel.batch_shards(mesh)
  for name, make in sets.items():
    first = next(iter(make()), None)
    if first is None:
      continue
    batch = sources.check_batch(first, None, f"eval_sets[{name!r}]'s first batch")
    rows = next(iter(batch.values())).shape[0]
    if rows % devices:
      raise BatchError(
        f"eval_sets[{name!r}]'s first batch has {rows} rows, which do not split over the "
        f"mesh's {devices} devices; give its batches a multiple of {devices} rows"
      )


class Evaluator:
  """Scores every eval set of a ``Trainer`` on a train state: ``eval_loss`` = Σ loss_sum /
  Σ units over the set (float64 on the host), ``eval_tokens`` = Σ units, and each aux
  entry of the loss summed over the set as ``eval_<name>`` (``eval_aux_<name>`` for an aux
  called ``loss`` or ``tokens``; ``extra_loss``, a mean-type term, is left out).

  Args:
    sets: ``{name: () -> iterable of batches}``.
    loss_fn: the training loss ``(params, batch, rng[, model_state]) -> (loss_sum, aux, …)``,
      called with a fixed key when ``eval_loss_fn`` is None.
    eval_loss_fn: ``(params, batch[, model_state]) -> (loss_sum, aux)``.
    units_fn: ``batch -> N``.
    limit: batches per set (0: all).
    mesh: batches are sharded over it (their rows must divide by its devices).
  """

  def __init__(self, sets, loss_fn, eval_loss_fn, units_fn, *, limit: int, mesh=None):
    self.sets, self.limit, self.mesh = sets, limit, mesh
    key = jax.random.PRNGKey(0)

    def scores(params, model_state, batch):
      with_state = () if model_state is None else (model_state,)
      if eval_loss_fn is not None:
        loss_sum, aux = eval_loss_fn(params, batch, *with_state)[:2]
      else:
        loss_sum, aux = loss_fn(params, batch, key, *with_state)[:2]
      named = {(f"aux_{k}" if k in RESERVED else k): v for k, v in aux.items()}
      named.pop("extra_loss", None)
      return {"__loss": loss_sum, "__tokens": units_fn(batch), **named}

    self.scores = jax.jit(scores)

  def _put(self, batch):
    if self.mesh is None:
      return batch
    return parallel.put_batch(batch, parallel.batch_sharding(self.mesh))

  def __call__(self, state) -> dict:
    return {name: self.score(state, make()) for name, make in self.sets.items()}

  def score(self, state, batches) -> dict:
    def outputs():
      for i, batch in enumerate(batches):
        if self.limit and i >= self.limit:
          return
        batch = sources.check_batch(batch, None, "an eval batch")
        yield self.scores(state.params, state.model_state, self._put(batch))

    sums = {k: float(v) for k, v in (summed(outputs()) or {}).items()}
    tokens = sums.pop("__tokens", 0.0)
    loss = sums.pop("__loss", 0.0) / max(tokens, 1.0)
    return {"eval_loss": loss, "eval_tokens": tokens, **{f"eval_{k}": v for k, v in sums.items()}}
