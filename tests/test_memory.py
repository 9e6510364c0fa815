"""Memory ledger: the ZeRO table by hand, jaxstep's layout against the compiled step."""

import subprocess
import sys

import pytest

from jaxstep.cli.memory import GIB
from jaxstep.trainer.config import loading as config_lib
from jaxstep.trainer.plan.memory import compiled_memory, jaxstep_layout, textbook_state_bytes


@pytest.mark.parametrize(
  "stage, expected_bytes",
  [
    (0, 120_000_000_000),  # 16 × 7.5e9              (ZeRO paper, Fig. 1: 120 GB)
    (1, 31_406_250_000),  # 4 × 7.5e9 + 12 × 7.5e9/64      (31.4 GB)
    (2, 16_640_625_000),  # 2 × 7.5e9 + 14 × 7.5e9/64      (16.6 GB)
    (3, 1_875_000_000),  # 16 × 7.5e9 / 64                 (1.9 GB)
  ],
)
def test_textbook_table_matches_the_zero_paper(stage, expected_bytes):
  assert textbook_state_bytes(7_500_000_000, zero_stage=stage, data_parallel=64) == expected_bytes


def test_textbook_single_device_is_16_bytes_per_param():
  assert {textbook_state_bytes(1000, zero_stage=s) for s in range(4)} == {16_000}


def test_jaxstep_layout_by_precision_and_fsdp():
  fp32 = jaxstep_layout(1000)
  assert sum(fp32.values()) == 16_000 and len(fp32) == 3
  bf16 = jaxstep_layout(1000, precision="bf16", fsdp=4)
  assert bf16["params fp32 (4P/F)"] == 1000 and bf16["Adam moments fp32 (8P/F)"] == 2000
  assert bf16["gathered params fp32 (4P, during the update)"] == 4000
  assert bf16["bf16 compute copy (2P, during the update)"] == 2000


@pytest.mark.slow
def test_layout_matches_compiled_arguments_on_the_tiny_config():
  cfg = config_lib.load("tiny")
  c = compiled_memory(cfg)
  layout = jaxstep_layout(c["num_params"], precision="fp32", fsdp=1)
  persistent = layout["params fp32 (4P/F)"] + layout["Adam moments fp32 (8P/F)"]
  assert persistent == pytest.approx(c["argument_bytes"], rel=0.05)
  assert c["temp_bytes"] > layout["grad accumulator fp32 (4P, during the update)"]


@pytest.mark.slow
def test_memory_cli_prints_gib_to_three_decimals():
  proc = subprocess.run(
    [sys.executable, "-m", "jaxstep.memory", "--config", "tiny"],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr
  for needle in ("ZeRO-3  16P/D", "jaxstep layout:", "arguments (state + batch)", "0.005 GiB"):
    assert needle in proc.stdout
  assert GIB == 2**30


def _predicted_over_compiled(name, *overrides):
  from jaxstep.trainer.plan.memory import predicted_bytes

  cfg = config_lib.load(name, list(overrides))
  c = compiled_memory(cfg)
  predicted = predicted_bytes(c["cfg"], c["num_params"], c["grad_accum_steps"], 1, 1)
  return predicted["peak"] / c["peak_bytes"]


@pytest.mark.parametrize(
  "name, overrides",
  [
    ("tiny", []),
    ("small", []),
    ("small", ["model.scan_layers=true"]),
    ("small", ["model.scan_layers=true", "model.remat=block", "train.precision=bf16"]),
  ],
)
@pytest.mark.slow
def test_ledger_prediction_is_within_10_percent_of_the_compiled_step(name, overrides):
  assert _predicted_over_compiled(name, *overrides) == pytest.approx(1.0, abs=0.10)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2-124m", "gpt-350m", "gpt-1.3b"])
def test_ledger_prediction_holds_for_the_real_size_configs(name):
  """Compiled on abstract inputs (nothing allocated) at the K an 80 GiB budget picks: the
  prediction's fit (the whole logits) within 10 %, and, with the loss in chunks (the
  default ``auto`` chunks these), an upper bound: it still counts the whole logits."""
  whole = _predicted_over_compiled(name, "train.grad_accum_steps=16", "model.loss_chunk=0")
  assert whole == pytest.approx(1.0, abs=0.10)
  assert _predicted_over_compiled(name, "train.grad_accum_steps=16") >= 0.95


@pytest.mark.slow
def test_memory_cli_prints_the_auto_search_for_a_budget():
  proc = subprocess.run(
    [sys.executable, "-m", "jaxstep.memory", "--config", "small", "mesh.cpu_devices=1"]
    + ["train.grad_accum_steps=auto", "train.memory_budget_gb=0.08"],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr
  assert "grad_accum_steps=auto, budget 0.080 GiB per device:" in proc.stdout
  assert "over" in proc.stdout and "fits" in proc.stdout and "chosen K = " in proc.stdout
  assert "predicted ÷ compiled peak" in proc.stdout


def test_frozen_parameters_have_no_moments_or_accumulator_in_the_layout():
  full = jaxstep_layout(1000)
  lora = jaxstep_layout(1000, trainable=10, frozen_bytes=2)
  assert lora == {
    "trainable params fp32 (4T/F)": 40,
    "frozen params bf16 (2(P−T)/F)": 1980,
    "Adam moments fp32 (8T/F)": 80,
    "grad accumulator fp32 (4T, during the update)": 40,
  }
  assert sum(lora.values()) < sum(full.values()) / 5
  assert jaxstep_layout(1000, trainable=1000) == full


@pytest.mark.slow
def test_the_memory_command_shows_the_trainable_split_of_a_lora_config(capsys):
  from jaxstep.cli import run as run_command

  args = ["model.lora.rank=4", "optim.frozen_dtype=bf16", "train.global_batch_size=8"]
  assert run_command("memory", [*args, "train.grad_accum_steps=2"]) == 0
  out = capsys.readouterr().out
  assert "train," in out and "frozen params bf16 (2(P−T)/F)" in out, out
  compiled = [line for line in out.splitlines() if "arguments (state + batch)" in line]
  assert compiled
