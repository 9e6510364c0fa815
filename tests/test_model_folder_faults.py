"""A model folder a user names (to ``model.init_from``, ``generate``, ``evaluate``,
``load_pretrained``) that is damaged in ways that would otherwise run on garbage or end in
a traceback: one ``ConfigError`` (exit 2 from the commands) naming the file and what is
wrong in it."""

import json
import math

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from test_hf_folder import tokenizer_files  # noqa: F401 - fixture
from test_pretrained import folder  # noqa: F401 - fixture

import jaxstep
from jaxstep.cli import evaluate, generate
from jaxstep.errors import ConfigError
from jaxstep.models import hf_config

WEIGHTS = "model.safetensors"


def relabel(file, tensor, dtype):
  """The file with ``tensor``'s header entry declaring ``dtype``, its bytes unchanged."""
  raw = file.read_bytes()
  length = int.from_bytes(raw[:8], "little")
  header = json.loads(raw[8 : 8 + length])
  header[tensor]["dtype"] = dtype
  text = json.dumps(header, separators=(",", ":")).encode()
  assert len(text) <= length
  file.write_bytes(raw[:8] + text.ljust(length) + raw[8 + length :])


def test_a_header_that_declares_integers_for_float_data_is_refused(folder):  # noqa: F811
  path, _ = folder
  name = "model.layers.0.mlp.down_proj.weight"
  relabel(path / WEIGHTS, name, "I32")  # F32 bytes read as I32: garbage of the same size
  with pytest.raises(ConfigError, match=f"tensor {name} is stored as I32, a model's weights"):
    jaxstep.load_pretrained(path)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_weights_with_nan_or_inf_are_refused_naming_the_tensors(folder, bad):  # noqa: F811
  path, _ = folder
  tensors = load_file(path / WEIGHTS)
  names = ["model.layers.1.self_attn.k_proj.weight", "model.norm.weight"]
  for name in names:
    tensors[name][0, ...] = bad
  save_file(tensors, path / WEIGHTS, metadata={"format": "pt"})
  with pytest.raises(ConfigError) as refused:
    jaxstep.load_pretrained(path)
  message = str(refused.value)
  assert "2 tensor(s) hold NaN or infinite values" in message
  assert all(name in message for name in names), message


@pytest.mark.parametrize(
  "key, value, expected",
  [
    ("hidden_size", "thirty-two", "'hidden_size' must be an integer, got 'thirty-two'"),
    ("num_hidden_layers", 2.5, "'num_hidden_layers' must be an integer, got 2.5"),
    ("rms_norm_eps", "small", "'rms_norm_eps' must be a number, got 'small'"),
    ("rope_theta", [1], "'rope_theta' must be a number, got [1]"),
    ("num_attention_heads", True, "'num_attention_heads' must be an integer, got True"),
  ],
)
def test_a_config_value_of_the_wrong_type_is_named(folder, key, value, expected):  # noqa: F811
  path, _ = folder
  hf = hf_config.read_config(path)
  hf.pop("rope_parameters", None) if key == "rope_theta" else None
  (path / "config.json").write_text(json.dumps({**hf, key: value}))
  with pytest.raises(ConfigError, match=expected.replace("[", r"\[").replace("]", r"\]")):
    jaxstep.load_pretrained(path)


def test_the_gpt2_fields_are_checked_too():
  with pytest.raises(ConfigError, match="'n_embd' must be an integer, got '768'"):
    hf_config.model_config({"architectures": ["GPT2LMHeadModel"], "n_embd": "768"})


def error_line(command: str, path, tmp_path, capsys) -> str:
  """The one stderr line of ``generate`` or ``evaluate`` on the folder ``path`` (exit 2)."""
  (tmp_path / "text.txt").write_text("some text to score")
  args = {"generate": ["--prompt", "hi"], "evaluate": ["--data", str(tmp_path / "text.txt")]}
  main = {"generate": generate.main, "evaluate": evaluate.main}[command]
  assert main([str(path), *args[command]]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: "), err
  return err[0]


@pytest.mark.parametrize("command", ["generate", "evaluate"])
def test_the_commands_say_it_in_one_line(folder, tmp_path, capsys, command):  # noqa: F811
  path, _ = folder
  hf = hf_config.read_config(path)
  (path / "config.json").write_text(json.dumps({**hf, "hidden_size": "thirty-two"}))
  assert "'hidden_size' must be an integer" in error_line(command, path, tmp_path, capsys)


def test_the_checks_pass_a_sound_folder(folder):  # noqa: F811
  path, _ = folder
  got = jaxstep.load_pretrained(path)
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(got.params))


@pytest.mark.parametrize("command", ["generate", "evaluate"])
def test_a_vocabulary_smaller_than_the_tokenizer_is_refused(folder, tmp_path, capsys, command):  # noqa: F811
  """The folder's tokenizer has 320 ids: a config.json that says 300 (an embedding of 300
  rows) would index past its end; every command refuses it as train does."""
  path, _ = folder
  hf = hf_config.read_config(path)
  (path / "config.json").write_text(json.dumps({**hf, "vocab_size": 300}))
  with pytest.raises(ConfigError, match="vocab_size 300 is smaller than the folder's tokenizer"):
    jaxstep.load_pretrained(path)
  assert "(320 ids)" in error_line(command, path, tmp_path, capsys)
