"""A tensor axis beside data and fsdp: the leaves' logical names and the rule that splits
them, and (8 virtual CPU devices, slow) the GPT and a grouped-query Llama, full and LoRA,
on meshes with a tensor axis matching one device after 3 updates."""

import subprocess
import sys

import pytest
from jax.sharding import PartitionSpec as P
from test_hf_folder import tokenizer_files  # noqa: F401 - fixture
from test_pretrained import folder  # noqa: F401 - fixture

from jaxstep.core import layout
from jaxstep.errors import ConfigError


def test_each_bundled_projection_has_its_megatron_split():
  names = layout.logical_names
  assert names("['blocks'][0]['qkv']['kernel']", 2) == ("embed", "heads")  # column-parallel
  assert names("['blocks'][0]['proj']['kernel']", 2) == ("heads", "embed")  # row-parallel
  assert names("['blocks'][0]['down_proj']['kernel']", 2) == ("mlp", "embed")
  assert names("['blocks'][0]['k_proj']['kernel']", 2) == ("embed", "kv_heads")
  assert names("['embed_tokens']['embedding']", 2) == ("vocab", "embed")
  assert names("['lm_head']['kernel']", 2) == ("embed", "vocab")
  assert names("['norm']['scale']", 1) == (None,)


def test_an_adapter_follows_its_projection_and_a_stacked_layer_axis_comes_first():
  names = layout.logical_names
  assert names("['blocks']['q_proj']['lora']['lora_a']", 2) == ("embed", None)
  assert names("['blocks']['q_proj']['lora']['lora_b']", 2) == (None, "heads")
  assert names("['blocks']['o_proj']['lora']['lora_a']", 2) == ("heads", None)
  assert names("['blocks']['q_proj']['kernel']", 3) == (None, "embed", "heads")  # scanned
  assert names(".opt_state[1].mu['blocks'][0]['fc']['kernel']", 2) == ("embed", "mlp")


def test_tensor_takes_the_named_dimension_and_fsdp_the_largest_other():
  spec = layout.leaf_spec
  assert spec((32, 96), 2, ("embed", "heads"), 4) == P("fsdp", "tensor")
  assert spec((96, 32), 2, ("heads", "embed"), 4) == P("tensor", "fsdp")
  assert spec((32, 6), 1, ("embed", "kv_heads"), 4) == P()  # 6 kv units over 4: whole
  assert spec((32, 96), 2, ("embed", "heads"), 1) == P(None, "fsdp")  # no tensor axis
  assert spec((32, 96), 2, None, 4) == P(None, "fsdp")  # unnamed: fsdp only


def test_a_model_of_your_own_joins_by_naming_its_dimensions(monkeypatch):
  monkeypatch.setattr(layout, "AXIS_NAMES", list(layout.AXIS_NAMES))
  layout.name_axes(r"\['mlp'\]\['w_in'\]", ("embed", "mlp"))
  assert layout.logical_names("['mlp']['w_in']", 2) == ("embed", "mlp")


def test_a_tensor_size_that_does_not_divide_the_devices_is_one_line():
  from jaxstep import parallel

  with pytest.raises(ConfigError, match=r"mesh.tensor=3 does not divide the 1 device\(s\)"):
    parallel.make_mesh(1, 1, tensor=3)


@pytest.fixture(scope="module")
def equivalence():
  from conftest import helper_lines

  lines = helper_lines("tensor_equivalence.py", devices=8, timeout=900)
  return (
    [r for r in lines if "model" in r],
    [r for r in lines if "vocab_hlo" in r],
    [r for r in lines if "sequence_hlo" in r],
  )


@pytest.mark.slow
def test_tensor_meshes_match_one_device(equivalence):
  """(data, fsdp, tensor) ∈ {(1,1,8), (2,1,4), (1,2,4), (2,2,2)}, K ∈ {1, 4} without
  sequence parallelism and K 4 with it (K 1 with it on (2,2,2)); LoRA on (1,2,4) and
  (2,2,2) at K 4 (``helpers/tensor_equivalence.py``'s ``CASES``): AdamW's loss, grad norm
  and params after 3 updates, and SGD's params at K 4 without sequence parallelism."""
  equivalence, _, _ = equivalence
  assert len(equivalence) == 2 * (4 * 3 + 1 + 2)
  assert sum(r["sp"] for r in equivalence) == 2 * (4 + 1)
  sgd = [r for r in equivalence if r["sgd_max_leaf_rel_err"] is not None]
  assert len(sgd) == 2 * (4 + 2) and all(r["k"] == 4 and not r["sp"] for r in sgd)
  for r in equivalence:
    assert r["tokens"] == r["ref_tokens"]  # N summed over every axis, counted once
    assert r["sgd_max_leaf_rel_err"] is None or r["sgd_max_leaf_rel_err"] <= 1e-5, r
    if not (r["lora"] and r["model"] == "gpt"):
      # GPT + LoRA under AdamW: noise-level adapter gradients that Adam scales to ±lr
      # steps; the same on a data-only mesh, so it is not the tensor split's
      assert r["loss_rel_err"] <= 1e-5, r
      assert r["adamw_max_leaf_rel_err"] <= 1e-5, r
      assert r["grad_norm_rel_err"] <= 1e-5, r


@pytest.mark.slow
def test_the_layers_are_split_the_megatron_way(equivalence):
  equivalence, _, _ = equivalence
  plain = [r for r in equivalence if not r["sp"]]
  specs = {(r["model"], tuple(r["mesh"]), r["lora"]): r["specs"] for r in plain}
  gpt = specs[("gpt", (1, 2, 4), False)]
  assert gpt["['blocks'][0]['qkv']['kernel']"] == ["fsdp", "tensor"]
  assert gpt["['blocks'][0]['proj']['kernel']"] == ["tensor", "fsdp"]
  assert gpt["['blocks'][0]['fc']['kernel']"] == ["fsdp", "tensor"]
  assert gpt["['embed']['embedding']"] == ["tensor", "fsdp"]  # vocab-parallel
  llama = specs[("llama", (2, 2, 2), True)]
  assert llama["['blocks'][0]['k_proj']['kernel']"] == ["fsdp", "tensor"]
  assert llama["['blocks'][0]['q_proj']['lora']['lora_b']"][-1] == "tensor"
  assert llama["['blocks'][0]['o_proj']['lora']['lora_a']"][0] == "tensor"


def test_sizes_the_tensor_axis_cannot_split_name_the_nearest_that_can(caplog):
  from jaxstep import models
  from jaxstep.trainer.config.schema import MeshConfig
  from jaxstep.trainer.plan import tensor_split

  def mesh(t, sp=False):
    return MeshConfig(tensor=t, sequence_parallel=sp)

  gpt = models.GPTConfig(vocab_size=264, d_model=32, n_heads=4, max_seq_len=16)
  with pytest.raises(ConfigError, match=r"does not divide model.n_heads 4 .*=2 or 4$"):
    tensor_split.check(gpt, mesh(3), 16)
  with pytest.raises(ConfigError, match=r"model.vocab_size 264 .* use mesh.tensor=12 or 22$"):
    tensor_split.check(models.GPTConfig(vocab_size=264, d_model=64, n_heads=16), mesh(16), 16)
  with pytest.raises(ConfigError, match=r"splits train.seq_len 6 over mesh.tensor=4: .*=3 or 6$"):
    tensor_split.check(gpt, mesh(4, sp=True), 6)
  with pytest.raises(ConfigError, match="mesh.sequence_parallel needs a tensor axis"):
    tensor_split.check(gpt, mesh(1, sp=True), 16)
  llama = models.LlamaConfig(vocab_size=32, d_model=32, n_heads=4, n_kv_heads=2, max_seq_len=8)
  try:
    with caplog.at_level("INFO", logger="jaxstep"):
      tensor_split.check(llama, mesh(4, sp=True), 8)
    assert "the 2 key/value heads do not split over it" in caplog.text
    assert layout.RULES["kv_heads"] is None and layout.RULES["heads"] == "tensor"
    assert layout.RULES["seq"] == "tensor"
    assert layout.leaf_spec((32, 16), 1, ("embed", "kv_heads"), 4) == P()  # k/v stay whole
  finally:
    layout.split_rules()
  assert layout.RULES["kv_heads"] == "tensor" and layout.RULES["seq"] is None


def test_a_vocabulary_from_the_tokenizer_that_the_tensor_axis_cannot_split_is_one_line(
  tmp_path, monkeypatch
):
  """``model.vocab_size`` 0 is known only once the data is read (bytes: 259 ids, padded to
  264), after the mesh was checked; mesh.tensor=5 is refused then, not trained replicated.
  The mesh is one device's here: the refusal comes from the vocabulary alone."""
  from conftest import make_cfg

  from jaxstep import parallel
  from jaxstep.trainer.plan import numbers

  monkeypatch.setattr(numbers, "mesh_for", lambda cfg: parallel.make_mesh(1, 1))
  cfg = make_cfg(tmp_path, "mesh.tensor=5", "model.n_heads=4", "model.d_model=40", docs=20)
  with pytest.raises(
    ConfigError,
    match=r"mesh.tensor=5 does not divide model.vocab_size 264 \(the tokenizer's 259 ids, "
    r"padded; .*\); use mesh.tensor=4 or 6, or set model.vocab_size=260$",
  ):
    numbers.make_plan(cfg)
  assert not (tmp_path / "run").exists()


def _train(tmp_path, name, *args, devices=None):
  from conftest import SMALL_MODEL

  cmd = [sys.executable, "-m", "jaxstep.train", *SMALL_MODEL, "train.global_batch_size=8"]
  cmd += ["train.grad_accum_steps=2", "train.log_every=1", *args, f"run_dir={tmp_path / name}"]
  return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_tensor_run_of_jaxstep_train_equals_one_device_and_resumes_on_another_mesh(tmp_path):
  """The CLI on (data 2, tensor 2) equals one device, held-out evaluation and text samples
  included; its checkpoint resumes on one device."""
  from conftest import read_lines

  steps = ["train.max_steps=4", "train.schedule_steps=4", "checkpoint.every=2"]
  steps += ["train.eval_every=2", "train.sample_every=2", "train.sample_max_new_tokens=8"]
  one = _train(tmp_path, "one", *steps, "mesh.cpu_devices=1")
  assert one.returncode == 0, one.stderr[-2000:]
  half = _train(
    tmp_path, "moved", *steps, "train.max_steps=2", "mesh.tensor=2", "mesh.cpu_devices=4"
  )
  assert half.returncode == 0, half.stderr[-2000:]
  rest = _train(tmp_path, "moved", *steps, "mesh.cpu_devices=1")
  assert rest.returncode == 0 and "resumed from the checkpoint" in rest.stderr, rest.stderr[-2000:]
  a, b = (
    read_lines(tmp_path / "one" / "metrics.jsonl"),
    read_lines(tmp_path / "moved" / "metrics.jsonl"),
  )
  assert [r["step"] for r in b] == [1, 2, 3, 4]
  for x, y in zip(a, b, strict=True):
    assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)
    assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4)
  evals = [read_lines(tmp_path / name / "eval.jsonl") for name in ("one", "moved")]
  assert [e["step"] for e in evals[1]] == [2, 4]
  for x, y in zip(*evals, strict=True):
    assert y["eval_loss"] == pytest.approx(x["eval_loss"], rel=1e-5)
  assert (tmp_path / "moved" / "samples.jsonl").read_text().count("\n") >= 2


@pytest.mark.slow
def test_a_run_on_a_tensor_mesh_killed_with_sigkill_resumes_bitwise(tmp_path):
  from conftest import SMALL_MODEL, bitwise_same_checkpoints, straight_and_killed

  args = [*SMALL_MODEL, "train.global_batch_size=8", "train.max_steps=6", "checkpoint.every=2"]
  args += ["mesh.tensor=2", "mesh.cpu_devices=4", "train.eval_every=0", "train.sample_every=0"]
  straight, killed = straight_and_killed(tmp_path, args, kill_at=2)
  assert bitwise_same_checkpoints(straight, killed)[0] == 6


@pytest.mark.slow
@pytest.mark.parametrize(("saved", "restored"), [((2, 1, 2), (1, 1, 1)), ((1, 1, 1), (1, 1, 4))])
def test_a_checkpoint_restores_bitwise_onto_another_tensor_mesh(tmp_path, saved, restored):
  from conftest import HELPERS, devices_env

  script = HELPERS / "tensor_reshard.py"
  for mode, shape in (("save", saved), ("restore", restored)):
    proc = subprocess.run(
      [sys.executable, str(script), mode, str(tmp_path / "ckpt"), *map(str, shape)],
      env=devices_env(4),
      capture_output=True,
      text=True,
      timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
  assert ("tensor" in proc.stdout) == (restored[2] > 1)


@pytest.mark.slow
def test_the_logits_are_never_whole_under_a_vocab_parallel_cross_entropy(equivalence):
  """Vocabulary 4,096 over tensor 4: no fp32 buffer of the compiled step holds a whole
  vocabulary's logits, and the largest is one device's quarter: [8 rows, 8, 1024]."""
  _, hlo, _ = equivalence
  assert [r["vocab_hlo"] for r in hlo] == ["gpt", "llama"]
  for r in hlo:
    assert r["whole_vocab"] == 0, r
    assert 1024 in r["largest"], r


@pytest.mark.slow
def test_sequence_parallelism_splits_the_residual_stream_over_positions(equivalence):
  """Tensor 4, 8 positions: buffers shaped [rows, 2, d_model] appear only with it on, for a
  few more collectives: the all-gathers into the tensor-parallel layers (a block's input
  gathered once, not keys and values resharded between the position and the head split).
  Without it, nothing is moved between splits: the GPT's head-major fused q/k/v columns
  split over tensor into whole heads (in GPT-2's [q | k | v] order: 11 such collectives)."""
  _, _, hlo = equivalence
  assert [r["sequence_hlo"] for r in hlo] == ["gpt", "llama"]
  for r in hlo:
    assert r["plain"] == 0 and r["sp"] > 0, r
    assert r["plain_reshards"] == 0, r
    assert r["sp_collectives"] - r["plain_collectives"] <= 12, r  # without the gathers: 24, 17


def test_check_takes_a_tensor_config_and_compares_on_one_device():
  from conftest import SMALL_MODEL

  from jaxstep.cli import check
  from jaxstep.trainer.config import loading as config_lib

  args = [*SMALL_MODEL, "train.global_batch_size=8", "train.grad_accum_steps=2"]
  cfg = config_lib.load(None, [*args, "mesh.tensor=2", "mesh.sequence_parallel=true"])
  assert check.check_config(cfg).passed


@pytest.mark.slow
def test_the_memory_ledger_of_a_tensor_mesh_names_it_and_compiles_its_step():
  proc = subprocess.run(
    [sys.executable, "-m", "jaxstep", "memory", "--config", "tiny", "mesh.tensor=2"]
    + ["mesh.cpu_devices=4", "mesh.sequence_parallel=true"],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "mesh data=2 fsdp=1 tensor=2;" in proc.stdout
  assert "predicted ÷ compiled peak" in proc.stdout


@pytest.mark.slow
def test_a_folder_trains_on_a_tensor_mesh_as_on_one_device_and_exports(folder, tmp_path):  # noqa: F811
  """A Qwen3 folder (GQA, q/k norms) from ``model.init_from`` on (data 1, tensor 2): its
  losses are one device's, and the run exports a folder that loads back."""
  from conftest import read_lines
  from test_init_from import corpus

  import jaxstep

  path, _ = folder
  corpus(tmp_path)
  args = [f"model.init_from={path}", f"data.path={tmp_path / 'corpus.txt'}", "train.seq_len=32"]
  args += ["train.global_batch_size=8", "train.grad_accum_steps=2", "train.max_steps=2"]
  args += ["train.log_every=1", "train.eval_every=0", "train.sample_every=0"]
  runs = {"one": ["mesh.cpu_devices=1"], "tp": ["mesh.cpu_devices=2", "mesh.tensor=2"]}
  for name, mesh in runs.items():
    cmd = [sys.executable, "-m", "jaxstep.train", *args, *mesh, f"run_dir={tmp_path / name}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
  a, b = (read_lines(tmp_path / n / "metrics.jsonl") for n in runs)
  for x, y in zip(a, b, strict=True):
    assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)
  out = tmp_path / "exported"
  done = subprocess.run(
    [sys.executable, "-m", "jaxstep", "export", str(tmp_path / "tp"), "--out", str(out)],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert done.returncode == 0, done.stderr[-2000:]
  assert jaxstep.load_pretrained(out).config.n_kv_heads == 2


@pytest.mark.slow
def test_two_processes_each_holding_a_tensor_group_equal_one_process(tmp_path):
  """2 processes × 2 devices, mesh.tensor=2: each host's devices form one tensor group
  (data 2 across the hosts) and the run equals one process on 4 devices."""
  from conftest import SMALL_MODEL, read_lines
  from test_sharding import one_and_two_processes

  args = [*SMALL_MODEL, "train.global_batch_size=8", "train.max_steps=3", "train.log_every=1"]
  args += ["mesh.tensor=2", "train.eval_every=0", "train.sample_every=0"]
  for err in one_and_two_processes(args, tmp_path):
    assert "spans hosts" not in err
  a, b = (read_lines(tmp_path / n / "metrics.jsonl") for n in ("one", "two"))
  assert [r["step"] for r in b] == [1, 2, 3]
  for x, y in zip(a, b, strict=True):
    assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)
