"""Adapters from a framework's module to what the step threads: ``params`` (differentiated)
and ``model_state`` (everything else the model updates, e.g. BatchNorm statistics).

Both adapters return a ``Model`` whose ``apply_fn(params, inputs, *, rng=None, train=False,
model_state=None)`` returns ``(outputs, new_model_state)``. In a step's loss::

  def loss_fn(params, batch, rng, model_state):
    logits, model_state = net.apply_fn(params, batch["x"], rng=rng, train=True,
                                       model_state=model_state)
    return loss_sum, aux, model_state

with ``net = from_nnx(module)`` and the state from ``train_step.init(net.params, rng,
model_state=net.model_state)``. ``rng`` is the
step's key for this micro-step: every random stream of the model (dropout) is drawn from
it, so each micro-step gets fresh randomness and a resumed run draws the same.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxstep.core.state import raw_key

# What an NNX module keeps besides its parameters and random streams.
_NNX_STATE = nnx.Not(nnx.Any(nnx.Param, nnx.RngState))


class Model(NamedTuple):
  apply_fn: Callable  # (params, inputs, *, rng, train, model_state) -> (outputs, model_state)
  params: Any  # plain nested dict of arrays: what the optimizer and checkpoints see
  model_state: Any  # plain nested dict of the model's other state ({} if it keeps none)


def _accepts(fn) -> set[str]:
  return set(inspect.signature(fn).parameters)


def _fresh_streams(rng_state: dict, rng) -> dict:
  """Every random stream's key replaced by ``fold_in(rng, i)`` and its count reset, so the
  streams depend on the step's key only (``rng=None``: left as they are). ``rng`` may be a
  typed key, a raw ``uint32[2]`` key or an int seed; a typed key and its ``key_data`` draw
  the same streams."""
  if rng is None:
    return rng_state
  base = jax.random.wrap_key_data(raw_key(rng))
  leaves, treedef = jax.tree.flatten(rng_state)
  fresh = [
    jax.random.fold_in(base, i)
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
    # a count: the stream starts over from its new key
    else jnp.zeros_like(x)
    for i, x in enumerate(leaves)
  ]
  return jax.tree.unflatten(treedef, fresh)


def from_nnx(module: nnx.Module) -> Model:
  """Adapts any NNX module: ``nnx.Param`` variables become ``params``, random streams
  (``nnx.Rngs`` held by ``nnx.Dropout`` and the like) are re-drawn from the step's ``rng``
  on every call, and every other variable (``nnx.BatchStat``, your own) is the
  ``model_state`` that each call returns updated.

  ``train`` is passed to ``__call__`` if it takes it; otherwise the module is switched
  with ``.train()`` / ``.eval()`` (dropout on/off, BatchNorm batch/running statistics).
  ``rng`` is passed on if ``__call__`` takes it. Any other keyword argument of
  ``apply_fn`` goes to ``__call__`` as it is (the bundled decoders' ``segment_ids`` and
  ``positions``). A module without other variables has ``model_state == {}``, which
  ``train_step.init`` takes as no model state (3-argument loss).
  """
  graphdef, params, rng_state, model_state = nnx.split(module, nnx.Param, nnx.RngState, ...)
  rng_state = nnx.to_pure_dict(rng_state)
  accepts = _accepts(type(module).__call__)

  def apply_fn(params, inputs, *, rng=None, train=False, model_state=None, **call_kwargs):
    model = nnx.merge(
      graphdef, params, _fresh_streams(rng_state, rng), model_state or {}, copy=True
    )
    kwargs = {}
    if "rng" in accepts:
      kwargs["rng"] = rng
    if "train" in accepts:
      kwargs["train"] = train
    elif train:
      model.train()
    else:
      model.eval()
    outputs = model(inputs, **kwargs, **call_kwargs)
    return outputs, nnx.to_pure_dict(nnx.state(model, _NNX_STATE))

  return Model(apply_fn, nnx.to_pure_dict(params), nnx.to_pure_dict(model_state))


def from_linen(module, sample_inputs, rng: jax.Array | int = 0) -> Model:
  """Adapts a linen module, initialised on ``sample_inputs``: the ``params`` collection
  becomes ``params`` and every other collection (``batch_stats``, …) ``model_state``.

  ``train`` is passed to ``__call__`` if it takes it; with ``train=True`` every
  non-parameter collection is mutable and comes back updated. ``rng`` (an int seed, a
  typed or a raw key, here and in ``apply_fn``) feeds the ``dropout`` stream. A module
  without other collections has ``model_state == {}``: ``train_step.init`` takes that as
  no model state, and the loss takes 3 arguments.
  """
  key = raw_key(rng)
  accepts = _accepts(module.__call__)
  flags = (lambda train: {"train": train}) if "train" in accepts else (lambda train: {})
  variables = dict(module.init({"params": key, "dropout": key}, sample_inputs, **flags(False)))
  params = variables.pop("params")

  def apply_fn(params, inputs, *, rng=None, train=False, model_state=None):
    model_state = dict(model_state or {})
    rngs = {"dropout": raw_key(rng)} if rng is not None else None
    variables = {"params": params, **model_state}
    if not (train and model_state):
      return module.apply(variables, inputs, rngs=rngs, **flags(train)), model_state
    outputs, updated = module.apply(
      variables, inputs, rngs=rngs, mutable=list(model_state), **flags(train)
    )
    return outputs, {**model_state, **updated}

  return Model(apply_fn, params, variables)
