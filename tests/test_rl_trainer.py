"""``jaxstep.RLTrainer``: GRPO on a model of your own through the Trainer's run driver —
exact over micro-batches, resumable between passes over a rollout to the bit, with held-out
prompt sets, hooks, the live reference and one-line refusals."""

import json

import numpy as np
import pytest
import yaml
from conftest import bitwise_same_checkpoints, read_lines

import jaxstep
from jaxstep import data, models
from jaxstep.data.readers import BUNDLED_PATHS
from jaxstep.errors import ConfigError, RewardError
from jaxstep.trainer.store.param_layout import PARAM_LAYOUT

TIMING = ("tokens_per_sec", "step_time", "mfu", "rollout_s", "rollout_tokens_per_s")
ROWS = [json.loads(x) for x in BUNDLED_PATHS["bundled:sums"].read_text().splitlines()[:40]]
TOK = data.ByteTokenizer()
CFG = models.GPTConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=1, n_heads=2, max_seq_len=32)


def digits(prompts, completions, answer, **_):
  """A reward that varies among a random model's completions: the share of digits, plus 1
  for the exact answer."""
  return [sum(ch.isdigit() for ch in c) / max(len(c), 1) + (c.strip() == a) for c, a in
          zip(completions, answer, strict=True)]  # fmt: skip


def trainer(run_dir, *, train=(), rl=(), rewards=(digits,), model=CFG, prompts=ROWS[:32], **kwargs):
  _, params = models.build(CFG, 0)
  settings = {"global_batch_size": 16, "grad_accum_steps": 1, "max_steps": 3, "log_every": 1}
  return jaxstep.RLTrainer(
    model,
    params,
    jaxstep.OptimConfig(lr=3e-3, warmup_steps=0),
    prompts=prompts,
    tokenizer=TOK,
    rewards=list(rewards),
    run_dir=run_dir,
    rl={"num_generations": 4, "max_new_tokens": 4, **dict(rl)},
    train={**settings, "progress": False, **dict(train)},
    **kwargs,
  )


def checkpoint_run(run_dir) -> dict:
  """The run-state JSON of the run's newest checkpoint."""
  from jaxstep.trainer.store import checkpoint_read

  (_, newest), *_ = checkpoint_read.step_dirs(run_dir / "checkpoints")
  return checkpoint_read.read_step(newest, arrays=False).run


def records(run_dir) -> list[dict]:
  return [
    {k: v for k, v in r.items() if k not in TIMING} for r in read_lines(run_dir / "metrics.jsonl")
  ]


@pytest.mark.slow
def test_k_micro_batches_give_one_big_batchs_run(tmp_path):
  trainer(tmp_path / "k1").fit()
  trainer(tmp_path / "k4", train={"grad_accum_steps": 4}).fit()
  a, b = records(tmp_path / "k1"), records(tmp_path / "k4")
  assert [r["step"] for r in a] == [1, 2, 3] and a[0]["advantage_std"] > 0  # a signal to learn
  for x, y in zip(a, b, strict=True):
    assert x["completion_tokens"] == y["completion_tokens"]
    for key in ("loss", "grad_norm", "reward", "entropy"):
      assert y[key] == pytest.approx(x[key], rel=1e-5, abs=1e-7), key


@pytest.mark.slow
def test_a_run_stopped_between_passes_resumes_to_the_bit(tmp_path):
  """Two passes per rollout: the run stopped after update 3 holds rollout 1 half-used; the
  resumed run reads it back and ends where the straight run does, records included."""
  settings = {"max_steps": 6, "schedule_steps": 6, "seed": 3}
  trainer(tmp_path / "straight", train=settings, rl={"iterations": 2}).fit()
  trainer(tmp_path / "stopped", train={**settings, "max_steps": 3}, rl={"iterations": 2}).fit()
  trainer(tmp_path / "stopped", train=settings, rl={"iterations": 2}).fit()
  step, _ = bitwise_same_checkpoints(tmp_path / "straight", tmp_path / "stopped")
  assert step == 6
  a, b = records(tmp_path / "straight"), records(tmp_path / "stopped")
  assert [r["rl_pass"] for r in b] == [0, 1, 0, 1, 0, 1]
  assert a == b


def test_eval_prompts_hooks_and_the_live_reference(tmp_path):
  seen = []
  t = trainer(
    tmp_path / "run",
    train={"max_steps": 4, "eval_every": 2},
    rl={"beta": 0.1},
    eval_prompts={"held": ROWS[32:]},
  )
  t.add_hook(lambda loop: seen.append(loop.step), every=2)
  result = t.fit()
  assert seen == [2, 4]
  evals = read_lines(tmp_path / "run" / "eval.jsonl")
  assert [(e["step"], e["set"], e["eval_prompts"]) for e in evals] == [
    (2, "held", 8),
    (4, "held", 8),
  ]
  assert set(evals[0]) >= {"eval_reward", "eval_rewards/digits"}
  got = records(tmp_path / "run")
  assert got[0]["kl"] == 0.0 and got[-1]["kl"] > 0  # the reference is the starting policy
  assert result.last_record["step"] == 4
  saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
  assert saved["rl"]["rewards"] == ["digits"] and saved["rl"]["beta"] == 0.1
  # a checkpoint names its bundled model and the params' layout, for a later layout to read
  run = checkpoint_run(tmp_path / "run")
  assert run["param_layout"] == PARAM_LAYOUT and run["model"]["n_heads"] == CFG.n_heads


def test_any_apply_fn_samples_and_trains_with_agreeing_log_probs(tmp_path):
  """A model given as a bare apply_fn is sampled by full recompute; the first pass's
  log-probs agree with the sampler's (else the run would stop)."""
  apply_fn, _ = models.build(CFG, 0)
  trainer(tmp_path / "run", model=apply_fn, max_seq_len=CFG.max_seq_len).fit()
  got = records(tmp_path / "run")
  assert [r["logp_gap_excess"] for r in got] == [0.0, 0.0, 0.0]
  assert got[0]["logp_gap"] < 1e-4
  run = checkpoint_run(tmp_path / "run")  # a model of your own: not named, the layout is
  assert run["param_layout"] == PARAM_LAYOUT and "model" not in run


@pytest.mark.parametrize(
  ("kwargs", "message"),
  [
    ({"train": {"global_batch_size": 18}}, "18 is not a multiple of rl.num_generations 4"),
    ({"rl": {"rewards": ["exact_answer"]}}, "give RLTrainer's rewards and reward_weights"),
    ({"prompts": "sums.jsonl"}, "prompts must be a list of rows"),
    ({"rl": {"advantage": "ppo"}}, "rl.advantage must be one of"),
    ({"model": models.LlamaConfig(num_experts=4, moe_intermediate_size=8)}, "dense policy"),
  ],
)
def test_bad_input_is_one_clear_error(tmp_path, kwargs, message):
  with pytest.raises(ConfigError, match=message):
    trainer(tmp_path / "run", **kwargs)
  assert not (tmp_path / "run").exists()


def test_a_reward_that_raises_names_itself_and_the_row(tmp_path):
  def broken(prompts, completions, **_):
    return [1 / 0 for _ in completions]

  with pytest.raises(RewardError, match="reward broken raised ZeroDivisionError on completion 0"):
    trainer(tmp_path / "run", rewards=[broken]).fit()
  assert not list((tmp_path / "run" / "checkpoints").glob("*[0-9]"))


def test_rows_in_memory_encode_as_a_prompts_file_does(tmp_path):
  from jaxstep.data.prompt_rows import prompt_set, read_prompts

  path = tmp_path / "p.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
  a, b = prompt_set(ROWS, TOK), read_prompts(str(path), TOK, max_prompt_len=0)
  assert a.texts == b.texts and a.columns == b.columns
  assert all(np.array_equal(x, y) for x, y in zip(a.ids, b.ids, strict=True))


@pytest.mark.slow
def test_the_docs_example_runs(tmp_path):
  import pathlib
  import re

  doc = pathlib.Path(__file__).resolve().parent.parent / "docs" / "rl.md"
  code = re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S)[0]
  assert '"runs/grpo-python"' in code
  exec(code.replace('"runs/grpo-python"', repr(str(tmp_path / "run"))), {})
  assert [r["step"] for r in read_lines(tmp_path / "run" / "metrics.jsonl")][-1] == 20
  assert [e["step"] for e in read_lines(tmp_path / "run" / "eval.jsonl")] == [10, 20]


def test_a_teacher_turns_the_trainer_into_on_policy_distillation(tmp_path):
  """``teacher=(model, params)``: the first update's loss is coef × the sampled reverse KL
  against the teacher; the teacher is in the state, not in the checkpoint; a teacher of
  another vocabulary, or a supervised mode, is one line."""
  _, teacher_params = models.build(CFG, 9)
  run = trainer(
    tmp_path / "run",
    train={"max_steps": 2},
    teacher=(CFG, teacher_params),
    distill={"coef": 0.5, "teacher_dtype": "bf16", "estimator": "sampled"},
  )
  run.fit()
  first = read_lines(tmp_path / "run" / "metrics.jsonl")[0]
  assert first["distill/reverse_kl"] > 0
  assert first["loss"] == pytest.approx(0.5 * first["distill/reverse_kl"], rel=1e-4, abs=1e-6)
  from conftest import restore_state_arrays

  _, state = restore_state_arrays(tmp_path / "run")
  assert state["model_state"] is None
  other = models.GPTConfig(vocab_size=300, d_model=32, n_layers=1, n_heads=2, max_seq_len=32)
  with pytest.raises(ConfigError, match="student's vocabulary"):
    trainer(tmp_path / "x", teacher=(other, models.build(other, 0)[1]))
  with pytest.raises(ConfigError, match="distills on its own samples"):
    trainer(tmp_path / "y", teacher=(CFG, teacher_params), distill={"mode": "logits"})
  gkd = {"mode": "gkd", "lmbda": 0.5, "completion_column": "answer"}
  with pytest.raises(ConfigError, match="drop rl.top_k"):
    trainer(tmp_path / "z", teacher=(CFG, teacher_params), distill=gkd, rl={"top_k": 5})


@pytest.mark.slow
def test_a_trainers_gkd_trains_on_the_prompts_completions_with_lmbda_0(tmp_path):
  """``distill={"mode": "gkd", "lmbda": 0}``: every update on the rows' ``answer``s, which
  the reward scores as all digits and exact (2), none sampled."""
  _, teacher_params = models.build(CFG, 9)
  gkd = {"mode": "gkd", "lmbda": 0.0, "completion_column": "answer"}
  trainer(tmp_path / "run", teacher=(CFG, teacher_params), distill=gkd).fit()
  for record in read_lines(tmp_path / "run" / "metrics.jsonl"):
    assert record["distill/on_policy"] == 0.0 and record["rewards/digits/mean"] == 2.0
