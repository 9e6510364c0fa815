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

from jaxstep.core.accumulate import accumulate, split_micro_batches
from jaxstep.core.precision import cast_floating, compute_dtype

TOLERANCE = {"fp32": 1e-5, "bf16": 3e-2, "fp16": 3e-2}  # max |a - b| / max |b| per stage


@dataclasses.dataclass(frozen=True)
class Stage:
  name: str
  max_abs: float
  max_rel: float
  passed: bool


def _errors(a, b) -> tuple[float, float]:
  a = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(a)])
  b = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(b)])
  max_abs = float(np.max(np.abs(a - b))) if a.size else 0.0
  return max_abs, max_abs / max(float(np.max(np.abs(b))), 1e-30)


def compare(
  loss_fn, apply_fn, optimizer, params, batch, *, grad_accum_steps: int, precision: str = "fp32"
) -> list[Stage]:
  """The five stages for K = ``grad_accum_steps`` against K = 1 on the same global batch."""
  dtype = compute_dtype(precision)
  units = jnp.maximum(jnp.sum(batch["loss_mask"]).astype(jnp.float32), 1.0)
  rng = jax.random.PRNGKey(0)
  opt_state = optimizer.init(params)

  def run(k):
    micro = split_micro_batches(batch, k)  # [K, G/K, ...]
    logits = jax.vmap(lambda mb: apply_fn(cast_floating(params, dtype), mb["inputs"]))(micro)
    logits = jnp.swapaxes(logits, 0, 1).reshape(-1, *logits.shape[2:])  # back to row order
    grads, loss, _, _ = accumulate(loss_fn, params, micro, units, rng, compute_dtype=dtype)
    updates, _ = optimizer.update(grads, opt_state, params)
    return logits, loss, grads, updates, optax.apply_updates(params, updates)

  run = jax.jit(run, static_argnums=0)
  ours, reference = run(grad_accum_steps), run(1)
  tol = TOLERANCE[precision]
  stages = []
  for name, a, b in zip(
    ("logits", "loss", "gradients", "clipped update", "new params"), ours, reference, strict=True
  ):
    max_abs, max_rel = _errors(a, b)
    stages.append(Stage(name, max_abs, max_rel, max_rel <= tol))
  return stages


def format_stages(stages: list[Stage], k: int, precision: str) -> str:
  lines = [
    f"K={k} micro-steps vs K=1 on the same global batch ({precision}, tolerance "
    f"{TOLERANCE[precision]:.0e} relative):",
    f"  {'stage':<16} {'max abs err':>12} {'max rel err':>12}  result",
  ]
  for s in stages:
    lines.append(
      f"  {s.name:<16} {s.max_abs:>12.3e} {s.max_rel:>12.3e}  {'PASS' if s.passed else 'FAIL'}"
    )
  failed = next((s for s in stages if not s.passed), None)
  lines.append(
    "PASS: accumulation is exact"
    if failed is None
    else f"FAIL: first divergence at stage '{failed.name}'"
  )
  return "\n".join(lines)
