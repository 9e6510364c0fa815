"""The examples run and do what they say."""

import importlib.util
import pathlib

import pytest
from conftest import long_run_env, xla_flags

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def load(name):
  spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_linear_regression_converges_to_3x_plus_2(capsys):
  state = load("linear_regression").main()
  assert float(state.params["w"]) == pytest.approx(3.0, abs=0.05)
  assert float(state.params["b"]) == pytest.approx(2.0, abs=0.05)
  lines = capsys.readouterr().out.strip().splitlines()
  assert len(lines) == 100 and lines[-1].startswith("step 100")


@pytest.mark.slow
def test_pretrain_text_learns_on_a_users_file(tmp_path):
  corpus = tmp_path / "mine.txt"
  corpus.write_text("\n\n".join("the cat sat on the mat. " * 3 for _ in range(200)))
  losses = load("pretrain_text").main(str(corpus), 30)
  assert losses[-1] < losses[0] - 1.0


@pytest.mark.slow
def test_sft_chat_counts_only_assistant_tokens(capsys):
  first, last = load("sft_chat").main(20)
  out = capsys.readouterr().out
  assert "[<eos>]" in out and "<|user|>" in out and "[<|user|>" not in out
  assert last < first


@pytest.mark.slow
def test_the_dpo_demo_raises_both_held_out_scores(tmp_path):
  """The demo as the docs run it (about a minute): on the pairs the DPO run held out, the
  share whose chosen answer is the more likely one and the share of sums the greedy decode
  gets right both rise (measured 0.51 → 0.67 and 0.03 → 0.10). Run as the docs run it, a
  process of its own with XLA's default optimizations."""
  import json
  import subprocess
  import sys

  command = [sys.executable, str(EXAMPLES / "dpo_sums.py"), str(tmp_path)]
  done = subprocess.run(command, env=long_run_env(JAX_PLATFORMS="cpu"), capture_output=True,
                        text=True, timeout=1200)  # fmt: skip
  assert done.returncode == 0, done.stderr[-3000:]
  report = json.loads((tmp_path / "report.json").read_text())
  assert report["held_out_pairs"] > 50
  for when in ("before", "after"):
    assert set(report[when]) == {"chosen_more_likely", "greedy_sum_right"}
  before, after = report["before"], report["after"]
  assert after["chosen_more_likely"] >= before["chosen_more_likely"] + 0.05, report
  assert after["greedy_sum_right"] >= before["greedy_sum_right"] + 0.03, report
  assert 0.5 < report["after_reward_accuracy"] <= 1
  assert (tmp_path / "report.json").is_file() and (tmp_path / "sft-hf" / "tokenizer.json").is_file()


def test_custom_loss_with_weight_units_is_k_invariant():
  loss, gap = load("custom_loss").main(100)
  assert loss < 0.1 and gap < 1e-4


@pytest.mark.slow
def test_own_nnx_model_trains_on_4_devices_and_resumes_bitwise(tmp_path):
  import os
  import subprocess
  import sys

  env = {**os.environ, "XLA_FLAGS": xla_flags()}  # no device count: the example chooses
  env["TMPDIR"] = str(tmp_path)  # where its checkpoint goes, and is removed from
  proc = subprocess.run(
    [sys.executable, str(EXAMPLES / "own_model.py"), "40"],
    capture_output=True,
    text=True,
    timeout=600,
    env={**env, "JAX_PLATFORMS": "cpu"},
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "4 devices; resumed at update 20: bitwise identical = True" in proc.stdout
  last = [line for line in proc.stdout.splitlines() if line.startswith("update 40:")][-1]
  assert float(last.rsplit("accuracy", 1)[1]) >= 0.8
  assert list(tmp_path.iterdir()) == []
