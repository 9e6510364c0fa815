"""``jaxstep export --adapter``: a LoRA run's adapters in PEFT's format, loaded by
``peft.PeftModel.from_pretrained`` onto the base model with the run's logits, named and laid
out as PEFT's own ``save_pretrained`` writes them. Tiny random models built locally with
transformers; nothing is downloaded."""

import dataclasses
import json

import numpy as np
import pytest
from conftest import LazyModule, make_cfg
from test_hf_folder import tokenizer_files  # noqa: F401 - fixture
from test_init_from import run_cfg
from test_pretrained import FOLDER_TERMS, folder  # noqa: F401 - fixture
from tolerance import assert_close, assert_far

import jaxstep
from jaxstep import models, trainer
from jaxstep.cli import run as run_command
from jaxstep.models import hf_export, lora, peft_export

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = LazyModule("peft")
safetensors_torch = pytest.importorskip("safetensors.torch")

IDS = np.random.default_rng(0).integers(0, 256, size=(2, 12))


def export(run_dir, out, *flags) -> int:
  return run_command("export", [str(run_dir), "--out", str(out), *flags])


def logits(model, ids=IDS) -> np.ndarray:
  with torch.no_grad():
    return model.eval()(torch.tensor(ids)).logits.numpy()


def ours(run_dir, ids=IDS) -> np.ndarray:
  saved = jaxstep.load_run(run_dir)
  return np.asarray(models.decoder(saved.cfg.model).apply_fn(saved.params, ids))


def peft_reference(base: str, adapter_config: dict, tmp_path):
  """``{name: shape}`` and the config PEFT itself saves for the same ``LoraConfig``."""
  model = transformers.AutoModelForCausalLM.from_pretrained(base)
  settings = {k: adapter_config[k] for k in ("r", "lora_alpha", "target_modules")}
  config = peft.LoraConfig(**settings, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
  peft.get_peft_model(model, config).save_pretrained(tmp_path / "reference")
  tensors = safetensors_torch.load_file(tmp_path / "reference" / peft_export.WEIGHTS)
  saved = json.loads((tmp_path / "reference" / peft_export.CONFIG).read_text())
  return {k: tuple(v.shape) for k, v in tensors.items()}, saved


@pytest.mark.parametrize(
  "overrides",
  [
    pytest.param((), marks=pytest.mark.slow),
    pytest.param(
      ("model.family=llama", "model.lora.targets=[q_proj, v_proj]"), marks=pytest.mark.slow
    ),
    pytest.param(("model.scan_layers=true",), marks=pytest.mark.slow),
  ],
  ids=["every-projection", "q-and-v", "stacked"],
)
def test_a_peft_model_from_the_adapter_computes_the_runs_logits(
  tmp_path,
  folder,  # noqa: F811 - the imported fixture
  overrides,
):
  path, _ = folder
  cfg = run_cfg(
    tmp_path, path, "model.lora.rank=4", "train.max_steps=2", "optim.lr=1e-2", *overrides
  )
  trainer.train(cfg)
  run_dir, out = tmp_path / "run", tmp_path / "adapter"
  assert export(run_dir, out, "--adapter") == 0
  assert export(run_dir, tmp_path / "merged") == 0
  config = json.loads((out / peft_export.CONFIG).read_text())
  targets = ["q_proj", "v_proj"] if any("targets" in o for o in overrides) else None
  assert sorted(config["target_modules"]) == sorted(targets or models.llama.PROJECTIONS)
  assert config["base_model_name_or_path"] == str(path)
  assert (config["r"], config["lora_alpha"], config["fan_in_fan_out"]) == (4, 16, False)
  for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    assert (out / name).is_file(), name  # the run's tokenizer files, as a merged export's
  shapes, reference = peft_reference(str(path), config, tmp_path)
  tensors = safetensors_torch.load_file(out / peft_export.WEIGHTS)
  assert {k: tuple(v.shape) for k, v in tensors.items()} == shapes  # names and layout
  same = ("peft_type", "task_type", "r", "lora_alpha", "bias", "fan_in_fan_out", "use_rslora")
  assert {k: config[k] for k in same} == {k: reference[k] for k in same}

  base = transformers.AutoModelForCausalLM.from_pretrained(path)
  with_adapter = peft.PeftModel.from_pretrained(base, out)
  expected = ours(run_dir)
  assert_close(logits(with_adapter), expected, terms=FOLDER_TERMS)
  merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
  assert_close(logits(with_adapter), logits(merged), terms=FOLDER_TERMS)
  plain = transformers.AutoModelForCausalLM.from_pretrained(path)
  # the margin: the base without the adapters is far outside the tolerance of either
  assert_far(logits(plain), expected, terms=FOLDER_TERMS)
  assert_far(logits(plain), logits(merged), terms=FOLDER_TERMS)


@pytest.mark.slow
def test_bf16_adapters_and_a_second_export_over_the_first(
  tmp_path,
  folder,  # noqa: F811 - the imported fixture
  capsys,
):
  path, _ = folder
  trainer.train(run_cfg(tmp_path, path, "model.lora.rank=4", "train.max_steps=1"))
  run_dir, out = tmp_path / "run", tmp_path / "adapter"
  assert export(run_dir, out, "--adapter") == 0
  full = safetensors_torch.load_file(out / peft_export.WEIGHTS)
  assert export(run_dir, out, "--adapter", "--dtype", "bf16") == 0  # over its own export
  half = safetensors_torch.load_file(out / peft_export.WEIGHTS)
  assert half.keys() == full.keys() and all(v.dtype == torch.bfloat16 for v in half.values())
  for name, tensor in full.items():
    assert torch.equal(half[name], tensor.to(torch.bfloat16)), name
  assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]
  base = transformers.AutoModelForCausalLM.from_pretrained(path)
  np.testing.assert_allclose(
    logits(peft.PeftModel.from_pretrained(base, out)), ours(run_dir), atol=0.05
  )

  def refused(target, why):
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    capsys.readouterr()
    assert export(run_dir, target) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and why in err[0], err
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before

  (out / "notes.txt").write_text("mine")  # the export is no longer jaxstep's alone
  refused(out, "holds files jaxstep did not write (notes.txt)")
  theirs = tmp_path / "theirs"
  theirs.mkdir()
  (theirs / "data.txt").write_text("keep")
  refused(theirs, "holds files jaxstep did not write (data.txt)")
  refused(path, "is the run's base model (model.init_from)")  # LoRA's merged weights


@pytest.mark.slow
@pytest.mark.parametrize("targets", ["[qkv, out]", "[proj, fc]"])
def test_the_bundled_gpt_adapter_loads_onto_gpt2(tmp_path, targets):
  cfg = make_cfg(
    tmp_path,
    "train.max_steps=2",
    "model.lora.rank=4",
    f"model.lora.targets={targets}",
    "optim.lr=1e-2",
  )
  trainer.train(cfg)
  run_dir, out = tmp_path / "run", tmp_path / "adapter"
  assert export(run_dir, out, "--adapter") == 0
  config = json.loads((out / peft_export.CONFIG).read_text())
  wanted = {"[qkv, out]": ["c_attn", "mlp.c_proj"], "[proj, fc]": ["attn.c_proj", "c_fc"]}
  assert config["target_modules"] == wanted[targets] and config["fan_in_fan_out"]
  assert config["base_model_name_or_path"] == ""  # trained from scratch
  # the base: the run's own frozen weights, as GPT-2
  saved = jaxstep.load_run(run_dir)
  base_cfg = dataclasses.replace(saved.cfg.model, lora=lora.LoraConfig())
  base_dir = hf_export.save_pretrained(
    tmp_path / "base", base_cfg, lora.merged(saved.params, 0.0), architecture="GPT2LMHeadModel"
  )
  base = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
  plain = logits(base, IDS % saved.cfg.model.vocab_size)
  with_adapter = peft.PeftModel.from_pretrained(base, out)
  adapted = {n for n, m in with_adapter.base_model.model.named_modules() if hasattr(m, "lora_A")}
  modules = {"[qkv, out]": ("attn.c_attn", "mlp.c_proj"), "[proj, fc]": ("attn.c_proj", "mlp.c_fc")}
  assert adapted == {f"transformer.h.0.{m}" for m in modules[targets]}  # those, and only those
  ids = IDS % saved.cfg.model.vocab_size
  expected = ours(run_dir, ids)
  terms = 4 * saved.cfg.model.d_model * saved.cfg.model.n_layers  # the MLP, once per layer
  assert_close(logits(with_adapter, ids), expected, terms=terms)
  assert_far(plain, expected, terms=terms)  # the base without the adapters


def test_adapter_on_a_run_without_lora_is_one_line_exit_2(tmp_path, capsys):
  trainer.train(make_cfg(tmp_path, "train.max_steps=1"))
  capsys.readouterr()
  assert export(tmp_path / "run", tmp_path / "adapter", "--adapter") == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: the run has no adapters"), err
  assert not (tmp_path / "adapter").exists()
  assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


@pytest.mark.parametrize(
  "targets, modules",
  [
    ((), ["c_attn", "c_fc", "c_proj"]),
    (("proj", "out"), ["c_proj"]),
    (("out",), ["mlp.c_proj"]),
    (("qkv", "proj"), ["c_attn", "attn.c_proj"]),
  ],
)
def test_gpt2_target_modules_select_exactly_the_adapted_projections(targets, modules):
  cfg = models.GPTConfig(lora=lora.LoraConfig(rank=2, targets=targets))
  assert peft_export.target_modules(cfg) == modules


@pytest.mark.parametrize("cfg", [models.GPTConfig, models.LlamaConfig], ids=["gpt", "llama"])
def test_the_adapter_config_drops_the_adapters_input_at_the_runs_rate(cfg):
  """PEFT's ``lora_dropout`` is ``model.lora.dropout``: both drop the adapter's input while
  training, so PEFT trains the adapter on as the run did."""
  config = peft_export.adapter_config(cfg(lora=lora.LoraConfig(rank=2, dropout=0.1)))
  assert config["lora_dropout"] == 0.1
