"""``model.init_from``: a run that starts from a local Hugging Face model folder, and
``jaxstep export`` back out; checked against transformers on tiny random models saved
locally (nothing is downloaded)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import read_lines, xla_flags
from test_hf_folder import tokenizer_files  # noqa: F401 - fixture
from test_pretrained import FOLDER_TERMS, folder  # noqa: F401 - fixture
from tolerance import assert_close, assert_far, planted

import jaxstep
from jaxstep import data, trainer
from jaxstep.cli import run as run_command
from jaxstep.errors import ConfigError
from jaxstep.trainer.config import loading as config_lib
from jaxstep.trainer.plan import init_from
from jaxstep.trainer.plan.numbers import make_plan

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

G, K, S = 8, 2, 32
# a first step's loss against transformers': the mean over the batch's G × S tokens of each
# token's NLL, whose longest sum is the softmax over the folders' vocabulary of 320
LOSS_TERMS = 320 * G * S


def corpus(tmp_path, docs=120):
  tmp_path.mkdir(parents=True, exist_ok=True)
  path = tmp_path / "corpus.txt"
  rng = np.random.default_rng(0)
  path.write_text(
    "\n\n".join(f"the {a} and {b}: {a + b}." for a, b in rng.integers(0, 50, (docs, 2)))
  )
  return path


def run_cfg(tmp_path, hf, *overrides):
  return config_lib.load(
    None,
    [
      f"model.init_from={hf}",
      f"data.path={corpus(tmp_path)}",
      f"run_dir={tmp_path / 'run'}",
      f"train.global_batch_size={G}",
      f"train.grad_accum_steps={K}",
      f"train.seq_len={S}",
      "train.schedule_steps=8",
      "train.eval_every=0",
      "mesh.cpu_devices=1",
      *overrides,
    ],
  )


def assert_first_loss(logged, model, batch) -> None:
  """The loss logged at step 1 is transformers' on the batch, and a per-row mean (the sum
  divided by the rows, not the tokens) is far outside the tolerance."""
  want = torch_loss(model, batch)
  assert_close(logged["loss"], want, terms=LOSS_TERMS)
  per_row = logged["loss"] * float(np.sum(batch["loss_mask"])) / len(batch["loss_mask"])
  assert_far(per_row, want, terms=LOSS_TERMS)


def torch_loss(model, batch) -> float:
  """The mean next-token NLL over the loss-masked targets, computed by transformers."""
  with torch.no_grad():
    logits = model(torch.tensor(batch["inputs"], dtype=torch.long)).logits.double()
  nll = torch.nn.functional.cross_entropy(
    logits.reshape(-1, logits.shape[-1]),
    torch.tensor(batch["targets"], dtype=torch.long).reshape(-1),
    reduction="none",
  )
  mask = torch.tensor(batch["loss_mask"], dtype=torch.float64).reshape(-1)
  return float((nll * mask).sum() / mask.sum())


def test_the_config_takes_its_model_and_tokenizer_from_the_folder(folder, tmp_path):  # noqa: F811
  path, _ = folder
  cfg = init_from.resolve(run_cfg(tmp_path, path, "model.remat=block", "model.dropout=0.1"))
  assert isinstance(cfg.model, jaxstep.models.LlamaConfig)
  assert (cfg.model.vocab_size, cfg.model.d_model, cfg.model.head_dim) == (320, 32, 8)
  assert cfg.model.qk_norm and cfg.model.remat == "block" and cfg.model.dropout == 0.1
  assert cfg.data.tokenizer == str(path)
  loaded = config_lib.load(None, [])
  text = config_lib.dump(cfg)
  (tmp_path / "resolved.yaml").write_text(text)
  assert config_lib.load(tmp_path / "resolved.yaml") == cfg != loaded  # config.yaml reads back


@pytest.mark.parametrize(
  "override, message",
  [
    ("model.d_model=64", "model.d_model 64 contradicts"),
    ("train.seq_len=100", "exceeds the 64 positions"),
    ("model.mlp_ratio=2", "model.init_from is a llama model: drop the key"),
    ("model.lora.targets=[experts.down_proj]", "names routed experts, and the model of"),
  ],
)
def test_settings_that_contradict_the_folder_are_one_line_and_nothing_is_written(
  folder,  # noqa: F811
  tmp_path,
  capsys,
  override,
  message,
):
  path, _ = folder
  with pytest.raises(ConfigError, match=message):
    init_from.resolve(run_cfg(tmp_path, path, override))
  code = run_command("train", [f"model.init_from={path}", f"run_dir={tmp_path / 'cli'}", override])
  err = capsys.readouterr().err
  errors = [line for line in err.splitlines() if line.startswith("error:")]
  assert code == 2 and len(errors) == 1 and message in errors[0], err
  assert not (tmp_path / "cli").exists()


def test_a_folder_without_config_json_is_one_line_exit_2(tmp_path, capsys):
  code = run_command("train", [f"model.init_from={tmp_path}", f"run_dir={tmp_path / 'run'}"])
  err = capsys.readouterr().err
  assert code == 2 and "has no config.json" in err and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_run_starts_from_the_folders_weights_and_exports_what_transformers_loads(
  folder,  # noqa: F811
  tmp_path,
  capsys,
):
  path, model = folder
  cfg = run_cfg(tmp_path, path, "train.max_steps=2", "train.log_every=1")
  first = make_plan(cfg, read_data=True)
  batch = data.global_batch(first.dataset.train, 0, 0, 0, G, first.dataset.pad_id)
  trainer.train(cfg)
  logged = read_lines(tmp_path / "run" / "metrics.jsonl")[0]
  assert logged["step"] == 1
  assert_first_loss(logged, model, batch)  # the folder's weights, its ids

  assert run_command("export", [str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
  out = tmp_path / "out"
  assert {p.name for p in out.iterdir()} >= {
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
  }
  before = safetensors_numpy.load_file(path / "model.safetensors")
  after = safetensors_numpy.load_file(out / "model.safetensors")
  assert {k: v.shape for k, v in before.items()} == {k: v.shape for k, v in after.items()}
  assert any(not np.array_equal(before[k], after[k]) for k in before)  # it trained

  saved = jaxstep.load_run(tmp_path / "run")
  exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  tokens = np.asarray(batch["inputs"][:2])
  with torch.no_grad():
    theirs = exported(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
  apply_fn = jaxstep.models.decoder(saved.cfg.model).apply_fn
  ours = np.asarray(apply_fn(saved.params, tokens))
  assert_close(ours, theirs, terms=FOLDER_TERMS)
  with torch.no_grad():  # the margin: the folder's weights, before the two updates, are far
    before_training = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
  assert_far(before_training, theirs, terms=FOLDER_TERMS)
  tok = transformers.AutoTokenizer.from_pretrained(out)
  assert tok.eos_token == "<|im_end|>" and "<|im_start|>" in tok.chat_template
  assert saved.tokenizer.EOS == tok.eos_token_id  # the run reads the folder's tokenizer copy


@pytest.mark.slow
def test_a_bundled_gpt_run_exports_as_gpt2_and_a_foreign_out_folder_is_refused(tmp_path, capsys):
  from conftest import make_cfg

  trainer.train(make_cfg(tmp_path / "gpt", "train.max_steps=1", "train.global_batch_size=8"))
  run_dir, out = tmp_path / "gpt" / "run", tmp_path / "o"
  assert run_command("export", [str(run_dir), "--out", str(out)]) == 0
  exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert type(exported).__name__ == "GPT2LMHeadModel"
  saved = jaxstep.load_run(run_dir)
  tokens = np.random.default_rng(0).integers(0, 259, size=(2, 16))
  with torch.no_grad():
    theirs = exported(torch.tensor(tokens)).logits.numpy()
  ours = np.asarray(jaxstep.models.decoder(saved.cfg.model).apply_fn(saved.params, tokens))
  terms = 4 * saved.cfg.model.d_model * saved.cfg.model.n_layers  # the MLP, once per layer
  assert_close(ours, theirs, terms=terms)
  assert_far(planted(ours), theirs, terms=terms)
  (tmp_path / "foreign").mkdir()
  (tmp_path / "foreign" / "notes.txt").write_text("mine")
  capsys.readouterr()
  code = run_command("export", [str(run_dir), "--out", str(tmp_path / "foreign")])
  assert code == 2 and capsys.readouterr().err.count("error:") == 1
  assert [p.name for p in (tmp_path / "foreign").iterdir()] == ["notes.txt"]


@pytest.fixture
def gpt2_folder(tmp_path, tokenizer_files):  # noqa: F811 - the imported fixture
  """A tiny random GPT-2 whose tokenizer declares ``<|endoftext|>`` as BOS and EOS, as
  GPT-2's does (and prepends nothing)."""
  import shutil

  shape = {"vocab_size": 320, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64}
  cfg = transformers.GPT2Config(**shape, bos_token_id=7, eos_token_id=7)  # <|endoftext|>
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
  model.save_pretrained(tmp_path / "gpt2")
  shutil.copy(tokenizer_files["plain"], tmp_path / "gpt2" / "tokenizer.json")
  specials = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}
  (tmp_path / "gpt2" / "tokenizer_config.json").write_text(json.dumps(specials))
  return tmp_path / "gpt2", model


@pytest.mark.slow
def test_a_gpt2_folder_trains_as_the_bundled_gpt_and_exports_the_same_names(gpt2_folder, tmp_path):
  path, model = gpt2_folder
  cfg = run_cfg(tmp_path, path, "train.max_steps=1")
  plan = make_plan(cfg, read_data=True)
  assert isinstance(plan.cfg.model, jaxstep.models.GPTConfig)
  assert (plan.cfg.model.layer_norm_eps, plan.cfg.model.vocab_size) == (1e-5, 320)
  batch = data.global_batch(plan.dataset.train, 0, 0, 0, G, plan.dataset.pad_id)
  trainer.train(cfg)
  logged = read_lines(tmp_path / "run" / "metrics.jsonl")[0]
  assert_first_loss(logged, model, batch)
  assert run_command("export", [str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
  before = safetensors_numpy.load_file(path / "model.safetensors")
  after = safetensors_numpy.load_file(tmp_path / "out" / "model.safetensors")
  assert {k: v.shape for k, v in before.items()} == {k: v.shape for k, v in after.items()}


@pytest.mark.slow
def test_a_run_from_a_folder_killed_with_sigkill_resumes_bitwise(folder, tmp_path):  # noqa: F811
  """The resumed half starts from its checkpoint, not again from the folder's weights."""
  import jax
  from conftest import restore_state_arrays, straight_and_killed

  path, _ = folder
  corpus(tmp_path)
  args = [f"model.init_from={path}", f"data.path={tmp_path / 'corpus.txt'}"]
  args += [f"train.global_batch_size={G}", f"train.grad_accum_steps={K}", f"train.seq_len={S}"]
  args += ["train.max_steps=8", "train.eval_every=0", "checkpoint.every=2", "mesh.cpu_devices=1"]
  straight_and_killed(tmp_path, args, kill_at=4)
  (step_a, a), (step_b, b) = (restore_state_arrays(tmp_path / n) for n in ("straight", "killed"))
  assert step_a == step_b == 8
  pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in pairs)


FSDP_SCRIPT = """
import sys, jax, numpy as np
from jaxstep import parallel, load_pretrained
from jaxstep.trainer.config import loading as config_lib
from jaxstep.trainer.plan import init_from
cfg = init_from.resolve(config_lib.load(None, [f"model.init_from={sys.argv[1]}",
                                                "train.global_batch_size=4", "train.seq_len=32"]))
mesh = parallel.make_mesh(data=1, fsdp=4)
params, _ = init_from.read_base(cfg.model, mesh)
reference = load_pretrained(sys.argv[1]).params
leaves, ref = jax.tree.leaves(params), jax.tree.leaves(reference)
assert len(leaves) == len(ref)
assert all(np.array_equal(np.asarray(x), y) for x, y in zip(leaves, ref))
big = [x for x in leaves if x.ndim == 2]
assert all(x.sharding.spec != jax.sharding.PartitionSpec() for x in big)
assert all(max(s.data.size for s in x.addressable_shards) == x.size // 4 for x in big)
print("ok", len(leaves))
"""


@pytest.mark.slow
def test_a_four_device_fsdp_import_equals_one_device_and_is_sharded(folder, tmp_path):  # noqa: F811
  path, _ = folder
  env = {**os.environ, "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=4")}
  proc = subprocess.run(
    [sys.executable, "-c", FSDP_SCRIPT, str(path)], env=env, capture_output=True, text=True
  )
  assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stderr[-3000:]


def test_text_from_a_folder_without_bos_masks_document_starts_by_position(folder, tmp_path):  # noqa: F811
  """Qwen declares no BOS: documents start with EOS, the id that ends the previous one; the
  ending EOS is a target, the starting one is not."""
  path, _ = folder
  cfg = run_cfg(tmp_path, path, "train.max_steps=1", "data.pack=true", "data.eval_fraction=0")
  dataset = make_plan(cfg, read_data=True).dataset
  tok = dataset.tokenizer
  assert not tok.has_bos and tok.BOS == tok.EOS
  windows = dataset.train
  tokens, flags = windows.stream.read(0, len(windows.stream))
  starts = set(windows.stream.doc_starts.tolist())
  got = np.concatenate([windows.window(i)[1][:-1] for i in range(len(windows))])
  got = got[: len(tokens) - 1]  # the last window's padding lies past the stream
  expected = np.array([i not in starts for i in range(len(got))], np.int32)
  assert np.array_equal(got, expected[: len(got)])
  eos_at = np.flatnonzero(tokens[: len(got)] == tok.EOS)
  assert {bool(got[i]) for i in eos_at} == {True, False}  # ends learned, starts not


@pytest.mark.slow
def test_the_sft_hf_config_fine_tunes_a_model_folder_on_chat_and_exports(
  folder,  # noqa: F811
  tmp_path,
  monkeypatch,
  capsys,
):
  from test_chat_sft import CHATML

  path, _ = folder
  (path / "chat_template.jinja").write_text(CHATML)  # renders turns incrementally
  monkeypatch.setenv("HF_MODEL", str(path))
  run_dir = tmp_path / "sft"
  args = ["--config", "sft-hf", f"run_dir={run_dir}", "train.max_steps=2", "train.seq_len=64"]
  args += ["train.global_batch_size=8", "train.grad_accum_steps=2", "mesh.cpu_devices=1"]
  assert run_command("train", args) == 0, capsys.readouterr().err
  cfg = jaxstep.load_run(run_dir).cfg
  assert cfg.model.init_from == str(path) and cfg.data.format == "chat"
  assert run_command("export", [str(run_dir), "--out", str(tmp_path / "hf")]) == 0
  assert (tmp_path / "hf" / "chat_template.jinja").read_text() == CHATML


@pytest.mark.slow
def test_every_model_option_trains_an_imported_model_alike(folder, tmp_path):  # noqa: F811
  """Three updates of the imported Qwen3 on one device; on an fsdp mesh of 4 devices; with
  the xla attention, scanned blocks and remat: the same losses (to fp32 reduction order)."""
  path, _ = folder
  corpus(tmp_path)
  args = [f"model.init_from={path}", f"data.path={tmp_path / 'corpus.txt'}", "train.log_every=1"]
  args += [f"train.global_batch_size={G}", f"train.grad_accum_steps={K}", f"train.seq_len={S}"]
  args += ["train.max_steps=3", "train.eval_every=0"]
  variants = {
    "one": ["mesh.cpu_devices=1"],
    "fsdp": ["mesh.cpu_devices=4", "mesh.fsdp=4", "mesh.data=1"],
    "kernels": ["mesh.cpu_devices=1", "model.attention=xla", "model.scan_layers=true"]
    + ["model.remat=block"],
  }
  losses = {}
  for name, extra in variants.items():
    run_dir = tmp_path / name
    command = [sys.executable, "-m", "jaxstep.train", *args, *extra, f"run_dir={run_dir}"]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    losses[name] = [r["loss"] for r in read_lines(run_dir / "metrics.jsonl")]
  assert len(losses["one"]) == 3
  np.testing.assert_allclose(losses["fsdp"], losses["one"], rtol=2e-5)
  np.testing.assert_allclose(losses["kernels"], losses["one"], rtol=2e-5)


def test_a_model_section_with_init_from_takes_the_folders_family(folder, tmp_path):  # noqa: F811
  path, _ = folder
  cfg = run_cfg(tmp_path, path, "model.lora.rank=4", "model.lora.targets=[q_proj, v_proj]")
  assert isinstance(cfg.model, jaxstep.models.LlamaConfig)
  assert init_from.resolve(cfg).model.lora.targets == ("q_proj", "v_proj")
