"""``jaxstep check --against-hf DIR``: jaxstep and transformers on the same ids, stage by
stage, on tiny random folders saved locally (nothing is downloaded). A conversion bug in
one place (made on jaxstep's side only: a folder damaged on disk reaches both sides alike)
is caught at that place: the stages before it pass, the first failure names it."""

import shutil
import sys

import jax
import numpy as np
import pytest

from jaxstep.cli import run
from jaxstep.models import LlamaConfig, build, hf_export, hf_weights


@pytest.fixture(scope="module")
def tiny():
  """``test_hf_import.save_tiny`` (needs torch and transformers; skipped without)."""
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  from test_hf_import import save_tiny

  return save_tiny


@pytest.fixture(scope="module")
def llama(tiny, tmp_path_factory):
  folder = tmp_path_factory.mktemp("parity") / "llama"
  tiny(folder, "llama")
  return folder


def corrupted(llama, tmp_path, name):
  """A copy of the ``llama`` folder with the tensor ``name`` perturbed."""
  from safetensors.numpy import load_file, save_file

  folder = tmp_path / "corrupted"
  shutil.copytree(llama, folder)
  tensors = load_file(folder / hf_weights.SINGLE)
  noise = np.random.default_rng(1).normal(0.0, 0.2, tensors[name].shape)
  tensors[name] = (tensors[name] + noise).astype(np.float32)
  save_file(tensors, folder / hf_weights.SINGLE, metadata={"format": "pt"})
  return folder


def one_error(capsys) -> str:
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: "), err
  return err[0]


@pytest.mark.parametrize(
  "family",
  [
    "qwen3",
    "llama",
    "gpt2",
    *(
      pytest.param(f, marks=pytest.mark.slow)
      for f in ("olmo2", "granite", "smollm3", "phi3", "gemma2", "gemma3")
    ),
  ],
)
def test_an_unmodified_folder_passes_every_stage(tiny, tmp_path, family):
  from jaxstep.models.hf_parity import parity_report

  tiny(tmp_path, family)
  report = parity_report(tmp_path)
  names = [s.name for s in report.stages]
  assert names == ["embeddings", "block 0", "block 1", "final norm", "logits"]
  assert report.passed and report.first_divergence is None, report
  assert report.shape == (2, 16)
  text = str(report)
  assert "PASS: every stage matches transformers" in text and "FAIL" not in text


def swap_gate_and_up(params, block=1):
  """A conversion bug: block ``block``'s ``gate_proj`` and ``up_proj`` read the wrong way
  round (both [D, I], so nothing fails on shapes)."""
  b = params["blocks"][block]
  b["gate_proj"], b["up_proj"] = b["up_proj"], b["gate_proj"]
  return params


# conversion bugs, each on jaxstep's side only, and the stage each must be caught at
BUGS = {
  "embeddings": lambda p: {  # the rows off by one
    **p,
    "embed_tokens": {"embedding": np.roll(p["embed_tokens"]["embedding"], 1, axis=0)},
  },
  "block 1": swap_gate_and_up,
  "final norm": lambda p: {**p, "norm": {"scale": p["norm"]["scale"] + 1.0}},  # a (1 + w) norm
  "logits": lambda p: {**p, "lm_head": {"kernel": p["embed_tokens"]["embedding"].T}},  # tied
}


@pytest.fixture
def bug(monkeypatch):
  """``bug(fn)``: jaxstep's side of the next reports reads its params through ``fn``."""
  from jaxstep.models import hf_parity

  read = hf_parity.read_model

  def install(fn):
    def buggy(folder, seq_len):
      config, params = read(folder, seq_len)
      return config, fn(params)

    monkeypatch.setattr(hf_parity, "read_model", buggy)

  return install


@pytest.mark.parametrize("stage", list(BUGS))
def test_a_conversion_bug_is_caught_at_its_own_stage(llama, bug, stage):
  from jaxstep.models.hf_parity import parity_report

  bug(BUGS[stage])
  report = parity_report(llama)
  assert report.first_divergence == stage, report
  at = [s.name for s in report.stages].index(stage)
  assert all(s.passed for s in report.stages[:at])
  assert report.stages[at].max_rel > 1e-2


def test_the_command_names_the_diverging_block_and_exits_1(llama, bug, capsys):
  bug(swap_gate_and_up)
  assert run("check", ["--against-hf", str(llama)]) == 1
  out = capsys.readouterr().out
  assert "FAIL: first divergence at 'block 1'" in out
  rows = {" ".join(line.split()[:-3]): line.split()[-1] for line in out.splitlines()[2:-1]}
  assert rows == {
    "embeddings": "PASS",
    "block 0": "PASS",
    "block 1": "FAIL",
    "final norm": "FAIL",
    "logits": "FAIL",
  }


def test_weights_damaged_on_disk_are_read_alike_by_both(llama, tmp_path):
  """The report compares the two implementations on the folder's weights, whatever they
  are: a tensor perturbed in the file changes both sides the same way and still passes."""
  from jaxstep.models.hf_parity import parity_report

  report = parity_report(corrupted(llama, tmp_path, "model.layers.1.mlp.down_proj.weight"))
  assert report.passed, report


def test_the_command_passes_an_unmodified_folder(llama, capsys):
  assert run("check", ["--against-hf", str(llama)]) == 0
  assert "PASS: every stage matches transformers" in capsys.readouterr().out


def test_a_folder_without_config_json_is_one_error_line(tmp_path, capsys):
  assert run("check", ["--against-hf", str(tmp_path)]) == 2
  assert "has no config.json" in one_error(capsys)


def test_without_transformers_it_says_what_to_install(tmp_path, capsys, monkeypatch):
  """A folder jaxstep wrote itself (no torch needed), then transformers made unimportable."""
  cfg = LlamaConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, intermediate_size=24)
  shapes = build(cfg, 0, abstract=True)[1]  # what the weights are does not matter here
  params = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)
  hf_export.save_pretrained(tmp_path / "m", cfg, params, architecture="LlamaForCausalLM")
  monkeypatch.setitem(sys.modules, "transformers", None)
  assert run("check", ["--against-hf", str(tmp_path / "m")]) == 2
  line = one_error(capsys)
  assert "needs torch and transformers" in line and "pip install 'jaxstep[test]'" in line


def test_against_hf_takes_no_config(tmp_path, capsys):
  with pytest.raises(SystemExit) as stop:
    run("check", ["--against-hf", str(tmp_path), "--config", "tiny"])
  assert stop.value.code == 2
  assert "--against-hf takes no --config" in capsys.readouterr().err


def test_given_ids_are_used_and_checked(llama):
  from jaxstep.errors import ConfigError
  from jaxstep.models.hf_parity import parity_report

  ids = np.arange(24).reshape(3, 8) % 96
  assert parity_report(llama, ids).shape == (3, 8)
  with pytest.raises(ConfigError, match=r"token ids must be in \[0, 96\)"):
    parity_report(llama, [[0, 96]])
  with pytest.raises(ConfigError, match="65 ids exceed the model's 64 positions"):
    parity_report(llama, np.zeros((1, 65), np.int64))
