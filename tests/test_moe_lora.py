"""LoRA on a Hugging Face MoE folder: the adapters train (attention, dense layers, shared
experts), the router and the routed experts stay bit for bit the folder's, and the PEFT
adapter jaxstep exports loads onto transformers' model with the run's logits."""

import json

import jax
import numpy as np
import pytest
from conftest import LazyModule
from test_hf_folder import random_chat_folder, tokenizer_files  # noqa: F401 - fixture
from test_hf_moe import CASES, SHAPE
from test_init_from import run_cfg
from test_lora_export import export, logits, ours
from tolerance import assert_close, assert_far

import jaxstep
from jaxstep import trainer
from jaxstep.core.trees import path_name
from jaxstep.models import hf_weights

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = LazyModule("peft")

TERMS = SHAPE["intermediate_size"] * SHAPE["num_hidden_layers"]


@pytest.fixture
def moe_folder(tmp_path, tokenizer_files):  # noqa: F811 - the imported fixture
  """A tiny random Qwen2-MoE (gated shared expert, layer 1 dense) with a tokenizer."""
  name, extra = CASES["qwen2_moe"]
  settings = {**SHAPE, **extra, "vocab_size": 320}
  return random_chat_folder(tmp_path / "qwen2moe", name, settings, tokenizer_files["plain"])


ROUTED = "model.lora.targets=[q_proj,down_proj,experts.gate_up_proj,experts.down_proj]"


@pytest.mark.slow
@pytest.mark.parametrize("targets", [None, ROUTED], ids=["projections", "routed_experts"])
def test_lora_on_an_moe_folder_exports_a_peft_adapter_with_the_runs_logits(
  tmp_path, moe_folder, targets
):
  """Without targets the projections are adapted (PEFT's ``target_modules``) and the
  routed experts stay the folder's; named, the routed experts get an adapter each (PEFT's
  ``target_parameters`` on transformers' fused expert weights) and train."""
  extra = [targets] if targets else []
  cfg = run_cfg(
    tmp_path, moe_folder, "model.lora.rank=4", "train.max_steps=2", "optim.lr=1e-2", *extra
  )
  trainer.train(cfg)
  run_dir, out = tmp_path / "run", tmp_path / "adapter"
  saved = jaxstep.load_run(run_dir)
  base = hf_weights.read_params(moe_folder, saved.cfg.model)
  flat = {path_name(p): v for p, v in jax.tree_util.tree_flatten_with_path(saved.params)[0]}
  folder = {path_name(p): v for p, v in jax.tree_util.tree_flatten_with_path(base)[0]}
  frozen = [n for n in flat if ("/mlp/router/" in n or "/mlp/experts/" in n) and "/lora/" not in n]
  assert frozen and all(np.array_equal(flat[n], folder[n]) for n in frozen)
  adapted = [n for n in flat if n.endswith("lora_b") and np.any(flat[n])]
  assert any("q_proj" in n for n in adapted)
  assert any("shared_expert/down_proj" in n for n in adapted)  # down_proj: a module's name
  routed = {n for n in adapted if "/mlp/experts/" in n}
  assert {n.split("/mlp/experts/")[1] for n in routed} == (
    {"gate_up/lora/lora_b", "down/lora/lora_b"} if targets else set()
  )

  assert export(run_dir, out, "--adapter") == 0
  written = json.loads((out / "adapter_config.json").read_text())
  expected_params = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if targets else None
  assert written.get("target_parameters") == expected_params
  hf = transformers.AutoModelForCausalLM.from_pretrained(moe_folder)
  with_adapter = peft.PeftModel.from_pretrained(hf, out)
  expected = ours(run_dir)
  assert_close(logits(with_adapter), expected, terms=TERMS)
  plain = transformers.AutoModelForCausalLM.from_pretrained(moe_folder)
  assert_far(logits(plain), expected, terms=TERMS)
