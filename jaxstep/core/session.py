"""``Session``: the same exact accumulation for callers that produce micro-batches one at a
time (an RL loop, a data source with its own pacing) — the micro-step protocol.

Each call adds one micro-batch: ``grad(loss_sum_k + extra_k/K)`` into an fp32 accumulator
on device (``micro_gradients`` with N = 1) and its ``normalization_units`` to a host count.
At the boundary (K micro-steps, or ``force_update``) the sum is divided once by the total N
and ``apply_update`` runs the optax chain — the same two functions ``make_train_step`` uses,
so there is one implementation of the math. Division is linear, so dividing the sum by N
equals summing the ``grad(loss_sum_k / N)`` that the scan uses, up to fp32 rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxstep.core import geometry
from jaxstep.core.accumulate import LossFn, micro_gradients
from jaxstep.core.precision import compute_dtype as precision_dtype
from jaxstep.core.state import TrainState
from jaxstep.core.step import NO_INJECTED_LR, apply_update, current_lr, injected_lr
from jaxstep.errors import AccumulationError, ConfigError, EmptyBatchError


class StepReport(NamedTuple):
  parameters_updated: bool  # did this call apply an optimizer update
  optimizer_step: int  # update steps taken so far (TrainState.step)
  microsteps_accumulated: int  # micro-steps in the current (or just applied) accumulation
  loss_sum: float  # Σ un-normalized loss over those micro-steps (the loss numerator)
  loss_units: float  # Σ normalization units over those micro-steps (N)


class Session:
  """Accumulates micro-batches and updates every K of them (or when forced).

  Args:
    loss_fn: ``(params, micro_batch, rng) -> (loss_sum, aux)`` as for ``make_train_step``.
    optimizer: an optax transformation; ``lr=`` overrides need an injected learning rate
      (``jaxstep.make_optimizer`` injects it).
    params: initial parameters.
    grad_accum_steps: K, micro-steps per update.
    rng: seed or key; micro-step k of update s uses ``fold_in(fold_in(rng, s), k)``.
    precision: ``None``/``"fp32"`` or ``"bf16"``.

  ``session.state`` is the ``TrainState`` (params, optimizer state, update count) after the
  last update and ``session.params`` its parameters. ``params`` are copied at the start, so
  the caller's arrays stay usable. A model with non-parameter state (BatchNorm) needs
  ``make_train_step``.

  Example:
    >>> session = Session(loss_fn, optax.adamw(1e-3), params, grad_accum_steps=4)
    >>> report = session.train_step(mb, normalization_units=mb["loss_mask"].sum())
  """

  def __init__(
    self,
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    params,
    *,
    grad_accum_steps: int,
    rng=0,
    precision: str | None = None,
  ):
    grad_accum_steps = geometry.grad_accum_steps(grad_accum_steps)
    compute_dtype = precision_dtype(precision)
    if precision == "fp16":
      raise ConfigError("Session supports precision fp32 or bf16 (fp16 needs loss scaling)")
    self.grad_accum_steps = grad_accum_steps
    # A copy: updates donate the state's buffers, and the caller's arrays must outlive them.
    params = jax.tree.map(lambda x: jnp.array(x, copy=True), params)
    self.state = TrainState.create(params=params, optimizer=optimizer, rng=rng)
    # lr= rescales by the injected lr; known once, so a bad override fails before any work
    self._injects_lr = injected_lr(self.state.opt_state) is not None

    def micro(params, grads_acc, loss_acc, micro_batch, rng):
      grads, (loss_sum, _, _, _) = micro_gradients(
        loss_fn,
        params,
        micro_batch,
        1.0,
        rng,
        grad_accum_steps=grad_accum_steps,
        compute_dtype=compute_dtype,
      )
      return optax.tree.add(grads_acc, grads), loss_acc + loss_sum

    def update(state, grads_acc, loss_acc, units, lr):
      grads = optax.tree.scale(1.0 / units, grads_acc)
      ok = jnp.isfinite(loss_acc) & jnp.isfinite(optax.tree.norm(grads))
      new_state = apply_update(optimizer, state, grads, ok, lr=lr)
      return new_state, new_state.skipped == state.skipped  # apply_update may skip too

    self._micro = jax.jit(micro, donate_argnums=(1,))
    self._update = jax.jit(update, donate_argnums=0)
    self.reset()

  def reset(self) -> None:
    """Drops any half-finished accumulation and makes the session usable again."""
    self._grads = optax.tree.zeros_like(self.state.params, jnp.float32)
    self._loss = jnp.zeros((), jnp.float32)
    self._units = 0.0
    self._count = 0
    self.valid = True

  @property
  def params(self):
    """The current parameters (after the last update; never the half-accumulated ones)."""
    return self.state.params

  @property
  def microsteps_accumulated(self) -> int:
    return self._count

  @property
  def loss_numerator(self) -> float:
    return float(self._loss)

  @property
  def optimizer_step(self) -> int:
    return int(self.state.step)

  @property
  def lr(self) -> float:
    """The learning rate of the last update (NaN before the first / without injection)."""
    return float(current_lr(self.state.opt_state))

  def _report(self, updated: bool) -> StepReport:
    return StepReport(
      updated, int(self.state.step), self._count, float(self._loss), float(self._units)
    )

  def train_step(
    self,
    micro_batch,
    *,
    normalization_units,
    force_update: bool = False,
    lr: float | None = None,
    before_update: Callable[[StepReport], bool] | None = None,
    after_update: Callable[[StepReport], None] | None = None,
  ) -> StepReport:
    """Adds one micro-batch; at the boundary, updates once.

    Args:
      micro_batch: one micro-batch (any pytree ``loss_fn`` takes).
      normalization_units: the units of THIS micro-batch (e.g. its loss-masked tokens);
        the update divides by their sum over the accumulation.
      force_update: update now, with fewer than K micro-steps (a short tail).
      lr: learning rate for this update instead of the optimizer's own (its updates are
        rescaled by ``lr / scheduled lr``). Needs an optimizer that injects its lr
        (``optax.inject_hyperparams`` or ``jaxstep.make_optimizer``); an update whose
        scheduled lr is 0 (a warmup's first) cannot be rescaled and is skipped.
      before_update: called at the boundary with the report; returning True aborts: no
        update, and the accumulation becomes invalid.
      after_update: called with the report after the update.

    Raises:
      ConfigError: ``lr`` given but the optimizer does not inject its lr; raised before
        anything is added, so the session trains on as if the call had not happened.
      AccumulationError: the accumulation was invalidated (abort or exception); ``reset()``.
      EmptyBatchError: zero units at the boundary; nothing is updated.
    """
    if lr is not None and not self._injects_lr:
      raise ConfigError(NO_INJECTED_LR)
    if not self.valid:
      raise AccumulationError(
        "this Session's accumulation was aborted or failed; call "
        "reset() to drop it before training on"
      )
    try:
      rng = jax.random.fold_in(jax.random.fold_in(self.state.rng, self.state.step), self._count)
      self._grads, self._loss = self._micro(
        self.state.params, self._grads, self._loss, micro_batch, rng
      )
      self._units += float(normalization_units)
      self._count += 1
      if self._count < self.grad_accum_steps and not force_update:
        return self._report(False)
      if self._units <= 0:
        raise EmptyBatchError(
          f"the accumulation of {self._count} micro-steps holds 0 normalization units; "
          f"nothing to average over and nothing was updated; call reset() to drop it"
        )
      if before_update is not None and before_update(self._report(False)):
        self.valid = False
        return self._report(False)
      units = jnp.float32(self._units)
      self.state, ok = self._update(
        self.state, self._grads, self._loss, units, None if lr is None else jnp.float32(lr)
      )
      report = self._report(bool(ok))
      self.reset()
      if after_update is not None:
        after_update(report)
      return report
    except Exception:
      self.valid = False
      raise
