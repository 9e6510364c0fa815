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

from jaxstep import models, trainer
from jaxstep.cli import run as run_command
from jaxstep.data.byte_folder import write_byte_tokenizer
from jaxstep.data.tokenizer import ByteTokenizer
from jaxstep.errors import ConfigError, RunIOError
from jaxstep.models import (
  GPTConfig,
  export_folder,
  hf_config,
  hf_export,
  hf_weights,
  layers,
  safetensors_out,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import make_cfg  # noqa: E402
from test_hf_import import FAMILIES, SHAPE, TERMS, save_tiny, torch_logits  # noqa: E402
from tolerance import assert_close  # noqa: E402

MARKER = export_folder.MARKER
GENERATION = hf_export.GENERATION
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


@pytest.mark.parametrize(
  "family",  # Mistral's window is written as Phi-3's, Qwen2's layer types as SmolLM3's
  [
    f if f != "mistral-window" else pytest.param(f, marks=pytest.mark.slow)
    for f in sorted(FAMILIES)
  ],
)
def test_an_export_loads_in_transformers_with_the_same_logits(tmp_path, family):
  model = save_tiny(tmp_path / "src", family)
  export(tmp_path / "src", tmp_path / "out")
  want = torch_logits(model, IDS)
  assert_close(torch_logits(loaded(tmp_path / "out"), IDS), want, terms=TERMS)
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
  assert_close(torch_logits(loaded(tmp_path / "out"), IDS), torch_logits(model, IDS), terms=TERMS)


def test_the_older_rope_layout_alone_loads_in_transformers(tmp_path):
  """``rope_theta`` + ``rope_scaling`` at the top level only, as transformers 4 reads them."""
  model = save_tiny(tmp_path / "src", "llama3-scaled")
  export(tmp_path / "src", tmp_path / "out", base=False)
  hf = hf_config.read_config(tmp_path / "out")
  del hf["rope_parameters"]
  assert hf["rope_scaling"]["rope_type"] == "llama3"
  (tmp_path / "out" / "config.json").write_text(json.dumps(hf))
  assert_close(torch_logits(loaded(tmp_path / "out"), IDS), torch_logits(model, IDS), terms=TERMS)


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
  assert_close(torch_logits(loaded(out), IDS), torch_logits(model, IDS), terms=TERMS)


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
  assert sorted(safetensors_out.plan_shards(sizes, 10)) == want


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
    assert marker["files"] == ["config.json", GENERATION, "model.safetensors"]  # shards gone
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
  names = ["config.json", GENERATION, MARKER, "model.safetensors", "tokenizer.json"]
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

  monkeypatch.setattr(safetensors_out, "host", failing)
  with pytest.raises(OSError, match="disk full"):
    export(tmp_path / "src", tmp_path / "out", max_shard_bytes=20_000)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_midway_is_exit_74s_error_with_nothing_left(tmp_path, monkeypatch, code):
  save_tiny(tmp_path / "src", "llama")

  def full(tensor, dtype):
    raise OSError(code, os.strerror(code))

  monkeypatch.setattr(safetensors_out, "host", full)
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


def test_a_weights_file_that_fills_the_disk_is_exit_74s_error_with_nothing_left(tmp_path, tmpfs):
  """The safetensors write itself meets the full disk (the first file written, larger than
  the filesystem): the export's exit-74 error, not the safetensors library's own."""
  save_tiny(tmp_path / "src", "llama")
  point = tmpfs("64k")
  assert (tmp_path / "src" / hf_weights.SINGLE).stat().st_size > 64 * 1024
  with pytest.raises(RunIOError, match=f"writing {point / 'out'} failed .No space left on device"):
    export(tmp_path / "src", point / "out")
  assert not any(point.iterdir())


def generated(folder, prompt: list[int], likeliest: int) -> list[int]:
  """The ids transformers' plain greedy ``generate`` adds to ``prompt`` (6 at most), with
  ``likeliest`` made the likeliest next token at every step (``sequence_bias``): the first
  new id, and the only one if ``generate`` stops there."""
  model = loaded(folder)
  bias = {(likeliest,): 100.0}
  out = model.generate(torch.tensor([prompt]), max_new_tokens=6, sequence_bias=bias)
  return out[0].tolist()[len(prompt) :]


def assert_no_dropout(folder, ids) -> None:
  """Two forward passes in train mode give the same logits: the config leaves no dropout
  rate to its class's default."""
  model = loaded(folder).train()
  with torch.no_grad():
    torch.manual_seed(0)
    first = model(torch.tensor(ids)).logits
    torch.manual_seed(1)
    assert torch.equal(model(torch.tensor(ids)).logits, first)


def test_a_gpt_export_names_the_ids_it_trained_with_and_no_dropout(tmp_path, capfd):
  """The bundled GPT on bytes (vocabulary 264), as ``jaxstep export`` writes it: both
  configs carry the byte tokenizer's ids, so transformers finds no id outside the vocabulary
  (GPT-2's default is 50256) and a plain ``generate()`` stops at EOS, and GPT-2's dropout
  rates are the model's (0, where GPT-2's default is 0.1)."""
  cfg = GPTConfig(vocab_size=264, d_model=32, n_layers=1, n_heads=2, max_seq_len=16)
  _, shapes = models.build(cfg, 0, abstract=True)  # random weights, drawn without compiling
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda s: rng.normal(0, 0.2, s.shape).astype(np.float32), shapes)
  (tmp_path / "bytes").mkdir()
  out = hf_export.save_pretrained(
    tmp_path / "out",
    cfg,
    params,
    architecture="GPT2LMHeadModel",
    extra_files=write_byte_tokenizer(tmp_path / "bytes"),
    special_ids=hf_export.token_ids(ByteTokenizer()),
  )
  written = hf_config.read_config(out)
  ids = (257, 258, 256)  # BOS, EOS, PAD
  assert tuple(written[k] for k in hf_export.TOKEN_IDS) == ids
  generation = json.loads((out / GENERATION).read_text())
  assert tuple(generation[k] for k in hf_export.TOKEN_IDS) == ids
  for key in ("embd_pdrop", "resid_pdrop", "attn_pdrop", "summary_first_dropout"):
    assert written[key] == 0.0, key
  capfd.readouterr()
  assert generated(out, [257, *b"1 + 2"], likeliest=258) == [258]
  assert "50256" not in capfd.readouterr().err
  assert_no_dropout(out, IDS)


def test_gpt2s_dropout_rates_are_the_runs_where_the_gpt_drops_and_0_where_it_does_not():
  rates = hf_export.dropout_fields(GPTConfig(dropout=0.1), "GPT2LMHeadModel")
  assert rates == {
    "embd_pdrop": 0.1,  # the embeddings
    "resid_pdrop": 0.1,  # the attention's and the MLP's outputs
    "attn_pdrop": 0.0,  # the GPT never drops attention probabilities
    "summary_first_dropout": 0.1,
  }


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_folder_export_keeps_the_folders_ids_and_generation_config(tmp_path, family):
  """The source's ids are written back; its generation_config.json is copied as it is when
  it names every id, and gets the config's where it lacks them (or is built of them where
  the source has none); ``attention_dropout`` is 0 (jaxstep's attention drops nothing)
  even where the source said otherwise."""
  src = tmp_path / "src"
  save_tiny(src, family)
  hf = hf_config.read_config(src)
  hf.update(bos_token_id=3, eos_token_id=4, pad_token_id=5, attention_dropout=0.1)
  (src / "config.json").write_text(json.dumps(hf))
  settings = {"bos_token_id": 3, "eos_token_id": [4, 7], "pad_token_id": 5, "max_new_tokens": 9}
  (src / GENERATION).write_text(json.dumps(settings))
  out = export(src, tmp_path / "out", extra_files=[src / GENERATION])
  written = hf_config.read_config(out)
  assert tuple(written[k] for k in hf_export.TOKEN_IDS) == (3, 4, 5)
  assert written["attention_dropout"] == 0.0
  assert (out / GENERATION).read_bytes() == (src / GENERATION).read_bytes()
  assert generated(out, [3, 10, 11], likeliest=7) == [7]  # a stop id of the source's
  assert_no_dropout(out, IDS)

  partial = {"eos_token_id": [4, 7], "max_new_tokens": 9}  # no bos, no pad
  (src / GENERATION).write_text(json.dumps(partial))
  out = export(src, tmp_path / "partial", extra_files=[src / GENERATION])
  assert json.loads((out / GENERATION).read_text()) == settings

  (src / GENERATION).unlink()
  out = export(src, tmp_path / "alone")
  generation = json.loads((out / GENERATION).read_text())
  assert generation == {"bos_token_id": 3, "eos_token_id": 4, "pad_token_id": 5}
  assert generated(out, [3, 10, 11], likeliest=4) == [4]


def test_a_gpt2_folders_ids_outside_its_vocabulary_are_not_written_back(tmp_path, capfd):
  """A tiny GPT-2 saved from ``GPT2Config``'s defaults says 50256 for BOS and EOS (in both
  files) and 0.1 for each dropout rate, on 96 ids: its export writes the tokenizer's ids
  in their place (null where it has none) and the rates of the model jaxstep trains."""
  src = tmp_path / "src"
  save_tiny(src, "gpt2")
  assert hf_config.read_config(src)["eos_token_id"] == 50256
  ids = {"bos_token_id": None, "eos_token_id": 5, "pad_token_id": None}
  out = export(src, tmp_path / "out", extra_files=[src / GENERATION], special_ids=ids)
  written = hf_config.read_config(out)
  assert {k: written[k] for k in hf_export.TOKEN_IDS} == ids
  assert (written["resid_pdrop"], written["embd_pdrop"], written["attn_pdrop"]) == (0, 0, 0)
  generation = json.loads((out / GENERATION).read_text())
  assert (generation["bos_token_id"], generation["eos_token_id"]) == (None, 5)
  capfd.readouterr()
  loaded(out)
  assert "50256" not in capfd.readouterr().err


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
  """A bundled-GPT run trained one update on bytes (``jaxstep train``)."""
  tmp_path = tmp_path_factory.mktemp("gpt")
  trainer.train(make_cfg(tmp_path, "train.max_steps=1", "train.global_batch_size=8"))
  return tmp_path / "run"


@pytest.mark.slow
def test_jaxstep_export_of_a_gpt_run_names_its_ids_and_no_dropout(tmp_path, gpt_run, capfd):
  assert run_command("export", [str(gpt_run), "--out", str(tmp_path / "hf")]) == 0
  out = tmp_path / "hf"
  written = hf_config.read_config(out)
  assert {k: written[k] for k in hf_export.TOKEN_IDS} == {
    "bos_token_id": 257,
    "eos_token_id": 258,
    "pad_token_id": 256,
  }
  assert json.loads((out / GENERATION).read_text())["eos_token_id"] == 258
  capfd.readouterr()
  prompt = transformers.AutoTokenizer.from_pretrained(out)("1 + 2")["input_ids"]
  assert prompt[0] == 257 and generated(out, prompt, likeliest=258) == [258]
  assert "50256" not in capfd.readouterr().err
  assert_no_dropout(out, IDS)


@pytest.mark.slow
def test_jaxstep_export_onto_a_full_disk_is_one_line_exit_74(gpt_run, tmpfs, capsys):
  point = tmpfs("64k")
  capsys.readouterr()
  assert run_command("export", [str(gpt_run), "--out", str(point / "hf")]) == 74
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: writing") and "No space left" in err[0], err
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
  save_tiny(tmp_path / "olmo2", "olmo2")  # q/k norms as Qwen3 has, but placed and sized apart
  _, olmo2, olmo2_params = imported(tmp_path / "olmo2")
  for other, why in (("Qwen3ForCausalLM", "block_norms=pre"), ("OlmoeForCausalLM", "experts")):
    with pytest.raises(ConfigError, match=f"{other} .*{why}"):
      hf_export.save_pretrained(tmp_path / "out", olmo2, olmo2_params, architecture=other)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["olmo2", "src"]


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
