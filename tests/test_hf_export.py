"""Hugging Face model folders out: tiny random models saved by transformers are imported,
exported by jaxstep and loaded back by transformers, which must compute the same logits;
the export reads back into the same params bit for bit (nothing is downloaded)."""

import dataclasses
import errno
import json
import os
import pathlib
import shutil
import subprocess

import jax
import numpy as np
import pytest

from jaxstep.errors import ConfigError, RunIOError
from jaxstep.models import export_folder, hf_config, hf_export, hf_weights, layers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_hf_import import FAMILIES, SHAPE, save_tiny, torch_logits  # noqa: E402

MARKER = export_folder.MARKER
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


def _earlier_export(folder, src):
  export(src, folder, max_shard_bytes=20_000)  # shards: the next export writes one file


def _with_a_note(folder, src):
  _earlier_export(folder, src)
  (folder / "notes.txt").write_text("mine")


def _damaged_marker(folder, src):
  _earlier_export(folder, src)
  (folder / MARKER).write_text("{")


TARGETS = {  # kind of target → (how it is made, whether an export may write it)
  "absent": (lambda folder, src: None, True),
  "empty": (lambda folder, src: folder.mkdir(), True),
  "an earlier export": (_earlier_export, True),
  "an earlier export with a file added": (_with_a_note, False),
  "an earlier export with a damaged marker": (_damaged_marker, False),
  "a model folder jaxstep did not write": (lambda folder, src: save_tiny(folder, "llama"), False),
  "a folder of other files": (lambda folder, src: (folder.mkdir(), (folder / "a").touch()), False),
  "a file": (lambda folder, src: folder.write_text("x"), False),
}


@pytest.mark.parametrize("kind", list(TARGETS))
def test_an_export_replaces_only_a_folder_jaxstep_wrote(tmp_path, kind):
  save_tiny(tmp_path / "src", "llama")
  out = tmp_path / "out"
  make, allowed = TARGETS[kind]
  make(out, tmp_path / "src")
  before = _snapshot(out)
  if allowed:
    export(tmp_path / "src", out, provenance={"run": "r", "step": 3})
    marker = json.loads((out / MARKER).read_text())
    assert marker["files"] == sorted(p.name for p in out.iterdir() if p.name != MARKER)
    assert marker["step"] == 3 and marker["kind"] == "model"
    assert sorted(marker["files"]) == ["config.json", "model.safetensors"]  # old shards gone
  else:
    with pytest.raises(ConfigError, match=f"{out}.*nothing was written"):
      export(tmp_path / "src", out)
    assert _snapshot(out) == before
  assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"][: 1 + out.exists()]


def _snapshot(path):
  if path.is_file():
    return path.read_bytes()
  if not path.exists():
    return None
  return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_a_protected_folder_is_never_replaced_even_if_jaxstep_wrote_it(tmp_path):
  save_tiny(tmp_path / "src", "llama")
  base = export(tmp_path / "src", tmp_path / "base")
  before = _snapshot(base)
  with pytest.raises(ConfigError, match="is the run's base model .* nothing was written"):
    export(tmp_path / "src", tmp_path / "base", protected={base: "the run's base model (x)"})
  assert _snapshot(base) == before


def test_the_tokenizer_files_arrive_with_the_weights_in_one_rename(tmp_path, monkeypatch):
  """Every file is in the staging folder before the one rename that publishes it."""
  save_tiny(tmp_path / "src", "llama")
  (tmp_path / "tokenizer.json").write_text("{}")
  renamed = []
  real_rename = os.rename

  def rename(a, b):
    renamed.append(sorted(p.name for p in pathlib.Path(a).iterdir()))
    real_rename(a, b)

  monkeypatch.setattr(os, "rename", rename)
  export(tmp_path / "src", tmp_path / "out", extra_files=[tmp_path / "tokenizer.json"])
  names = ["config.json", MARKER, "model.safetensors", "tokenizer.json"]
  assert renamed == [sorted(names)]


def test_the_staging_folders_of_a_killed_export_are_removed_by_the_next(tmp_path):
  save_tiny(tmp_path / "src", "llama")
  gone = tmp_path / f".out{export_folder.PARTIAL}999999999-abc"  # past any pid_max
  alive = tmp_path / f".out{export_folder.PARTIAL}{os.getppid()}-abc"  # a running process
  for leftover in (gone, alive, gone.with_name(gone.name + ".old")):
    leftover.mkdir()
    (leftover / "model.safetensors").write_text("cut")
  export(tmp_path / "src", tmp_path / "out")
  assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", "src", alive.name])


def test_a_failure_midway_leaves_no_folder(tmp_path, monkeypatch):
  save_tiny(tmp_path / "src", "llama")
  calls = []

  def failing(tensor, dtype):
    calls.append(tensor.name)
    if len(calls) > 3:
      raise OSError("disk full")
    return np.zeros(tensor.shape, dtype)

  monkeypatch.setattr(hf_export, "host", failing)
  with pytest.raises(OSError, match="disk full"):
    export(tmp_path / "src", tmp_path / "out", max_shard_bytes=20_000)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_midway_is_exit_74s_error_with_nothing_left(tmp_path, monkeypatch, code):
  save_tiny(tmp_path / "src", "llama")

  def full(tensor, dtype):
    raise OSError(code, os.strerror(code))

  monkeypatch.setattr(hf_export, "host", full)
  with pytest.raises(RunIOError, match=f"writing {tmp_path / 'out'} failed .*nothing was left"):
    export(tmp_path / "src", tmp_path / "out")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_read_only_filesystem_is_exit_74s_error(tmp_path, tmpfs):
  save_tiny(tmp_path / "src", "llama")
  point = tmpfs("1M")
  tmpfs.read_only(point)
  with pytest.raises(RunIOError, match="Read-only file system"):
    export(tmp_path / "src", point / "out")
  assert not any(point.iterdir())


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


KILLED_EXPORT = """
import os, pathlib, shutil, signal, sys
import safetensors.numpy
from jaxstep.models import hf_config, hf_export, hf_weights

src, out, tokenizer, at = sys.argv[1:5]
calls = [0]

def counted(fn):  # SIGKILL at the at-th file written, copied or renamed
  def wrapper(*args, **kwargs):
    calls[0] += 1
    if calls[0] == int(at):
      os.kill(os.getpid(), signal.SIGKILL)
    return fn(*args, **kwargs)
  return wrapper

safetensors.numpy.save_file = counted(safetensors.numpy.save_file)
pathlib.Path.write_text = counted(pathlib.Path.write_text)
shutil.copy2, os.rename = counted(shutil.copy2), counted(os.rename)
hf = hf_config.read_config(src)
cfg = hf_config.model_config(hf, attention="xla")
hf_export.save_pretrained(
  out, cfg, hf_weights.read_params(src, cfg), architecture=hf["architectures"][0],
  base_config=hf, max_shard_bytes=20_000, extra_files=[tokenizer], provenance={"step": int(at)},
)
"""


def _whole_or_absent(out, steps):
  """``out`` is absent, or a complete export of one of ``steps`` that transformers loads."""
  if not out.exists():
    return
  marker = json.loads((out / MARKER).read_text())
  assert marker["step"] in steps
  assert sorted(p.name for p in out.iterdir()) == sorted([*marker["files"], MARKER])
  assert "tokenizer.json" in marker["files"] and "model.safetensors.index.json" in marker["files"]
  loaded(out)


@pytest.mark.slow
def test_an_export_killed_at_any_file_leaves_the_target_whole_or_absent(tmp_path):
  """SIGKILL at each file an export writes, copies or renames, first into a new folder and
  then over an earlier export: the target is absent, the earlier export or the new one,
  never a mix; the next export removes what the killed one left and completes."""
  import sys

  save_tiny(tmp_path / "src", "llama")
  (tmp_path / "tokenizer.json").write_text("{}")
  out = tmp_path / "out"

  def run(at):
    args = [tmp_path / "src", out, tmp_path / "tokenizer.json", at]
    return subprocess.run(
      [sys.executable, "-c", KILLED_EXPORT, *map(str, args)], capture_output=True, text=True
    )

  for earlier in (None, 0):
    at = 1
    while (proc := run(at)).returncode != 0:
      assert proc.returncode == -9, proc.stderr[-2000:]
      _whole_or_absent(out, {earlier, at} - {None})
      at += 1
    _whole_or_absent(out, {at})
    assert at > 5  # killed at every shard, the index, the config, the copy and the renames
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src", "tokenizer.json"]
    shutil.rmtree(out)
    assert run(0).returncode == 0  # the earlier export of the second round
    _whole_or_absent(out, {0})
