"""Phi-3 folders (Phi-3, Phi-4-mini): LongRoPE's long factors past the original length,
both config layouts, the fused projections' PEFT adapter, and decoding on either side of
the switch. (Logits at 12 positions, export, gradients, greedy tokens and the parity report
against transformers: ``test_hf_import``, ``test_hf_export``, ``test_hf_training``,
``test_hf_parity``, family ``phi3``.)"""

import dataclasses
import json
import types

import jax
import numpy as np
import pytest
from conftest import LazyModule
from test_hf_import import FAMILIES, SHAPE, save_tiny, torch_logits
from tolerance import assert_close, assert_far

from jaxstep import Generator, models
from jaxstep.errors import ConfigError
from jaxstep.models import hf_config, hf_export, hf_weights, layers, lora, peft_export
from jaxstep.models.hf_dense import PHI3
from jaxstep.models.rope import LongRope

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = LazyModule("peft")

TERMS = SHAPE["intermediate_size"] * SHAPE["num_hidden_layers"]
ORIGINAL = FAMILIES["phi3"][1]["original_max_position_embeddings"]  # 16


def imported(folder, **options):
  cfg = hf_config.model_config(hf_config.read_config(folder), attention="xla", **options)
  return cfg, hf_weights.read_params(folder, cfg)


def logits_of(cfg, params, ids):
  apply_fn, _ = models.build(cfg, 0, abstract=True)
  return np.asarray(jax.jit(apply_fn)(params, ids))


def test_past_the_original_length_the_long_factors_give_transformers_logits(tmp_path, monkeypatch):
  model = save_tiny(tmp_path, "phi3")
  monkeypatch.setattr(hf_weights, "BLOCK_BYTES", 5 * 32 * 4)  # blocks of 5 rows: parts straddle
  cfg, params = imported(tmp_path)
  assert cfg.rotary_dim == 6 and cfg.rope_scaling.attention_factor == pytest.approx(1.2247449)
  ids = np.random.default_rng(0).integers(0, SHAPE["vocab_size"], size=(2, ORIGINAL + 8))
  theirs = torch_logits(model, ids)
  assert_close(logits_of(cfg, params, ids), theirs, terms=TERMS)
  short = dataclasses.replace(cfg.rope_scaling, long_factor=cfg.rope_scaling.short_factor)
  assert_far(
    logits_of(dataclasses.replace(cfg, rope_scaling=short), params, ids), theirs, terms=TERMS
  )
  whole = dataclasses.replace(cfg, partial_rotary_factor=1.0, rope_scaling=None)
  assert_far(logits_of(whole, params, ids[:, :12]), torch_logits(model, ids[:, :12]), terms=TERMS)


def test_the_older_layout_and_transformers_reading_rules():
  """transformers 4's ``rope_scaling`` (type ``su``) + ``rope_theta`` at the top level read
  the same; the top-level ``original_max_position_embeddings`` wins over the scaling's own
  and defaults to 4096; a ``factor`` sets the attention factor; ``rope_parameters``'
  ``partial_rotary_factor`` wins over the top level's."""
  name, extra = FAMILIES["phi3"]
  new = {**transformers.Phi3Config(**SHAPE, **extra).to_dict(), "architectures": [PHI3]}
  scaling = {
    k: v for k, v in new["rope_parameters"].items() if k not in ("rope_theta", "rope_type")
  }
  old = {k: v for k, v in new.items() if k != "rope_parameters"}
  old |= {"rope_theta": 10000.0, "rope_scaling": {**scaling, "type": "su"}}
  assert hf_config.model_config(old) == hf_config.model_config(new)
  del old["original_max_position_embeddings"]
  read = hf_config.model_config(old).rope_scaling
  assert read.original_max_position_embeddings == 4096 and read.attention_factor == 1.0
  old["rope_scaling"]["factor"] = 8.0
  assert hf_config.model_config(old).rope_scaling.attention_factor == pytest.approx(
    (1 + np.log(8) / np.log(4096)) ** 0.5
  )
  new["rope_parameters"]["partial_rotary_factor"] = 0.5
  with pytest.raises(ConfigError, match="factors number 3, the rotated width 4 needs 2"):
    hf_config.model_config(new)


@pytest.mark.parametrize("scan", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_adapters_on_parts_of_the_fused_projections_load_into_peft(tmp_path, scan):
  """q and v of ``qkv_proj``, gate of ``gate_up_proj`` and ``o_proj`` adapted: one adapter
  per module of rank n·r, B block-diagonal, by PEFT's patterns; transformers + PEFT compute
  the model's logits (from per-block or stacked params)."""
  model = save_tiny(tmp_path / "base", "phi3")
  targets = ("q_proj", "v_proj", "gate_proj", "o_proj")
  adapters = lora.LoraConfig(rank=2, alpha=6.0, targets=targets)
  cfg, base = imported(tmp_path / "base", lora=adapters, scan_layers=scan)
  base = layers.convert_layout(base, scan_layers=scan)
  _, abstract = models.build(cfg, 0, abstract=True)
  rng = np.random.default_rng(3)
  adapters = {
    name: rng.normal(0, 0.3, leaf.shape).astype(np.float32)
    for name, leaf in lora.init_adapters(abstract, jax.random.PRNGKey(0)).items()
  }
  params = lora.with_adapters(base, abstract, adapters)
  out = peft_export.save_adapter(
    tmp_path / "adapter", cfg, params, base_model_name_or_path="", architecture=PHI3
  )
  config = json.loads((out / peft_export.CONFIG).read_text())
  assert sorted(config["target_modules"]) == ["gate_up_proj", "o_proj", "qkv_proj"]
  assert config["rank_pattern"] == {"qkv_proj": 4} and config["alpha_pattern"] == {"qkv_proj": 12.0}
  ids = np.random.default_rng(0).integers(0, SHAPE["vocab_size"], size=(2, 12))
  plain = torch_logits(model, ids)
  with_adapter = peft.PeftModel.from_pretrained(model, out).eval()  # into the model itself
  expected = logits_of(cfg, params, ids)
  assert_close(torch_logits(with_adapter, ids), expected, terms=TERMS)
  assert_far(plain, expected, terms=TERMS)


def greedy(model, cfg, params, prompts, new: int):
  tokenizer = types.SimpleNamespace(vocab_size=SHAPE["vocab_size"], PAD=0, BOS=0, EOS=1)
  ids, _ = Generator(cfg, params, tokenizer).generate_ids(prompts, max_new_tokens=new)
  for prompt, got in zip(prompts, ids, strict=True):
    with torch.no_grad():
      out = model.float().eval().generate(
        torch.tensor(prompt[None]), max_new_tokens=new, do_sample=False, eos_token_id=1,
        pad_token_id=0, suppress_tokens=[0],
      )  # fmt: skip
    assert got == out[0, len(prompt) :].tolist()


@pytest.mark.slow
def test_decoding_past_the_original_length_and_across_it(tmp_path):
  """Prompts already past the original length decode with the long factors throughout, as
  transformers does; a prompt that would cross it while decoding is refused by name."""
  model = save_tiny(tmp_path, "phi3")
  cfg, params = imported(tmp_path)
  assert isinstance(cfg.rope_scaling, LongRope)
  rng = np.random.default_rng(5)
  prompts = [rng.integers(2, SHAPE["vocab_size"], size=n) for n in (ORIGINAL + 1, ORIGINAL + 6)]
  greedy(model, cfg, params, prompts, new=12)
  within = prompts[0][: ORIGINAL - 4]
  greedy(model, cfg, params, [within], new=5)  # the last position fed: 15, within 16
  with pytest.raises(ConfigError, match=f"changes factors after {ORIGINAL} positions"):
    greedy(model, cfg, params, [within], new=6)


def test_the_settings_as_config_keys_survive_the_runs_config_yaml(tmp_path):
  """``model.partial_rotary_factor`` and a LongRoPE ``model.rope_scaling`` from the command
  line, written to a run's ``config.yaml`` and read back the same (a resume's config)."""
  from jaxstep import config as config_lib

  scaling = (
    "{rope_type: longrope, short_factor: [1, 1.5], long_factor: [2, 4], "
    "original_max_position_embeddings: 32, attention_factor: 1.1}"
  )
  overrides = ["model.family=llama", "model.n_heads=16", "model.partial_rotary_factor=0.5"]
  cfg = config_lib.load("tiny", [*overrides, f"model.rope_scaling={scaling}"])
  assert cfg.model.rotary_dim == 4 and cfg.model.rope_scaling.long_factor == (2.0, 4.0)
  (tmp_path / "config.yaml").write_text(config_lib.dump(cfg))
  assert config_lib.load(tmp_path / "config.yaml") == cfg
  with pytest.raises(ConfigError, match="partial_rotary_factor must be in"):
    config_lib.load("tiny", ["model.family=llama", "model.partial_rotary_factor=1.5"])


def test_an_export_as_phi3_refuses_what_its_config_refuses(tmp_path):
  """transformers' Phi-3 config takes only LongRoPE and sizes its factors by d_model /
  n_heads; a mixture of experts has no partial rotary share."""
  shape = dict(vocab_size=40, d_model=16, n_layers=1, n_heads=2, intermediate_size=24)
  llama3 = dict(rope_type="llama3", original_max_position_embeddings=8)
  for settings, why in (
    (dict(partial_rotary_factor=0.5, rope_scaling=llama3), "takes LongRoPE or no RoPE scaling"),
    (dict(head_dim=4), "head_dim = d_model / n_heads"),
  ):
    cfg = models.LlamaConfig(**shape, **settings)
    with pytest.raises(ConfigError, match=why):
      hf_export.check_architecture(cfg, PHI3)
  moe = models.LlamaConfig(**shape, num_experts=4, qk_norm=True, partial_rotary_factor=0.5)
  with pytest.raises(ConfigError, match="cannot hold this model: partial_rotary_factor 0.5"):
    hf_export.check_architecture(moe, "Qwen3MoeForCausalLM")


def test_decoding_across_the_original_length_is_refused_before_compiling(tmp_path):
  save_tiny(tmp_path, "phi3")
  cfg, params = imported(tmp_path)
  prompt = np.arange(2, ORIGINAL - 2)
  with pytest.raises(ConfigError, match=f"changes factors after {ORIGINAL} positions"):
    greedy(None, cfg, params, [prompt], new=6)
