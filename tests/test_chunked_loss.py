"""The loss from the hidden states in chunks of tokens (``model.loss_chunk``): the same sums
and gradients as the whole logits, for every model, K and chunk size; the compiled step
holds no ``[tokens × vocab]`` array; the settings' rules and errors."""

import dataclasses
import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import devices_env, make_cfg

import jaxstep
from jaxstep import make_train_step, models, trainer
from jaxstep.core import chunked_loss, router_loss
from jaxstep.core.losses import masked_nll, next_token_loss
from jaxstep.errors import ConfigError
from jaxstep.models import GPTConfig, LlamaConfig


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-12))


@pytest.mark.parametrize("chunk", [1, 7, 16, 48])
def test_chunked_sums_and_gradients_equal_the_whole_logits(chunk):
  keys = jax.random.split(jax.random.key(0), 4)
  h = jax.random.normal(keys[0], (3, 16, 24))
  w = jax.random.normal(keys[1], (24, 37)) * 0.5
  targets = jax.random.randint(keys[2], (3, 16), 0, 37)
  mask = (jax.random.uniform(keys[3], (3, 16)) < jnp.array([[0.1], [1.0], [0.6]])).astype(jnp.int32)

  def whole(h, w):
    nll, aux = masked_nll(h @ w, targets, mask)
    return nll, aux["correct"]

  def chunked(h, w):
    return chunked_loss.chunked_nll(h, w, targets, mask, chunk)

  @jax.jit
  def both():
    return [
      (f(h, w), jax.grad(lambda *a, f=f: f(*a)[0], argnums=(0, 1))(h, w)) for f in (whole, chunked)
    ]

  ((nll, hits), grads), ((nll_c, hits_c), grads_c) = both()
  assert _rel(nll_c, nll) <= 1e-6 and float(hits_c) == float(hits) > 0
  for g_c, g in zip(grads_c, grads, strict=True):
    assert _rel(g_c, g) <= 1e-6
  assert not np.any(grads_c[0][0][np.asarray(mask[0]) == 0])  # masked rows: no gradient


def test_the_chunk_size_follows_the_setting():
  size = chunked_loss.chunk_size
  assert size(0, 4096, 50_000) == 0 and size(64, 4096, 50_000) == 64
  assert size(4096, 4096, 50_000) == 0  # one chunk of everything: the whole logits
  assert size("auto", 1024, 1024) == 0  # small: whole
  auto = size("auto", 16_384, 49_152)  # SmolLM2's vocabulary, 8 × 2,048 tokens
  assert auto % 8 == 0 and 2**23 < auto * 49_152 <= chunked_loss.AUTO_CHUNK
  for bad in (-1, "big", 1.5, True):
    with pytest.raises(ConfigError, match="model.loss_chunk must be auto, 0"):
      LlamaConfig(loss_chunk=bad)
  with pytest.raises(ConfigError, match="model.loss_chunk"):
    GPTConfig(loss_chunk=-3)


TINY_LLAMA = dict(
  vocab_size=61, max_seq_len=16, d_model=32, n_layers=2, n_heads=2, intermediate_size=48
)
MODELS = {
  "gpt": GPTConfig(vocab_size=61, max_seq_len=16, d_model=32, n_layers=2, n_heads=2),
  "llama_tied": LlamaConfig(**TINY_LLAMA, tie_embeddings=True),
  "llama_moe": LlamaConfig(
    **TINY_LLAMA, num_experts=4, moe_intermediate_size=16, router_aux_loss=0.1
  ),
  # Granite's logits divided by logits_scaling, OLMo 2's post-norms: the hidden states the
  # chunked loss multiplies by the head must carry both
  "llama_granite_post": LlamaConfig(
    **TINY_LLAMA, logits_scaling=3.0, residual_multiplier=0.5, block_norms="post"
  ),
}


def _batches(g=8, s=16):
  rng = np.random.default_rng(1)
  out = []
  for _ in range(2):
    tokens = rng.integers(0, 61, size=(g, s + 1), dtype=np.int32)
    mask = (rng.random((g, s)) < rng.choice([0.2, 1.0], size=(g, 1))).astype(np.int32)
    out.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": mask})
  return out


@functools.cache
def _run(name: str, k: int, chunk):
  cfg = dataclasses.replace(MODELS[name], loss_chunk=chunk)
  apply_fn, params = models.build(cfg, 0)
  sparse = name.endswith("moe")
  build = functools.partial(next_token_loss, chunk=chunk)
  loss = (
    router_loss.with_router_losses(build, apply_fn, cfg, router_loss.sft_rows)
    if sparse
    else build(apply_fn)
  )
  step = make_train_step(loss, optax.sgd(0.5), grad_accum_steps=k)  # AdamW's first step
  # would turn a gradient's last-bit noise near zero into ±lr
  state = step.init(params, 0)
  step = jax.jit(router_loss.with_router_metrics(step, cfg, k) if sparse else step)
  metrics = []
  for b in _batches():
    state, m = step(state, b)
    metrics.append(jax.device_get(m))
  return jax.device_get(state.params), metrics


FAST = {("gpt", 4)}  # the MoE and tied-head cases are slow


@pytest.mark.parametrize(
  "name, k",
  [
    (n, k) if (n, k) in FAST else pytest.param(n, k, marks=pytest.mark.slow)
    for n in sorted(MODELS)
    for k in (1, 4)
  ],
)
def test_k_micro_steps_of_chunked_loss_give_the_whole_logits_updates(name, k):
  params, metrics = _run(name, k, 24)  # 24 tokens: chunks across the rows, the last padded
  whole_params, whole = _run(name, k, 0)
  for m, w in zip(metrics, whole, strict=True):
    for key in ("loss", "grad_norm", "accuracy", "moe/lbl"):
      if key in w:
        assert _rel(m[key], w[key]) <= 1e-6, (key, m[key], w[key])
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(whole_params), strict=True):
    assert _rel(a, b) <= 1e-6


def test_the_compiled_step_holds_no_tokens_by_vocab_array():
  cfg = LlamaConfig(
    vocab_size=523, max_seq_len=64, d_model=32, n_layers=1, n_heads=2, intermediate_size=48
  )
  apply_fn, params = models.build(cfg, 0)
  rng = np.random.default_rng(2)
  tokens = rng.integers(0, 523, size=(4, 65), dtype=np.int32)
  batch = {
    "inputs": tokens[:, :-1],
    "targets": tokens[:, 1:],
    "loss_mask": np.ones((4, 64), np.int32),
  }
  compiled = {}
  for chunk in (0, 32):
    step = make_train_step(next_token_loss(apply_fn, chunk), optax.adamw(1e-3), grad_accum_steps=1)
    compiled[chunk] = jax.jit(step).lower(step.init(params, 0), batch).compile()
  whole = ("f32[4,64,523]", "f32[256,523]")
  assert any(s in compiled[0].as_text() for s in whole)
  text = compiled[32].as_text()
  assert not any(s in text for s in whole) and "f32[32,523]" in text
  temp = {c: x.memory_analysis().temp_size_in_bytes for c, x in compiled.items()}
  assert temp[32] < temp[0] - 256 * 523 * 4, temp  # at least one whole logits array fewer


def test_a_run_with_a_loss_chunk_trains_as_the_whole_logits(tmp_path):
  runs = {}
  for chunk in (0, 40):
    cfg = make_cfg(
      tmp_path / str(chunk),
      f"model.loss_chunk={chunk}",
      "train.max_steps=2",
      "optim.name=sgd",
      "optim.warmup_steps=0",
    )
    trainer.train(cfg)
    runs[chunk] = jaxstep.load_run(tmp_path / str(chunk) / "run").params
  for a, b in zip(jax.tree.leaves(runs[40]), jax.tree.leaves(runs[0]), strict=True):
    assert _rel(a, b) <= 1e-5


@pytest.mark.slow
def test_a_chunked_run_on_a_data_and_tensor_mesh_equals_the_whole_logits(tmp_path):
  """Four devices, (data 2, tensor 2): the head's vocabulary split over the tensor axis,
  each chunk's logsumexp reduced across it; the run equals the unchunked one."""
  out = {}
  for chunk in (0, 16):
    run = tmp_path / f"run{chunk}"
    cmd = [
      sys.executable, "-m", "jaxstep.train", "--config", "tiny", "model.family=llama",
      "mesh.data=2", "mesh.tensor=2", "train.max_steps=3", f"model.loss_chunk={chunk}",
      "optim.name=sgd", "optim.warmup_steps=0",
      f"run_dir={run}", "train.progress=false",
    ]  # fmt: skip
    done = subprocess.run(cmd, env=devices_env(4), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    out[chunk] = jaxstep.load_run(run).params
  for a, b in zip(jax.tree.leaves(out[16]), jax.tree.leaves(out[0]), strict=True):
    assert _rel(a, b) <= 1e-5
  assert os.path.isdir(tmp_path / "run16")


def test_the_memory_ledger_prints_the_logits_whole_and_chunked(tmp_path):
  from jaxstep.cli.memory import loss_line
  from jaxstep.trainer.plan.memory import loss_tokens

  lines = {}
  for chunk in (0, 40):
    cfg = make_cfg(tmp_path, f"model.loss_chunk={chunk}", "model.vocab_size=264")
    lines[chunk] = loss_line(cfg, 4)
    assert loss_tokens(cfg, 4) == (40 if chunk else 4 * cfg.train.seq_len)
  tokens, vocab = 4 * cfg.train.seq_len, cfg.model.vocab_size
  assert f"[{tokens:,} × {vocab:,}] fp32" in lines[0] and "model.loss_chunk=0: whole" in lines[0]
  assert f"40 tokens at a time: [40 × {vocab:,}]" in lines[40], lines[40]


@pytest.mark.parametrize("source", ["build", "decoder"])
def test_the_held_out_sums_in_chunks_equal_the_whole_logits(source):
  from jaxstep.trainer.plan.steps import make_eval_step

  cfg = MODELS["llama_tied"]
  apply_fn, params = models.build(cfg, 0)
  if source == "decoder":  # what jaxstep evaluate runs
    decode = models.decoder(cfg).apply_fn
    apply_fn = lambda p, x, train=False, rng=None, **f: decode(p, x, **f)  # noqa: E731
    apply_fn.emits_hidden, apply_fn.vocab_size = True, cfg.vocab_size
  batch = _batches()[0]
  token_bytes = np.arange(61) % 3 + 1
  steps = [jax.jit(make_eval_step(apply_fn, token_bytes, 61, chunk)) for chunk in (0, 24)]
  whole, chunked = (step(params, batch) for step in steps)
  logits = [("8x16x61xf32" in s.lower(params, batch).as_text()) for s in steps]
  assert logits == [True, False]  # the chunked step never has the whole logits
  assert _rel(chunked[0], whole[0]) <= 1e-6 and whole[0] > 0
  assert float(chunked[1]) == float(whole[1]) and float(chunked[2]) == float(whole[2])


def test_chunked_log_probs_and_their_gradients_equal_the_whole_logits():
  keys = jax.random.split(jax.random.key(7), 4)
  h = jax.random.normal(keys[0], (4, 9, 16))
  w = jax.random.normal(keys[1], (16, 29)) * 0.5
  targets = jax.random.randint(keys[2], (4, 9), 0, 29)
  cot = jax.random.normal(keys[3], (4, 9))  # a row's cotangent differs token by token

  def whole(h, w):
    return -optax.softmax_cross_entropy_with_integer_labels(h @ w, targets)

  @jax.jit
  def both():
    out = []
    for f in (whole, lambda h, w: chunked_loss.chunked_logps(h, w, targets, 5)):
      value, vjp = jax.vjp(f, h, w)
      out.append((value, vjp(cot)))
    return out

  (v, g), (v_c, g_c) = both()
  assert _rel(v_c, v) <= 1e-6
  assert _rel(g_c[0], g[0]) <= 1e-6 and _rel(g_c[1], g[1]) <= 1e-6


@pytest.mark.parametrize(
  "loss, reference", [("dpo", "adapters"), pytest.param("simpo", None, marks=pytest.mark.slow)]
)
def test_a_chunked_preference_loss_equals_the_whole_logits(loss, reference):
  from test_preference_losses import make_examples, pair_batch

  from jaxstep.core.preference import preference_loss
  from jaxstep.models import lora
  from jaxstep.trainer.plan.reference_model import _like

  cfg = dataclasses.replace(MODELS["llama_tied"], lora=lora.LoraConfig(rank=4))
  apply_fn, params = models.build(cfg, 0)
  params = jax.tree_util.tree_map_with_path(
    lambda p, x: x + 0.1 if jax.tree_util.keystr(p).endswith("['lora_b']") else x, params
  )
  off = lambda p, x, **kw: apply_fn(lora.adapters_off(p), x, **kw)  # noqa: E731
  ref = _like(apply_fn, off) if reference else None
  batch = pair_batch(make_examples(vocab=61), 12, pad_rows=1, vocab=61)
  results = []
  for chunk in (0, 7):
    fn = preference_loss(apply_fn, loss=loss, reference=ref, chunk=chunk)
    value_and_grad = jax.jit(jax.value_and_grad(lambda p, fn=fn: fn(p, batch, None)[0]))
    results.append(value_and_grad(params))
  (v, g), (v_c, g_c) = results
  assert _rel(v_c, v) <= 1e-6 and float(v) != 0
  for a, b in zip(jax.tree.leaves(g_c), jax.tree.leaves(g), strict=True):
    assert _rel(a, b) <= 1e-5
  whole_logits = "10x11x61xf32"  # the 5 pairs' (4, 1 padding) 10 rows of 11 tokens
  for chunk in (0, 7):
    fn = preference_loss(apply_fn, loss=loss, reference=ref, chunk=chunk)
    text = jax.jit(lambda p, fn=fn: fn(p, batch, None)[0]).lower(params).as_text()
    assert (whole_logits in text) == (chunk == 0)


def test_the_harness_scorer_in_chunks_scores_as_the_whole_logits(monkeypatch):
  from jaxstep.lmeval.scoring import Scorer

  cfg = MODELS["gpt"]
  _, params = models.build(cfg, 0)
  apply_fn = models.decoder(cfg).apply_fn
  rng = np.random.default_rng(3)
  requests = [
    (list(rng.integers(1, 61, n)), list(rng.integers(1, 61, m)))
    for n, m in [(5, 3), (2, 7), (9, 1)]
  ]
  context = [int(t) for t in rng.integers(1, 61, 4)]
  own = [int(jnp.argmax(apply_fn(params, jnp.asarray([context]))[0, -1]))]  # its argmax
  requests.append((context, own))
  calls = []
  monkeypatch.setattr(
    chunked_loss,
    "chunked_scores",
    lambda *a, f=chunked_loss.chunked_scores: calls.append(1) or f(*a),
  )
  scored = []
  for chunk in (0, 5):
    scorer = Scorer(apply_fn, params, rows=4, max_length=16, pad_id=0, chunk=chunk)
    scored.append(scorer.score(requests))
  assert calls  # traced through the chunks
  for (ll, greedy), (ll_w, greedy_w) in zip(scored[1], scored[0], strict=True):
    assert abs(ll - ll_w) <= 1e-6 * abs(ll_w) and greedy == greedy_w
  assert [g for _, g in scored[1]] == [False, False, False, True]


@pytest.mark.parametrize(
  "dist",
  [
    dict(temperature=0.7),
    pytest.param(dict(top_k=5, top_p=0.9, allowed=np.arange(61) % 7 != 3), marks=pytest.mark.slow),
  ],
)
def test_a_chunked_grpo_loss_equals_the_whole_logits(dist):
  from jaxstep.core import rl
  from jaxstep.models import lora
  from jaxstep.trainer.plan.reference_model import _like

  cfg = dataclasses.replace(MODELS["llama_tied"], lora=lora.LoraConfig(rank=4))
  apply_fn, params = models.build(cfg, 0)
  params = jax.tree_util.tree_map_with_path(
    lambda p, x: x + 0.1 if jax.tree_util.keystr(p).endswith("['lora_b']") else x, params
  )
  off = lambda p, x, **kw: apply_fn(lora.adapters_off(p), x, **kw)  # noqa: E731
  rng = np.random.default_rng(4)
  ids = rng.integers(0, 61, (6, 13)).astype(np.int32)
  mask = (np.arange(12) >= 3) & (np.arange(12) < rng.integers(4, 13, (6, 1)))
  targets = ids[:, 1:]
  if "allowed" in dist:  # a sampler draws inside its filters: here the allowed argmax
    logits = np.asarray(apply_fn(params, ids[:, :-1]))
    best = np.argmax(np.where(dist["allowed"], logits, -np.inf), axis=-1)
    targets = np.where(mask, best, targets).astype(np.int32)
  batch = {
    "inputs": ids[:, :-1],
    "targets": targets,
    "completion_mask": mask.astype(np.int32),
    "advantages": rng.normal(size=6).astype(np.float32),
    "old_logps": (np.log(1 / 61) + rng.normal(0, 0.3, (6, 12))).astype(np.float32),
  }
  results = []
  for chunk in (0, 10):
    ref = dict(beta=0.04, reference=_like(apply_fn, off))
    fn = rl.grpo_loss(apply_fn, chunk=chunk, **ref, **dist)
    value_and_grad = jax.jit(jax.value_and_grad(lambda p, fn=fn: fn(p, batch, None), has_aux=True))
    results.append(value_and_grad(params))
    text = jax.jit(lambda p, fn=fn: fn(p, batch, None)[0]).lower(params).as_text()
    assert ("6x12x61xf32" in text) == (chunk == 0)
  ((v, aux), g), ((v_c, aux_c), g_c) = results
  assert _rel(v_c, v) <= 1e-6 and float(v) != 0
  for key in ("kl", "entropy", "logp_gap"):
    assert _rel(aux_c[key], aux[key]) <= 1e-6 and np.isfinite(aux[key]), key
  for a, b in zip(jax.tree.leaves(g_c), jax.tree.leaves(g), strict=True):
    assert _rel(a, b) <= 1e-5


def test_the_commands_train_step_holds_no_whole_logits(tmp_path):
  """The step ``jaxstep train`` compiles (``trainer/plan/steps.py``) takes the chunked path
  from the config: no ``[G, S, V]`` logits in its program with ``model.loss_chunk``."""
  from jaxstep import parallel
  from jaxstep.trainer.plan import steps

  texts = {}
  for chunk in (0, 40):
    overrides = [f"model.loss_chunk={chunk}", "model.vocab_size=264", "train.grad_accum_steps=1"]
    cfg = make_cfg(tmp_path / str(chunk), *overrides)
    apply_fn, params = models.build(cfg.model, 0)
    step = steps.train_step(cfg, apply_fn, parallel.make_mesh(1, 1, jax.devices()[:1]), 10, 1)
    g, s = cfg.train.global_batch_size, cfg.train.seq_len
    batch = {n: np.zeros((g, s), np.int32) for n in ("inputs", "targets", "loss_mask")}
    texts[chunk] = jax.jit(step).lower(step.init(params, 0), batch).as_text()
  whole = f"{g}x{s}x264xf32"
  assert whole in texts[0] and whole not in texts[40]
