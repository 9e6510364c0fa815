"""OLMo 2, Granite, SmolLM3 and Phi-3 folders trained with LoRA: K micro-batches give one
batch's updates, and the PEFT adapter and the merged export load onto transformers' model
with the run's logits; models built here with their settings export as their architecture.
(Their logits, gradients, greedy tokens and parity reports against transformers:
``test_hf_import``, ``test_hf_training``, ``test_hf_parity``, families ``olmo2``,
``granite``, ``smollm3``, ``phi3``, ``gemma2``, ``gemma3``; Phi-3's and Gemma's own:
``test_phi3``, ``test_gemma``.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import LazyModule, read_lines
from test_hf_folder import random_chat_folder, tokenizer_files  # noqa: F401 - fixture
from test_hf_import import FAMILIES, SHAPE, save_tiny, torch_logits
from test_init_from import run_cfg
from test_lora_export import export, logits, ours
from tolerance import assert_close, assert_far

from jaxstep import models, trainer
from jaxstep.errors import ConfigError
from jaxstep.models import hf_config, hf_export, hf_weights, layers
from jaxstep.models.llama import LlamaConfig
from jaxstep.trainer.saved_run.export import architecture_of

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = LazyModule("peft")

TERMS = SHAPE["intermediate_size"] * SHAPE["num_hidden_layers"]


@pytest.fixture(params=["olmo2", "granite", "smollm3", "phi3", "gemma2", "gemma3"])
def family_folder(request, tmp_path, tokenizer_files):  # noqa: F811 - the imported fixture
  """A tiny random model of the family (every weight random, norms too) with a tokenizer."""
  name, extra = FAMILIES[request.param]
  settings = {**SHAPE, **extra, "vocab_size": 320}
  return random_chat_folder(tmp_path / request.param, name, settings, tokenizer_files["plain"])


@pytest.mark.slow
def test_a_lora_run_on_a_folder_is_k_invariant_and_exports_what_it_trained(tmp_path, family_folder):
  runs = {}
  for k in (1, 4):
    cfg = run_cfg(
      tmp_path,
      family_folder,
      "model.lora.rank=4",
      "train.max_steps=3",
      "train.log_every=1",
      "optim.lr=1e-2",
      f"train.grad_accum_steps={k}",
      f"run_dir={tmp_path / f'k{k}'}",
    )
    trainer.train(cfg)
    runs[k] = read_lines(tmp_path / f"k{k}" / "metrics.jsonl")
  assert len(runs[1]) == 3
  for a, b in zip(runs[1], runs[4], strict=True):
    for key in ("loss", "grad_norm"):
      np.testing.assert_allclose(b[key], a[key], rtol=2e-5, err_msg=key)

  run_dir = tmp_path / "k4"
  architecture = hf_config.read_config(family_folder)["architectures"][0]
  assert export(run_dir, tmp_path / "adapter", "--adapter") == 0
  assert export(run_dir, tmp_path / "merged") == 0
  expected = ours(run_dir)
  base = transformers.AutoModelForCausalLM.from_pretrained(family_folder)
  with_adapter = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
  assert_close(logits(with_adapter), expected, terms=TERMS)
  merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
  assert type(merged).__name__ == architecture
  assert_close(logits(merged), expected, terms=TERMS)
  plain = transformers.AutoModelForCausalLM.from_pretrained(family_folder)
  assert_far(logits(plain), expected, terms=TERMS)  # the adapters moved the logits


@pytest.mark.slow
def test_scanned_rematerialized_blocks_compute_the_folders_logits(tmp_path):
  """Stacked blocks walked by ``lax.scan`` and recomputed in the backward pass hold the
  post-norm block as the per-layer model does: transformers' logits, and the gradient of
  the unstacked model."""
  model = save_tiny(tmp_path, "olmo2")
  ids = np.random.default_rng(0).integers(0, SHAPE["vocab_size"], size=(2, 12))
  hf = hf_config.read_config(tmp_path)
  grads = {}
  for scan in (False, True):
    cfg = hf_config.model_config(hf, attention="xla", scan_layers=scan, remat="block")
    apply_fn, _ = models.build(cfg, 0, abstract=True)
    params = layers.convert_layout(hf_weights.read_params(tmp_path, cfg), scan_layers=scan)
    assert_close(np.asarray(jax.jit(apply_fn)(params, ids)), torch_logits(model, ids), terms=TERMS)
    g = jax.jit(jax.grad(lambda p, f=apply_fn: jnp.sum(f(p, ids)[..., 3])))(params)["blocks"]
    scale = g[1]["post_feedforward_layernorm"]["scale"] if not scan else None
    grads[scan] = scale if not scan else g["post_feedforward_layernorm"]["scale"][1]
  assert_close(grads[True], grads[False], terms=TERMS)


BUILT = {
  "Olmo2ForCausalLM": dict(qk_norm=True, qk_norm_scope="projection", block_norms="post"),
  "GraniteForCausalLM": dict(
    embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=4.0, tie_embeddings=True
  ),
  "SmolLM3ForCausalLM": dict(nope_layers=(0,)),
  "MistralForCausalLM": dict(sliding_window=4),  # 9 positions: past the window
  "Gemma2ForCausalLM": dict(
    **dict(block_norms="both", norm_offset=1.0, mlp_activation="gelu_tanh"),
    **dict(scale_embeddings=True, tie_embeddings=True, query_pre_attn_scalar=4.0),
    **dict(sliding_window=4, full_layers=(1,), attn_logit_softcapping=1.0),
    final_logit_softcapping=2.0,
  ),
  "Gemma3ForCausalLM": dict(
    **dict(qk_norm=True, block_norms="both", norm_offset=1.0, mlp_activation="gelu_tanh"),
    **dict(scale_embeddings=True, tie_embeddings=True, query_pre_attn_scalar=4.0),
    **dict(sliding_window=4, full_layers=(1,), local_rope_theta=100.0),
  ),
  "Phi3ForCausalLM": dict(  # 9 positions: past the original 6, the long factors
    partial_rotary_factor=0.5,
    rope_scaling=dict(
      rope_type="longrope",
      short_factor=[1.0, 2.0],
      long_factor=[3.0, 5.0],
      original_max_position_embeddings=6,
      attention_factor=1.3,
    ),
  ),
}


SLOW_BUILT = ("MistralForCausalLM", "Gemma2ForCausalLM")  # their pieces: the others'


@pytest.mark.parametrize(
  "architecture",
  [a if a not in SLOW_BUILT else pytest.param(a, marks=pytest.mark.slow) for a in BUILT],
)
def test_a_model_built_with_a_familys_settings_exports_as_it(tmp_path, architecture):
  """No base folder: the settings name the architecture, transformers computes the
  exported folder's logits, and the architectures without them are refused by name."""
  cfg = LlamaConfig(
    vocab_size=40, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, intermediate_size=24,
    attention="xla", **BUILT[architecture],
  )  # fmt: skip
  apply_fn, params = models.build(cfg, 0)
  assert architecture_of(cfg, None) == architecture
  out = hf_export.save_pretrained(tmp_path / "m", cfg, params, architecture=architecture)
  model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
  assert type(model).__name__ == architecture
  ids = np.random.default_rng(1).integers(0, 40, size=(2, 9))
  assert_close(np.asarray(apply_fn(params, ids)), torch_logits(model, ids), terms=24 * 2)
  for other, why in (("LlamaForCausalLM", "LlamaForCausalLM "), ("OlmoeForCausalLM", "experts")):
    with pytest.raises(ConfigError, match=why):
      hf_export.save_pretrained(tmp_path / "x", cfg, params, architecture=other)


def test_smollm3s_nope_layers_are_read_as_transformers_reads_them():
  """Its flags where the folder lists them, else every ``no_rope_layer_interval``-th layer
  (4 by default); flags of another length or value are one error naming the key; stacked
  blocks need every layer alike."""
  base = {"architectures": ["SmolLM3ForCausalLM"], **SHAPE, "num_hidden_layers": 8}
  read = lambda **kw: hf_config.model_config({**base, **kw}).nope_layers  # noqa: E731
  assert read() == (3, 7)
  assert read(no_rope_layer_interval=3) == (2, 5)
  assert read(no_rope_layers=[1, 0, 1, 1, 0, 0, 1, 1]) == (1, 4, 5)
  for bad in ([1, 0], [1, 2, 1, 1, 1, 1, 1, 1]):
    with pytest.raises(ConfigError, match="no_rope_layers must be 8 flags of 0 or 1"):
      read(no_rope_layers=bad)
  with pytest.raises(ConfigError, match="scan_layers needs every block alike"):
    hf_config.model_config(base, scan_layers=True)
  assert hf_config.model_config({**base, "no_rope_layers": [0] * 8}, scan_layers=True).scan_layers


def test_an_moe_export_refuses_what_its_architectures_do_not_compute():
  """A mixture of experts with a dense family's settings has no architecture to go to."""
  moe = dict(num_experts=4, experts_per_token=2, qk_norm=True, qk_norm_scope="projection")
  for settings, why in (
    (dict(block_norms="post"), "block_norms=post"),
    (dict(logits_scaling=2.0), "multipliers"),
    (dict(nope_layers=(1,)), "nope_layers"),
  ):
    cfg = LlamaConfig(vocab_size=40, d_model=16, n_heads=2, intermediate_size=24, **moe, **settings)
    with pytest.raises(ConfigError, match=f"OlmoeForCausalLM cannot hold this model: {why}"):
      hf_export.check_architecture(cfg, "OlmoeForCausalLM")


def test_a_granite_folders_multipliers_must_be_positive():
  base = {"architectures": ["GraniteForCausalLM"], **SHAPE}
  assert hf_config.model_config(base).attention_multiplier == 1.0  # transformers' default
  with pytest.raises(ConfigError, match="multipliers must be > 0, got {'attention_multiplier'"):
    hf_config.model_config({**base, "attention_multiplier": 0.0})


@pytest.mark.parametrize("architecture", sorted(hf_export.MODEL_TYPES))
def test_a_config_without_rms_norm_eps_gets_transformers_default(architecture):
  """A hand-written config.json may leave the epsilon out: the family's own default then,
  as transformers builds the model (OLMo 2, Mixtral and OLMoE use 1e-5, the rest 1e-6)."""
  theirs = transformers.AutoConfig.for_model(hf_export.MODEL_TYPES[architecture], **SHAPE)
  hf = {**theirs.to_dict(), "architectures": [architecture]}
  del hf["rms_norm_eps"]
  assert hf_config.model_config(hf).rms_norm_eps == theirs.rms_norm_eps
