"""QLoRA: a frozen base stored in NF4 or int8 (``model.lora.base_quant``), adapters in fp32.

The quantization against bitsandbytes (its CPU path, the reference QLoRA implementation)
and against numpy from the QLoRA paper's NF4 table; a quantized model against the same
model holding the dequantized weights; a run that trains, checkpoints its codes and
reports their bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_cfg, read_lines, restore_state_arrays
from tolerance import assert_close

from jaxstep import models, trainer
from jaxstep.cli import run as run_command
from jaxstep.core import freeze
from jaxstep.core.trees import path_name
from jaxstep.errors import ConfigError
from jaxstep.models import lora, quant

# the QLoRA paper's NormalFloat-4 levels (Dettmers et al. 2023, appendix E), written out here
# so the reference below owes nothing to the code under test
NF4 = np.array([
  -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
  -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
  0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
  0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
], np.float32)  # fmt: skip


def numpy_nf4(w: np.ndarray, block: int) -> np.ndarray:
  """``w`` ``[in, out]`` through NF4 by hand: per block of ``block`` input rows and output
  column, ``absmax``; each value the nearest level of ``w / absmax``; back as level · absmax."""
  rows, cols = w.shape
  b = w.reshape(rows // block, block, cols)
  absmax = np.abs(b).max(axis=1, keepdims=True)
  codes = np.abs((b / absmax)[..., None] - NF4).argmin(-1)
  return (NF4[codes] * absmax).reshape(rows, cols)


def numpy_int8(w: np.ndarray, block: int) -> np.ndarray:
  """Symmetric int8 by hand: ``scale = absmax / 127.5`` per block, ``round(w / scale)``."""
  rows, cols = w.shape
  b = w.reshape(rows // block, block, cols)
  scale = np.abs(b).max(axis=1, keepdims=True) / np.float32(127.5)
  return (np.clip(np.round(b / scale), -128, 127) * scale).reshape(rows, cols)


@pytest.mark.parametrize("shape", [(128, 48), (64, 7), (256, 96)])
def test_nf4_dequantizes_as_the_papers_levels_and_as_bitsandbytes(shape):
  w = np.random.default_rng(shape[0]).normal(size=shape).astype(np.float32)
  q = quant.quantize(w, "nf4", 64)
  assert q.codes.dtype == jnp.uint8 and q.codes.shape == (shape[0] // 2, shape[1])
  assert q.scale.shape == (shape[0] // 64, shape[1]) and q.shape == shape
  ours = np.asarray(quant.dequantize(q))
  np.testing.assert_allclose(ours, numpy_nf4(w, 64), rtol=1e-6, atol=0)
  bnb = pytest.importorskip("bitsandbytes.functional")
  torch = pytest.importorskip("torch")
  # bitsandbytes quantizes torch's [out, in] weight in blocks of 64 consecutive values of a
  # row: the same blocks as ours along the input axis of the [in, out] kernel
  codes, state = bnb.quantize_4bit(torch.from_numpy(w.T.copy()), blocksize=64, quant_type="nf4")
  theirs = bnb.dequantize_4bit(codes, state).numpy().T
  np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=0)


def test_int8_dequantizes_as_symmetric_absmax_rounding():
  w = np.random.default_rng(1).normal(size=(3, 128, 40)).astype(np.float32)
  q = quant.quantize(w, "int8", 32)
  assert q.codes.dtype == jnp.int8 and q.scale.shape == (3, 4, 40)
  ours = np.asarray(quant.dequantize(q))
  # a block's ±absmax sits at ±127.5 steps, a rounding tie that one ulp of the scale
  # decides either way: compared against the bound below, the rest value by value
  absmax = np.abs(w.reshape(3, 4, 32, 40)).max(2, keepdims=True)
  extreme = np.abs(w) == absmax.repeat(32, 2).reshape(w.shape)
  for i in range(3):  # a stacked leading axis is quantized layer by layer
    same = ~extreme[i]
    np.testing.assert_allclose(ours[i][same], numpy_int8(w[i], 32)[same], rtol=1e-6, atol=0)
  # the error is what the rounding allows: half a step of each block's scale
  assert np.abs(ours - w).max() <= np.abs(w).max() / 127.5 / 2 * 1.0001


def test_an_nf4_base_is_under_three_tenths_of_its_bf16_bytes():
  """An 8B-shaped MLP weight: the codes at 4 bits and an fp32 scale per 64 values."""
  w = jax.ShapeDtypeStruct((4096, 14336), jnp.bfloat16)
  q = quant.quantize(w, "nf4", 64)
  ratio = quant.nbytes(q) / (4096 * 14336 * 2)
  assert ratio == pytest.approx((0.5 + 4 / 64) / 2) and ratio <= 0.3


MOE = {"num_experts": 4, "experts_per_token": 2, "moe_intermediate_size": 32}


def llama(scan: bool, remat: str = "none", moe=False, **lora_kw):
  targets = ("q_proj", "experts.down_proj") if moe else ("q_proj", "down_proj")
  spec = lora.LoraConfig(rank=4, targets=targets, **lora_kw)
  return models.LlamaConfig(
    vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=48,
    max_seq_len=16, scan_layers=scan, remat=remat, lora=spec, **(MOE if moe else {}),
  )  # fmt: skip


def _quantized(params, qtype="nf4", block=16):
  return quant.quantized(params, qtype, block, frozen=lambda name: "/lora/" not in name)


def _trained_adapters(params, seed=3):
  """``params`` with every adapter ``B`` non-zero (as after training)."""
  key = jax.random.PRNGKey(seed)

  def bump(path, x):
    name = "/".join(str(getattr(k, "key", k)) for k in path)
    return x + 0.05 * jax.random.normal(key, x.shape) if name.endswith("lora_b") else x

  return jax.tree_util.tree_map_with_path(bump, params)


@pytest.mark.parametrize(
  "qtype,scan,remat,moe",
  [
    pytest.param("nf4", True, "block", False, marks=pytest.mark.slow),
    ("int8", False, "none", False),
    ("nf4", True, "none", True),
  ],
)
def test_a_quantized_base_computes_what_its_dequantized_weights_compute(qtype, scan, remat, moe):
  """The logits equal, bitwise, those of the same model holding the dequantized weights as
  plain arrays (the base is dequantized and nothing else changes), and the adapters'
  gradients within fp32 rounding (XLA fuses the backward passes differently)."""
  apply_fn, params = models.build(llama(scan, remat, moe), 0)
  params = _trained_adapters(params)
  q = _quantized(params, qtype)
  kernels = [x for x in jax.tree.leaves(q, is_leaf=quant.is_quantized) if quant.is_quantized(x)]
  # q k v o and gate up down per layer (an MoE layer's: the stacked experts; its router stays)
  assert len(kernels) == 7 * (1 if scan else 2)
  assert not moe or not quant.is_quantized(q["blocks"]["mlp"]["router"]["kernel"])
  plain = quant.materialized(q)
  inputs = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 12)))
  logits = jax.jit(apply_fn)
  assert np.array_equal(logits(q, inputs), logits(plain, inputs))
  assert not np.array_equal(logits(params, inputs), logits(q, inputs))  # it did quantize
  if remat == "none":  # the gradients: once, through the rematerialized block body
    return
  trains = freeze.by_patterns([lora.ADAPTER])

  def loss(adapters, base):
    return jnp.mean(apply_fn(freeze.combine(adapters, base), inputs) ** 2)

  grads = [jax.jit(jax.grad(loss))(*freeze.partition(p, trains)) for p in (q, plain)]
  flat = [jax.tree_util.tree_flatten_with_path(g)[0] for g in grads]
  adapters = [{path_name(k): v for k, v in leaves} for leaves in flat]
  assert adapters[0].keys() == adapters[1].keys() and len(adapters[0]) == 4 * (1 if scan else 2)
  assert all(np.any(g != 0) for g in adapters[0].values())
  assert_close(adapters[0], adapters[1], terms=2 * 12 * 48)  # positions × the widest matmul


def test_cached_decoding_dequantizes_the_blocks_too():
  cfg = llama(True)
  apply_fn, params = models.build(cfg, 0)
  q = _quantized(_trained_adapters(params))
  dec = models.decoder(cfg)
  inputs = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 10)))
  positions = jnp.broadcast_to(jnp.arange(10), (2, 10))
  logits, _ = jax.jit(dec.decode_fn)(q, inputs, positions, dec.init_cache(2, 16))
  np.testing.assert_allclose(logits, jax.jit(apply_fn)(q, inputs), rtol=1e-5, atol=1e-5)


def test_merged_dequantizes_the_base_and_folds_the_adapters_in():
  cfg = llama(False)
  apply_fn, params = models.build(cfg, 0)
  q = _quantized(_trained_adapters(params))
  merged = lora.merged(q, cfg.lora.scale)
  assert not quant.has_quantized(merged) and not lora.has_adapters(merged)
  plain_apply, _ = models.build(_no_lora(cfg), 0)
  inputs = jnp.asarray(np.random.default_rng(2).integers(0, 64, (2, 12)))
  ours, theirs = jax.jit(plain_apply)(merged, inputs), jax.jit(apply_fn)(q, inputs)
  np.testing.assert_allclose(ours, theirs, rtol=2e-5, atol=2e-5)


def _no_lora(cfg):
  import dataclasses

  return dataclasses.replace(cfg, lora=lora.LoraConfig())


@pytest.mark.parametrize(
  "kwargs,words",
  [
    ({"rank": 4, "base_quant": "fp4"}, "base_quant must be one of none, int8, nf4"),
    ({"rank": 0, "base_quant": "nf4"}, "set model.lora.rank > 0"),
    ({"rank": 4, "base_quant": "nf4", "quant_block": 5}, "quant_block must be an even"),
  ],
)
def test_bad_quantization_settings_are_one_line(kwargs, words):
  with pytest.raises(ConfigError, match=words):
    lora.LoraConfig(**kwargs)


def test_a_block_that_does_not_divide_a_weight_names_it():
  with pytest.raises(ConfigError, match=r"quant_block 64 does not divide the input size 48 of x"):
    quant.quantize(np.zeros((48, 8), np.float32), "nf4", 64, "x")


QLORA = ["model.lora.rank=4", "model.lora.base_quant=nf4", "model.lora.quant_block=16"]


def test_a_qlora_run_learns_stores_its_codes_and_the_ledger_counts_them(tmp_path, capsys):
  cfg = make_cfg(tmp_path, *QLORA, "train.max_steps=12", "train.log_every=1", "train.eval_every=0")
  trainer.train(cfg)
  losses = [r["loss"] for r in read_lines(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
  assert losses[-1] < losses[0] - 0.3
  step, arrays = restore_state_arrays(tmp_path / "run")
  leaves = jax.tree_util.tree_flatten_with_path(arrays)[0]
  codes = [x for p, x in leaves if path_name(p).endswith("kernel/codes")]
  assert step == 12 and codes and all(x.dtype == np.uint8 for x in codes)

  capsys.readouterr()
  args = ["--config", str(tmp_path / "run" / "config.yaml")]
  assert run_command("memory", args) == 0
  out = capsys.readouterr().out
  row = next(line for line in out.splitlines() if "frozen params" in line)
  assert "quantized" in row, out
  per_param = float(row.split("(")[1].split("(")[0])
  # what the checkpoint's frozen params take, per frozen parameter the ledger's header counts
  frozen = int(out.split(" train, ")[1].split(" frozen")[0].replace(",", ""))
  params = jax.tree_util.tree_flatten_with_path(arrays["params"])[0]
  stored = sum(x.nbytes for p, x in params if "/lora/" not in path_name(p))
  assert per_param == pytest.approx(stored / frozen, abs=0.005) and per_param < 4


@pytest.mark.slow
def test_dpo_on_a_quantized_base_starts_at_ln2_and_learns(tmp_path):
  """The reference is the same quantized base with the adapters off (one copy): the first
  loss is ln 2 exactly, and the adapters learn from there."""
  import math

  from test_preference_run import DPO, cfg_for

  trainer.train(cfg_for(tmp_path, *DPO, *QLORA[1:]))
  lines = read_lines(tmp_path / "run" / "metrics.jsonl")
  assert lines[0]["loss"] == pytest.approx(math.log(2), rel=1e-6)
  assert lines[-1]["loss"] < math.log(2)


@pytest.mark.slow
def test_grpo_on_a_quantized_base_samples_what_it_trains_on(tmp_path):
  """The sampler decodes with the quantized base as the trainer computes with it: the first
  pass's log-probs agree, and the KL to the adapters-off reference starts at 0."""
  from test_rl_run import cfg_for

  trainer.train(cfg_for(tmp_path, *QLORA, "rl.beta=0.1", "train.eval_every=0"))
  lines = read_lines(tmp_path / "run" / "metrics.jsonl")
  assert [r["step"] for r in lines] == [1, 2, 3]
  assert all(r["logp_gap"] < 1e-5 for r in lines)
  assert lines[0]["kl"] == pytest.approx(0.0, abs=1e-7) and lines[-1]["kl"] > 0


def test_a_pattern_judges_a_quantized_weight_whole_by_its_own_name():
  """``optim.trainable=[scale$]`` trains the norms' scales, never a quantized weight's
  ``kernel/scale``: a quantized weight trains or not as one leaf, by the kernel's name."""
  _, params = models.build(llama(True), 0)
  q = _quantized(params)
  train, frozen = freeze.partition(q, freeze.by_patterns([lora.ADAPTER, "scale$"]))
  names = [path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(train)[0]]
  assert "norm/scale" in names and "blocks/input_layernorm/scale" in names
  assert not [n for n in names if "kernel" in n]
  assert (
    freeze.count(q, freeze.by_patterns([lora.ADAPTER]))[1]
    == freeze.count(params, freeze.by_patterns([lora.ADAPTER]))[1]
  )  # the frozen count is the weights', not their codes'


def test_a_folder_read_a_block_at_a_time_quantizes_by_the_stacked_names():
  """Read from a folder, a stacked model's tensors come one block at a time
  (``blocks/0/o_proj/kernel``); ``optim.trainable`` names the stack (``blocks/o_proj/…``),
  and a weight it trains is kept as it is, in fp32, not quantized or cast."""
  from jaxstep.trainer.config import loading as config_lib
  from jaxstep.trainer.plan import steps

  cfg = config_lib.load(
    None,
    [*QLORA, "model.scan_layers=true", "optim.frozen_dtype=bf16",
     "optim.trainable=[blocks/o_proj/kernel]"],
  )  # fmt: skip
  convert = steps.base_leaf(cfg)
  w = np.ones((32, 32), np.float32)
  kept = convert(("blocks", 0, "o_proj", "kernel"), w)
  assert isinstance(kept, np.ndarray) and kept.dtype == np.float32
  assert quant.is_quantized(convert(("blocks", 0, "q_proj", "kernel"), w))
  assert convert(("norm", "scale"), np.ones(32, np.float32)).dtype == jnp.bfloat16


def test_a_checkpoint_from_before_these_settings_resumes_as_the_same_model():
  """A run written before ``model.lora`` had ``base_quant`` and ``quant_block`` records a
  ``lora`` section without them: that is the unquantized model, not a change."""
  from jaxstep.trainer.config import loading as config_lib
  from jaxstep.trainer.store import resume

  model = config_lib.to_dict(config_lib.load(None, ["model.lora.rank=4"]).model)
  older = {**model, "lora": {k: v for k, v in model["lora"].items() if "quant" not in k}}

  class Current:
    pass

  current = Current()
  current.model = model
  assert resume._model_changes({"model": older}, current) == {}
  changed = {**model, "lora": {**model["lora"], "base_quant": "nf4"}}
  current.model = changed
  assert set(resume._model_changes({"model": older}, current)) == {"lora"}


def test_the_ledger_counts_a_quantized_moes_experts_as_their_weights():
  from jaxstep.trainer.plan import memory

  _, params = models.build(llama(True, moe=True), 0)
  assert memory._expert_params(_quantized(params)) == memory._expert_params(params) > 0


@pytest.mark.slow
def test_check_passes_on_a_quantized_base(capsys):
  """``jaxstep check`` compares K micro-batches with one on the base the run would store:
  the adapters differentiated, the quantized codes closed over."""
  args = ["--config", "tiny", "model.lora.rank=4", "model.lora.base_quant=nf4"]
  assert run_command("check", args) == 0
  assert "PASS: accumulation is exact" in capsys.readouterr().out
