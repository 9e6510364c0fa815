"""Distillation through ``jaxstep train`` (``distill.teacher``): a teacher run directory or
exported model folder scores the student's windows (``logits``, ``gkd``) or its rollouts
(``on_policy``); the teacher rides in the train state, never in a checkpoint, and a killed
run resumes bitwise; settings that do not fit are one line."""

import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import SMALL_MODEL, read_lines, restore_state_arrays
from test_hf_folder import tokenizer_files  # noqa: F401 - fixture
from test_pretrained import folder  # noqa: F401 - fixture

from jaxstep.errors import ConfigError, DataError, RunDirError
from jaxstep.trainer import config_run
from jaxstep.trainer.config import loading as config_lib

COMMON = [
  *SMALL_MODEL,
  "train.global_batch_size=16",
  "train.log_every=1",
  "train.eval_every=0",
  "train.sample_every=0",
  "model.dropout=0",
  "optim.warmup_steps=0",
]
SFT = [*COMMON, "data.path=bundled:sum-docs", "data.pack=false", "data.eval_fraction=0.05"]
RL = [
  *COMMON,
  "data.path=bundled:sums",
  "data.eval_fraction=0.02",
  "rl.rewards=[exact_answer]",
  "rl.num_generations=4",
  "rl.max_new_tokens=5",
]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> pathlib.Path:
  """A run directory trained for 6 updates on the sums (another seed than the students')."""
  run_dir = tmp_path_factory.mktemp("teacher") / "run"
  cfg = config_lib.load(None, [*SFT, "train.max_steps=6", "train.seed=5", f"run_dir={run_dir}"])
  config_run.train(cfg)
  return run_dir


def test_a_logits_run_weighs_its_two_terms_and_stores_no_teacher(tmp_path, teacher):
  args = [*SFT, "train.max_steps=2", "checkpoint.every=1", f"run_dir={tmp_path / 'run'}"]
  args += [f"distill.teacher={teacher}", "distill.alpha=0.3", "distill.temperature=2.0"]
  config_run.train(config_lib.load(None, args))
  for line in read_lines(tmp_path / "run" / "metrics.jsonl"):
    soft, nll = line["distill/divergence"], line["distill/nll"]
    assert soft > 0 and nll > 0
    assert line["loss"] == pytest.approx(0.3 * soft + 0.7 * nll, rel=1e-5)
  _, state = restore_state_arrays(tmp_path / "run")
  assert state["model_state"] is None  # read again at every start, never stored


def test_an_exported_teacher_in_bf16_drives_gkd(tmp_path, teacher):
  from jaxstep.cli import export as export_cli

  assert export_cli.main([str(teacher), "--out", str(tmp_path / "teacher-hf")]) == 0
  args = [*SFT, "train.max_steps=2", f"run_dir={tmp_path / 'run'}", "distill.mode=gkd"]
  args += [f"distill.teacher={tmp_path / 'teacher-hf'}", "distill.teacher_dtype=bf16"]
  result = config_run.train(config_lib.load(None, args))
  teacher_leaves = jax.tree.leaves(result.state.model_state["teacher"])
  assert teacher_leaves and all(x.dtype == jax.numpy.bfloat16 for x in teacher_leaves)
  lines = read_lines(tmp_path / "run" / "metrics.jsonl")
  assert all(r["loss"] == pytest.approx(r["distill/divergence"], rel=1e-6) for r in lines)


def test_on_policy_first_update_is_the_teachers_reverse_kl(tmp_path, teacher):
  """With the sampled estimator, on the first pass over a rollout the importance ratio is
  1, so the loss is coef × the sampled reverse KL against the teacher, which the record
  reports."""
  args = [*RL, "train.max_steps=2", "train.grad_accum_steps=2", f"run_dir={tmp_path / 'run'}"]
  args += [f"distill.teacher={teacher}", "distill.coef=0.5", "train.eval_every=2"]
  args += ["distill.estimator=sampled"]
  config_run.train(config_lib.load(None, args))
  first = read_lines(tmp_path / "run" / "metrics.jsonl")[0]
  assert first["distill/reverse_kl"] > 0
  assert first["loss"] == pytest.approx(0.5 * first["distill/reverse_kl"], rel=1e-4, abs=1e-6)
  evals = read_lines(tmp_path / "run" / "eval.jsonl")
  assert "eval_rewards/exact_answer" in evals[-1]


@pytest.mark.slow
def test_check_compares_k_on_a_first_rollout_of_the_datas_completions(tmp_path, teacher, capsys):
  """With lmbda 0 the run's first rollout is the prompts' own completions: ``check``
  builds that one (marked ``given``), and refuses a missing column before it."""
  from jaxstep.cli import check as check_cli

  args = [*RL, f"distill.teacher={teacher}", "distill.mode=gkd", "distill.lmbda=0"]
  args += ["train.grad_accum_steps=4", f"run_dir={tmp_path / 'run'}"]
  assert check_cli.main([*args, "distill.completion_column=answer"]) == 0
  out = capsys.readouterr()
  assert "PASS: accumulation is exact" in out.out
  assert check_cli.main(args) != 0
  assert "no 'completion' column" in capsys.readouterr().err


@pytest.mark.slow
def test_gkd_on_the_students_samples_at_beta_1_is_on_policys_reverse_kl(tmp_path, teacher):
  """``distill.mode=gkd`` in an RL run trains on the student's samples (TRL's lmbda 1);
  at β = 1 its JSD is the reverse KL, so its updates are ``on_policy``'s (full estimator)
  record by record, and at β = 0.5 they are not."""
  args = [*RL, "train.max_steps=3", f"distill.teacher={teacher}", "distill.coef=0.5"]
  runs = {}
  for name, mode in (("reverse", ["distill.mode=on_policy"]), ("gkd", ["distill.mode=gkd",
      "distill.beta=1"]), ("mid", ["distill.mode=gkd", "distill.beta=0.5"])):  # fmt: skip
    config_run.train(config_lib.load(None, [*args, *mode, f"run_dir={tmp_path / name}"]))
    runs[name] = read_lines(tmp_path / name / "metrics.jsonl")
  for a, b, c in zip(runs["reverse"], runs["gkd"], runs["mid"], strict=True):
    np.testing.assert_allclose([b["loss"], b["grad_norm"]], [a["loss"], a["grad_norm"]],
                               rtol=1e-5)  # fmt: skip
    assert c["loss"] < 0.9 * a["loss"]  # another divergence (the JSD is the smaller here)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["gkd", "on_policy"])
def test_a_chunked_loss_distills_as_the_whole_logits(tmp_path, teacher, mode, monkeypatch):
  """``model.loss_chunk``: both models' logits a few tokens at a time (the chunked path
  traced, for that run only), the same records."""
  from jaxstep.core import chunked_loss

  traced, pair_map = [], chunked_loss.chunked_pair_map
  monkeypatch.setattr(
    chunked_loss, "chunked_pair_map", lambda *a, **k: traced.append(1) or pair_map(*a, **k)
  )
  data, keys = (SFT, ("distill/nll",)) if mode == "gkd" else (RL, ("distill/reverse_kl",))
  runs = []
  for chunk in (0, 24):
    run_dir = tmp_path / f"chunk{chunk}"
    args = [*data, "train.max_steps=2", f"model.loss_chunk={chunk}", f"distill.mode={mode}"]
    config_run.train(
      config_lib.load(None, [*args, f"distill.teacher={teacher}", f"run_dir={run_dir}"])
    )
    runs.append(read_lines(run_dir / "metrics.jsonl"))
    assert bool(traced) == bool(chunk), (chunk, len(traced))
  for a, b in zip(*runs, strict=True):
    for key in ("loss", "grad_norm", *keys):
      np.testing.assert_allclose(b[key], a[key], rtol=2e-5, atol=1e-7, err_msg=key)


def test_gkd_trains_a_share_of_updates_on_the_datas_completions(tmp_path, teacher):
  """``distill.lmbda`` 0.6: each rollout a seeded coin chooses the student's samples or
  the prompts' own completions (the sums' ``answer`` column, then the stop id), which the
  rewards score as right and whose length is the answer's; the records say which."""
  from jaxstep.trainer.rl.rollout import COIN_STREAM

  args = [*RL, "train.max_steps=3", f"distill.teacher={teacher}", "distill.mode=gkd"]
  args += ["distill.lmbda=0.6", "distill.completion_column=answer", f"run_dir={tmp_path / 'r'}"]
  config_run.train(config_lib.load(None, args))
  lines = read_lines(tmp_path / "r" / "metrics.jsonl")
  coins = [np.random.default_rng([0, i, COIN_STREAM]).random() < 0.6 for i in range(3)]
  assert [r["distill/on_policy"] for r in lines] == [float(c) for c in coins] == [1, 0, 0]
  for record in lines[1:]:
    assert record["rewards/exact_answer/mean"] == 1.0 and record["logp_gap"] == 0.0
    assert record["rollout_s"] == 0.0 and "rollout_tokens_per_s" not in record  # no sampling
    assert "frac_reward_zero_std" not in record  # G copies of one completion: no spread
    assert 2 <= record["completions/mean_length"] <= 4  # 1-3 digits and the stop id
    assert record["loss"] > 0


def test_distillation_settings_that_do_not_fit_are_one_line(tmp_path, teacher):
  given = [f"distill.teacher={teacher}", f"run_dir={tmp_path / 'run'}"]
  for args, words in (
    ([*SFT, *given, "distill.mode=on_policy"], "name rl.rewards"),
    ([*RL, *given, "distill.mode=logits"], "use distill.mode=on_policy or gkd"),
    ([*RL, *given, "distill.mode=gkd", "distill.estimator=sampled"], "drop distill.estimator"),
    ([*SFT, *given, "distill.mode=gkd", "distill.lmbda=0.5"], "drop distill.lmbda"),
    ([*RL, *given, "distill.lmbda=0.5"], "use distill.mode=gkd"),
    ([*RL, *given, "distill.mode=gkd", "distill.lmbda=0.5", "rl.top_k=5"], "drop rl.top_k"),
    ([*RL, *given, "rl.filter_groups=true"], "drop rl.filter_groups"),
    ([*SFT, *given, "distill.beta=2"], "weights in"),
    ([*RL, f"run_dir={tmp_path / 'run'}", "rl.num_generations=1"], "must be >= 2 for advantage"),
  ):
    with pytest.raises(ConfigError, match=words):
      config_lib.load(None, args)
  assert config_lib.load(None, [*RL, *given, "rl.num_generations=1"]).rl.num_generations == 1
  (tmp_path / "untrained").mkdir()  # a run directory with a config and no checkpoint
  (tmp_path / "untrained" / "config.yaml").write_text((teacher / "config.yaml").read_text())
  empty = [*SFT, f"distill.teacher={tmp_path / 'untrained'}", f"run_dir={tmp_path / 'run'}"]
  with pytest.raises(RunDirError, match="distill.teacher .*untrained: .* holds no checkpoint"):
    config_run.train(config_lib.load(None, empty))
  no_column = [*RL, *given, "distill.mode=gkd", "distill.lmbda=0.5", "train.max_steps=1"]
  with pytest.raises(DataError, match="no 'completion' column .*distill.completion_column"):
    config_run.train(config_lib.load(None, no_column))
  gone = [*SFT, f"distill.teacher={tmp_path / 'nowhere'}", f"run_dir={tmp_path / 'run'}"]
  with pytest.raises(ConfigError, match="neither a model folder"):
    config_run.train(config_lib.load(None, gone))
  assert not (tmp_path / "run").exists()  # refused before anything is written


@pytest.mark.slow
def test_an_moe_student_distills_with_its_router_losses_exact_over_k(tmp_path, teacher):
  """A mixture-of-experts student: its router losses ride along, and with ``lbl_scope:
  global`` K = 4 micro-batches give K = 1's records, on windows (a dense teacher) and on its
  own rollouts (a mixture-of-experts teacher: the first student's run)."""
  from test_moe_post_training import MOE, _same

  from jaxstep.cli.check import check_config

  moe_teacher = tmp_path / "logits-k1"
  for mode, data, ks, taught_by in (
    ("logits", SFT, (1, 4), teacher),
    ("on_policy", RL, (1, 2), moe_teacher),
  ):
    runs = []
    for k in ks:
      run_dir = tmp_path / f"{mode}-k{k}"
      args = [*data, *MOE, "train.max_steps=2", f"train.grad_accum_steps={k}"]
      args += [f"distill.teacher={taught_by}", f"run_dir={run_dir}"]
      config_run.train(config_lib.load(None, args))
      runs.append(read_lines(run_dir / "metrics.jsonl"))
    _same(runs)
    first = runs[0][0]
    assert first["moe/lbl"] > 1.0 and first["extra_loss"] > 0, first
    assert first["distill/divergence" if mode == "logits" else "distill/reverse_kl"] > 0
    report = check_config(config_lib.load(None, args))  # K against 1, the router losses too
    assert report.passed and "extra loss" in [stage.name for stage in report.stages], report


def test_a_teacher_of_another_vocabulary_is_one_line(tmp_path, folder):  # noqa: F811
  """A Qwen3 folder of 320 ids against the bytes' 259 (padded to 264)."""
  args = [*SFT, f"distill.teacher={folder[0]}", f"run_dir={tmp_path / 'run'}"]
  with pytest.raises(ConfigError, match="student's vocabulary"):
    config_run.train(config_lib.load(None, args))


@pytest.mark.slow
@pytest.mark.parametrize("data", ["windows", "prompts"])
def test_a_killed_distillation_run_resumes_bitwise(tmp_path, teacher, data):
  """GKD on supervised windows, and on prompts with lmbda 0.6 and two passes over each
  rollout: the kill comes once update 3 is saved, between the passes over rollout 1 (the
  prompts' own completions), which the resume reads back from ``rl_rollout.npz`` (unless
  update 4 was saved first); the rollouts' coins (sampled, given, given) come out the same
  and the run continues bitwise."""
  from conftest import bitwise_same_checkpoints, straight_and_killed

  args = ["train.max_steps=6", "checkpoint.every=1", "train.grad_accum_steps=2"]
  args += [f"distill.teacher={teacher}", "distill.mode=gkd", "mesh.cpu_devices=1"]
  if data == "windows":
    args = [*SFT, *args]
  else:
    args = [*RL, *args, "distill.lmbda=0.6", "distill.completion_column=answer"]
    args += ["rl.iterations=2"]
  straight, killed = straight_and_killed(tmp_path, args, kill_at=3)
  step, _ = bitwise_same_checkpoints(straight, killed)
  assert step == 6
  a, b = (read_lines(d / "metrics.jsonl") for d in (straight, killed))
  assert [r["loss"] for r in a] == [r["loss"] for r in b[-len(a) :]]


@pytest.mark.slow
def test_distillation_on_four_devices_equals_one_device(tmp_path, teacher):
  """The teacher sharded like the student (fsdp 4, a supervised run) and the batch over
  data (4 devices, an on-policy run): the same losses and gradient norms as one device."""
  meshes = {
    "data": ["mesh.cpu_devices=4", "mesh.data=4"],
    "fsdp": ["mesh.cpu_devices=4", "mesh.fsdp=4", "mesh.data=1"],
  }
  for kind, base, split in (("logits", SFT, "fsdp"), ("on_policy", RL, "data")):
    runs = {}
    for name, mesh in {"one": ["mesh.cpu_devices=1"], split: meshes[split]}.items():
      run_dir = tmp_path / f"{kind}-{name}"
      args = [*base, "train.max_steps=3", f"run_dir={run_dir}", f"distill.teacher={teacher}"]
      done = subprocess.run(
        [sys.executable, "-m", "jaxstep.train", *args, *mesh], capture_output=True
      )
      assert done.returncode == 0, done.stderr.decode()[-2000:]
      runs[name] = read_lines(run_dir / "metrics.jsonl")
    for a, b in zip(runs["one"], runs[split], strict=True):
      for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(b[key], a[key], rtol=2e-5, atol=1e-6, err_msg=f"{kind} {key}")


def test_the_memory_ledger_counts_the_teacher(tmp_path, teacher):
  from jaxstep.cli import memory as memory_cli
  from jaxstep.trainer.plan.memory import compiled_memory

  args = [*SFT, f"run_dir={tmp_path / 'run'}", "mesh.cpu_devices=1"]
  alone = compiled_memory(config_lib.load(None, args))
  cfg = config_lib.load(None, [*args, f"distill.teacher={teacher}", "distill.teacher_dtype=bf16"])
  taught = compiled_memory(cfg)
  _, state = restore_state_arrays(teacher)
  params = sum(x.size for x in jax.tree.leaves(state["params"]))
  assert taught["argument_bytes"] - alone["argument_bytes"] == 2 * params  # bf16
  assert f"the teacher {teacher} holds {params:,} parameters in bf16" in memory_cli.report(cfg)


def test_the_demo_config_distills_from_folders(tmp_path, teacher, monkeypatch):
  """``configs/distill-arith.yaml`` as the demo runs it, on small stand-ins: the teacher's
  export as the teacher and, for its shape, as the student's start too (2 updates)."""
  from jaxstep.cli import export as export_cli

  exported = tmp_path / "teacher-hf"
  assert export_cli.main([str(teacher), "--out", str(exported)]) == 0
  monkeypatch.chdir(pathlib.Path(__file__).parents[1])
  small = ["train.max_steps=2", "train.global_batch_size=16", "train.grad_accum_steps=2"]
  small += ["train.eval_every=2", "train.progress=false", f"run_dir={tmp_path / 'run'}"]
  paths = [f"model.init_from={exported}", f"distill.teacher={exported}"]
  cfg = config_lib.load("configs/distill-arith.yaml", [*paths, *small])
  assert (cfg.distill.mode, cfg.distill.estimator, cfg.rl.num_generations) == (
    "on_policy",
    "full",
    1,
  )
  config_run.train(cfg)
  lines = read_lines(tmp_path / "run" / "metrics.jsonl")
  assert lines[0]["loss"] == pytest.approx(0.0, abs=1e-5)  # the student is its own teacher
  assert "frac_reward_zero_std" not in lines[0]  # groups of one have no spread to report
  assert "eval_rewards/exact_answer" in read_lines(tmp_path / "run" / "eval.jsonl")[-1]


def test_a_resume_against_another_teacher_is_refused(tmp_path, teacher):
  """The run records its teacher; a folder whose weights changed since is one line."""
  from jaxstep.cli import export as export_cli
  from jaxstep.errors import CheckpointError

  exported = tmp_path / "teacher-hf"
  assert export_cli.main([str(teacher), "--out", str(exported)]) == 0
  args = [*SFT, "train.schedule_steps=4", f"run_dir={tmp_path / 'run'}"]
  args += [f"distill.teacher={exported}"]
  config_run.train(config_lib.load(None, [*args, "train.max_steps=2"]))
  assert export_cli.main([str(tmp_path / "run"), "--out", str(exported)]) == 0  # another model
  with pytest.raises(CheckpointError, match="the distillation teacher changed since"):
    config_run.train(config_lib.load(None, [*args, "train.max_steps=4"]))


def test_a_poisoned_update_of_a_distillation_run_is_skipped(tmp_path, teacher):
  """``train.debug_nan_step`` reaches a loss that carries the teacher (4 arguments)."""
  args = [*SFT, "train.max_steps=3", "train.debug_nan_step=2", f"run_dir={tmp_path / 'run'}"]
  config_run.train(config_lib.load(None, [*args, f"distill.teacher={teacher}"]))
  lines = read_lines(tmp_path / "run" / "metrics.jsonl")
  assert [r["updated"] for r in lines] == [True, False, True]


def test_a_teacher_shorter_than_the_windows_is_one_line(tmp_path, teacher):
  args = [*SFT, "model.max_seq_len=32", "train.seq_len=24", f"run_dir={tmp_path / 'run'}"]
  with pytest.raises(ConfigError, match="takes 16 positions, the student's windows"):
    config_run.train(config_lib.load(None, [*args, f"distill.teacher={teacher}"]))


def test_a_packed_run_gives_the_teacher_its_documents(tmp_path, teacher):
  """Self-distillation on packed windows with document masks: the student starts as the
  teacher, so the KL is 0 at the first update only if the teacher sees the same document
  boundaries and positions as the student."""
  from jaxstep.cli import export as export_cli

  exported = tmp_path / "teacher-hf"
  assert export_cli.main([str(teacher), "--out", str(exported)]) == 0
  args = [*SFT, "data.pack=true", "data.document_mask=true", "train.max_steps=1"]
  args += [f"model.init_from={exported}", f"distill.teacher={exported}", "distill.alpha=1.0"]
  config_run.train(config_lib.load(None, [*args, f"run_dir={tmp_path / 'run'}"]))
  first = read_lines(tmp_path / "run" / "metrics.jsonl")[0]
  assert first["distill/divergence"] == pytest.approx(0.0, abs=1e-6)
  assert first["distill/nll"] > 0.1


def test_a_lora_student_distills_on_policy_with_its_base_as_reference(tmp_path, teacher):
  """LoRA adapters train against the teacher; ``rl.beta`` > 0 takes the LoRA base as the
  KL's reference (its KL is 0 before the first update); checkpoints hold neither."""
  args = [*RL, "model.lora.rank=4", "rl.beta=0.1", "train.max_steps=2", "checkpoint.every=1"]
  args += [f"distill.teacher={teacher}", f"run_dir={tmp_path / 'run'}", "optim.lr=1e-2"]
  config_run.train(config_lib.load(None, args))
  lines = read_lines(tmp_path / "run" / "metrics.jsonl")
  assert lines[0]["kl"] == 0.0 and lines[0]["loss"] > 0 and lines[1]["kl"] > 0
  _, state = restore_state_arrays(tmp_path / "run")
  assert state["model_state"] is None


def test_a_trainer_of_your_own_distills_with_the_teacher_in_its_state(tmp_path):
  """``jaxstep.Trainer`` with ``distill.teacher_loss`` and the teacher's params in the
  model state: offline KD of your own model; its checkpoints hold no teacher."""
  import jax.numpy as jnp
  from conftest import tiny_lm_apply, tiny_lm_params

  import jaxstep
  from jaxstep.core import distill

  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 11, (40, 8, 9)).astype(np.int32)
  data = [{"inputs": t[:, :-1], "targets": t[:, 1:], "loss_mask": np.ones((8, 8), np.int32)}
          for t in tokens]  # fmt: skip
  d = distill.DistillConfig(alpha=1.0)
  build = lambda teacher: distill.supervised_loss(tiny_lm_apply, teacher, d, "logits")  # noqa: E731
  teacher_params = tiny_lm_params(vocab=11, seed=3)
  train = {"global_batch_size": 8, "grad_accum_steps": 2, "max_steps": 30, "progress": False}
  result = jaxstep.Trainer(
    distill.teacher_loss(build, tiny_lm_apply),
    tiny_lm_params(vocab=11),
    jaxstep.OptimConfig(lr=3e-2, warmup_steps=0),
    train_data=data,
    run_dir=tmp_path / "run",
    model_state={distill.TEACHER: teacher_params},
    train={**train, "log_every": 1},
  ).fit()
  kl = [r["loss"] for r in read_lines(tmp_path / "run" / "metrics.jsonl")]
  assert kl[-1] < 0.5 * kl[0]  # the student moves to the teacher's distributions
  held = result.state.model_state[distill.TEACHER]
  assert all(
    jnp.array_equal(a, b)
    for a, b in zip(jax.tree.leaves(held), jax.tree.leaves(teacher_params), strict=True)
  )
  assert restore_state_arrays(tmp_path / "run")[1]["model_state"] is None
