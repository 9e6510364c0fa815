"""Hugging Face model folders out: tiny random models saved by transformers are imported,
exported by jaxstep and loaded back by transformers, which must compute the same logits;
the export reads back into the same params bit for bit (nothing is downloaded)."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from jaxstep.errors import ConfigError
from jaxstep.models import hf_config, hf_export, hf_weights, layers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_hf_import import FAMILIES, SHAPE, save_tiny, torch_logits  # noqa: E402

IDS = np.random.default_rng(0).integers(0, SHAPE["vocab_size"], size=(2, 12))


def imported(folder):
  """``(hf config dict, LlamaConfig, per-block numpy params)`` of a folder."""
  hf = hf_config.read_config(folder)
  cfg = hf_config.model_config(hf, attention="xla")
  return hf, cfg, hf_weights.read_params(folder, cfg)


def export(src, out, *, base=True, **options):
  hf, cfg, params = imported(src)
  return hf_export.save_pretrained(
    out,
    cfg,
    params,
    architecture=hf["architectures"][0],
    base_config=hf if base else None,
    **options,
  )


def loaded(folder):
  """The folder loaded by transformers, after checking every tensor matched a parameter."""
  model, info = transformers.AutoModelForCausalLM.from_pretrained(
    folder, attn_implementation="eager", output_loading_info=True
  )
  assert not info["missing_keys"] and not info["unexpected_keys"], info
  return model.eval()


def tensor_shapes(folder) -> dict:
  from safetensors import safe_open

  shapes = {}
  for name, file in hf_weights.weight_files(folder).items():
    with safe_open(str(file), framework="np") as f:
      shapes[name] = tuple(f.get_slice(name).get_shape())
  return shapes


def assert_same_params(a, b):
  flat_a, flat_b = (dict(jax.tree_util.tree_flatten_with_path(t)[0]) for t in (a, b))
  assert flat_a.keys() == flat_b.keys()
  for path, leaf in flat_a.items():
    assert leaf.dtype == flat_b[path].dtype and np.array_equal(leaf, flat_b[path]), path


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_an_export_loads_in_transformers_with_the_same_logits(tmp_path, family):
  model = save_tiny(tmp_path / "src", family)
  export(tmp_path / "src", tmp_path / "out")
  want = torch_logits(model, IDS)
  np.testing.assert_allclose(torch_logits(loaded(tmp_path / "out"), IDS), want, atol=1e-5)
  assert tensor_shapes(tmp_path / "out") == tensor_shapes(tmp_path / "src")
  assert_same_params(imported(tmp_path / "out")[2], imported(tmp_path / "src")[2])


@pytest.mark.parametrize("family", ["llama3-scaled", "qwen3", "qwen2", "mistral"])
def test_a_config_built_from_scratch_loads_the_same_model(tmp_path, family):
  model = save_tiny(tmp_path / "src", family)
  export(tmp_path / "src", tmp_path / "out", base=False)
  hf = hf_config.read_config(tmp_path / "out")
  assert hf["rope_theta"] == hf["rope_parameters"]["rope_theta"]
  original = hf_config.read_config(tmp_path / "src")
  assert hf_config.model_config(hf) == hf_config.model_config(original)
  np.testing.assert_allclose(
    torch_logits(loaded(tmp_path / "out"), IDS), torch_logits(model, IDS), atol=1e-5
  )


def test_the_older_rope_layout_alone_loads_in_transformers(tmp_path):
  """``rope_theta`` + ``rope_scaling`` at the top level only, as transformers 4 reads them."""
  model = save_tiny(tmp_path / "src", "llama3-scaled")
  export(tmp_path / "src", tmp_path / "out", base=False)
  hf = hf_config.read_config(tmp_path / "out")
  del hf["rope_parameters"]
  assert hf["rope_scaling"]["rope_type"] == "llama3"
  (tmp_path / "out" / "config.json").write_text(json.dumps(hf))
  np.testing.assert_allclose(
    torch_logits(loaded(tmp_path / "out"), IDS), torch_logits(model, IDS), atol=1e-5
  )


def test_the_base_configs_other_fields_survive(tmp_path):
  save_tiny(tmp_path / "src", "llama")
  hf, cfg, params = imported(tmp_path / "src")
  short = dataclasses.replace(cfg, max_seq_len=16)
  hf["rope_parameters"]["rope_theta"] = 1234.0  # jaxstep's own value wins
  out = hf_export.save_pretrained(
    tmp_path / "out", short, params, architecture="LlamaForCausalLM", base_config=hf
  )
  written = hf_config.read_config(out)
  assert (written["bos_token_id"], written["eos_token_id"], written["dtype"]) == (1, 2, "float32")
  assert written["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default"}
  assert written["max_position_embeddings"] == SHAPE["max_position_embeddings"]
  assert hf["rope_parameters"]["rope_theta"] == 1234.0  # the caller's dict is not changed


def test_a_sharded_export_has_a_complete_index_and_loads(tmp_path):
  model = save_tiny(tmp_path / "src", "qwen2")
  out = export(tmp_path / "src", tmp_path / "out", max_shard_bytes=20_000)
  index = json.loads((out / hf_weights.INDEX).read_text())
  files = sorted(out.glob("model-*.safetensors"))
  assert len(files) > 2 and not (out / hf_weights.SINGLE).exists()
  assert set(index["weight_map"].values()) == {f.name for f in files}
  assert index["weight_map"].keys() == tensor_shapes(tmp_path / "src").keys()
  assert index["metadata"]["total_size"] == sum(f.stat().st_size for f in files) - sum(
    _header_bytes(f) for f in files
  )
  np.testing.assert_allclose(torch_logits(loaded(out), IDS), torch_logits(model, IDS), atol=1e-5)


def _header_bytes(file) -> int:
  """Bytes of a safetensors file before its tensor data (length field + JSON header)."""
  with open(file, "rb") as f:
    return 8 + int.from_bytes(f.read(8), "little")


def test_shards_are_split_as_huggingface_hub_splits_them():
  hub = pytest.importorskip("huggingface_hub.serialization._base")
  sizes = [("a", 6), ("b", 6), ("c", 2), ("d", 11), ("e", 6), ("f", 2), ("g", 2)]
  split = hub.split_state_dict_into_shards_factory(
    dict(sizes), get_storage_size=lambda n: n, filename_pattern="m{suffix}", max_shard_size=10
  )
  want = sorted(sorted(names) for names in split.filename_to_tensors.values())
  assert sorted(hf_export.plan_shards(sizes, 10)) == want


def test_a_scanned_params_tree_exports_the_same_files(tmp_path):
  save_tiny(tmp_path / "src", "qwen3")
  hf, cfg, params = imported(tmp_path / "src")
  stacked = layers.convert_layout(params, scan_layers=True)
  assert layers.layout_of(stacked)
  for name, tree in (("blocks", params), ("scanned", stacked)):
    hf_export.save_pretrained(
      tmp_path / name, cfg, tree, architecture="Qwen3ForCausalLM", max_shard_bytes=30_000
    )
  for file in sorted((tmp_path / "blocks").iterdir()):
    assert file.read_bytes() == (tmp_path / "scanned" / file.name).read_bytes(), file.name


def test_a_bf16_export_holds_the_rounded_weights_and_loads(tmp_path):
  from safetensors.torch import load_file

  model = save_tiny(tmp_path / "src", "llama")
  out = export(tmp_path / "src", tmp_path / "out", dtype="bfloat16")
  assert hf_config.read_config(out)["dtype"] == "bfloat16"
  written = load_file(out / hf_weights.SINGLE)
  for name, tensor in model.state_dict().items():
    assert written[name].dtype == torch.bfloat16
    assert torch.equal(written[name], tensor.to(torch.bfloat16)), name
  want = torch_logits(model, IDS)
  got = torch_logits(loaded(out), IDS)
  np.testing.assert_allclose(got, want, atol=0.05 * np.abs(want).max())


def test_a_foreign_non_empty_folder_is_refused_and_untouched(tmp_path):
  save_tiny(tmp_path / "src", "llama")
  (tmp_path / "out").mkdir()
  (tmp_path / "out" / "notes.txt").write_text("mine")
  with pytest.raises(ConfigError, match="not empty and has no config.json"):
    export(tmp_path / "src", tmp_path / "out")
  assert [p.name for p in (tmp_path / "out").iterdir()] == ["notes.txt"]
  assert (tmp_path / "out" / "notes.txt").read_text() == "mine"
  assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


def test_an_export_over_a_model_folder_keeps_its_other_files(tmp_path):
  save_tiny(tmp_path / "src", "llama")
  out = export(tmp_path / "src", tmp_path / "out", max_shard_bytes=20_000)
  (out / "tokenizer.json").write_text("{}")
  export(tmp_path / "src", out)
  names = sorted(p.name for p in out.iterdir())
  assert names == ["config.json", "model.safetensors", "tokenizer.json"]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


def test_a_failure_midway_leaves_no_folder(tmp_path, monkeypatch):
  save_tiny(tmp_path / "src", "llama")
  calls = []

  def failing(tensor, dtype):
    calls.append(tensor.name)
    if len(calls) > 3:
      raise OSError("disk full")
    return np.zeros(tensor.shape, dtype)

  monkeypatch.setattr(hf_export, "_host", failing)
  with pytest.raises(OSError, match="disk full"):
    export(tmp_path / "src", tmp_path / "out", max_shard_bytes=20_000)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_mismatched_architecture_or_params_tree_is_refused(tmp_path):
  save_tiny(tmp_path / "src", "qwen2")
  hf, cfg, params = imported(tmp_path / "src")
  with pytest.raises(ConfigError, match="LlamaForCausalLM has attention_bias=False"):
    hf_export.save_pretrained(tmp_path / "out", cfg, params, architecture="LlamaForCausalLM")
  params["blocks"][1]["k_proj"]["kernel"] = params["blocks"][1]["k_proj"]["kernel"][:, :-1]
  with pytest.raises(ConfigError, match=r"\['k_proj'\]\['kernel'\] has shape \(32, 15\)"):
    hf_export.save_pretrained(tmp_path / "out", cfg, params, architecture="Qwen2ForCausalLM")
  params["extra"] = np.zeros(3)
  with pytest.raises(ConfigError, match=r"1 leaves the config has no tensor for: \['extra'\]"):
    hf_export.save_pretrained(tmp_path / "out", cfg, params, architecture="Qwen2ForCausalLM")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
