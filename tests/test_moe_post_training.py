"""Preference optimization and RL of an MoE model: the policy's router losses ride along,
and with ``lbl_scope: global`` K micro-batches give one big batch's update."""

import numpy as np
import pytest
from conftest import read_lines
from test_preference_run import DPO
from test_preference_run import cfg_for as pairs_cfg
from test_rl_run import cfg_for as rl_cfg

from jaxstep.trainer import config_run

MOE = [
  "model.family=llama", "model.num_experts=4", "model.experts_per_token=2",
  "model.moe_intermediate_size=16", "model.intermediate_size=48", "model.router_aux_loss=0.5",
  "model.router_z_loss=0.1",
]  # fmt: skip
KEYS = ("loss", "moe/lbl", "moe/z_loss", "grad_norm", "extra_loss")


def _same(runs):
  a, b = runs
  assert [r["step"] for r in a] == [r["step"] for r in b]
  for x, y in zip(a, b, strict=True):
    for key in KEYS:
      # atol: a GRPO loss starts at 0 (advantages sum to 0 in each group), its rounding ~1e-7
      np.testing.assert_allclose(x[key], y[key], rtol=2e-5, atol=1e-6, err_msg=key)


@pytest.mark.slow
def test_lora_dpo_of_an_moe_model_is_exact_over_k(tmp_path):
  runs = []
  for k in (1, 4):
    cfg = pairs_cfg(tmp_path, *DPO, *MOE, f"train.grad_accum_steps={k}", name=f"k{k}")
    config_run.train(cfg)
    runs.append(read_lines(tmp_path / f"k{k}" / "metrics.jsonl"))
  _same(runs)
  assert runs[0][0]["moe/lbl"] > 1.0 and runs[0][0]["extra_loss"] > 0


@pytest.mark.slow
def test_grpo_of_an_moe_model_is_exact_over_k(tmp_path):
  runs = []
  for k in (1, 2):
    cfg = rl_cfg(tmp_path, *MOE, f"train.grad_accum_steps={k}", name=f"k{k}")
    config_run.train(cfg)
    runs.append(read_lines(tmp_path / f"k{k}" / "metrics.jsonl"))
  _same(runs)
  assert "moe/max_load" in runs[0][0] and "reward" in runs[0][0]
