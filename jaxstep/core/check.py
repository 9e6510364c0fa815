"""Is accumulation exact for this model? One update computed with K micro-steps and with
K = 1 on the same global batch, through the library's own ``split_micro_batches``,
``accumulate`` and optimizer, compared stage by stage: logits → loss → gradients → clipped
update → new params. The first stage whose relative error exceeds the precision's
tolerance is where the two diverge.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxstep.core import geometry
from jaxstep.core.accumulate import accumulate, split_micro_batches
from jaxstep.core.precision import cast_floating, compute_dtype
from jaxstep.core.step import default_units_fn, global_batch_size
from jaxstep.errors import EmptyBatchError

TOLERANCE = {"fp32": 1e-5, "bf16": 3e-2, "fp16": 3e-2}  # max |a - b| / max |b| per stage


@dataclasses.dataclass(frozen=True)
class Stage:
  name: str
  max_abs: float
  max_rel: float
  passed: bool


@dataclasses.dataclass(frozen=True)
class CheckReport:
  """Where K micro-steps and one big batch agree, stage by stage; ``str()`` is the table."""

  stages: tuple[Stage, ...]
  grad_accum_steps: int
  precision: str

  @property
  def passed(self) -> bool:
    return all(s.passed for s in self.stages)

  @property
  def first_divergence(self) -> str | None:
    """The first stage over the tolerance (e.g. ``"loss"``), or None if all pass."""
    return next((s.name for s in self.stages if not s.passed), None)

  def __str__(self) -> str:
    lines = [
      f"K={self.grad_accum_steps} micro-steps vs K=1 on the same global batch "
      f"({self.precision}, tolerance {TOLERANCE[self.precision]:.0e} relative):",
      f"  {'stage':<16} {'max abs err':>12} {'max rel err':>12}  result",
    ]
    for s in self.stages:
      verdict = "PASS" if s.passed else "FAIL"
      lines.append(f"  {s.name:<16} {s.max_abs:>12.3e} {s.max_rel:>12.3e}  {verdict}")
    failed = self.first_divergence
    lines.append(
      "PASS: accumulation is exact" if failed is None else f"FAIL: first divergence at '{failed}'"
    )
    return "\n".join(lines)


def _errors(a, b) -> tuple[float, float]:
  a = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(a)])
  b = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(b)])
  max_abs = float(np.max(np.abs(a - b))) if a.size else 0.0
  return max_abs, max_abs / max(float(np.max(np.abs(b))), 1e-30)


def check_accumulation(
  loss_fn,
  params,
  batch,
  optimizer: optax.GradientTransformation,
  grad_accum_steps: int,
  *,
  apply_fn=None,
  units_fn=None,
  precision: str = "fp32",
) -> CheckReport:
  """One update of ``params`` on ``batch`` with K = ``grad_accum_steps`` micro-steps and
  with K = 1, compared stage by stage: [logits →] loss → gradients → update → new params.

  Args:
    loss_fn: the step's ``(params, micro_batch, rng) -> (loss_sum, aux)``. A loss that
      returns a mean instead of a sum fails at ``loss``: with K micro-steps it is divided
      by N on top of its own mean.
    params, batch, optimizer: as for ``make_train_step`` (batch leaves ``[G, ...]``).
    grad_accum_steps: K; G must divide by it.
    apply_fn: ``(params, inputs) -> logits``, to compare the logits first (optional).
    units_fn: N of the global batch; default ``batch["loss_mask"].sum()``.
    precision: the compute precision; sets the tolerance (``TOLERANCE``).

  Returns:
    A ``CheckReport``: ``passed``, ``first_divergence`` and the table as ``str()``.
  """
  k = geometry.grad_accum_steps(grad_accum_steps)
  global_batch_size(batch, k)
  dtype = compute_dtype(precision)
  units = jnp.asarray((units_fn or default_units_fn)(batch), jnp.float32)
  if float(units) <= 0:
    raise EmptyBatchError(
      "the batch has no normalization units (no loss-masked tokens): both runs would be "
      "zero and the comparison says nothing; check a batch with tokens"
    )
  rng = jax.random.PRNGKey(0)
  opt_state = optimizer.init(params)

  def run(k):
    micro = split_micro_batches(batch, k)  # [K, G/K, ...]
    grads, loss, _, _, _ = accumulate(loss_fn, params, micro, units, rng, compute_dtype=dtype)
    updates, _ = optimizer.update(grads, opt_state, params)
    stages = (loss, grads, updates, optax.apply_updates(params, updates))
    if apply_fn is None:
      return stages
    logits = jax.vmap(lambda mb: apply_fn(cast_floating(params, dtype), mb["inputs"]))(micro)
    return (jnp.swapaxes(logits, 0, 1).reshape(-1, *logits.shape[2:]), *stages)  # row order

  names = ("loss", "gradients", "update", "new params")
  names = names if apply_fn is None else ("logits", *names)
  run = jax.jit(run, static_argnums=0)
  ours, reference = run(k), run(1)
  tol = TOLERANCE[precision or "fp32"]
  stages = []
  for name, a, b in zip(names, ours, reference, strict=True):
    max_abs, max_rel = _errors(a, b)
    stages.append(Stage(name, max_abs, max_rel, max_rel <= tol))
  return CheckReport(tuple(stages), k, precision or "fp32")
