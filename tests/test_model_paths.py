"""The GPT's kernel and depth choices: attention backends, remat, scanned layers and the
params layout conversion. Each must change memory or speed only, never the numbers."""

import logging

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import xla_flags
from flax import nnx
from tolerance import assert_close, assert_far, planted

from jaxstep import ConfigError, models
from jaxstep.core.optim import OptimConfig, decay_mask, make_optimizer
from jaxstep.models import backends, cpu_kernels, layers

CFG = models.GPTConfig(
  vocab_size=32, max_seq_len=16, d_model=32, n_layers=3, n_heads=4, tie_embeddings=False
)
TOKENS = jax.random.randint(jax.random.key(1), (2, 16), 0, 32)
TERMS = 4 * 32  # the longest sum: the MLP's down projection (4 × d_model)


def variant(**changes) -> models.GPTConfig:
  return models.GPTConfig(**{**CFG.__dict__, **changes})


def loss_and_grads(cfg, params=None, rng=None, dtype=jnp.float32):
  apply_fn, init = models.build(cfg, 0)
  params = init if params is None else params

  def loss(p):
    p = jax.tree.map(lambda x: x.astype(dtype), p)
    logits = apply_fn(p, TOKENS, rng=rng, train=rng is not None).astype(jnp.float32)
    return -jnp.mean(jax.nn.log_softmax(logits)[..., 3])

  return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.slow
def test_xla_attention_equals_blocked_in_fp32():
  (loss_b, grads_b), (loss_x, grads_x) = (
    loss_and_grads(variant(attention=a)) for a in ("blocked", "xla")
  )
  assert_close((loss_x, grads_x), (loss_b, grads_b), terms=TERMS)
  assert_far(planted(grads_x), grads_b, terms=TERMS)


@pytest.mark.slow
def test_xla_attention_equals_blocked_in_bf16():
  """bf16 params and activations: both kernels keep scores and softmax in fp32, so they
  differ by bf16 rounding of the other operands (stated bound: 2e-2 relative on the loss,
  3e-2 absolute on the gradients of a loss of order 1)."""
  (loss_b, grads_b), (loss_x, grads_x) = (
    loss_and_grads(variant(attention=a), dtype=jnp.bfloat16) for a in ("blocked", "xla")
  )
  np.testing.assert_allclose(loss_x, loss_b, rtol=2e-2)
  chex.assert_trees_all_close(grads_x, grads_b, atol=3e-2)


def test_auto_runs_the_blocked_kernel_on_cpu(monkeypatch):
  calls = []
  original = cpu_kernels.causal_attention
  monkeypatch.setattr(cpu_kernels, "causal_attention", lambda *a: calls.append(1) or original(*a))
  apply_fn, params = models.build(variant(attention="auto"), 0)
  jax.jit(apply_fn)(params, TOKENS)
  assert backends.platform() == "cpu" and len(calls) == CFG.n_layers
  assert backends.resolve_attention("auto", jnp.bfloat16, 64) == "blocked"


def test_auto_on_a_gpu_picks_cudnn_where_it_can_else_xla(monkeypatch, caplog):
  monkeypatch.setattr(backends, "platform", lambda: "gpu")
  monkeypatch.setattr(backends, "_logged", set())
  assert backends.resolve_attention("auto", jnp.bfloat16, 64) == "cudnn"
  assert backends.resolve_attention("auto", jnp.float16, 128) == "cudnn"
  with caplog.at_level(logging.WARNING, logger="jaxstep"):
    assert backends.resolve_attention("auto", jnp.float32, 64) == "xla"
    assert backends.resolve_attention("auto", jnp.float32, 64) == "xla"
    assert backends.resolve_attention("auto", jnp.bfloat16, 36) == "xla"
  lines = [r.getMessage() for r in caplog.records]
  assert len(lines) == 2  # one line per reason, not per call
  assert "bf16 or fp16" in lines[0] and "multiple of 8" in lines[1]
  with pytest.raises(ConfigError, match="model.attention=cudnn: cuDNN attention needs bf16"):
    backends.resolve_attention("cudnn", jnp.float32, 64)
  monkeypatch.setattr(backends, "platform", lambda: "tpu")
  assert backends.resolve_attention("auto", jnp.bfloat16, 64) == "xla"


def test_cudnn_off_a_gpu_is_a_config_error():
  with pytest.raises(ConfigError, match="needs a CUDA GPU, this run is on cpu"):
    models.build(variant(attention="cudnn"), 0)
  with pytest.raises(ConfigError, match="model.attention must be one of"):
    variant(attention="flash")
  with pytest.raises(ConfigError, match="model.remat must be one of"):
    variant(remat="full")


def test_cpu_backward_kernels_apply_only_on_cpu(monkeypatch):
  def kinds(model):
    linears = [n for _, n in nnx.iter_graph(model) if isinstance(n, nnx.Linear)]
    norms = [n for _, n in nnx.iter_graph(model) if isinstance(n, nnx.LayerNorm)]
    return {n.dot_general for n in linears}, {type(n) for n in norms}

  assert kinds(models.GPT(CFG, rngs=nnx.Rngs(0))) == (
    {cpu_kernels.dense_dot_general},
    {cpu_kernels.LayerNorm},
  )
  monkeypatch.setattr(backends, "platform", lambda: "gpu")
  gpu_model = models.GPT(CFG, rngs=nnx.Rngs(0))
  assert kinds(gpu_model) == ({jax.lax.dot_general}, {nnx.LayerNorm})
  # the same parameters either way: a checkpoint moves between platforms
  chex.assert_trees_all_equal(
    nnx.to_pure_dict(nnx.state(gpu_model, nnx.Param)), models.build(CFG, 0)[1]
  )


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("remat", ["block", "dots"])
@pytest.mark.slow
def test_remat_gives_the_same_loss_and_gradients(remat, scan):
  rng = jax.random.key_data(jax.random.key(5))
  cfg = variant(scan_layers=scan, dropout=0.1)
  loss_0, grads_0 = loss_and_grads(cfg, rng=rng)
  loss_r, grads_r = loss_and_grads(variant(scan_layers=scan, dropout=0.1, remat=remat), rng=rng)
  assert_close(loss_r, loss_0, terms=TERMS)
  assert_close(grads_r, grads_0, terms=TERMS)
  # the margin: another dropout draw is far outside the tolerance
  _, grads_other = loss_and_grads(cfg, rng=jax.random.key_data(jax.random.key(6)))
  assert_far(grads_other, grads_0, terms=TERMS)


def test_a_seed_initialises_the_same_model_in_both_layouts():
  _, unrolled = models.build(CFG, 0)
  _, scanned = models.build(variant(scan_layers=True), 0)
  assert not layers.is_stacked(unrolled["blocks"]) and layers.is_stacked(scanned["blocks"])
  assert scanned["blocks"]["qkv"]["kernel"].shape == (3, 32, 96)
  convert = jax.jit(layers.convert_layout, static_argnums=1)
  chex.assert_trees_all_equal(convert(unrolled, True), scanned)
  chex.assert_trees_all_equal(convert(scanned, False), unrolled)
  chex.assert_trees_all_equal(convert(scanned, True), scanned)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.slow
def test_scanned_layers_give_the_same_loss_and_gradients(dropout):
  rng = jax.random.key_data(jax.random.key(7)) if dropout else None
  loss_u, grads_u = loss_and_grads(variant(dropout=dropout), rng=rng)
  loss_s, grads_s = loss_and_grads(variant(dropout=dropout, scan_layers=True), rng=rng)
  assert_close(loss_s, loss_u, terms=TERMS)
  assert_close(layers.convert_layout(grads_s, False), grads_u, terms=TERMS)
  # the margin: the layers' gradients in another order (a layout converted the wrong way)
  swapped = layers.convert_layout(grads_s, False)
  swapped["blocks"] = dict(enumerate(reversed(swapped["blocks"].values())))
  assert_far(swapped, grads_u, terms=TERMS)


@pytest.mark.slow
def test_scanned_layers_decode_like_unrolled():
  prompts = TOKENS[:, :5]
  positions = jnp.broadcast_to(jnp.arange(5), (2, 5))
  outs = []
  for scan in (False, True):
    cfg = variant(scan_layers=scan)
    dec, (_, params) = models.decoder(cfg), models.build(cfg, 0)
    logits, cache = dec.decode_fn(params, prompts, positions, dec.init_cache(2, 16))
    outs.append((logits, cache))
  assert_close(outs[0], outs[1], terms=TERMS)
  assert_far(planted(outs[0][0]), outs[1][0], terms=TERMS)


def test_layout_conversion_covers_the_whole_train_state_and_the_decay_mask():
  from jaxstep import make_train_step
  from jaxstep.core.losses import next_token_loss

  apply_fn, params = models.build(CFG, 0)
  optimizer = make_optimizer(OptimConfig(), 10)
  step = make_train_step(next_token_loss(apply_fn), optimizer, grad_accum_steps=1)
  state = step.init(params, 0)
  convert = jax.jit(layers.convert_layout, static_argnums=1)
  stacked = convert(state, True)
  assert layers.layout_of(stacked) is True and layers.layout_of(state) is False
  chex.assert_trees_all_equal(convert(stacked, False), state)
  # Adam moments moved with the params
  mu = jax.tree.leaves(stacked.opt_state, is_leaf=lambda n: isinstance(n, dict))
  assert any(layers.layout_of(m) for m in mu if isinstance(m, dict))
  # the leading layer axis does not make biases and norm scales "matrices"
  per_block, stacked_mask = decay_mask(params), decay_mask(stacked.params)
  assert stacked_mask["blocks"] == per_block["blocks"][0]
  assert stacked_mask["blocks"]["ln1"] == {"bias": False, "scale": False}
  assert {k: v for k, v in stacked_mask.items() if k != "blocks"} == {
    k: v for k, v in per_block.items() if k != "blocks"
  }


@pytest.mark.parametrize("first, then", [(False, True), (True, False)])
@pytest.mark.slow
def test_a_checkpoint_resumes_in_the_other_block_layout(tmp_path, first, then):
  """2 steps in one layout, resumed for 2 more in the other: the same losses as 4 steps in
  one go (fp32 rounding of a differently compiled step), and the state converted back."""
  from conftest import make_cfg

  from jaxstep import trainer
  from jaxstep.trainer.store.records import read_records

  common = ["model.n_layers=2", "train.log_every=1", "train.eval_every=0"]
  straight = trainer.train(make_cfg(tmp_path / "a", "train.max_steps=4", *common))
  trainer.train(
    make_cfg(tmp_path / "b", "train.max_steps=2", *common, f"model.scan_layers={first}")
  )
  resumed = trainer.train(
    make_cfg(tmp_path / "b", "train.max_steps=4", *common, f"model.scan_layers={then}")
  )
  assert layers.layout_of(resumed.state.params) is then
  # generate and evaluate read a checkpoint of either layout in the run's current one
  from jaxstep.trainer.saved_run.load import load_run

  older = load_run(tmp_path / "b" / "run", step=2)
  assert layers.layout_of(older.params) is then
  losses = [
    [r["loss"] for r in read_records(d / "run" / "metrics.jsonl")]
    for d in (tmp_path / "a", tmp_path / "b")
  ]
  np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
  chex.assert_trees_all_close(
    layers.convert_layout(resumed.state.params, False),
    layers.convert_layout(straight.state.params, False),
    rtol=1e-4,
    atol=5e-5,  # the key bias has a ~0 gradient (softmax ignores it): Adam amplifies noise
  )


@pytest.mark.slow
def test_scanned_remat_model_on_an_fsdp_mesh_matches_one_device(tmp_path):
  """8 virtual devices (data 2 × fsdp 4): 3 updates with scanned blocks and remat, then a
  resume with unrolled blocks for a 4th (the sharded restore converts the layout), against
  4 updates on one device with unrolled blocks: the same losses."""
  import os
  import subprocess
  import sys

  from conftest import make_cfg

  from jaxstep import trainer
  from jaxstep.trainer.store.records import read_records

  common = ["model.n_layers=2", "train.log_every=1", "train.eval_every=0"]
  trainer.train(make_cfg(tmp_path / "one", *common, "train.max_steps=4"))
  mesh = [*common, "mesh.data=2", "mesh.fsdp=4"]
  scanned = [*mesh, "train.max_steps=3", "model.scan_layers=true", "model.remat=block"]
  script = (
    "import pathlib, sys; sys.path.insert(0, 'tests'); from conftest import make_cfg; "
    f"from jaxstep import trainer; root = pathlib.Path({str(tmp_path / 'mesh')!r}); "
    f"trainer.train(make_cfg(root, *{scanned!r})); "
    f"trainer.train(make_cfg(root, *{mesh!r}, 'train.max_steps=4'))"
  )
  env = {**os.environ, "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=8")}
  proc = subprocess.run(
    [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  losses = [
    [r["loss"] for r in read_records(tmp_path / d / "run" / "metrics.jsonl")]
    for d in ("one", "mesh")
  ]
  assert len(losses[0]) == 4
  np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
  assert "scan_layers: false" in (tmp_path / "mesh" / "run" / "config.yaml").read_text()
