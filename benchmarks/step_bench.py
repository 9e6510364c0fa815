"""Step contenders: the same GPT, the same global batch, the same math.

Model: bundled GPT fp32 (vocab 264, d 128, 2 layers, 4 heads, S 128); global batch 64
sequences (8192 tokens); AdamW + clip 1.0; loss normalized by the global masked-token count.
Every contender reports seconds per global batch (one optimizer update).
"""

from __future__ import annotations

import os
import time

import numpy as np

MODEL = dict(vocab_size=264, max_seq_len=128, d_model=128, n_layers=2, n_heads=4)
QUICK_MODEL = dict(vocab_size=264, max_seq_len=32, d_model=32, n_layers=1, n_heads=2)


def make_batch(g: int, s: int, vocab: int, seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, 256, size=(g, s + 1), dtype=np.int32)
  mask = (rng.random((g, s)) < 0.9).astype(np.int32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": mask}


def mean_seconds(fn, repeats: int) -> dict:
  """``{"seconds": …}``: the mean wall time of ``repeats`` calls of ``fn``."""
  t = time.perf_counter()
  for _ in range(repeats):
    fn()
  return {"seconds": (time.perf_counter() - t) / repeats}


def full_batch(rows: int, seq_len: int, vocab: int, seed: int = 0) -> dict:
  """``rows`` sequences of ``seq_len`` random ids over the whole vocabulary, every target
  in the loss."""
  ids = np.random.default_rng(seed).integers(0, vocab, (rows, seq_len + 1)).astype(np.int32)
  return {"inputs": ids[:, :-1], "targets": ids[:, 1:], "loss_mask": np.ones_like(ids[:, 1:])}


def timed_step(step, state, batch: dict, repeats: int = 2):
  """A worker's ``(info, run_once)`` for a ``make_train_step`` step: jitted with the state
  donated, run twice (compile and warm-up), then ``run_once`` times ``repeats`` updates
  (``mean_seconds``)."""
  import jax

  jitted, holder, batch = jax.jit(step, donate_argnums=0), {"state": state}, jax.device_put(batch)

  def once():
    holder["state"], metrics = jitted(holder["state"], batch)
    jax.block_until_ready(metrics)

  once()
  once()
  return {"devices": jax.device_count()}, lambda: mean_seconds(once, repeats)


def _jax_parts(spec):
  import jax

  from jaxstep import models
  from jaxstep.core.losses import next_token_loss
  from jaxstep.core.optim import OptimConfig, make_optimizer

  cfg = models.GPTConfig(**spec["model"])
  apply_fn, params = models.build(cfg, 0)
  opt = make_optimizer(OptimConfig(lr=1e-3, warmup_steps=0), 1000)
  batch = make_batch(spec["g"], cfg.max_seq_len, cfg.vocab_size)
  return jax, cfg, next_token_loss(apply_fn), params, opt, batch


def jaxstep_contender(spec):
  """``make_train_step`` exactly as ``python -m jaxstep.train`` builds it (CPU defaults)."""
  from jaxstep.trainer.config import loading as config_lib
  from jaxstep.trainer.plan.numbers import configure_devices

  m = spec["model"]
  overrides = [f"model.{k}={v}" for k, v in m.items()] + [
    f"train.seq_len={m['max_seq_len']}",
    f"train.global_batch_size={spec['g']}",
    f"train.grad_accum_steps={spec['k']}",
    "optim.warmup_steps=0",
    "optim.lr=1e-3",
    *spec.get("overrides", []),
  ]
  cfg = config_lib.load("tiny", overrides)
  if spec.get("cpu_defaults", True):
    configure_devices(cfg)
  import jax

  from jaxstep import parallel, trainer

  r, state, _ = trainer.build(cfg)
  batch = make_batch(spec["g"], m["max_seq_len"], m["vocab_size"])
  holder = {"state": state}

  def once():
    global_batch = parallel.put_batch(batch, r.batch_sharding)
    holder["state"], metrics = r.step_fn(holder["state"], global_batch)
    jax.block_until_ready(metrics)

  once()
  once()
  return (
    {"devices": jax.device_count(), "xla_flags": os.environ.get("XLA_FLAGS", "")},
    lambda: mean_seconds(once, spec.get("repeats", 2)),
  )


def floor_contender(spec):
  """The compute floor: one jitted micro fwd+bwd (+ add into the accumulator) called K
  times from Python, then one jitted optimizer update."""
  jax, cfg, loss_fn, params, opt, batch = _jax_parts(spec)
  import jax.numpy as jnp
  import optax

  k = spec["k"]
  n = jnp.float32(batch["loss_mask"].sum())
  micro = [jax.tree.map(lambda x, i=i: jax.device_put(x[i::k]), batch) for i in range(k)]

  @jax.jit
  def micro_step(params, acc, mb):
    g = jax.grad(lambda p: loss_fn(p, mb, None)[0] / n)(params)
    return optax.tree.add(acc, g)

  @jax.jit
  def update(params, opt_state, grads):
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  holder = {"params": params, "opt": opt.init(params)}

  def once():
    acc = optax.tree.zeros_like(holder["params"])
    for mb in micro:
      acc = micro_step(holder["params"], acc, mb)
    holder["params"], holder["opt"] = update(holder["params"], holder["opt"], acc)
    jax.block_until_ready(holder["params"])

  once()
  once()
  return {}, lambda: mean_seconds(once, spec.get("repeats", 2))


def multisteps_contender(spec):
  """``optax.MultiSteps`` driven by a host loop, one jitted call per micro-batch. Each
  micro-gradient is of K·loss_sum_k/N, so MultiSteps' mean equals the exact update."""
  jax, cfg, loss_fn, params, opt, batch = _jax_parts(spec)
  import jax.numpy as jnp
  import optax

  k = spec["k"]
  multi = optax.MultiSteps(opt, every_k_schedule=k)
  n = jnp.float32(batch["loss_mask"].sum())
  micro = [jax.tree.map(lambda x, i=i: jax.device_put(x[i::k]), batch) for i in range(k)]

  @jax.jit
  def call(params, state, mb):
    g = jax.grad(lambda p: k * loss_fn(p, mb, None)[0] / n)(params)
    updates, state = multi.update(g, state, params)
    return optax.apply_updates(params, updates), state

  holder = {"params": params, "state": multi.init(params)}

  def once():
    for mb in micro:
      holder["params"], holder["state"] = call(holder["params"], holder["state"], mb)
    jax.block_until_ready(holder["params"])

  once()
  once()
  return {}, lambda: mean_seconds(once, spec.get("repeats", 2))


def _unrolled_step(loss_fn, opt, k):
  import jax
  import jax.numpy as jnp
  import optax

  def step(params, opt_state, batch):
    n = jnp.maximum(jnp.sum(batch["loss_mask"]), 1).astype(jnp.float32)
    acc = optax.tree.zeros_like(params)
    for i in range(k):  # Python-unrolled: K copies of fwd+bwd in one program
      mb = jax.tree.map(lambda x, i=i: x[i::k], batch)
      acc = optax.tree.add(acc, jax.grad(lambda p, mb=mb: loss_fn(p, mb, None)[0] / n)(params))
    updates, opt_state = opt.update(acc, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return jax.jit(step)


def unrolled_contender(spec):
  jax, cfg, loss_fn, params, opt, batch = _jax_parts(spec)
  step = _unrolled_step(loss_fn, opt, spec["k"])
  holder = {"params": params, "opt": opt.init(params)}

  def once():
    holder["params"], holder["opt"] = step(holder["params"], holder["opt"], batch)
    jax.block_until_ready(holder["params"])

  t = time.perf_counter()
  once()
  compile_s = time.perf_counter() - t
  once()
  return {"first_call_s": compile_s}, lambda: mean_seconds(once, spec.get("repeats", 2))


def matmul_contender(spec):
  """fp32 matmul rates (FLOP/s, median of 5) on one device with all cores: jnp.dot 1024²
  and the model's own matmul shapes (one micro-batch's rows × d → 3d, 4d, d, vocab)."""
  import statistics

  import jax
  import jax.numpy as jnp

  from jaxstep.trainer.tracking.mfu import measured_matmul_flops

  m = spec.get("model", MODEL)
  rows, d = spec.get("rows", 512), m["d_model"]
  shapes = [
    (rows, d, 3 * d),
    (rows, d, d),
    (rows, d, 4 * d),
    (rows, 4 * d, d),
    (rows, d, m["vocab_size"]),
  ]
  mats = [(jnp.ones((a, b)), jnp.ones((b, c))) for a, b, c in shapes]
  dots = jax.jit(lambda ms: [x @ y for x, y in ms])
  jax.block_until_ready(dots(mats))
  model_flops = sum(2 * a * b * c for a, b, c in shapes)

  def model_rate():
    times = []
    for _ in range(5):
      t = time.perf_counter()
      jax.block_until_ready(dots(mats))
      times.append(time.perf_counter() - t)
    return model_flops / statistics.median(times)

  n = spec.get("n", 1024)
  measured_matmul_flops(n, repeats=2)
  return {}, lambda: {
    "flops": measured_matmul_flops(n, repeats=5, stat=statistics.median),
    "model_shape_flops": model_rate(),
  }


def compile_vs_k(spec):
  """Compile seconds and ``memory_analysis()`` temp bytes vs K at a fixed micro-batch of
  ``spec["micro"]`` sequences (G = micro × K): scan vs Python-unrolled. Caches are cleared
  before every compile so each one is real; each compile time is the best of
  ``compile_repeats``, the scan's repeats taken round-robin over K (and before any unrolled
  compile, whose gigabytes of temporaries would otherwise disturb the later timings)."""
  jax, cfg, loss_fn, params, opt, _ = _jax_parts({**spec, "g": spec["micro"]})
  from jaxstep import TrainState, make_train_step

  jax.jit(lambda x: x + 1).lower(1.0).compile()  # one-time backend warm-up, not counted
  state = TrainState.create(params=params, optimizer=opt, rng=0)
  batches = {k: make_batch(spec["micro"] * k, cfg.max_seq_len, cfg.vocab_size) for k in spec["ks"]}
  rows = {k: {"k": k} for k in spec["ks"]}

  def timed_compile(name, k, fn, args):
    jax.clear_caches()
    lowered = fn.lower(*args, batches[k])
    t = time.perf_counter()
    compiled = lowered.compile()
    seconds = time.perf_counter() - t
    row = rows[k]
    row[f"{name}_compile_s"] = min(row.get(f"{name}_compile_s", seconds), seconds)
    row[f"{name}_temp_bytes"] = compiled.memory_analysis().temp_size_in_bytes

  repeats = spec.get("compile_repeats", 3)
  for _ in range(repeats):
    for k in spec["ks"]:
      step = jax.jit(make_train_step(loss_fn, opt, grad_accum_steps=k))
      timed_compile("scan", k, step, (state,))
  for k in spec["ks"]:
    if k <= spec.get("max_unrolled_k", 64):
      for _ in range(repeats if k <= 16 else 1):  # K=64 unrolled takes ~40 s per compile
        timed_compile("unrolled", k, _unrolled_step(loss_fn, opt, k), (params, opt.init(params)))
  return {"rows": list(rows.values())}, lambda: {}


CONTENDERS = {
  "jaxstep": jaxstep_contender,
  "floor": floor_contender,
  "multisteps": multisteps_contender,
  "unrolled": unrolled_contender,
  "matmul": matmul_contender,
  "compile_vs_k": compile_vs_k,
}
