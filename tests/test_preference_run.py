"""Preference runs (``preference.loss``) through ``jaxstep train``: pairs read from JSONL,
the loss normalized by the global number of pairs (K micro-batches and a padded last batch
give one big batch's numbers), the LoRA base as the reference, TRL's metric names as means,
evaluation on held-out pairs, and one-line refusals."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SMALL_MODEL, read_lines
from test_hf_folder import tokenizer_files  # noqa: F401 - fixture
from test_pretrained import folder  # noqa: F401 - fixture

from jaxstep import models
from jaxstep.cli import train as train_cli
from jaxstep.trainer import config_run
from jaxstep.trainer.config import loading as config_lib
from jaxstep.trainer.plan.build import build

BASE = [
  *SMALL_MODEL,
  "train.global_batch_size=8",
  "train.grad_accum_steps=2",
  "train.max_steps=3",
  "train.schedule_steps=8",
  "train.log_every=1",
  "train.eval_every=0",
  "data.eval_fraction=0",
  "optim.lr=3e-3",
  "optim.warmup_steps=0",
  "preference.max_prompt_len=12",  # "12 + 34 = " and BOS: 11 tokens
]
DPO = ["preference.loss=dpo", "preference.beta=0.5", "model.lora.rank=4", "model.lora.alpha=8"]


def sums_file(tmp_path, n=20, seed=0):
  """``n`` pairs from sums: prompt ``"a + b = "``, chosen the right answer, rejected a wrong
  one (the bundled corpus's task as preferences)."""
  rng = np.random.default_rng(seed)
  rows = []
  sums = rng.integers(0, 50, (n, 2))
  for (a, b), d in zip(sums, rng.integers(1, 9, n), strict=True):
    rows.append({"prompt": f"{a} + {b} = ", "chosen": f"{a + b}", "rejected": f"{a + b + d}"})
  path = tmp_path / "pairs.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return path


def cfg_for(tmp_path, *overrides, name="run"):
  path = sums_file(tmp_path)
  args = [*BASE, f"data.path={path}", f"run_dir={tmp_path / name}", *overrides]
  return config_lib.load(None, args)


def logged(run_dir):
  return read_lines(run_dir / "metrics.jsonl")


@pytest.fixture(scope="module")
def dpo_runs(tmp_path_factory):
  """The records of LoRA DPO runs with K = 1, 2 and 4 micro-batches from the same start;
  K = 4 computes the log-probs (policy and reference) in chunks of 8 tokens."""
  tmp_path, runs = tmp_path_factory.mktemp("dpo"), {}
  for k in (1, 2, 4):
    name, chunk = f"k{k}", 8 if k == 4 else 0
    overrides = [f"train.grad_accum_steps={k}", f"model.loss_chunk={chunk}"]
    config_run.train(cfg_for(tmp_path, *DPO, *overrides, name=name))
    runs[k] = logged(tmp_path / name)
  return runs


def test_a_lora_dpo_run_starts_at_ln2_with_zero_rewards(dpo_runs):
  """The adapters start at zero, so the policy is its reference: every pair's DPO loss is
  −log σ(0) = ln 2 and every reward 0 (no chosen reward beats its rejected one)."""
  first = dpo_runs[2][0]
  assert first["loss"] == pytest.approx(math.log(2), rel=1e-6)
  for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
    assert first[name] == 0.0, name
  assert first["tokens"] == 8  # the step's unit: pairs
  assert first["logps/chosen"] < 0 and first["logps/rejected"] < 0


def test_k_micro_batches_and_a_padded_last_batch_equal_one_big_batch(dpo_runs):
  """20 pairs in global batches of 8: the third holds 4 real pairs and 4 padding rows. With
  K = 1, 2 and 4 micro-batches every update's loss and metrics agree (the mean over real
  pairs of the whole global batch, never a mean of micro-batch means), the log-probs of
  K = 4 computed in chunks of tokens."""
  runs = dpo_runs
  assert [r["tokens"] for r in runs[1]] == [8, 8, 4]
  for k in (2, 4):
    for a, b in zip(runs[1], runs[k], strict=True):
      for key in ("loss", "grad_norm", "rewards/accuracies", "rewards/margins", "logps/chosen"):
        # fp32 sums of a micro-batch's log-probs (tens of nats) in another order: ~1e-6
        np.testing.assert_allclose(b[key], a[key], rtol=2e-5, atol=1e-5, err_msg=key)
  assert runs[1][-1]["loss"] < math.log(2)  # it learns to prefer the right sums


def test_a_simpo_run_needs_no_reference_and_its_first_loss_is_computed_by_hand(tmp_path):
  """Full fine-tuning with SimPO (reference-free): the first update's loss is the mean over
  the batch's pairs of −log σ(β·(π̄_c − π̄_r) − γ), computed here from the model's logits."""
  cfg = cfg_for(tmp_path, "preference.loss=simpo", "preference.beta=2.0", "train.max_steps=1")
  run, state, rs = build(cfg)
  batch = config_run.next_batch(run, rs)
  params = jax.device_get(state.params)
  apply_fn, _ = models.build(run.cfg.model, jax.random.PRNGKey(0), abstract=True)
  apply_fn = jax.jit(apply_fn)

  def mean_logp(side):
    logits = np.asarray(apply_fn(params, jnp.asarray(batch[f"{side}_inputs"])), np.float64)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    picked = np.take_along_axis(logp, batch[f"{side}_targets"][..., None], -1)[..., 0]
    mask = batch[f"{side}_mask"]
    return (picked * mask).sum(1) / mask.sum(1)

  z = 2.0 * (mean_logp("chosen") - mean_logp("rejected")) - 0.5
  want = np.mean(np.log1p(np.exp(-z)))
  config_run.train(cfg)  # builds the same run again, and trains it
  assert logged(tmp_path / "run")[0]["loss"] == pytest.approx(want, rel=1e-5)


def test_held_out_pairs_are_evaluated_with_the_same_names(tmp_path):
  config_run.train(cfg_for(tmp_path, *DPO, "data.eval_fraction=0.25", "train.max_steps=2"))
  (record,) = read_lines(tmp_path / "run" / "eval.jsonl")
  assert record["step"] == 2 and record["eval_pairs"] >= 1
  assert set(record) >= {"eval_loss", "eval_rewards/accuracies", "eval_rewards/margins"}
  assert 0 <= record["eval_rewards/accuracies"] <= 1


@pytest.mark.parametrize(
  "overrides, words",
  [
    (["preference.loss=dpo", "preference.reference=adapters"], "model.lora.rank > 0"),
    (["preference.loss=ipo", "preference.reference=none"], "needs a reference"),
    (["preference.loss=dpo", "preference.reference_dtype=fp16"], "reference_dtype"),
    (["preference.loss=simpo", "preference.reference=adapters"], "reference-free"),
    (["preference.loss=kto"], "preference.loss"),
  ],
)
def test_a_preference_config_that_cannot_run_is_one_line_and_exit_2(
  tmp_path, capsys, overrides, words
):
  path = sums_file(tmp_path)
  args = [*BASE, f"data.path={path}", f"run_dir={tmp_path / 'run'}", *overrides]
  assert train_cli.main(args) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and words in err[0], err
  assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_check_compares_k_micro_batches_of_pairs_with_one(tmp_path, capsys):
  from jaxstep.cli import check as check_cli

  path = sums_file(tmp_path)
  args = [*BASE, *DPO, f"data.path={path}", f"run_dir={tmp_path / 'run'}"]
  assert check_cli.main(args) == 0, capsys.readouterr().out
  assert "PASS: accumulation is exact" in capsys.readouterr().out


@pytest.mark.slow
def test_check_of_full_fine_tuning_dpo_passes(tmp_path, capsys):
  """With a live reference every parameter trains. At the first update the policy is its
  reference and the gradients agree (K = 2 vs 1); entries whose gradient is rounding noise
  around zero (the key bias, to which attention is invariant), which Adam would scale to
  ±lr, are left out of the update stages and counted."""
  from jaxstep.cli import check as check_cli

  path = sums_file(tmp_path)
  args = [*BASE, *FULL, f"data.path={path}", f"run_dir={tmp_path / 'run'}"]
  assert check_cli.main(args) == 0
  table = capsys.readouterr().out
  assert "PASS: accumulation is exact" in table
  assert "leave out" in table and "entries whose gradient" in table


@pytest.mark.slow
def test_a_dpo_run_exports_and_generates_as_a_supervised_run_does(tmp_path, capsys):
  """A LoRA DPO run is a LoRA run: its merged export is a GPT-2 folder, its adapters a
  PEFT folder, and generate decodes from the run dir with the tokenizer it kept."""
  from jaxstep.cli import run as run_command

  config_run.train(cfg_for(tmp_path, *DPO, "train.max_steps=2"))
  run_dir = tmp_path / "run"
  assert run_command("export", [str(run_dir), "--out", str(tmp_path / "hf")]) == 0
  assert (tmp_path / "hf" / "config.json").is_file()
  assert run_command("export", [str(run_dir), "--out", str(tmp_path / "ad"), "--adapter"]) == 0
  assert (
    run_command("generate", [str(run_dir), "--prompt", "12 + 30 = ", "--max-new-tokens", "3"]) == 0
  )
  assert "12 + 30 = " in capsys.readouterr().out


def test_the_lora_reference_is_the_base_models_forward_bitwise(tmp_path):
  """The reference of a LoRA run's dpo is its params with the adapters off: the same logits,
  to the bit, as the model built without adapters on the base weights."""
  from jaxstep.models import lora

  cfg = dataclasses.replace(cfg_for(tmp_path, *DPO).model, vocab_size=264)
  lora_fn, params = models.build(cfg, jax.random.PRNGKey(0))
  trained = jax.tree_util.tree_map_with_path(  # adapters as after training: B no longer 0
    lambda p, x: x + 0.1 if jax.tree_util.keystr(p).endswith("['lora_b']") else x, params
  )
  base_cfg = dataclasses.replace(cfg, lora=lora.LoraConfig())
  base_fn, _ = models.build(base_cfg, jax.random.PRNGKey(0), abstract=True)
  lora_fn, base_fn = jax.jit(lora_fn), jax.jit(base_fn)  # as a train step computes them
  ids = jnp.asarray(np.random.default_rng(0).integers(0, 259, (2, 16)), jnp.int32)
  assert not np.array_equal(lora_fn(trained, ids), base_fn(lora.merged(params, 1.0), ids))
  want = base_fn(lora.merged(params, 1.0), ids)  # B = 0: the base weights themselves
  assert np.array_equal(lora_fn(lora.adapters_off(trained), ids), want)


def _cli_run(tmp_path, name, *overrides):
  import subprocess
  import sys

  path = sums_file(tmp_path)
  args = [*BASE, *DPO, f"data.path={path}", f"run_dir={tmp_path / name}", *overrides]
  done = subprocess.run([sys.executable, "-m", "jaxstep.train", *args], capture_output=True)
  assert done.returncode == 0, done.stderr.decode()[-2000:]
  return logged(tmp_path / name)


@pytest.mark.slow
def test_a_dpo_run_on_four_devices_equals_one_device(tmp_path):
  """Data over 4 devices (some hold only padding rows in the last batch) and the params
  over 4 (fsdp): the same losses and metrics as one device."""
  one = _cli_run(tmp_path, "one", "mesh.cpu_devices=1")
  for name, mesh in {"data": ["mesh.data=4"], "fsdp": ["mesh.fsdp=4", "mesh.data=1"]}.items():
    got = _cli_run(tmp_path, name, "mesh.cpu_devices=4", *mesh)
    for a, b in zip(one, got, strict=True):
      assert a["tokens"] == b["tokens"]
      for key in ("loss", "rewards/accuracies", "rewards/margins", "logps/rejected"):
        np.testing.assert_allclose(b[key], a[key], rtol=2e-5, atol=1e-5, err_msg=f"{name} {key}")


@pytest.mark.slow
def test_a_dpo_run_killed_with_sigkill_resumes_bitwise(tmp_path):
  from conftest import bitwise_same_checkpoints, straight_and_killed

  path = sums_file(tmp_path)
  args = [*BASE, *DPO, f"data.path={path}", "train.max_steps=6", "checkpoint.every=2"]
  straight, killed = straight_and_killed(tmp_path, [*args, "mesh.cpu_devices=1"], kill_at=2)
  step, _ = bitwise_same_checkpoints(straight, killed)
  assert step == 6
  assert [r["loss"] for r in logged(straight)] == [r["loss"] for r in logged(killed)]


@pytest.mark.slow
def test_the_trainer_takes_the_preference_loss_with_pairs_as_its_unit(tmp_path):
  """From Python: ``preference_loss`` and ``pair_units`` plug into ``jaxstep.Trainer`` with
  batches of pairs; K = 2 trains as K = 1, and the first DPO loss of LoRA is ln 2."""
  from jaxstep import Trainer, data
  from jaxstep.core.optim import OptimConfig
  from jaxstep.core.preference import pair_units, preference_loss
  from jaxstep.models import lora

  path = str(sums_file(tmp_path))
  pairs = data.load_pair_dataset(path, "byte", seq_len=16, max_prompt_len=12, eval_fraction=0)
  model_cfg = dataclasses.replace(cfg_for(tmp_path, *DPO).model, vocab_size=264)
  apply_fn, params = models.build(model_cfg, jax.random.PRNGKey(0))

  def reference(p, inputs):
    return apply_fn(lora.adapters_off(p), inputs, train=False)

  loss_fn = preference_loss(apply_fn, loss="dpo", beta=0.5, reference=reference)
  batches = [data.global_batch(pairs.train, 0, 0, step, 8, 0) for step in range(3)]
  optim = OptimConfig(lr=3e-3, warmup_steps=0, trainable=(lora.ADAPTER,))
  losses = {}
  for k in (1, 2):
    train = {"global_batch_size": 8, "grad_accum_steps": k, "max_steps": 3, "log_every": 1}
    train |= {"eval_every": 0, "progress": False}
    run_dir = tmp_path / f"k{k}"
    Trainer(
      loss_fn, params, optim, train_data=batches, run_dir=run_dir, train=train, units_fn=pair_units
    ).fit()
    losses[k] = [r["loss"] for r in logged(run_dir)]
  assert losses[1][0] == pytest.approx(math.log(2), rel=1e-6)
  np.testing.assert_allclose(losses[2], losses[1], rtol=2e-5)


@pytest.mark.slow
def test_the_dpo_hf_config_tunes_a_model_folder_on_chat_pairs_and_exports(
  folder,  # noqa: F811
  tmp_path,
  monkeypatch,
  capsys,
):
  """``configs/dpo-hf.yaml`` on a Qwen3 folder with a chat template: the bundled chat pairs
  rendered by the folder's template, LoRA with the folder's model as the reference (the
  first loss is ln 2), then a merged export carrying the template."""
  from test_chat_sft import CHATML

  from jaxstep.cli import run as run_command

  path, _ = folder
  (path / "chat_template.jinja").write_text(CHATML)
  monkeypatch.setenv("HF_MODEL", str(path))
  run_dir = tmp_path / "dpo"
  args = ["--config", "dpo-hf", f"run_dir={run_dir}", "train.max_steps=2", "train.log_every=1"]
  args += ["train.seq_len=64", "preference.max_prompt_len=32"]  # the folder has 64 positions
  args += ["train.global_batch_size=8", "train.grad_accum_steps=2", "mesh.cpu_devices=1"]
  assert run_command("train", args) == 0, capsys.readouterr().err
  first = logged(run_dir)[0]
  assert first["loss"] == pytest.approx(math.log(2), rel=1e-6) and first["tokens"] == 8
  assert run_command("export", [str(run_dir), "--out", str(tmp_path / "hf")]) == 0
  assert (tmp_path / "hf" / "chat_template.jinja").read_text() == CHATML


@pytest.mark.parametrize(
  "rows, words",
  [
    ([{"prompt": "1 + 1 = ", "rejected": "3"}], "pairs.jsonl:1: no 'chosen' field"),
    (
      [{"prompt": [{"role": "user", "content": "1+1?"}], "chosen": [], "rejected": []}],
      "empty list",
    ),
  ],
)
def test_bad_pairs_are_one_line_and_exit_2_with_nothing_written(tmp_path, capsys, rows, words):
  path = tmp_path / "pairs.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  args = [*BASE, *DPO, f"data.path={path}", f"run_dir={tmp_path / 'run'}"]
  assert train_cli.main(args) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and words in err[0], err
  assert not (tmp_path / "run").exists()


def test_the_memory_ledger_counts_pairs_and_names_the_reference(tmp_path, capsys):
  """A pair is two sequences in one forward: the ledger predicts a preference batch of G
  pairs as a supervised batch of 2G sequences, and says what the reference holds."""
  from jaxstep.cli import memory as memory_cli
  from jaxstep.trainer.plan.memory import predicted_bytes

  path = sums_file(tmp_path)
  args = [*BASE, *DPO, f"data.path={path}", f"run_dir={tmp_path / 'run'}"]
  assert memory_cli.main(args) == 0
  out = capsys.readouterr().out
  per_device = 8 // (2 * jax.device_count())  # one device, unless this process has more
  assert f"micro-batch {per_device} pairs per device" in out
  assert "the reference is the LoRA base" in out
  pairs = config_lib.load(None, [*args, "model.vocab_size=264"])
  sft = dataclasses.replace(pairs, preference=type(pairs.preference)())
  double = dataclasses.replace(sft, train=dataclasses.replace(sft.train, global_batch_size=16))
  got, want = (predicted_bytes(c, 10_000, 2, 1, 1) for c in (pairs, double))
  assert got["activations"] == want["activations"] and got["batch"] == want["batch"]


FULL = ["preference.loss=dpo", "preference.beta=0.5"]  # no LoRA: a live reference


@pytest.mark.slow
def test_full_fine_tuning_dpo_keeps_a_frozen_copy_and_starts_at_ln2(tmp_path):
  """Without LoRA the reference is a frozen copy of the starting weights in the state: the
  first loss is ln 2, K = 2 trains as K = 1, and the copy never moves while the params do."""
  runs = {}
  for k in (1, 2):
    cfg = cfg_for(tmp_path, *FULL, f"train.grad_accum_steps={k}", name=f"k{k}")
    runs[k] = config_run.train(cfg)
  first = logged(tmp_path / "k1")[0]
  assert first["loss"] == pytest.approx(math.log(2), rel=1e-6) and first["rewards/margins"] == 0
  for a, b in zip(logged(tmp_path / "k1"), logged(tmp_path / "k2"), strict=True):
    np.testing.assert_allclose(b["loss"], a["loss"], rtol=2e-5, atol=1e-6)
  state = runs[1].state
  run, start, _ = build(cfg_for(tmp_path, *FULL, name="fresh"))
  frozen = jax.tree.leaves(state.model_state["reference"])
  initial = jax.tree.leaves(jax.device_get(start.params))
  assert all(np.array_equal(np.asarray(x), y) for x, y in zip(frozen, initial, strict=True))
  moved = jax.tree.leaves(jax.device_get(state.params))
  assert any(not np.array_equal(x, y) for x, y in zip(moved, initial, strict=True))


@pytest.mark.slow
def test_a_bf16_reference_copy_halves_its_bytes_and_still_trains(tmp_path, capsys):
  from jaxstep.cli import memory as memory_cli

  result = config_run.train(cfg_for(tmp_path, *FULL, "preference.reference_dtype=bf16"))
  leaves = jax.tree.leaves(result.state.model_state["reference"])
  assert {x.dtype for x in leaves} == {jnp.dtype(jnp.bfloat16)}
  assert logged(tmp_path / "run")[0]["loss"] == pytest.approx(math.log(2), abs=0.02)
  args = [*BASE, *FULL, f"data.path={sums_file(tmp_path)}", f"run_dir={tmp_path / 'm'}"]
  assert memory_cli.main([*args, "preference.reference_dtype=bf16"]) == 0
  assert "a frozen copy of the starting weights in bf16" in capsys.readouterr().out


@pytest.mark.slow
def test_a_full_fine_tuning_dpo_run_killed_with_sigkill_resumes_bitwise(tmp_path):
  """The live reference is checkpointed with the state: the resumed run's copy, params and
  optimizer state end bitwise equal to the uninterrupted run's."""
  from conftest import bitwise_same_checkpoints, straight_and_killed

  path = sums_file(tmp_path)
  args = [*BASE, *FULL, f"data.path={path}", "train.max_steps=6", "checkpoint.every=2"]
  straight, killed = straight_and_killed(tmp_path, [*args, "mesh.cpu_devices=1"], kill_at=2)
  step, a = bitwise_same_checkpoints(straight, killed)
  assert step == 6 and jax.tree.leaves(a["model_state"])


@pytest.mark.slow
def test_batches_cut_to_their_pairs_train_as_batches_padded_to_seq_len(tmp_path):
  """``preference.length_buckets`` 4 (the default) against 1 at ``train.seq_len`` 64, where
  the sums' pairs (about 14 tokens) fill the first bucket: the same updates, in fp32's
  rounding of sums over fewer zeros."""
  from jaxstep import data
  from jaxstep.trainer.plan.numbers import make_plan

  runs = {}
  for b in (1, 4):
    longer = ["train.seq_len=64", "model.max_seq_len=64", "train.max_steps=2"]
    cfg = cfg_for(tmp_path, *DPO, *longer, f"preference.length_buckets={b}", name=f"b{b}")
    train = make_plan(cfg, read_data=True).dataset.train
    assert data.global_batch(train, 0, 0, 0, 8, 0)["chosen_inputs"].shape == (8, 64 // b)
    config_run.train(cfg)
    runs[b] = logged(tmp_path / f"b{b}")
    for r in runs[b]:  # the throughput counts the positions the cut batch holds
      assert r["tokens_per_sec"] * r["step_time"] == pytest.approx(8 * 2 * 64 // b)
  for a, b in zip(runs[1], runs[4], strict=True):
    for key in ("loss", "grad_norm", "logps/chosen", "rewards/margins"):
      np.testing.assert_allclose(b[key], a[key], rtol=2e-5, atol=1e-5, err_msg=key)
