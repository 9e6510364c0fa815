"""``optim.name`` and ``optim.schedule: wsd``: each optimizer is optax's own transformation
on the same accumulated gradient, K micro-batches still give one big batch's update, Muon
takes the hidden matrices and leaves the rest to AdamW, the WSD lr is its formula at every
step, and a run of ``jaxstep train`` goes through each."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import SMALL_MODEL, lm_batch, read_lines
from optax.contrib import MuonDimensionNumbers

from jaxstep import make_train_step, models
from jaxstep.core.losses import next_token_loss
from jaxstep.core.optim import (
  OPTIMIZERS,
  OptimConfig,
  decay_mask,
  make_optimizer,
  make_schedule,
  muon_dims,
)
from jaxstep.errors import ConfigError

LLAMA = models.LlamaConfig(vocab_size=32, max_seq_len=8, d_model=16, n_layers=2, n_heads=2)


def params_and_grads(seed: int = 0):
  rng = np.random.default_rng(seed)
  shapes = {
    "embed_tokens": {"embedding": (32, 16)},
    "blocks": {"0": {"q_proj": {"kernel": (16, 16)}, "norm": {"scale": (16,)}}},
    "lm_head": {"kernel": (16, 32)},
  }
  draw = lambda s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
  is_shape = lambda x: isinstance(x, tuple)  # noqa: E731
  params = jax.tree.map(draw, shapes, is_leaf=is_shape)
  grads = [jax.tree.map(draw, shapes, is_leaf=is_shape) for _ in range(3)]
  return params, grads


def reference(cfg: OptimConfig) -> optax.GradientTransformation:
  """The same optimizer written straight from optax (constant lr, no warmup)."""
  lr, wd = cfg.lr, cfg.weight_decay
  mask = lambda p: decay_mask(p)  # noqa: E731
  inner = {
    "adamw": lambda: optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=wd, mask=mask),
    "lion": lambda: optax.lion(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=wd, mask=mask),
    "adafactor": lambda: optax.adafactor(lr, weight_decay_rate=wd, weight_decay_mask=mask),
    "sgd": lambda: optax.chain(
      optax.add_decayed_weights(wd, mask), optax.sgd(lr, momentum=cfg.momentum)
    ),
    "muon": lambda: optax.contrib.muon(
      lr,
      weight_decay=wd,
      weight_decay_mask=mask,
      adam_b1=cfg.b1,
      adam_b2=cfg.b2,
      muon_weight_dimension_numbers=muon_dims,
    ),  # fmt: skip
  }[cfg.name]()
  return optax.chain(optax.clip_by_global_norm(cfg.clip_grad_norm), inner)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_optimizer_is_optaxs_own_transformation(name):
  cfg = OptimConfig(name=name, lr=0.01, schedule="constant", weight_decay=0.1)
  params, grads = params_and_grads()
  ours, theirs = make_optimizer(cfg, 10), reference(cfg)
  a, b = ours.init(params), theirs.init(params)
  for g in grads:
    ua, a = ours.update(g, a, params)
    ub, b = theirs.update(g, b, params)
    for x, y in zip(jax.tree.leaves(ua), jax.tree.leaves(ub), strict=True):
      x, y = np.asarray(x), np.asarray(y)
      # Muon's fp32 Newton–Schulz iterations, run with its hyperparameters injected as
      # arrays, round differently in the last bits: within 2e-6 of the largest update
      atol = 2e-6 * np.abs(y).max() if name == "muon" else 1e-9
      np.testing.assert_allclose(x, y, rtol=1e-6, atol=atol)
    params = optax.apply_updates(params, ua)


def test_muon_takes_the_hidden_matrices_and_leaves_the_rest_to_adamw():
  _, params = models.build(LLAMA, 0)
  dims = muon_dims(params)
  block = dims["blocks"][0]
  assert block["q_proj"]["kernel"] == MuonDimensionNumbers()
  assert block["down_proj"]["kernel"] == MuonDimensionNumbers()
  assert dims["embed_tokens"]["embedding"] is None and dims["lm_head"]["kernel"] is None
  assert block["input_layernorm"]["scale"] is None
  scanned = dataclasses.replace(LLAMA, scan_layers=True)
  _, stacked = models.build(scanned, 0)
  assert muon_dims(stacked)["blocks"]["q_proj"]["kernel"] == MuonDimensionNumbers(1, 2)


@pytest.mark.parametrize(
  "name",
  [n if n in ("adamw", "muon") else pytest.param(n, marks=pytest.mark.slow) for n in OPTIMIZERS],
)
def test_k_micro_batches_give_one_batchs_update_with_each_optimizer(name, np_rng):
  apply_fn, params = models.build(dataclasses.replace(LLAMA, n_layers=1), 0)
  batches = [lm_batch(np_rng, 16, 8, 32) for _ in range(2)]
  out = []
  for k in (1, 4):
    opt = make_optimizer(OptimConfig(name=name, lr=0.01, warmup_steps=0), 10)
    train_step = make_train_step(next_token_loss(apply_fn), opt, grad_accum_steps=k)
    state, step = train_step.init(params, 0), jax.jit(train_step)
    for b in batches:
      state, _ = step(state, b)
    out.append(state.params)
  for x, y in zip(jax.tree.leaves(out[0]), jax.tree.leaves(out[1]), strict=True):
    err = np.linalg.norm(np.asarray(x) - np.asarray(y)) / max(np.linalg.norm(np.asarray(x)), 1e-30)
    assert err <= 1e-5, (name, err)


@pytest.mark.parametrize("shape", ["linear", "cosine", "1-sqrt"])
def test_the_wsd_lr_is_its_formula_at_every_step(shape):
  cfg = OptimConfig(
    lr=0.02, schedule="wsd", warmup_steps=10, decay_fraction=0.25, decay_shape=shape,
    final_lr_fraction=0.1,
  )  # fmt: skip
  schedule = make_schedule(cfg, 110)  # 10 warmup, then 100: 75 stable, 25 decaying

  def expected(s):
    if s < 10:
      return 0.02 * s / 10
    x = min(max((s - 85) / 25, 0.0), 1.0)
    progress = {"linear": x, "cosine": (1 - np.cos(np.pi * x)) / 2, "1-sqrt": np.sqrt(x)}[shape]
    return 0.02 * (1 - 0.9 * progress)

  got = [float(schedule(s)) for s in range(111)]
  np.testing.assert_allclose(got, [expected(s) for s in range(111)], rtol=1e-6, atol=1e-9)
  assert got[85] == pytest.approx(0.02) and got[110] == pytest.approx(0.002)


@pytest.mark.parametrize(
  ("key", "message"),
  [
    ("name=rmsprop", "optim.name must be one of adamw, muon, adafactor, lion, sgd"),
    ("decay_fraction=0", "optim.decay_fraction must be in"),
    ("decay_shape=exp", "optim.decay_shape must be one of linear, cosine, 1-sqrt"),
  ],
)
def test_a_bad_optimizer_setting_is_one_line(key, message):
  from jaxstep.trainer.config import loading as config_lib

  with pytest.raises(ConfigError, match=message):
    config_lib.load(None, [f"optim.{key}"])


@pytest.mark.parametrize("name", ["muon", "lion"])
def test_jaxstep_train_runs_each_optimizer_and_reports_its_lr(tmp_path, name):
  from jaxstep.trainer import config_run
  from jaxstep.trainer.config import loading as config_lib

  args = [*SMALL_MODEL, "train.global_batch_size=8", "train.grad_accum_steps=2"]
  args += ["train.max_steps=4", "train.log_every=1", "train.eval_every=0", "mesh.cpu_devices=1"]
  args += [f"optim.name={name}", "optim.schedule=wsd", "optim.decay_fraction=0.5"]
  args += ["optim.warmup_steps=0", "optim.lr=0.01", f"run_dir={tmp_path / 'run'}"]
  config_run.train(config_lib.load(None, args))
  lrs = [r["lr"] for r in read_lines(tmp_path / "run" / "metrics.jsonl")]
  # stable for 2 updates, then linear to 0.1 × lr over 2: the lr each update used
  np.testing.assert_allclose(lrs, [0.01, 0.01, 0.01, 0.0055], rtol=1e-6)


@pytest.mark.parametrize(  # one factored, one of a single moment fast; the rest slow
  "name",
  [
    n if n in ("adafactor", "lion") else pytest.param(n, marks=pytest.mark.slow) for n in OPTIMIZERS
  ],
)
def test_the_memory_ledger_shows_each_optimizers_own_state(name, monkeypatch):
  """The ledger's optimizer row is the state's bytes as the optimizer lays it out: Adam's
  two moments, one for Lion and SGD, Muon's one on matrices, Adafactor's factored rows.
  The report's own compile of the step is the one whose numbers are checked."""
  from jaxstep.cli import memory
  from jaxstep.trainer.config import loading as config_lib

  compiled, compile_for = [], memory.compiled_memory

  def recorded(cfg):
    compiled.append(compile_for(cfg))
    return compiled[-1]

  monkeypatch.setattr(memory, "compiled_memory", recorded)

  args = [*SMALL_MODEL, "model.family=llama", "model.vocab_size=264", "mesh.cpu_devices=1"]
  cfg = config_lib.load(None, [*args, f"optim.name={name}", "train.global_batch_size=8"])
  _, params = models.build(cfg.model, 0, abstract=True)
  state = jax.eval_shape(make_optimizer(cfg.optim, 10).init, params)
  expected = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
  text = memory.report(cfg)
  (ledger,) = compiled
  assert ledger["optimizer_state_bytes"] == expected
  p = sum(x.size for x in jax.tree.leaves(params))
  ratio = {"adamw": 2.0, "lion": 1.0, "sgd": 1.0}
  if name in ratio:
    assert expected == pytest.approx(4 * p * ratio[name], rel=1e-3)
  assert ("Adam moments" in text) == (name == "adamw")
  assert (f"{name} state (its own shapes, per device)" in text) == (name != "adamw")


GROUPS = ({"match": "norm", "weight_decay": 0.0, "lr_scale": 0.5, "optimizer": "sgd"},)


def test_groups_assign_the_leaves_their_pattern_matches():
  from jaxstep.core import param_groups

  _, params = models.build(LLAMA, 0)
  got = param_groups.assignment(params, ({"match": "norm"}, {"match": "embed"}))
  assert got["group1"] == ["embed_tokens/embedding"]
  assert "blocks/0/input_layernorm/scale" in got["group0"] and "norm/scale" in got["group0"]
  assert "blocks/0/q_proj/kernel" in got["main"] and not set(got["main"]) & set(got["group0"])


def test_a_group_runs_its_own_optimizer_on_its_leaves_only():
  """Norms on SGD at half the lr without decay, the rest on AdamW: each part's update is its
  optimizer's on those leaves alone, after the one clipping of the whole gradient."""
  cfg = OptimConfig(lr=0.01, schedule="constant", groups=GROUPS)
  params, grads = params_and_grads()
  ours = make_optimizer(cfg, 10)
  state = ours.init(params)
  clip = optax.clip_by_global_norm(cfg.clip_grad_norm)
  norms = lambda t: {"blocks": {"0": {"norm": t["blocks"]["0"]["norm"]}}}  # noqa: E731
  rest = lambda t: {**t, "blocks": {"0": {"q_proj": t["blocks"]["0"]["q_proj"]}}}  # noqa: E731
  sgd = optax.sgd(0.005, momentum=0.9)
  adamw = optax.adamw(0.01, b2=0.95, weight_decay=0.1, mask=decay_mask)
  sgd_state, adamw_state = sgd.init(norms(params)), adamw.init(rest(params))
  for g in grads:
    update, state = ours.update(g, state, params)
    clipped, _ = clip.update(g, clip.init(params))
    expected, sgd_state = sgd.update(norms(clipped), sgd_state)
    others, adamw_state = adamw.update(rest(clipped), adamw_state, rest(params))
    np.testing.assert_allclose(
      np.asarray(update["blocks"]["0"]["norm"]["scale"]),
      np.asarray(expected["blocks"]["0"]["norm"]["scale"]),
      rtol=1e-6,
    )
    for x, y in zip(jax.tree.leaves(rest(update)), jax.tree.leaves(others), strict=True):
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-9)
    params = optax.apply_updates(params, update)
  labels = ours.init(params)[1].inner_states
  assert set(labels) == {"main", "group0"}  # one optimizer state per group


@pytest.mark.parametrize(
  ("groups", "message"),
  [
    (
      ({"match": "norm"}, {"match": "scale"}),
      "matched by optim.groups\\[0\\] .* and optim.groups\\[1\\]",
    ),
    (
      ({"match": "nothing-here"},),
      "optim.groups\\[0\\] \\(match 'nothing-here'\\) matches no parameter",
    ),
    (({"match": "norm", "lr": 1},), "optim.groups\\[0\\] has lr; a group takes match, lr_scale"),
    (({"match": "norm", "optimizer": "adam"},), "optim.groups\\[0\\].optimizer must be one of"),
  ],
)
def test_a_bad_group_is_one_line(groups, message):
  from jaxstep.core import param_groups

  _, params = models.build(LLAMA, 0)
  with pytest.raises(ConfigError, match=message):
    param_groups.assignment(params, OptimConfig(groups=groups).groups)


def test_jaxstep_train_logs_which_leaves_each_group_got(tmp_path, caplog):
  from jaxstep.trainer import config_run
  from jaxstep.trainer.config import loading as config_lib

  args = [*SMALL_MODEL, "train.global_batch_size=8", "train.grad_accum_steps=2"]
  args += ["train.max_steps=2", "train.eval_every=0", "mesh.cpu_devices=1"]
  args += ["optim.groups=[{match: 'ln', weight_decay: 0}]", f"run_dir={tmp_path / 'run'}"]
  with caplog.at_level("INFO", logger="jaxstep"):
    config_run.train(config_lib.load(None, args))
  assert "optim.groups[0] (match 'ln'): blocks/0/ln1/bias, blocks/0/ln1/scale" in caplog.text
  assert "leaves in no group keep optim.name=adamw" in caplog.text


@pytest.mark.slow
def test_each_optimizer_on_four_devices_equals_one_device():
  """fsdp 4 (Muon orthogonalizes matrices the layout splits) and data 2 × fsdp 2."""
  import json
  import pathlib
  import subprocess
  import sys

  from conftest import devices_env

  script = pathlib.Path(__file__).parent / "helpers" / "optim_equivalence.py"
  proc = subprocess.run(
    [sys.executable, str(script)], env=devices_env(4), capture_output=True, text=True, timeout=600
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = [json.loads(line) for line in proc.stdout.splitlines()]
  assert sorted({r["optimizer"] for r in lines}) == sorted(OPTIMIZERS) and len(lines) == 10
  for r in lines:
    assert r["err"] <= 1e-5, r


@pytest.mark.slow
def test_a_muon_run_killed_with_sigkill_resumes_bitwise(tmp_path):
  from conftest import bitwise_same_checkpoints, straight_and_killed

  args = [*SMALL_MODEL, "train.global_batch_size=8", "train.max_steps=6", "checkpoint.every=2"]
  args += ["optim.name=muon", "optim.schedule=wsd", "train.eval_every=0", "train.sample_every=0"]
  straight, killed = straight_and_killed(tmp_path, args, kill_at=2)
  assert bitwise_same_checkpoints(straight, killed)[0] == 6
