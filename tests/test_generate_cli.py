"""Generation and evaluation of a trained run, as a user runs them: `jaxstep generate`,
`jaxstep evaluate`, samples written during training, bits per byte."""

import json
import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import make_cfg, read_lines
from tolerance import assert_close, assert_far

from jaxstep import Generator, load_run, models, trainer
from jaxstep.cli import run as run_command
from jaxstep.core.losses import masked_nll
from jaxstep.data import ByteTokenizer, eval_batches
from jaxstep.trainer.saved_run import evaluate as saved_evaluation

TRAIN = ["train.max_steps=12", "train.global_batch_size=8", "train.grad_accum_steps=2"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A short run that wrote samples at steps 6 and 12 and two checkpoints."""
  tmp = tmp_path_factory.mktemp("trained")
  cfg = make_cfg(
    tmp, *TRAIN, "train.sample_every=6", "checkpoint.every=6", "train.sample_max_new_tokens=8"
  )
  trainer.train(cfg)
  return tmp / "run"


def generate(capsys, *args):
  code = run_command("generate", [str(a) for a in args])
  out, err = capsys.readouterr()
  return code, out, err


@pytest.mark.slow
def test_samples_during_training_are_what_generate_makes_from_that_checkpoint(trained, capsys):
  records = read_lines(trained / "samples.jsonl")
  assert [(r["step"], r["mode"]) for r in records[:4]] == [
    (6, "greedy"), (6, "greedy"), (6, "sampled"), (6, "sampled"),
  ]  # fmt: skip
  assert {r["step"] for r in records} == {6, 12}
  for step in (6, 12):
    greedy = [r for r in records if r["step"] == step and r["mode"] == "greedy"]
    code, out, _ = generate(
      capsys, trained, "--step", step, "--temperature", 0, "--max-new-tokens", 8, "--json"
    )
    assert code == 0
    got = [json.loads(line) for line in out.splitlines()]
    assert [(g["prompt"], g["text"]) for g in got] == [(r["prompt"], r["text"]) for r in greedy]


@pytest.mark.slow
def test_generate_json_lines_match_the_python_api_and_the_no_cache_path(trained, capsys):
  args = [trained, "--prompt", "1", "--prompt", "23 + ", "--temperature", "0", "--json"]
  code, out, err = generate(capsys, *args, "--max-new-tokens", 12)
  assert code == 0, err
  lines = [json.loads(line) for line in out.splitlines()]
  assert [set(x) for x in lines] == [{"prompt", "text", "tokens", "stop_reason"}] * 2
  saved = load_run(trained)
  assert saved.step == 12 and isinstance(saved.tokenizer, ByteTokenizer)
  api = Generator(saved.cfg.model, saved.params, saved.tokenizer).generate(
    ["1", "23 + "], max_new_tokens=12, temperature=0.0
  )
  assert [x["tokens"] for x in lines] == [s.tokens for s in api]
  assert [x["text"] for x in lines] == [s.text for s in api]
  code, out_no_cache, _ = generate(capsys, *args, "--max-new-tokens", 12, "--no-cache")
  assert code == 0 and out_no_cache == out


@pytest.mark.slow
def test_generate_samples_reproducibly_and_prints_text_by_default(trained, capsys):
  args = [trained, "--prompt", "4", "--temperature", "1.0", "--num-samples", 3]
  first, second = generate(capsys, *args, "--seed", 5), generate(capsys, *args, "--seed", 5)
  assert first[0] == 0 and first[1] == second[1]
  assert first[1].count("--- sample") == 3 and "(update step 12, stop:" in first[1]


@pytest.mark.parametrize(
  "args, message",
  [
    (["{missing}"], "does not exist"),
    (["{empty_run}"], "holds no checkpoint"),
    (["{run}", "--prompt", ""], "prompt 1 is empty"),
    (["{run}", "--prompt", "9" * 40], "max_seq_len is 16"),
    (["{run}", "--step", "7"], "no checkpoint of update step 7"),
    (["{run}", "--prompts-file", "{missing}"], "--prompts-file"),
    (["{run}", "--top-p", "0"], "top_p must be in (0, 1]"),
    (["{run}", "--prompt", "bad byte \udcff"], "prompt 1 is not valid text"),
  ],
)
def test_bad_generate_input_is_one_line_and_exit_2(trained, tmp_path, capsys, args, message):
  empty_run = tmp_path / "empty"
  empty_run.mkdir()
  (empty_run / "config.yaml").write_text((trained / "config.yaml").read_text())
  names = {"run": trained, "missing": tmp_path / "nope", "empty_run": empty_run}
  code, out, err = generate(capsys, *[a.format(**names) for a in args])
  assert code == 2 and out == ""
  assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


def test_a_damaged_newest_checkpoint_falls_back_and_none_left_is_exit_2(trained, tmp_path, capsys):
  import shutil

  run = tmp_path / "run"
  shutil.copytree(trained, run)
  (run / "checkpoints" / "12" / "_CHECKPOINT_METADATA").unlink()  # as a kill mid-save leaves
  code, out, err = generate(capsys, run, "--prompt", "1", "--max-new-tokens", 2)
  assert code == 0 and "(update step 6," in out and "update step 12 is unusable" in err
  (run / "checkpoints" / "6" / "_CHECKPOINT_METADATA").unlink()
  code, out, err = generate(capsys, run, "--prompt", "1")
  lines = err.splitlines()  # a warning per skipped checkpoint, then the one error line
  assert code == 2 and lines[-1].startswith("error: no checkpoint in")
  assert sum(line.startswith("error") for line in lines) == 1


def test_load_run_logs_no_missing_metadata_warning(trained, caplog, capfd):
  """Reading a run from Python is quiet: orbax finds the metadata of what it reads."""
  import logging

  with caplog.at_level(logging.DEBUG):
    saved = load_run(trained)
  out, err = capfd.readouterr()
  assert saved.step == 12
  assert "Metadata file does not exist" not in caplog.text + out + err


@pytest.mark.slow
def test_python_m_jaxstep_generate_runs(trained):
  proc = subprocess.run(
    [sys.executable, "-m", "jaxstep.generate", trained, "--prompt", "1", "--max-new-tokens", "5"],
    capture_output=True,
    text=True,
    timeout=300,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert proc.returncode == 0 and proc.stdout.startswith("--- sample 1"), proc.stderr


def nll_terms(cfg, tokens) -> int:
  """Per-token NLLs (the longest sum: the MLP's down projection or the softmax over the
  vocabulary) summed over ``tokens`` tokens."""
  return max(cfg.mlp_ratio * cfg.d_model, cfg.vocab_size) * int(tokens)


def independent_eval(saved, windows, pad_id):
  """Σ NLL, tokens and bytes over the windows, one batch of 4 at a time, by hand."""
  apply_fn, _ = models.build(saved.cfg.model, 0)
  nll = tokens = num_bytes = 0.0
  for batch in eval_batches(windows, 4, pad_id):
    s, _ = masked_nll(apply_fn(saved.params, batch["inputs"]), batch["targets"], batch["loss_mask"])
    mask = batch["loss_mask"].astype(bool)
    nll, tokens = nll + float(s), tokens + mask.sum()
    num_bytes += (batch["targets"][mask] < 256).sum()  # bytes: every id below 256 is one byte
  return nll, tokens, num_bytes


@pytest.mark.slow
def test_evaluate_reports_token_weighted_loss_and_bits_per_byte(trained, tmp_path, capsys):
  text = tmp_path / "held_out.txt"
  text.write_text("1 + 2 = 3\n\n40 + 4 = 44\n\nnaïve café ☕ text\n\n" * 5)
  code = run_command("evaluate", [str(trained), "--data", str(text), "--json"])
  out, err = capsys.readouterr()
  assert code == 0, err
  got = json.loads(out)
  saved = load_run(trained)
  dataset = saved_evaluation.load_data(saved, trained, str(text), "file")  # one file: one text
  nll, tokens, num_bytes = independent_eval(saved, dataset.train, dataset.pad_id)
  assert got["format"] == "file"
  assert got["tokens"] == tokens and got["bytes"] == num_bytes < tokens  # EOS: nats, no bytes
  lines = text.read_text().splitlines()  # the file's lines, joined by "\n" (file format)
  assert got["bytes"] == len("\n".join(lines).encode())  # every byte of the text
  terms = nll_terms(saved.cfg.model, tokens)
  expected = {"loss": nll / tokens, "bpb": nll / (math.log(2) * num_bytes)}
  assert_close({k: got[k] for k in expected}, expected, terms=terms)
  assert_close(math.log(got["ppl"]), nll / tokens, terms=terms)  # ppl = exp(loss)
  # the margin: the sum divided by the windows instead of the tokens and bytes is far
  nats, rows = got["loss"] * got["tokens"], got["windows"]
  assert_far({"loss": nats / rows, "bpb": nats / (math.log(2) * rows)}, expected, terms=terms)


def test_evaluate_chat_counts_only_the_assistant_targets(trained, capsys):
  code = run_command("evaluate", [str(trained), "--data", "bundled:chat", "--json"])
  got = json.loads(capsys.readouterr().out)
  dataset = saved_evaluation.load_data(load_run(trained), trained, "bundled:chat", "auto")
  masked = sum(int(dataset.train.rows(np.arange(len(dataset.train)), len(dataset.train), 256)[
    "loss_mask"].sum()) for _ in [0])  # fmt: skip
  assert code == 0 and got["tokens"] == masked
  assert masked < 0.5 * len(dataset.train) * 16  # prompts and system turns are not targets


def test_evaluate_refuses_data_prepared_with_another_tokenizer(trained, tmp_path, capsys):
  from jaxstep.data import prepare

  prepare(["bundled:text"], tmp_path / "bpe", train_bpe_vocab=300, progress=False)
  code = run_command("evaluate", [str(trained), "--data", str(tmp_path / "bpe")])
  err = capsys.readouterr().err
  assert code == 2 and "another tokenizer" in err and err.count("\n") == 1


@pytest.mark.slow
def test_eval_during_training_reports_bits_per_byte(tmp_path):
  cfg = make_cfg(tmp_path, *TRAIN, "data.eval_fraction=0.2", "train.max_steps=2")
  run, state, _ = trainer.build(cfg)
  got = trainer.evaluate(run, state.params)
  saved = type("Saved", (), {"cfg": run.cfg, "params": state.params})
  nll, tokens, num_bytes = independent_eval(saved, run.dataset.eval, run.dataset.pad_id)
  assert got["eval_tokens"] == tokens and got["eval_bytes"] == num_bytes
  terms = nll_terms(run.cfg.model, tokens)
  assert_close(got["eval_bpb"], nll / (math.log(2) * num_bytes), terms=terms)
  # the margin: the bits divided by the windows instead of the bytes are far outside it
  per_window = got["eval_bpb"] * num_bytes / len(run.dataset.eval)
  assert_far(per_window, nll / (math.log(2) * num_bytes), terms=terms)


@pytest.mark.slow
def test_a_checkpoint_written_on_four_devices_generates_on_one(tmp_path):
  """Trained by the CLI on a 2 x 2 (data x fsdp) mesh of CPU devices, samples written there;
  generated here on one device from the checkpoint: the same greedy text."""
  cfg = make_cfg(tmp_path)  # writes the corpus
  proc = subprocess.run(
    [sys.executable, "-m", "jaxstep.train", "--config", "tiny", "mesh.data=2", "mesh.fsdp=2",
     "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.max_seq_len=32",
     "train.seq_len=32", "train.progress=false", *TRAIN, "train.sample_every=12",
     f"data.path={cfg.data.path}", f"run_dir={tmp_path / 'run'}"],
    capture_output=True, text=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )  # fmt: skip
  assert proc.returncode == 0, proc.stderr
  assert "CPU: 4 devices" in proc.stderr and jax.device_count() == 1
  greedy = [r for r in read_lines(tmp_path / "run" / "samples.jsonl") if r["mode"] == "greedy"]
  saved = load_run(tmp_path / "run")
  out = Generator(saved.cfg.model, saved.params, saved.tokenizer).generate(
    [r["prompt"] for r in greedy], max_new_tokens=64, temperature=0.0
  )
  assert [s.text for s in out] == [r["text"] for r in greedy]


def test_evaluate_batch_size_must_be_a_count_and_says_so(trained, capsys):
  from jaxstep.cli import evaluate

  with pytest.raises(SystemExit) as e:
    evaluate.main([str(trained), "--data", "bundled:text", "--batch-size", "-1"])
  assert e.value.code == 2
  assert "--batch-size: must be a whole number >= 0, got '-1'" in capsys.readouterr().err


@pytest.mark.parametrize(
  "command, extra, option",
  [("generate", [], "--num-samples"), ("evaluate", ["--data", "bundled:text"], "--batch-size")],
)
def test_a_count_that_cannot_fit_is_one_line_and_exit_2_before_allocating(
  trained, capsys, command, extra, option
):
  import time

  start = time.perf_counter()
  code = run_command(command, [str(trained), *extra, option, str(10**12)])
  out, err = capsys.readouterr()
  assert time.perf_counter() - start < 30  # refused from the estimate, nothing allocated
  assert code == 2 and out == "" and "Traceback" not in err
  assert err.startswith(f"error: {option} 1,000,000,000,000 needs about ") and err.count("\n") == 1
  assert "GiB one device holds; the largest " + option + " that fits is " in err


def test_the_memory_estimates_match_the_arrays_they_count():
  """Small shapes counted by hand, the cache from the model's own ``init_cache``."""
  import jax.numpy as jnp

  from jaxstep.generation.engine import generation_bytes
  from jaxstep.trainer.saved_run.evaluate import eval_bytes

  cfg = models.GPTConfig(vocab_size=8, max_seq_len=16, d_model=4, n_layers=2, n_heads=2)
  rows, prompt, width, b = 3, 2, 5, 2  # bf16: 2 bytes
  cache = jax.eval_shape(lambda: models.decoder(cfg).init_cache(rows, width, jnp.bfloat16))
  cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
  assert cache_bytes == 2 * 2 * rows * width * 4 * b == 480
  tokens, next_logits = rows * width * 4, rows * 8 * 4
  with_cache = tokens + next_logits + rows * prompt * 8 * b + cache_bytes
  assert generation_bytes(rows, prompt, width, 8, b, cfg) == with_cache == 732
  assert generation_bytes(rows, prompt, width, 8, b) == tokens + next_logits + rows * width * 8 * b
  batch, residual, hidden = 3 * rows * width * 4, rows * width * 4 * 4, rows * width * 16 * 4
  assert eval_bytes(cfg, rows, width) == batch + residual + max(rows * width * 8 * 4, hidden)


def params_bytes(saved):
  return sum(x.nbytes for x in jax.tree.leaves(saved.params))


@pytest.mark.slow
def test_num_samples_just_within_a_small_limit_runs_and_one_more_is_refused(
  trained, monkeypatch, capsys
):
  from jaxstep.core import device_memory
  from jaxstep.generation.engine import generation_bytes

  saved = load_run(trained)
  # prompt "1" is BOS + 1 token; with 2 new tokens the buffer is 4 wide
  per_sample = generation_bytes(1, 2, 4, saved.cfg.model.vocab_size, 4, saved.cfg.model)
  limit = params_bytes(saved) + 3 * per_sample
  monkeypatch.setattr(device_memory, "device_memory_bytes", lambda: limit)
  args = [trained, "--prompt", "1", "--max-new-tokens", 2, "--num-samples"]
  code, out, err = generate(capsys, *args, 3)
  assert code == 0 and out.count("--- sample") == 3, err
  code, out, err = generate(capsys, *args, 4)
  assert code == 2 and out == "" and "the largest --num-samples that fits is 3" in err


def test_batch_size_just_within_a_small_limit_runs_and_one_more_is_refused(
  trained, tmp_path, monkeypatch, capsys
):
  from jaxstep.core import device_memory
  from jaxstep.trainer.saved_run import evaluate as evaluation

  saved = load_run(trained)
  per_window = evaluation.eval_bytes(saved.cfg.model, 1, saved.cfg.train.seq_len)
  limit = params_bytes(saved) + 5 * per_window
  monkeypatch.setattr(device_memory, "device_memory_bytes", lambda: limit)
  text = tmp_path / "held_out.txt"
  text.write_text("1 + 2 = 3\n\n40 + 4 = 44\n\n" * 5)
  args = [str(trained), "--data", str(text), "--batch-size"]
  assert run_command("evaluate", [*args, "5"]) == 0
  assert run_command("evaluate", [*args, "6"]) == 2
  assert "the largest --batch-size that fits is 5" in capsys.readouterr().err


@pytest.mark.slow
def test_absurd_max_new_tokens_and_top_k_mean_no_limit_not_an_overflow(trained, capsys):
  args = [trained, "--prompt", "1", "--temperature", 0, "--json", "--max-new-tokens"]
  code, out, err = generate(capsys, *args, 10**12, "--top-k", 10**12)
  assert code == 0, err
  assert out == generate(capsys, *args, 100)[1]  # past max_seq_len: the same stops


def test_checkpoints_passes_over_metrics_lines_without_a_step_or_loss(trained, tmp_path, capsys):
  import shutil

  from jaxstep.cli import checkpoints

  run = tmp_path / "run"
  shutil.copytree(trained, run)
  with (run / "metrics.jsonl").open("a") as f:
    f.write('{"loss": 1.0}\n{"step": 12}\n{"step": 12, "loss": "x"}\n')
  assert checkpoints.main([str(run)]) == 0
  assert "12" in capsys.readouterr().out
