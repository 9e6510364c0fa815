"""LoRA on the routed experts: one low-rank adapter per expert on the fused gate|up and on
down, computed on the expert-sorted rows, equal to every expert run with its weights plus
``(α/r)·A_e·B_e`` folded in by hand; ``lora.merged`` folds them for an export; the adapters
split over the expert axis with their experts; the settings' errors."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_moe import TINY, every_expert

from jaxstep import models
from jaxstep.core import layout
from jaxstep.core.trees import path_name
from jaxstep.errors import ConfigError
from jaxstep.models import lora, moe
from jaxstep.models.llama import LlamaConfig
from jaxstep.trainer.plan import numbers

ROUTED = lora.LoraConfig(rank=3, alpha=6.0, targets=("q_proj", *lora.ROUTED))


def _with_random_b(tree, seed=5):
  """``tree`` with every adapter's ``B`` random (at init it is zero: the base model)."""
  key = jax.random.key(seed)

  def fill(path, x):
    if not path_name(path).endswith("lora_b"):
      return x
    return 0.3 * jax.random.normal(jax.random.fold_in(key, len(path_name(path)) + x.size), x.shape)

  return jax.tree_util.tree_map_with_path(fill, tree)


def _folded(ex, scale):
  """The experts' weights with the adapters folded in by hand, expert by expert."""
  gu = ex.gate_up.lora
  f = ex.gate_proj.shape[-1]
  delta = jnp.stack([gu.lora_a[e] @ gu.lora_b[e] for e in range(ex.gate_proj.shape[0])])
  down = jnp.stack([ex.down.lora.lora_a[e] @ ex.down.lora.lora_b[e] for e in range(delta.shape[0])])
  return (
    ex.gate_proj[...] + scale * delta[..., :f],
    ex.up_proj[...] + scale * delta[..., f:],
    ex.down_proj[...] + scale * down,
  )


def _oracle(layer, x):
  """``every_expert`` with each expert's weights ``W_e + (α/r)·A_e·B_e``."""
  gate, up, down = _folded(layer.experts, ROUTED.scale)
  plain = nnx.clone(layer)
  plain.experts.gate_proj[...], plain.experts.up_proj[...] = gate, up
  plain.experts.down_proj[...] = down
  return every_expert(plain, x)


@pytest.mark.parametrize("impl", ["tiles", "ragged"])
def test_expert_adapters_equal_each_expert_with_its_update_folded_in(impl):
  cfg = LlamaConfig(**TINY, moe_matmul=impl, lora=ROUTED)
  linear = functools.partial(nnx.Linear, use_bias=False, rngs=nnx.Rngs(1))
  layer = moe.MoeMLP(cfg, lambda name, i, o: linear(i, o), rngs=nnx.Rngs(2))
  for adapter in (layer.experts.gate_up, layer.experts.down):
    a, b = adapter.lora.lora_a, adapter.lora.lora_b
    a[...] = jax.random.normal(jax.random.key(a.shape[1]), a.shape) * 0.3
    b[...] = jax.random.normal(jax.random.key(b.shape[2]), b.shape) * 0.3
  x = jax.random.normal(jax.random.key(3), (3, 11, 16))
  cot = jax.random.normal(jax.random.key(4), x.shape)

  @nnx.jit
  def values_and_grads(layer, x):
    out = []
    for fn in (lambda m, x: m(x)[0], _oracle):
      loss = lambda m, x, fn=fn: jnp.sum(fn(m, x) * cot)  # noqa: E731
      out.append((fn(layer, x), nnx.grad(loss)(layer, x)))
    return out

  (y, g), (y_ref, g_ref) = values_and_grads(layer, x)
  np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=1e-5)
  assert float(jnp.max(jnp.abs(y - every_expert(layer, x)))) > 1e-2  # the adapters count
  for adapter in ("gate_up", "down"):
    for leaf in ("lora_a", "lora_b"):
      ours, ref = (getattr(getattr(t.experts, adapter).lora, leaf) for t in (g, g_ref))
      np.testing.assert_allclose(ours[...], ref[...], atol=2e-5, rtol=2e-5)
      assert float(jnp.max(jnp.abs(ours[...]))) > 0


@pytest.mark.parametrize("scan", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_merged_folds_the_expert_adapters_into_a_model_without_them(scan):
  cfg = LlamaConfig(**TINY, scan_layers=scan, lora=ROUTED)
  apply_fn, params = models.build(cfg, 0)
  params = _with_random_b(params)
  plain_fn, _ = models.build(dataclasses.replace(cfg, lora=lora.LoraConfig()), 0)
  inputs = jnp.arange(24, dtype=jnp.int32).reshape(2, 12) % 40
  merged = lora.merged(params, ROUTED.scale)
  assert not lora.has_adapters(merged)
  ours, folded = jax.jit(apply_fn)(params, inputs), jax.jit(plain_fn)(merged, inputs)
  np.testing.assert_allclose(ours, folded, atol=2e-5, rtol=2e-5)
  off = jax.jit(apply_fn)(lora.adapters_off(params), inputs)
  np.testing.assert_allclose(
    off, jax.jit(plain_fn)(lora.merged(lora.adapters_off(params), 1.0), inputs), atol=1e-6
  )
  assert float(jnp.max(jnp.abs(ours - off))) > 1e-3


def test_the_adapters_split_over_the_expert_axis_and_are_counted():
  cfg = LlamaConfig(**TINY, lora=ROUTED)
  _, params = models.build(cfg, 0)
  leaves = {path_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
  r, e, d, f = 3, 4, 16, 12
  gate_up, down = "blocks/0/mlp/experts/gate_up/lora/", "blocks/0/mlp/experts/down/lora/"
  assert leaves[gate_up + "lora_a"].shape == (e, d, r)
  assert leaves[gate_up + "lora_b"].shape == (e, r, 2 * f)
  assert leaves[down + "lora_a"].shape == (e, f, r) and leaves[down + "lora_b"].shape == (e, r, d)
  assert not np.any(leaves[gate_up + "lora_b"]) and np.any(leaves[gate_up + "lora_a"])
  adapters = sum(x.size for n, x in leaves.items() if re.search(lora.ADAPTER, n))
  assert numbers._adapter_params(cfg) == adapters
  spell = "['blocks'][0]['mlp']['experts']['{}']['lora']['{}']"
  assert layout.logical_names(spell.format("gate_up", "lora_a"), 3) == ("experts", "embed", None)
  assert layout.logical_names(spell.format("down", "lora_b"), 3) == ("experts", None, "embed")
  names = layout.logical_names(spell.format("gate_up", "lora_b"), 3)
  assert tuple(layout.leaf_spec((e, r, 2 * f), 1, names, 1, 2)) == ("expert", None, None)


def test_expert_targets_are_checked_with_one_line():
  with pytest.raises(ConfigError, match="'experts.down_proj' is not a projection of this model"):
    LlamaConfig(**{**TINY, "num_experts": 0}, lora=lora.LoraConfig(rank=2, targets=lora.ROUTED))
  with pytest.raises(ConfigError, match="model.lora.dropout must be 0 with routed experts"):
    LlamaConfig(**TINY, lora=lora.LoraConfig(rank=2, dropout=0.1, targets=lora.ROUTED[:1]))
  every = LlamaConfig(**TINY, lora=lora.LoraConfig(rank=2))  # no targets: not the experts
  assert not any(every.lora.adapts(name) for name in lora.ROUTED)
  assert every.lora.adapts("gate_proj")


def test_a_dense_models_adapter_has_no_routed_tensors_or_target_parameters():
  from jaxstep.models import peft_export

  for cfg in (
    models.GPTConfig(vocab_size=40, max_seq_len=16, d_model=16, n_layers=1, n_heads=2),
    LlamaConfig(**{**TINY, "num_experts": 0}),
  ):
    cfg = dataclasses.replace(cfg, lora=lora.LoraConfig(rank=2))
    _, params = models.build(cfg, 0)
    names = [t.name for t in peft_export.adapter_tensors(cfg, params)]
    assert names and not any("experts" in n for n in names)
    assert "target_parameters" not in peft_export.adapter_config(cfg)
  routed = LlamaConfig(**TINY, lora=ROUTED)
  _, params = models.build(routed, 0)
  names = [t.name for t in peft_export.adapter_tensors(routed, params)]
  assert "base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight" in names
  assert peft_export.adapter_config(routed)["target_parameters"] == [
    "mlp.experts.gate_up_proj",
    "mlp.experts.down_proj",
  ]
