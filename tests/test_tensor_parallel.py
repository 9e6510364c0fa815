"""A tensor axis beside data and fsdp: the leaves' logical names and the rule that splits
them, and (8 virtual CPU devices, slow) the GPT and a grouped-query Llama, full and LoRA,
on meshes with a tensor axis matching one device after 3 updates."""

import json
import pathlib
import subprocess
import sys

import pytest
from jax.sharding import PartitionSpec as P

from jaxstep.core import layout
from jaxstep.errors import ConfigError

HELPERS = pathlib.Path(__file__).resolve().parent / "helpers"


def test_each_bundled_projection_has_its_megatron_split():
  names = layout.logical_names
  assert names("['blocks'][0]['qkv']['kernel']", 2) == ("embed", "heads")  # column-parallel
  assert names("['blocks'][0]['proj']['kernel']", 2) == ("heads", "embed")  # row-parallel
  assert names("['blocks'][0]['down_proj']['kernel']", 2) == ("mlp", "embed")
  assert names("['blocks'][0]['k_proj']['kernel']", 2) == ("embed", "kv_heads")
  assert names("['embed_tokens']['embedding']", 2) == ("vocab", "embed")
  assert names("['lm_head']['kernel']", 2) == ("embed", "vocab")
  assert names("['norm']['scale']", 1) == (None,)


def test_an_adapter_follows_its_projection_and_a_stacked_layer_axis_comes_first():
  names = layout.logical_names
  assert names("['blocks']['q_proj']['lora']['lora_a']", 2) == ("embed", None)
  assert names("['blocks']['q_proj']['lora']['lora_b']", 2) == (None, "heads")
  assert names("['blocks']['o_proj']['lora']['lora_a']", 2) == ("heads", None)
  assert names("['blocks']['q_proj']['kernel']", 3) == (None, "embed", "heads")  # scanned
  assert names(".opt_state[1].mu['blocks'][0]['fc']['kernel']", 2) == ("embed", "mlp")


def test_tensor_takes_the_named_dimension_and_fsdp_the_largest_other():
  spec = layout.leaf_spec
  assert spec((32, 96), 2, ("embed", "heads"), 4) == P("fsdp", "tensor")
  assert spec((96, 32), 2, ("heads", "embed"), 4) == P("tensor", "fsdp")
  assert spec((32, 6), 1, ("embed", "kv_heads"), 4) == P()  # 6 kv units over 4: whole
  assert spec((32, 96), 2, ("embed", "heads"), 1) == P(None, "fsdp")  # no tensor axis
  assert spec((32, 96), 2, None, 4) == P(None, "fsdp")  # unnamed: fsdp only


def test_a_model_of_your_own_joins_by_naming_its_dimensions(monkeypatch):
  monkeypatch.setattr(layout, "AXIS_NAMES", list(layout.AXIS_NAMES))
  layout.name_axes(r"\['mlp'\]\['w_in'\]", ("embed", "mlp"))
  assert layout.logical_names("['mlp']['w_in']", 2) == ("embed", "mlp")


def test_a_tensor_size_that_does_not_divide_the_devices_is_one_line():
  from jaxstep import parallel

  with pytest.raises(ConfigError, match=r"mesh.tensor=3 does not divide the 1 device\(s\)"):
    parallel.make_mesh(1, 1, tensor=3)


@pytest.fixture(scope="module")
def equivalence():
  from test_sharding import devices_env

  proc = subprocess.run(
    [sys.executable, str(HELPERS / "tensor_equivalence.py")],
    env=devices_env(8),
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  return [json.loads(line) for line in proc.stdout.splitlines()]


@pytest.mark.slow
def test_tensor_meshes_match_one_device(equivalence):
  """(data, fsdp, tensor) ∈ {(1,1,8), (2,1,4), (1,2,4), (2,2,2)}, K ∈ {1, 4} (LoRA: K 4)."""
  assert len(equivalence) == 2 * (8 + 4)
  for r in equivalence:
    assert r["tokens"] == r["ref_tokens"]  # N summed over every axis, counted once
    assert r["sgd_max_leaf_rel_err"] <= 1e-5, r
    if not (r["lora"] and r["model"] == "gpt"):
      # GPT + LoRA under AdamW: noise-level adapter gradients that Adam scales to ±lr
      # steps; the same on a data-only mesh, so it is not the tensor split's
      assert r["loss_rel_err"] <= 1e-5, r
      assert r["adamw_max_leaf_rel_err"] <= 1e-5, r
      assert r["grad_norm_rel_err"] <= 1e-5, r


@pytest.mark.slow
def test_the_layers_are_split_the_megatron_way(equivalence):
  specs = {(r["model"], tuple(r["mesh"]), r["lora"]): r["specs"] for r in equivalence}
  gpt = specs[("gpt", (1, 2, 4), False)]
  assert gpt["['blocks'][0]['qkv']['kernel']"] == ["fsdp", "tensor"]
  assert gpt["['blocks'][0]['proj']['kernel']"] == ["tensor", "fsdp"]
  assert gpt["['blocks'][0]['fc']['kernel']"] == ["fsdp", "tensor"]
  assert gpt["['embed']['embedding']"] == ["tensor", "fsdp"]  # vocab-parallel
  llama = specs[("llama", (2, 2, 2), True)]
  assert llama["['blocks'][0]['k_proj']['kernel']"] == ["fsdp", "tensor"]
  assert llama["['blocks'][0]['q_proj']['lora']['lora_b']"][-1] == "tensor"
  assert llama["['blocks'][0]['o_proj']['lora']['lora_a']"][0] == "tensor"
