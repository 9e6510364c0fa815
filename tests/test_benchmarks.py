"""The benchmark scripts run (tiny sizes) and emit valid JSON with every summary key."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

SUMMARY_KEYS = {  # the step suite's headline figures, then the other suites'
  "scan_over_floor",
  "compile_ratio_k64_k1",
  "temp_mem_ratio_k64_k1",
  "depth_compile_ratio_scanned",
  "depth_compile_ratio_unrolled",
  "tokens_vs_multisteps",
  "cpu_mfu",
  "ckpt_stall_over_step",
  "host_overhead_over_step",
  "host_overhead_mlflow_over_step",
  "doc_mask_step_over_plain",
  "ckpt_save_mb_per_s",
  "ckpt_restore_mb_per_s",
  "fsdp8_state_ratio",
  "data_startup_delta_s_200m_10m",
  "data_rss_delta_mib_200m_10m",
  "prepare_over_tokenizers",
  "loader_tokens_per_s",
  "loader_batch_cost_ratio_100m_1m",
  "data_startup_delta_s_2b_10m",
  "decode_cache_over_recompute",
  "decode_tokens_per_s_b8",
  "prefill_tokens_per_s_b8",
  "ttft_ms_b8",
  "samples_over_step",
  "distill_step_over_grpo",  # the rl suite's on-policy distillation against GRPO
  "muon_steps_to_loss_over_adamw",  # the optim suite's training comparisons
  "wsd_final_loss_over_cosine",
  "step_time_over_adamw_muon",
  "moe_step_over_dense_active",  # the moe suite's
  "moe_global_lbl_step_over_micro",
  "ce_chunked_temp_over_full",  # the chunked_loss suite's
  "ce_chunked_step_time_over_full",
  "dpo_chunked_temp_over_full",
  "sliding_window_decode_over_full",  # the families suite's
}
HF_KEYS = {  # the hf suite's, with torch and transformers installed
  "hf_import_over_transformers",
  "hf_import_rss_over_model_bytes",
  "hf_read_floor_over_transformers",
  "llama_tokens_vs_pytorch",
  "llama_decode_vs_hf",
  "harness_vs_hf_requests_per_s",  # the eval suite's
  "folder_ppl_vs_transformers_rel_diff",
  "moe_tokens_vs_pytorch",
  "gemma_tokens_vs_pytorch",
}


@pytest.mark.slow
def test_quick_benchmarks_write_results(tmp_path):
  scratch = tmp_path / "tmp"  # the workers' temporary dir: what they leave there is checked
  scratch.mkdir()
  proc = subprocess.run(
    [sys.executable, "-m", "benchmarks.run", "--quick", "--out", str(tmp_path)],
    capture_output=True,
    text=True,
    timeout=600,
    env={**os.environ, "TMPDIR": str(scratch)},
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  kept = {"jaxstep-bench-hf"}  # the transformers folders, kept on purpose (hf_load.py)
  assert {p.name for p in scratch.iterdir() if p.name.startswith("jaxstep-")} <= kept
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert SUMMARY_KEYS <= set(summary)
  if importlib.util.find_spec("torch"):  # torch is installed only for benchmarks
    assert "tokens_vs_pytorch" in summary
  if importlib.util.find_spec("torch") and importlib.util.find_spec("transformers"):
    assert "decode_vs_hf" in summary
    assert HF_KEYS <= set(summary)
  if os.cpu_count() > 1:  # busy cores slowing each other down needs at least two
    assert "cores_together_over_alone" in summary
  deltas = {  # may be < 0
    "data_startup_delta_s_200m_10m",
    "data_rss_delta_mib_200m_10m",
    "data_startup_delta_s_2b_10m",
  }
  assert all(isinstance(v, float) and (v > 0 or k in deltas) for k, v in summary.items())
  for name in (
    "step",
    "compile",
    "depth",
    "host_overhead",
    "doc_mask",
    "checkpoint",
    "fsdp_memory",
    "data",
    "generate",
    "hf",
  ):
    result = json.loads((tmp_path / f"{name}.json").read_text())
    assert result["environment"]["jax"] and result["rows"]
  assert "| measurement |" in (tmp_path / "results.md").read_text()


def test_reusable_kinds_are_contenders():
  """A quick run hands workers of ``harness.REUSABLE`` kinds on to later suites: each names
  a contender (a misspelt one would only start processes anew, silently)."""
  from benchmarks import harness, worker

  assert set(harness.REUSABLE) <= set(worker.contenders())
  assert "jaxstep" not in harness.REUSABLE  # it splits the CPU before JAX starts


def test_quick_workers_share_a_cache_and_keep_their_own_xla_flags(monkeypatch):
  from benchmarks import harness

  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/a/users/cache")
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  assert "JAX_COMPILATION_CACHE_DIR" not in harness._worker_env(None)  # every worker compiles
  with harness.quick_compiles():
    own = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    env, measuring = harness._worker_env(own), harness._worker_env(harness.OWN_COMPILES)
    assert os.path.isdir(env["JAX_COMPILATION_CACHE_DIR"])
    assert env["XLA_FLAGS"].split() == [own["XLA_FLAGS"], *harness.quick_xla_flags()]
    assert measuring["XLA_FLAGS"].split() == harness.quick_xla_flags()
    assert measuring["JAX_ENABLE_COMPILATION_CACHE"] == "false"
  assert "XLA_FLAGS" not in os.environ and not os.path.exists(env["JAX_COMPILATION_CACHE_DIR"])
  assert "JAX_COMPILATION_CACHE_DIR" not in harness._worker_env(None)


@pytest.mark.slow
def test_gpu_smoke_runs_on_tiny_shapes_and_round_trips_bitwise(tmp_path):
  """The GPU check's script, on this host with tiny shapes: one JSON line, the checkpoint
  round trip bitwise (device → device, one more step, → CPU), a GPT case and the Llama case
  measured per field."""
  out = tmp_path / "smoke.json"
  proc = subprocess.run(
    [sys.executable, "-m", "benchmarks.gpu_smoke", "--tiny", "--steps", "1", "--max-cases", "1"]
    + ["--models", "gpt2-124m", "llama-1b", "--out", str(out)],
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  assert json.loads(out.read_text()) == result
  checkpoint = result["checkpoint"]
  assert checkpoint["restored_on_device_bitwise"] and checkpoint["next_step_bitwise"]
  assert checkpoint["restored_on_cpu_bitwise"] and checkpoint["cpu_copy_platform"] == "cpu"
  gpt, llama = result["cases"]
  assert gpt["model"] == "gpt2-124m" and gpt["attention"] == "blocked"
  assert llama["model"] == "llama-1b" and llama["family"] == "LlamaConfig"
  assert llama["attention"] == "blocked" and llama["remat"] == "block"
  for case in (gpt, llama):
    assert case["tokens_per_s"] > 0 and 0 < case["mfu"] < 1 and case["auto_table_gib"]
    assert case["grad_accum_steps"] in {int(k) for k in case["auto_table_gib"]}
  assert len(result["skipped"]) == 7  # GPTs: 2 models × 2 kernels × 2 remat, one measured


def test_demo_gains_reads_the_demo_runs(tmp_path):
  """``benchmarks.demo_gains`` from three run directories' records: gains in the first 100
  updates, their ratio only where GRPO gained, the filter's sampling time over plain's."""
  from benchmarks import demo_gains

  def run(name, exact, rollout_s):
    d = tmp_path / name
    d.mkdir()
    evals = [
      {"step": s, "eval_rewards/exact_answer": v} for s, v in zip((0, 100), exact, strict=True)
    ]
    d.joinpath("eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    lines = [{"step": i, "rollout_s": rollout_s} for i in range(1, 10)]
    d.joinpath("metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return ["--" + name, str(d)]

  args = [*run("grpo", (0.1, 0.15), 0.5), *run("filter", (0.1, 0.2), 1.5)]
  args += [*run("distill", (0.1, 0.35), 0.4), "--out", str(tmp_path / "out")]
  assert demo_gains.main(args) == 0
  summary = json.loads((tmp_path / "out" / "summary.json").read_text())
  assert summary["distill_vs_grpo_accuracy_gain_100"] == pytest.approx(5.0)
  assert summary["rl_filter_overhead"] == pytest.approx(3.0)
  run("falling", (0.1, 0.05), 0.5)  # a GRPO run that lost accuracy: no ratio to record
  found = demo_gains.gains(tmp_path / "falling", tmp_path / "filter", tmp_path / "distill")
  assert "distill_vs_grpo_accuracy_gain_100" not in found
  assert found["grpo_accuracy_gain_100"] == pytest.approx(-0.05)


@pytest.mark.slow
def test_the_gradient_parity_report_finds_jaxsteps_norm_at_fp64s(tmp_path):
  """``benchmarks.grad_parity`` on a tiny random tied Llama: jaxstep's DPO gradient and
  PyTorch's fp32 one both equal fp64's, and jaxstep's global norm is fp64's."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from conftest import TINY_HF_SHAPE

  from benchmarks import grad_parity

  torch.manual_seed(0)
  config = transformers.LlamaConfig(**TINY_HF_SHAPE, tie_word_embeddings=True)
  transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "folder")
  args = [str(tmp_path / "folder"), "--pairs", "2", "--seq-len", "48", "--out", str(tmp_path)]
  result = grad_parity.main(args)
  truth = result["norm_fp64"]
  assert abs(result["norm_jaxstep"] - truth) <= 1e-6 * truth
  assert abs(result["norm_torch_clip_grad_norm"] - truth) <= 1e-5 * truth
  for side in ("jaxstep", "torch_fp32"):
    total, worst = result["distance_to_fp64"][side]
    assert total <= 1e-5 and worst[0][1] <= 1e-4, (side, worst)
  assert json.loads((tmp_path / "grad_parity.json").read_text())["rows"][0]["pairs"] == 2
