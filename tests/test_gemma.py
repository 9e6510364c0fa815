"""Gemma 2 and Gemma 3 text folders: each piece of their math is the one transformers
computes (a model without it is far off), the older config layout reads the same, logits
soft-capped after the head are never chunked, and what jaxstep does not compute is refused
by name. (Logits, export, gradients, greedy tokens, LoRA and the parity report against
transformers: ``test_hf_import``, ``test_hf_export``, ``test_hf_training``,
``test_dense_families``, ``test_hf_parity``, families ``gemma2``, ``gemma3``.)"""

import dataclasses

import numpy as np
import pytest
from test_hf_folder import tokenizer_files  # noqa: F401 - fixture
from test_hf_import import FAMILIES, SHAPE, save_tiny, torch_logits
from test_phi3 import imported, logits_of
from tolerance import assert_close, assert_far

from jaxstep import models
from jaxstep.errors import ConfigError
from jaxstep.models import hf_config
from jaxstep.models.hf_gemma import GEMMA3

transformers = pytest.importorskip("transformers")
TERMS = SHAPE["intermediate_size"] * SHAPE["num_hidden_layers"]


def test_each_piece_of_gemmas_math_is_transformers(tmp_path):
  model = save_tiny(tmp_path, "gemma3")
  cfg, params = imported(tmp_path)
  assert cfg.windows == (5, 0) and cfg.rope_bases == ((100.0, None), (10000.0, None))
  ids = np.random.default_rng(0).integers(0, SHAPE["vocab_size"], size=(2, 12))
  theirs = torch_logits(model, ids)
  assert_close(logits_of(cfg, params, ids), theirs, terms=TERMS)
  for wrong in (
    dict(norm_offset=0.0),  # w, not 1 + w
    dict(mlp_activation="silu"),
    dict(scale_embeddings=False),
    dict(query_pre_attn_scalar=0.0),  # 1/√head_dim
    dict(local_rope_theta=0.0),  # one base for both kinds of layer
  ):
    assert_far(logits_of(dataclasses.replace(cfg, **wrong), params, ids), theirs, terms=TERMS)


def test_gemma2s_soft_caps_are_transformers_and_its_logits_are_computed_whole(tmp_path):
  model = save_tiny(tmp_path, "gemma2")
  cfg, params = imported(tmp_path)
  assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (0.8, 1.5)
  assert cfg.windows == (5, 0) and not cfg.qk_norm
  ids = np.random.default_rng(0).integers(0, SHAPE["vocab_size"], size=(2, 12))
  theirs = torch_logits(model, ids)
  assert_close(logits_of(cfg, params, ids), theirs, terms=TERMS)
  for wrong in (dict(attn_logit_softcapping=0.0), dict(final_logit_softcapping=0.0)):
    assert_far(logits_of(dataclasses.replace(cfg, **wrong), params, ids), theirs, terms=TERMS)
  apply_fn, _ = models.build(cfg, 0, abstract=True)
  assert not apply_fn.emits_hidden  # every chunked path takes the whole logits
  with pytest.raises(ConfigError, match="soft-capped after the head"):
    apply_fn(params, ids, as_hidden=True)
  null = {"architectures": ["Gemma2ForCausalLM"], **SHAPE, "attn_logit_softcapping": None}
  assert hf_config.model_config(null).attn_logit_softcapping == 0.0  # null: none
  assert hf_config.model_config(null).final_logit_softcapping == 30.0  # absent: the default


def test_the_older_layout_and_transformers_defaults_read_the_same():
  """``rope_theta`` / ``rope_local_base_freq`` at the top level and the layers from
  ``sliding_window_pattern``, as transformers 4 wrote them; head_dim 256, tied embeddings
  and a query scalar of 256 where a folder names none."""
  _, extra = FAMILIES["gemma3"]
  new = transformers.Gemma3TextConfig(**SHAPE, **extra).to_dict() | {"architectures": [GEMMA3]}
  old = {k: v for k, v in new.items() if k not in ("rope_parameters", "layer_types")}
  old |= {"rope_theta": 10000.0, "rope_local_base_freq": 100.0, "sliding_window_pattern": 2}
  assert hf_config.model_config(old) == hf_config.model_config(new)
  bare = {**SHAPE, "architectures": [GEMMA3], "num_hidden_layers": 7}
  read = hf_config.model_config(bare)
  assert (read.resolved_head_dim, read.tie_embeddings, read.query_pre_attn_scalar) == (
    256,
    True,
    256,
  )
  assert read.full_layers == (5,) and read.sliding_window == 4096
  assert read.rope_bases[0] == (10000.0, None) and read.rope_bases[5] == (1e6, None)


@pytest.mark.slow
def test_a_bf16_folder_computes_in_bf16_within_its_rounding_of_transformers(tmp_path):
  """bf16 weights and compute on both sides: jaxstep's logits within bf16's rounding of
  transformers' (about 1.5 % of their scale here), where a model without the ``1 + w``
  norms is off by far more. (Which of the two libraries' roundings lands where is below
  this bound: the fp32 comparisons pin the math.)"""
  import jax
  import jax.numpy as jnp
  import torch

  from jaxstep import models

  model = save_tiny(tmp_path, "gemma3", dtype=torch.bfloat16)
  cfg, params = imported(tmp_path)
  ids = np.random.default_rng(0).integers(0, SHAPE["vocab_size"], size=(2, 12))
  with torch.no_grad():
    theirs = model(torch.tensor(ids)).logits.float().numpy()
  bf16 = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), params)

  def error(c):
    apply_fn, _ = models.build(c, 0, abstract=True)
    return np.abs(np.asarray(jax.jit(apply_fn)(bf16, ids), np.float32) - theirs).max()

  scale = np.abs(theirs).max()
  assert error(cfg) < 0.03 * scale
  assert error(dataclasses.replace(cfg, norm_offset=0.0)) > 0.1 * scale


def test_a_mixture_of_experts_refuses_gemmas_mlp_and_a_zero_pattern():
  with pytest.raises(ConfigError, match="mlp_activation gelu_tanh is not computed by the experts"):
    models_llama(num_experts=4, mlp_activation="gelu_tanh")
  with pytest.raises(ConfigError, match="sliding_window_pattern must be >= 1"):
    hf_config.model_config({**SHAPE, "architectures": [GEMMA3], "sliding_window_pattern": 0})


def models_llama(**settings):
  from jaxstep.models.llama import LlamaConfig

  return LlamaConfig(vocab_size=40, d_model=16, n_heads=2, intermediate_size=24, **settings)


@pytest.mark.parametrize(
  "setting, why",
  [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0 is not supported"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
    ({"hidden_activation": "gelu"}, "hidden_activation 'gelu' is not supported"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 8.0}}, "linear RoPE scaling"),
  ],
)
def test_what_is_not_computed_is_refused_by_name(setting, why):
  with pytest.raises(ConfigError, match=why):
    hf_config.model_config({**SHAPE, "architectures": [GEMMA3], **setting})


@pytest.mark.slow
def test_a_gemma2_run_asking_for_chunks_trains_on_the_whole_logits(tmp_path, tokenizer_files):  # noqa: F811
  """``model.loss_chunk`` set on a model whose logits are soft-capped after the head: the
  run computes them whole (the same losses as ``loss_chunk: 0``), a LoRA run and its
  frozen reference alike, never a wrong chunked loss."""
  from conftest import read_lines
  from test_hf_folder import random_chat_folder
  from test_init_from import run_cfg

  from jaxstep import trainer

  name, extra = FAMILIES["gemma2"]
  folder = random_chat_folder(
    tmp_path / "gemma2", name, {**SHAPE, **extra, "vocab_size": 320}, tokenizer_files["plain"]
  )
  losses = {}
  for chunk in (0, 4):
    run = tmp_path / f"chunk{chunk}"
    cfg = run_cfg(
      tmp_path, folder, "model.lora.rank=2", "train.max_steps=2", "train.log_every=1",
      f"model.loss_chunk={chunk}", f"run_dir={run}",
    )  # fmt: skip
    trainer.train(cfg)
    losses[chunk] = [r["loss"] for r in read_lines(run / "metrics.jsonl")]
  assert len(losses[0]) == 2 and losses[4] == losses[0]
