"""One gradient reduction per update step on a 64-device mesh, whatever K is.

The train step is compiled (never run) on a data 8 × fsdp 8 mesh of 64 virtual CPU devices
by ``benchmarks/scaling.py`` in a subprocess, for K = 1 and K = 4, and its collectives are
counted from the compiled HLO text. The model has gpt-1.3b's structure (scanned blocks,
block remat, bf16 compute, tied embeddings) at a small width and depth: the full 1.3 B
model compiles the same collectives (one per parameter leaf, and its 16 leaves are the
same 16) with more memory and time; docs/scaling.md has its numbers.

What ``jaxstep.core.accumulate.sharded_accumulate`` promises, per update step:
- every fsdp-sharded gradient leaf is reduce-scattered over ``fsdp`` once, and then only
  each device's 1/fsdp shard of it is all-reduced over ``data`` (XLA combines the data
  all-reduces into one tuple all-reduce, so they are counted as its operands);
- the replicated leaves and the metric sums go through ONE flat psum over all devices;
- no collective runs inside the micro-step loop (or any other while loop);
- so none of this grows with K.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest
from conftest import xla_flags

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.scaling import gradient_reductions  # noqa: E402

MODEL = [
  "model.d_model=64",
  "model.n_layers=2",
  "model.n_heads=2",
  "model.vocab_size=256",
  "model.max_seq_len=16",
  "train.seq_len=16",
  "train.global_batch_size=256",  # 64 devices × K 4
]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
  out = tmp_path_factory.mktemp("scaling") / "scaling.json"
  cmd = [sys.executable, "-m", "benchmarks.scaling", "--config", "gpt-1.3b"]
  cmd += ["--data", "8", "--fsdp", "8", "--ks", "1,4", "--json", str(out), *MODEL]
  env = {**os.environ, "XLA_FLAGS": xla_flags()}  # no device count: the benchmark chooses
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(out.read_text())


def rows_of(run):
  keys = ("op", "axis", "source", "in_loop", "count", "operands", "operand_bytes")
  return [tuple(r[k] for k in keys) for r in run["rows"]]


@pytest.mark.slow
def test_one_gradient_reduction_per_update_for_any_k(measured):
  assert measured["devices"] == 64
  assert [r["k"] for r in measured["runs"]] == [1, 4]
  sharded = measured["sharded_param_leaves"]
  assert sharded == measured["param_leaves"] == 16  # 8 | every leaf: all are fsdp-sharded
  one, four = (gradient_reductions(r) for r in measured["runs"])
  assert one == four
  assert one == {
    "flat_psum": 1,  # replicated leaves + metric sums: one buffer
    "fsdp_reduce_scatters": sharded,  # each sharded leaf once over fsdp …
    "data_all_reduce_operands": sharded,  # … and its shard once over data
    "in_loop": 0,
  }


@pytest.mark.slow
def test_collectives_do_not_grow_with_k(measured):
  one, four = measured["runs"]
  assert rows_of(one) == rows_of(four)
  assert not any(c["in_loop"] for run in measured["runs"] for c in run["collectives"])


@pytest.mark.slow
def test_gradient_bytes_are_one_fp32_gradient(measured):
  sharded_bytes = 4 * measured["sharded_param_elements"]
  for run in measured["runs"]:
    found = run["collectives"]
    scatters = [c for c in found if c["op"] == "reduce-scatter"]
    assert all(c["axis"] == "fsdp" and c["dtypes"] == ["f32"] for c in scatters)
    assert sum(c["operand_bytes"] for c in scatters) == sharded_bytes
    data = [c for c in found if c["op"] == "all-reduce" and c["axis"] == "data"]
    assert sum(c["operand_bytes"] for c in data) == sharded_bytes // 8  # the scattered shards
    gathers = [c for c in found if c["op"] == "all-gather"]
    assert all(c["axis"] == "fsdp" for c in gathers)
    assert sum(c["operand_bytes"] for c in gathers) == sharded_bytes // 8  # fp32 shards


@pytest.mark.slow
def test_an_expert_axis_dispatches_inside_the_layer_loop_and_splits_the_experts(tmp_path):
  """A tiny MoE on data 2 × expert 4: the token dispatch (all-gather in, reduce-scatter
  out) runs over the expert axis inside the loop over layers, and the state per device
  is smaller than on data 8, where every device holds every expert."""
  moe = [
    "model.family=llama", "model.vocab_size=512", "model.max_seq_len=16", "model.d_model=64",
    "model.n_layers=2", "model.n_heads=4", "model.num_experts=8", "model.moe_intermediate_size=64",
    "model.scan_layers=true", "train.seq_len=16", "train.global_batch_size=8",
  ]  # fmt: skip
  found = {}
  for name, mesh in {"expert": ["--data", "2", "--expert", "4"], "data": ["--data", "8"]}.items():
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, "-m", "benchmarks.scaling", "--config", "tiny", "--fsdp", "1"]
    cmd += [*mesh, "--ks", "1", "--json", str(out), *moe]
    env = {**os.environ, "XLA_FLAGS": xla_flags()}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    found[name] = json.loads(out.read_text())
  rows = found["expert"]["runs"][0]["rows"]
  dispatch = {(r["op"], r["in_loop"]) for r in rows if r["axis"] == "expert"}
  assert {("all-gather", True), ("reduce-scatter", True)} <= dispatch
  assert not any(r["in_loop"] for r in found["data"]["runs"][0]["rows"])
  per_device = {n: m["state_bytes_per_device"] for n, m in found.items()}
  assert per_device["expert"] < 0.6 * per_device["data"]  # experts: most of the params
