"""QLoRA from a model folder: the base quantized as it is read, trained through adapters,
exported merged (transformers loads it and computes jaxstep's logits) and as a PEFT adapter,
killed and resumed bitwise, and the post-training losses on the same quantized base. Tiny
random models built locally with transformers; nothing is downloaded."""

import dataclasses

import jax
import numpy as np
import pytest
from conftest import read_lines, restore_state_arrays
from test_hf_folder import tokenizer_files  # noqa: F401 - fixture
from test_init_from import G, K, S, corpus, run_cfg
from test_pretrained import FOLDER_TERMS, folder  # noqa: F401 - fixture
from tolerance import assert_close

import jaxstep
from jaxstep import models, trainer
from jaxstep.cli import run as run_command
from jaxstep.core.trees import path_name
from jaxstep.models import lora, quant

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow
QLORA = ["model.lora.rank=4", "model.lora.base_quant=nf4", "model.lora.quant_block=16"]


def test_a_qlora_run_learns_exports_merged_and_its_first_logits_are_the_dequantized_bases(
  folder,  # noqa: F811
  tmp_path,
):
  path, _ = folder
  steps = ["train.max_steps=16", "optim.warmup_steps=1", "optim.lr=1e-2", "train.log_every=1"]
  cfg = run_cfg(tmp_path, path, *QLORA, *steps)
  trainer.train(cfg)
  losses = [r["loss"] for r in read_lines(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
  assert losses[-1] < losses[0] - 0.2

  saved = jaxstep.load_run(tmp_path / "run")
  blocks = jax.tree.leaves(saved.params["blocks"], is_leaf=quant.is_quantized)
  layers = [x.codes.shape[0] if x.codes.ndim == 3 else 1 for x in blocks if quant.is_quantized(x)]
  assert sum(layers) == 7 * 2  # every projection of both layers (stacked or not)
  ids = np.random.default_rng(0).integers(0, 300, size=(2, 12))
  apply_fn = models.decoder(saved.cfg.model).apply_fn
  ours = np.asarray(apply_fn(saved.params, ids))

  # the start: adapters off, the model is the folder's weights through NF4, bit for bit
  start = lora.adapters_off(saved.params)
  plain = models.decoder(dataclasses.replace(saved.cfg.model, lora=lora.LoraConfig()))
  dequantized = lora.merged(start, saved.cfg.model.lora.scale)
  assert np.array_equal(apply_fn(start, ids), plain.apply_fn(dequantized, ids))

  assert run_command("export", [str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
  with torch.no_grad():
    theirs = exported(torch.tensor(ids)).logits.numpy()
  assert_close(ours, theirs, terms=FOLDER_TERMS)

  out = tmp_path / "adapter"
  assert run_command("export", [str(tmp_path / "run"), "--out", str(out), "--adapter"]) == 0
  assert (out / "adapter_model.safetensors").is_file()


def test_a_qlora_run_killed_with_sigkill_resumes_bitwise(folder, tmp_path):  # noqa: F811
  """The checkpoint holds the adapters; the resumed start quantizes the folder again, after
  checking its fingerprint, and continues as if never stopped."""
  from conftest import straight_and_killed

  path, _ = folder
  corpus(tmp_path)
  args = [f"model.init_from={path}", f"data.path={tmp_path / 'corpus.txt'}", *QLORA]
  args += [f"train.global_batch_size={G}", f"train.grad_accum_steps={K}", f"train.seq_len={S}"]
  args += ["train.max_steps=6", "train.eval_every=0", "checkpoint.every=2", "mesh.cpu_devices=1"]
  straight_and_killed(tmp_path, args, kill_at=2)
  (step_a, a), (step_b, b) = (restore_state_arrays(tmp_path / n) for n in ("straight", "killed"))
  assert step_a == step_b == 6
  names = [path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(a["params"])[0]]
  assert names and all("/lora/" in n for n in names)  # the base is the folder's, not stored
  pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in pairs)


def test_evaluate_scores_a_qlora_run_as_its_merged_export(folder, tmp_path, capsys):  # noqa: F811
  """``jaxstep evaluate`` on the run (quantized base + adapters) and on its merged export
  (plain weights) score the same text alike."""
  path, _ = folder
  cfg = run_cfg(tmp_path, path, *QLORA, "train.max_steps=4", "optim.lr=1e-2")
  trainer.train(cfg)
  assert run_command("export", [str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
  text = tmp_path / "text.txt"
  text.write_text("the 3 and 4: 7. the 10 and 20: 30. the 1 and 1: 2.")
  scores = []
  for source in ("run", "out"):
    capsys.readouterr()
    args = [str(tmp_path / source), "--data", str(text), "--seq-len", "32"]
    assert run_command("evaluate", args) == 0
    line = capsys.readouterr().out
    scores.append(float(line.split(" loss ")[1].split()[0]))
  assert scores[0] == pytest.approx(scores[1], rel=1e-5)


def test_a_qlora_run_on_a_tensor_and_fsdp_mesh_equals_one_device(tmp_path):
  """4 CPU devices (tensor 2 × fsdp 2): the codes and scales split as their weight does,
  and the updates equal one device's."""
  import subprocess
  import sys

  from conftest import long_run_env

  base = ["--config", "tiny", "train.max_steps=4", "train.log_every=1", "train.eval_every=0"]
  base += ["model.lora.rank=4", "model.lora.base_quant=nf4", "model.lora.quant_block=32"]
  runs = {}
  for name, mesh in (
    ("one", ["mesh.cpu_devices=1"]),
    ("four", ["mesh.cpu_devices=4", "mesh.tensor=2", "mesh.fsdp=2"]),
  ):
    cmd = [sys.executable, "-m", "jaxstep.train", *base, *mesh, f"run_dir={tmp_path / name}"]
    done = subprocess.run(cmd, env=long_run_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    runs[name] = read_lines(tmp_path / name / "metrics.jsonl")
  for a, b in zip(runs["one"], runs["four"], strict=True):
    np.testing.assert_allclose(b["loss"], a["loss"], rtol=1e-5)
    np.testing.assert_allclose(b["grad_norm"], a["grad_norm"], rtol=1e-4)
