"""Is accumulation exact for this model? One update computed with K micro-steps and with
K = 1 on the same global batch, through the library's own ``split_micro_batches``,
``accumulate`` and optimizer, compared stage by stage: logits → loss → extra loss (an MoE model's
router losses; only when there is one) → gradients → clipped update → new params. The first
stage whose relative error exceeds the precision's tolerance is where the two diverge.

Two things make K and K = 1 differ without any accumulation bug, and the report names them
instead of a stage: a *random* loss (dropout: the K micro-steps draw other masks than the
one big batch, by design), found by running K = 1 under two keys; and a model state used in
training mode (BatchNorm: each micro-batch is normalized by its own batch statistics).

The update and the new params are compared where the two runs' gradients agree to the
tolerance relative to the entry's own size. The others agree only relative to the largest
gradient (what the ``gradients`` stage asks): rounding noise around a small or exactly-zero
gradient (e.g. the key bias, to which attention's softmax is invariant). Adam divides each
gradient by its own magnitude, so it turns that noise into differences of up to ±lr; such
entries are left out of those two stages and counted in the report.
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
from jaxstep.core.state import empty_to_none
from jaxstep.core.step import check_loss_arity, default_units_fn, global_batch_size
from jaxstep.errors import EmptyBatchError

TOLERANCE = {"fp32": 1e-5, "bf16": 3e-2, "fp16": 3e-2}  # max |a - b| / max |b| per stage

RANDOM_LOSS = (
  "INCONCLUSIVE: the loss is random — K = 1 alone gives another loss or gradient under "
  "another rng (dropout?), so K micro-steps, which draw other masks, cannot match it. "
  "Check with randomness off: a loss_fn whose model runs with train=False (or dropout 0)"
)
BATCH_STATISTICS = (
  "note: the loss takes a model state. In training mode BatchNorm normalizes each "
  "micro-batch by its own batch statistics, so K micro-batches of G/K samples are not one "
  "batch of G and a divergence from 'logits'/'loss' on is expected, not an accumulation "
  "bug. To check the accumulation itself, use a loss_fn with train=False (running "
  "statistics)"
)


@dataclasses.dataclass(frozen=True)
class Stage:
  name: str
  max_abs: float
  max_rel: float
  passed: bool
  left_out: int = 0  # entries not compared: their gradient is rounding noise around zero


@dataclasses.dataclass(frozen=True)
class CheckReport:
  """Where K micro-steps and one big batch agree, stage by stage; ``str()`` is the table
  and a verdict: PASS, FAIL at the first divergent stage, or INCONCLUSIVE for a random
  loss, followed by a note on batch statistics when a model state was involved."""

  stages: tuple[Stage, ...]
  grad_accum_steps: int
  precision: str
  random_loss: bool = False  # K = 1 under two rngs disagrees: the comparison says nothing
  model_state: bool = False  # the loss took a model state (batch statistics may differ)

  @property
  def passed(self) -> bool:
    """Every stage within tolerance, and the loss deterministic (a random loss never
    passes: its stages cannot show that accumulation is exact)."""
    return not self.random_loss and all(s.passed for s in self.stages)

  @property
  def first_divergence(self) -> str | None:
    """The first stage over the tolerance (e.g. ``"loss"``); None if all pass or the loss
    is random (then no stage is to blame; see ``random_loss``)."""
    if self.random_loss:
      return None
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
    left_out = max((s.left_out for s in self.stages), default=0)
    if left_out:
      lines.append(
        f"note: 'update' and 'new params' leave out {left_out} entries whose gradients "
        f"agree only relative to the largest one (rounding noise on a small gradient, which "
        f"Adam scales up to ±lr); their gradients passed at 'gradients'"
      )
    if self.random_loss:
      lines.append(RANDOM_LOSS)
    elif failed is None:
      lines.append("PASS: accumulation is exact")
    else:
      lines.append(f"FAIL: first divergence at '{failed}'")
    if self.model_state and not self.passed:
      lines.append(BATCH_STATISTICS)
    return "\n".join(lines)


def _flat(tree) -> np.ndarray:
  leaves = [np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)]
  return np.concatenate(leaves) if leaves else np.zeros(0)


def _errors(a, b, keep=None) -> tuple[float, float]:
  a, b = _flat(a), _flat(b)
  if keep is not None:
    a, b = a[keep], b[keep]
  max_abs = float(np.max(np.abs(a - b))) if a.size else 0.0
  return max_abs, max_abs / max(float(np.max(np.abs(b), initial=0.0)), 1e-30)


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
  model_state=None,
) -> CheckReport:
  """One update of ``params`` on ``batch`` with K = ``grad_accum_steps`` micro-steps and
  with K = 1, compared stage by stage: [logits →] loss → [extra loss →] gradients → update →
  new params.

  Args:
    loss_fn: the step's ``(params, micro_batch, rng) -> (loss_sum, aux)``, or with
      ``model_state`` its 4-argument form. A loss that returns a mean instead of a sum
      fails at ``loss``: with K micro-steps it is divided by N on top of its own mean. The
      loss must be deterministic: K = 1 is also run under a second rng, and if that
      changes the loss or gradients (dropout on) the report says ``random_loss`` instead
      of naming a stage; check with dropout off (``train=False``).
    params, batch, optimizer: as for ``make_train_step`` (batch leaves ``[G, ...]``).
    grad_accum_steps: K; G must divide by it.
    apply_fn: ``(params, inputs) -> logits``, to compare the logits first (optional).
    units_fn: N of the global batch; default ``batch["loss_mask"].sum()``.
    precision: the compute precision; sets the tolerance (``TOLERANCE``).
    model_state: the model's non-parameter state (``train_step.init``'s), threaded through
      the micro-steps in order as the step does; empty means none. In training mode
      BatchNorm's batch statistics differ with the micro-batch size, so K and K = 1
      legitimately differ from the logits on; the report says so. With ``train=False``
      (running statistics) accumulation must be exact.

  Returns:
    A ``CheckReport``: ``passed``, ``first_divergence``, ``random_loss`` and the table
    with its verdict as ``str()``.
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
  model_state = empty_to_none(model_state)
  check_loss_arity(loss_fn, model_state)
  opt_state = optimizer.init(params)

  def run(k, rng):
    micro = split_micro_batches(batch, k)  # [K, G/K, ...]
    grads, loss, extra, _, _ = accumulate(
      loss_fn, params, micro, units, rng, compute_dtype=dtype, model_state=model_state
    )
    updates, _ = optimizer.update(grads, opt_state, params)
    stages = (loss, extra, grads, updates, optax.apply_updates(params, updates))
    if apply_fn is None:
      return stages
    logits = jax.vmap(
      lambda mb: apply_fn(cast_floating(params, dtype), cast_floating(mb["inputs"], dtype))
    )(micro)
    return (jnp.swapaxes(logits, 0, 1).reshape(-1, *logits.shape[2:]), *stages)  # row order

  names = ("loss", "extra loss", "gradients", "update", "new params")
  names = names if apply_fn is None else ("logits", *names)
  run = jax.jit(run, static_argnums=0)
  rng = jax.random.PRNGKey(0)
  ours, reference = run(k, rng), run(1, rng)
  extra = names.index("extra loss")
  if not float(reference[extra]):  # no extra term (an MoE router's losses): no stage
    names, ours, reference = (t[:extra] + t[extra + 1 :] for t in (names, ours, reference))
  tol = TOLERANCE[precision or "fp32"]
  # The same K = 1 update under another key: a deterministic loss gives it again (to the
  # tolerance); a random one (dropout) does not, and then no K can be expected to match.
  redrawn = run(1, jax.random.PRNGKey(1))
  if len(redrawn) > len(reference):
    redrawn = redrawn[:extra] + redrawn[extra + 1 :]
  at = (names.index("loss"), names.index("gradients"))  # not the logits
  random_loss = any(_errors(redrawn[i], reference[i])[1] > tol for i in at)
  grads = names.index("gradients")
  g_ref = np.abs(_flat(reference[grads]))
  resolved = np.abs(_flat(ours[grads]) - _flat(reference[grads])) <= tol * g_ref
  stages = []
  for i, (name, a, b) in enumerate(zip(names, ours, reference, strict=True)):
    # update, new params: where the gradient is resolved, once the gradients agree at all
    keep = resolved if i > grads and stages[grads].passed else None
    max_abs, max_rel = _errors(a, b, keep)
    left_out = 0 if keep is None else int(resolved.size - resolved.sum())
    stages.append(Stage(name, max_abs, max_rel, max_rel <= tol, left_out))
  return CheckReport(tuple(stages), k, precision or "fp32", random_loss, model_state is not None)
