"""``python -m jaxstep.check [--config FILE] [key=value …]``: is accumulation exact here?

Runs one update of the config's model, optimizer and first global batch twice — with the
config's K micro-steps and with K = 1 — through the library's own ``split_micro_batches``,
``accumulate`` and optimizer, and compares stage by stage: logits → loss → gradients →
clipped update → new params. Prints max abs / rel error per stage with PASS/FAIL against the
precision's tolerance and names the first stage that diverges. Exit 0 only if all pass.
Dropout is switched off for the comparison (its masks depend on the micro-batch split).
"""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

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
  from jaxstep.accumulate import accumulate, split_micro_batches
  from jaxstep.step import PRECISIONS

  dtype = PRECISIONS[precision]
  cast = (
    (lambda p: p)
    if dtype is None
    # noqa: E731
    else (lambda p: jax.tree.map(lambda x: x.astype(dtype), p))
  )
  units = jnp.maximum(jnp.sum(batch["loss_mask"]).astype(jnp.float32), 1.0)
  rng = jax.random.PRNGKey(0)
  opt_state = optimizer.init(params)

  def run(k):
    micro = split_micro_batches(batch, k)  # [K, G/K, ...]
    logits = jax.vmap(lambda mb: apply_fn(cast(params), mb["inputs"]))(micro)
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


def check_config(cfg, loss_fn=None) -> list[Stage]:
  """``compare`` on ``cfg``'s model, optimizer and first global batch (dropout off)."""
  from jaxstep import data, models
  from jaxstep.losses import next_token_loss
  from jaxstep.optim import make_optimizer

  t = cfg.train
  model_cfg = dataclasses.replace(cfg.model, dropout=0.0)
  dataset = data.load_dataset(cfg.data, t.seq_len, model_cfg.vocab_size)
  apply_fn, params = models.build(model_cfg, jax.random.PRNGKey(t.seed))
  spe = data.steps_per_epoch(len(dataset.train), t.global_batch_size)
  optimizer = make_optimizer(cfg.optim, max(t.max_steps, spe))
  batch = data.global_batch(dataset.train, t.seed, 0, 0, t.global_batch_size, dataset.pad_id)
  k = t.grad_accum_steps if t.grad_accum_steps > 1 else 2
  return compare(
    loss_fn or next_token_loss(apply_fn),
    apply_fn,
    optimizer,
    params,
    jax.tree.map(jnp.asarray, batch),
    grad_accum_steps=k,
    precision=t.precision,
  )


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


def main(argv=None) -> int:
  from jaxstep import config as config_lib

  def action(cfg) -> int:
    stages = check_config(cfg)
    k = cfg.train.grad_accum_steps if cfg.train.grad_accum_steps > 1 else 2
    print(format_stages(stages, k, cfg.train.precision))
    return 0 if all(s.passed for s in stages) else 1

  return config_lib.config_command("python -m jaxstep.check", __doc__, action, argv)


if __name__ == "__main__":
  sys.exit(main())
