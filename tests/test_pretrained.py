"""``jaxstep.load_pretrained``: a whole local model folder (config, weights, tokenizer, chat
template) in one call, and ``Pretrained.save`` back out."""

import json
import shutil

import jax
import numpy as np
import pytest
from test_hf_folder import CHATML_TEMPLATE, MESSAGES, tokenizer_files  # noqa: F401 - fixture
from test_hf_import import SHAPE
from tolerance import assert_close, assert_far, planted

import jaxstep
from jaxstep import models
from jaxstep.data import hf_folder
from jaxstep.errors import ConfigError
from jaxstep.models import layers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# jaxstep against transformers on the folder's weights: the longest sum (the MLP's down
# projection) once per layer
FOLDER_TERMS = SHAPE["intermediate_size"] * SHAPE["num_hidden_layers"]


@pytest.fixture
def folder(tmp_path, tokenizer_files):  # noqa: F811 - the imported fixture
  """A tiny random Qwen3 with a ChatML-style tokenizer folder (vocabulary 320)."""
  cfg = transformers.Qwen3Config(**{**SHAPE, "vocab_size": 320, "head_dim": 8})
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
  with torch.no_grad():
    for p in model.parameters():
      p.copy_(torch.randn_like(p) * 0.2)
  model.eval().save_pretrained(tmp_path / "qwen")
  shutil.copy(tokenizer_files["plain"], tmp_path / "qwen" / "tokenizer.json")
  specials = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
  (tmp_path / "qwen" / "tokenizer_config.json").write_text(json.dumps(specials))
  (tmp_path / "qwen" / "chat_template.jinja").write_text(CHATML_TEMPLATE)
  return tmp_path / "qwen", model


def test_one_call_reads_the_model_its_tokenizer_and_its_template(folder):
  path, model = folder
  got = jaxstep.load_pretrained(path, attention="xla", max_seq_len=256)
  assert got.architecture == "Qwen3ForCausalLM" and got.config.qk_norm
  assert got.config.max_seq_len == 256  # an option the folder does not decide
  tok = got.tokenizer
  assert tok.stop_ids[0] == tok.EOS != tok.PAD and not tok.has_bos
  assert got.chat_template == CHATML_TEMPLATE
  text = hf_folder.render_chat(got.chat_template, MESSAGES, **tok.template_tokens)
  ids = np.asarray(tok.encode(text))[None]
  apply_fn, _ = models.build(got.config, 0, abstract=True)
  with torch.no_grad():
    expected = model(torch.tensor(ids)).logits.numpy()
  ours = np.asarray(jax.jit(apply_fn)(got.params, ids))
  assert_close(ours, expected, terms=FOLDER_TERMS)
  assert_far(planted(ours), expected, terms=FOLDER_TERMS)


def test_every_tensor_goes_through_place_and_scan_layers_stacks(folder):
  path, _ = folder
  placed = []

  def place(where, array):
    placed.append(where)
    return jax.device_put(array)

  flat = jaxstep.load_pretrained(path, place=place)
  assert len(placed) == len(jax.tree.leaves(flat.params))
  stacked = jaxstep.load_pretrained(path, scan_layers=True)
  assert stacked.config.scan_layers and not flat.config.scan_layers
  expected = jax.jit(layers.convert_layout, static_argnums=1)(flat.params, True)
  for a, b in zip(jax.tree.leaves(stacked.params), jax.tree.leaves(expected), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_save_writes_a_folder_that_reads_back_bitwise(folder, tmp_path):
  path, _ = folder
  got = jaxstep.load_pretrained(path)
  out = got.save(tmp_path / "out")
  params = models.hf_weights.read_params(out, got.config)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(got.params), strict=True):
    np.testing.assert_array_equal(a, b)
  saved = json.loads((out / "config.json").read_text())
  assert saved["architectures"] == ["Qwen3ForCausalLM"]
  assert saved["max_position_embeddings"] == SHAPE["max_position_embeddings"]
  again = jaxstep.load_pretrained(out)  # a whole folder: the tokenizer came along
  assert again.chat_template == got.chat_template
  files = [t.describe()["folder_files"] for t in (again.tokenizer, got.tokenizer)]
  for each in files:
    del each["generation_config.json"]  # given the ids it lacked: a test below
  assert files[0] == files[1]
  assert (again.tokenizer.EOS, again.tokenizer.PAD) == (got.tokenizer.EOS, got.tokenizer.PAD)
  assert again.tokenizer.stop_ids == got.tokenizer.stop_ids
  assert got.save(out) == out  # its own earlier save is replaced
  before = {p.name: p.read_bytes() for p in path.iterdir()}
  with pytest.raises(ConfigError, match="is the folder these weights were read from"):
    got.save(path)
  assert {p.name: p.read_bytes() for p in path.iterdir()} == before


def test_save_writes_the_ids_the_tokenizer_declares_where_the_config_names_none(folder, tmp_path):
  """The folder's config.json says null for every id and its generation config (as
  transformers wrote it) has none: the save writes the ids its tokenizer declares (EOS
  ``<|im_end|>``, PAD ``<|endoftext|>``, no BOS) into both, so a plain ``generate()``
  stops at the EOS the model learned."""
  from test_hf_export import generated

  from jaxstep.models import hf_export

  path, _ = folder
  assert json.loads((path / "config.json").read_text())["eos_token_id"] is None
  assert "eos_token_id" not in json.loads((path / "generation_config.json").read_text())
  got = jaxstep.load_pretrained(path)
  out = got.save(tmp_path / "out")
  want = {"bos_token_id": None, "eos_token_id": 6, "pad_token_id": 7}
  assert (got.tokenizer.EOS, got.tokenizer.PAD) == (6, 7)
  for name in ("config.json", "generation_config.json"):
    written = json.loads((out / name).read_text())
    assert {k: written.get(k) for k in hf_export.TOKEN_IDS} == want, name
  assert generated(out, [10, 11], likeliest=6) == [6]


def test_a_folder_that_is_not_a_model_is_one_clear_error(tmp_path):
  with pytest.raises(ConfigError, match="has no config.json"):
    jaxstep.load_pretrained(tmp_path)


@pytest.mark.slow
def test_the_python_block_of_docs_pretrained_runs_as_written(folder, tmp_path):
  """docs/pretrained.md's walkthrough on a tiny folder: chat, one exact update, export."""
  import pathlib
  import re
  import subprocess
  import sys

  doc = pathlib.Path(__file__).resolve().parent.parent / "docs" / "pretrained.md"
  (block,) = re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S)
  script = tmp_path / "walkthrough.py"
  header = f"MODEL = {str(folder[0])!r}\nEXPORT = {str(tmp_path / 'export')!r}\n"
  script.write_text(header + block)
  proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "loss " in proc.stdout and "'model.safetensors'" in proc.stdout
  assert "'tokenizer.json'" in proc.stdout and "'chat_template.jinja'" in proc.stdout


def test_a_folders_sliding_window_is_read_and_a_tensor_without_a_place_is_refused(folder):
  from safetensors.numpy import load_file, save_file

  path, _ = folder
  config = json.loads((path / "config.json").read_text())
  types = ["full_attention", "sliding_attention"]
  windowed = {**config, "sliding_window": 16, "use_sliding_window": True, "layer_types": types}
  (path / "config.json").write_text(json.dumps(windowed))
  loaded = jaxstep.load_pretrained(path).config
  assert (loaded.max_seq_len, loaded.windows) == (64, (0, 16))
  tensors = load_file(path / "model.safetensors")
  tensors["model.layers.0.self_attn.o_proj.bias"] = np.zeros(32, np.float32)
  save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(ConfigError, match="no place for, e.g. model.layers.0.self_attn.o_proj.bias"):
    jaxstep.load_pretrained(path, max_seq_len=16)


def test_lora_on_a_loaded_folder_adds_adapters_that_start_at_the_base(folder, tmp_path):
  """``load_pretrained(DIR, lora=LoraConfig(rank=4))``: the params hold fresh adapters
  (B = 0, so the logits are the folder's exactly), an update trains them alone, and
  ``save`` merges them into a plain folder that transformers reads."""
  import jax.numpy as jnp
  import optax

  from jaxstep.core import freeze
  from jaxstep.models import lora

  path, model = folder
  plain = jaxstep.load_pretrained(path)
  got = jaxstep.load_pretrained(path, lora=lora.LoraConfig(rank=4, alpha=8.0))
  ids = jnp.asarray(np.random.default_rng(0).integers(0, 320, size=(2, 12)))
  apply_fn, _ = models.build(got.config, 0, abstract=True)
  base_fn, _ = models.build(plain.config, 0, abstract=True)
  logits, base_logits = jax.jit(apply_fn), jax.jit(base_fn)
  np.testing.assert_array_equal(logits(got.params, ids), base_logits(plain.params, ids))
  names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(got.params)[0]]
  assert sum("lora" in n for n in names) == 2 * 7 * SHAPE["num_hidden_layers"]  # A, B × 7

  loss_fn = jaxstep.next_token_loss(apply_fn)
  step = jax.jit(
    jaxstep.make_train_step(
      loss_fn, optax.sgd(0.5), grad_accum_steps=1, trainable=freeze.by_patterns([lora.ADAPTER])
    )
  )
  batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:], "loss_mask": jnp.ones((2, 11), jnp.int32)}
  trained = step(step.init(got.params, 0), batch)[0].params
  out = got.save(tmp_path / "merged", trained)
  merged = jaxstep.load_pretrained(out)
  assert_close(
    base_logits(merged.params, ids), logits(trained, ids), terms=FOLDER_TERMS
  )  # W + (α/r)·A·B
  assert_far(base_logits(plain.params, ids), logits(trained, ids), terms=FOLDER_TERMS)


def test_saving_adapters_into_a_plain_config_says_how_to_merge(folder, tmp_path):
  from jaxstep.models import hf_export, lora

  path, _ = folder
  got = jaxstep.load_pretrained(path, lora=lora.LoraConfig(rank=2))
  with pytest.raises(ConfigError, match=r"LoRA adapter leaves .* merge them into the weights"):
    hf_export.save_pretrained(
      tmp_path / "out",
      jaxstep.load_pretrained(path).config,
      got.params,
      architecture=got.architecture,
    )
