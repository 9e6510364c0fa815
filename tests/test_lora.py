"""LoRA (``model.lora``): adapters that start as the base model, train alone, and fold into
the weights on export."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SMALL_MODEL, make_cfg, read_lines
from test_hf_folder import tokenizer_files  # noqa: F401 - fixture
from test_pretrained import FOLDER_TERMS, folder  # noqa: F401 - fixture
from tolerance import assert_close, assert_far

import jaxstep
from jaxstep import models, trainer
from jaxstep.cli import run as run_command
from jaxstep.core.trees import path_name
from jaxstep.models.lora import LoraConfig, merged

IDS = np.random.default_rng(0).integers(0, 64, size=(2, 12))
LLAMA = models.LlamaConfig(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, intermediate_size=48)
GPT = models.GPTConfig(vocab_size=64, d_model=32, n_heads=4)


def names(tree):
  return {path_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.parametrize(
  "cfg",
  [
    pytest.param(LLAMA, marks=pytest.mark.slow),
    GPT,
    pytest.param(
      dataclasses.replace(LLAMA, scan_layers=True, remat="block"), marks=pytest.mark.slow
    ),
  ],
  ids=["llama", "gpt", "llama-scanned"],
)
def test_adapters_at_init_leave_the_base_models_logits_and_weights(cfg):
  base_fn, base = models.build(cfg, 3)
  lora_cfg = dataclasses.replace(cfg, lora=LoraConfig(rank=4, alpha=8.0))
  lora_fn, params = models.build(lora_cfg, 3)
  assert np.array_equal(jax.jit(base_fn)(base, IDS), jax.jit(lora_fn)(params, IDS))
  adapters = {n: x for n, x in names(params).items() if "/lora/" in n}
  assert adapters and all(
    np.array_equal(x, names(base)[n]) for n, x in names(params).items() if n not in adapters
  )
  assert all(not np.any(x) for n, x in adapters.items() if n.endswith("lora_b"))
  a = [x for n, x in adapters.items() if n.endswith("lora_a")]
  assert all(np.any(x) for x in a) and not np.array_equal(a[0], a[-1])


def test_merged_weights_compute_what_the_adapters_do():
  cfg = dataclasses.replace(LLAMA, lora=LoraConfig(rank=4, alpha=8.0))
  apply_fn, params = models.build(cfg, 0)
  rng = np.random.default_rng(1)
  params = jax.tree_util.tree_map_with_path(  # B non-zero, as after training
    lambda p, x: (
      rng.normal(size=x.shape).astype(np.float32) * 0.1 if path_name(p).endswith("lora_b") else x
    ),
    params,
  )
  base_fn, _ = models.build(dataclasses.replace(cfg, lora=LoraConfig()), 0, abstract=True)
  merged_logits = jax.jit(lambda params, scale: base_fn(merged(params, scale), IDS))
  got = merged_logits(params, cfg.lora.scale)
  want = jax.jit(apply_fn)(params, IDS)
  terms = LLAMA.intermediate_size  # the longest sum: the MLP's down projection
  assert_close(got, want, terms=terms)
  # the margin: the base without the adapters, and the adapters at twice their scale, are far
  assert_far(merged_logits(params, 0.0), want, terms=terms)
  assert_far(merged_logits(params, 2 * cfg.lora.scale), want, terms=terms)


def test_a_lora_run_trains_only_the_adapters(tmp_path):
  cfg = make_cfg(tmp_path, "train.max_steps=3", "model.lora.rank=4", "optim.lr=1e-2")
  trainer.train(cfg)
  saved = jaxstep.load_run(tmp_path / "run")
  _, init = models.build(saved.cfg.model, jax.random.PRNGKey(saved.cfg.train.seed))
  before, after = names(init), names(saved.params)
  changed = {n for n in before if not np.array_equal(before[n], after[n])}
  assert changed and all(n.endswith("/lora/lora_a") or n.endswith("/lora/lora_b") for n in changed)
  assert any(n.endswith("lora_b") for n in changed)


@pytest.mark.slow
def test_generate_decodes_a_lora_run_with_the_cache_as_without(tmp_path):
  trainer.train(make_cfg(tmp_path, "train.max_steps=2", "model.lora.rank=2", "optim.lr=1e-2"))
  saved = jaxstep.load_run(tmp_path / "run")
  outs = []
  for cache in (True, False):
    gen = jaxstep.Generator(saved.cfg.model, saved.params, saved.tokenizer, use_cache=cache)
    outs.append(gen.generate(["12 + "], max_new_tokens=6, temperature=0.0)[0].tokens)
  assert outs[0] == outs[1]


@pytest.mark.slow
def test_the_accumulation_check_passes_with_lora(tmp_path, capsys):
  make_cfg(tmp_path)
  args = [*SMALL_MODEL, f"data.path={tmp_path / 'corpus.txt'}", "model.lora.rank=4"]
  args += ["train.global_batch_size=8", "train.grad_accum_steps=4"]
  code = run_command("check", args)
  out = capsys.readouterr().out
  assert code == 0 and "FAIL" not in out, out


@pytest.mark.parametrize(
  "override, message",
  [
    ("model.lora.rank=-1", "model.lora.rank must be >= 0"),
    ("model.lora.targets=[q_proj]", "its projections are qkv, proj, fc, out"),
    ("model.lora.alpha=0", "model.lora.alpha must be > 0"),
  ],
)
def test_bad_lora_settings_are_one_line_exit_2(tmp_path, capsys, override, message):
  code = run_command("train", [override, f"run_dir={tmp_path / 'run'}"])
  err = capsys.readouterr().err
  assert code == 2 and err.count("error:") == 1 and message in err, err
  assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_lora_run_on_an_fsdp_mesh_trains_as_on_one_device(tmp_path):
  import subprocess
  import sys

  make_cfg(tmp_path)
  common = [*SMALL_MODEL, f"data.path={tmp_path / 'corpus.txt'}", "model.lora.rank=4"]
  common += ["train.max_steps=3", "train.log_every=1", "train.eval_every=0", "optim.lr=1e-2"]
  common += ["train.global_batch_size=8", "train.grad_accum_steps=2"]
  meshes = {"one": ["mesh.cpu_devices=1"], "fsdp": ["mesh.cpu_devices=4", "mesh.fsdp=4"]}
  losses = {}
  for name, mesh in meshes.items():
    command = [sys.executable, "-m", "jaxstep.train", *common, *mesh, f"run_dir={tmp_path / name}"]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    losses[name] = [r["loss"] for r in read_lines(tmp_path / name / "metrics.jsonl")]
  np.testing.assert_allclose(losses["fsdp"], losses["one"], rtol=2e-5)


@pytest.mark.slow
def test_lora_on_an_imported_model_keeps_its_weights_and_exports_them_merged(
  tmp_path,
  folder,  # noqa: F811 - the imported fixture
):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from test_init_from import run_cfg

  path, base_model = folder
  cfg = run_cfg(tmp_path, path, "model.lora.rank=4", "train.max_steps=2", "optim.lr=1e-2")
  trainer.train(cfg)
  saved = jaxstep.load_run(tmp_path / "run")
  assert saved.cfg.model.scan_layers and saved.cfg.model.remat == "block"  # a frozen base's
  base = names(jaxstep.load_pretrained(path, scan_layers=True).params)
  for name, leaf in names(saved.params).items():
    assert ("/lora/" in name) or np.array_equal(leaf, base[name]), name
  assert run_command("export", [str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
  ids = np.random.default_rng(0).integers(0, 320, size=(2, 12))
  with torch.no_grad():
    theirs = exported(torch.tensor(ids)).logits.numpy()
    base_logits = base_model(torch.tensor(ids)).logits.numpy()
  ours = np.asarray(models.decoder(saved.cfg.model).apply_fn(saved.params, ids))
  assert_close(ours, theirs, terms=FOLDER_TERMS)
  # the margin: the base model without the trained adapters is far outside the tolerance
  assert_far(base_logits, theirs, terms=FOLDER_TERMS)


def lora_args(tmp_path, path, *extra):
  import test_init_from

  test_init_from.corpus(tmp_path)
  args = [f"model.init_from={path}", f"data.path={tmp_path / 'corpus.txt'}", "model.lora.rank=4"]
  args += ["train.global_batch_size=8", "train.grad_accum_steps=2", "train.seq_len=32"]
  args += ["train.schedule_steps=8", "train.eval_every=0", "optim.lr=1e-2", "mesh.cpu_devices=1"]
  return [*args, *extra]


@pytest.mark.slow
def test_a_lora_checkpoint_holds_the_adapters_only_and_a_changed_base_is_refused(
  tmp_path,
  folder,  # noqa: F811 - the imported fixture
  capsys,
):
  from safetensors.numpy import load_file, save_file

  from jaxstep.trainer.store.checkpoint_read import saved_shapes, step_dirs

  path, _ = folder
  run_dir = tmp_path / "run"
  args = lora_args(tmp_path, path, f"run_dir={run_dir}")
  assert run_command("train", [*args, "train.max_steps=2"]) == 0
  (_, step_dir), *_ = step_dirs(run_dir / "checkpoints")
  params = [n for n in saved_shapes(step_dir) if n.startswith("params/")]
  assert params and all("/lora/lora_" in n for n in params)
  assert run_command("generate", [str(run_dir), "--prompt", "the", "--max-new-tokens", "2"]) == 0
  tensors = load_file(path / "model.safetensors")
  tensors["model.norm.weight"] = tensors["model.norm.weight"] * 2
  save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
  capsys.readouterr()
  assert run_command("train", [*args, "train.max_steps=4"]) == 2
  err = capsys.readouterr().err
  assert err.count("error:") == 1 and "changed since the checkpoint" in err, err
  assert run_command("generate", [str(run_dir), "--prompt", "the"]) == 2
  assert "changed since this run's checkpoint" in capsys.readouterr().err


def flip_bit(file, offset: int) -> None:
  """Changes the lowest bit of ``file``'s byte at ``offset`` (the first byte of an fp32 value:
  its lowest mantissa bits, so the value stays finite and close)."""
  data = bytearray(file.read_bytes())
  data[offset] ^= 1
  file.write_bytes(data)


def data_start(file) -> int:
  return 8 + int.from_bytes(file.read_bytes()[:8], "little")


def unsampled_offset(file) -> int:
  """The first byte of an fp32 value that the older sampled fingerprint never read: past the
  first 64 KiB of the data, before the last 64 KiB of the file."""
  start = data_start(file)
  first, last = start + (1 << 16), file.stat().st_size - (1 << 16)
  assert first < last, f"{file} is too small to have bytes the old fingerprint skipped"
  middle = (first + last) // 2
  return middle - (middle - start) % 4


@pytest.mark.slow
def test_a_base_changed_between_the_old_samples_is_refused_on_resume_and_by_generate(
  tmp_path,
  folder,  # noqa: F811 - the imported fixture
  capsys,
):
  """One bit of a weight changed where the older sampled fingerprint never looked: a resume,
  ``generate``, ``evaluate`` and ``export`` refuse it in one line; unchanged, it resumes."""
  from jaxstep.models import hf_weights
  from jaxstep.trainer.store.checkpoint_read import step_dirs

  path, _ = folder
  run_dir = tmp_path / "run"
  args = lora_args(tmp_path, path, f"run_dir={run_dir}")
  assert run_command("train", [*args, "train.max_steps=2"]) == 0
  assert run_command("train", [*args, "train.max_steps=3"]) == 0  # the same base: resumes
  assert max(s for s, _ in step_dirs(run_dir / "checkpoints")) == 3
  sampled = hf_weights.sampled_fingerprint(path)
  flip_bit(path / "model.safetensors", unsampled_offset(path / "model.safetensors"))
  assert hf_weights.sampled_fingerprint(path) == sampled  # the older fingerprint misses it
  capsys.readouterr()
  assert run_command("train", [*args, "train.max_steps=4"]) == 2
  err = capsys.readouterr().err
  assert err.count("error:") == 1 and "changed since the checkpoint" in err, err
  assert max(s for s, _ in step_dirs(run_dir / "checkpoints")) == 3  # nothing trained
  for command, extra in [
    ("generate", ["--prompt", "the", "--max-new-tokens", "2"]),
    ("evaluate", ["--data", str(tmp_path / "corpus.txt")]),
    ("export", ["--out", str(tmp_path / "hf")]),
  ]:
    assert run_command(command, [str(run_dir), *extra]) == 2, command
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "changed since this run's checkpoint" in err, err
  assert not (tmp_path / "hf").exists()


def test_a_run_that_recorded_the_older_sampled_fingerprint_still_resumes(
  tmp_path,
  folder,  # noqa: F811 - the imported fixture
):
  """A run written before full fingerprints recorded the sampled one (16 hex digits): its
  resume and ``with_base`` compare that, accepting the same folder and refusing one changed
  where the samples look; a run recording the full one is compared with the read's."""
  from test_init_from import run_cfg

  from jaxstep import CheckpointError, parallel
  from jaxstep.core import freeze
  from jaxstep.models import hf_weights
  from jaxstep.trainer.plan import init_from, steps
  from jaxstep.trainer.saved_run import load as saved_run
  from jaxstep.trainer.store.resume import reconcile
  from jaxstep.trainer.store.run_state import RunState

  path, _ = folder
  cfg = init_from.resolve(run_cfg(tmp_path, path, "model.lora.rank=4"))
  kept = steps.stored(cfg)
  mesh = parallel.make_mesh(1, 1, devices=jax.local_devices()[:1])
  full, fingerprint = init_from.read_base(cfg.model, mesh, cfg.train.seed)
  assert fingerprint == hf_weights.fingerprint(path) and fingerprint.startswith("xxh3:")
  adapters = freeze.partition(steps.frozen_cast(cfg, full), kept)[0]
  old = {"path": str(path), "fingerprint": hf_weights.sampled_fingerprint(path)}
  assert len(old["fingerprint"]) == 16
  model = {"vocab_size": 320}

  def resume(recorded: dict, now: str):
    saved = RunState(step=2, step_in_epoch=2, model=model, base=recorded).to_json()
    current = RunState(model=model, base={"path": str(path), "fingerprint": now})
    return reconcile(saved, current, state_step=2, steps_per_epoch=10, allow_data_change=False)

  assert resume(old, fingerprint).base["fingerprint"] == fingerprint  # then records the full one
  combined = saved_run.with_base(cfg, adapters, kept, {"base": old})
  assert set(names(combined)) == set(names(full))
  flip_bit(path / "model.safetensors", data_start(path / "model.safetensors"))  # sampled there
  changed = hf_weights.fingerprint(path)
  for recorded in (old, {"path": str(path), "fingerprint": fingerprint}):
    with pytest.raises(CheckpointError, match="changed since the checkpoint"):
      resume(recorded, changed)
    with pytest.raises(CheckpointError, match="changed since this run's checkpoint"):
      saved_run.with_base(cfg, adapters, kept, {"base": recorded})


@pytest.mark.slow
def test_a_lora_run_killed_with_sigkill_resumes_bitwise(
  tmp_path,
  folder,  # noqa: F811 - the imported fixture
):
  from conftest import straight_and_killed

  path, _ = folder
  args = lora_args(tmp_path, path, "train.max_steps=6", "checkpoint.every=2")
  straight_and_killed(tmp_path, args, kill_at=2)
  a, b = (jaxstep.load_run(tmp_path / n) for n in ("straight", "killed"))
  assert a.step == b.step == 6
  pairs = zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True)
  assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in pairs)


@pytest.mark.slow
def test_a_bf16_frozen_base_trains_resumes_and_keeps_its_dtype(tmp_path):
  import jax.numpy as jnp

  extra = ["model.lora.rank=4", "optim.frozen_dtype=bf16", "optim.lr=1e-2"]
  trainer.train(make_cfg(tmp_path, "train.max_steps=2", *extra))
  trainer.train(make_cfg(tmp_path, "train.max_steps=3", *extra))  # resumes from step 2
  saved = jaxstep.load_run(tmp_path / "run")
  assert saved.step == 3
  for name, leaf in names(saved.params).items():
    assert leaf.dtype == (jnp.float32 if "/lora/" in name else jnp.bfloat16), name
  assert len(read_lines(tmp_path / "run" / "metrics.jsonl")) >= 1


def test_your_own_linen_model_gets_adapters_by_path_pattern():
  import flax.linen as nn
  import optax

  from jaxstep.core import freeze
  from jaxstep.models import lora

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(4)(nn.relu(nn.Dense(16)(x)))

  x = np.random.default_rng(0).normal(size=(8, 6)).astype(np.float32)
  y = np.random.default_rng(1).normal(size=(8, 4)).astype(np.float32)
  params = jax.jit(MLP().init)(jax.random.PRNGKey(0), x)["params"]
  apply_fn = lora.merged_apply(lambda p, x: MLP().apply({"params": p}, x), 2.0)
  adapted = lora.add_adapters(params, ["Dense_0"], rank=2, rng=jax.random.PRNGKey(1))
  assert "lora" in adapted["Dense_0"] and "lora" not in adapted["Dense_1"]
  assert "lora" not in params["Dense_0"]  # the caller's tree is left as it was
  plain = jax.jit(lambda p, x: MLP().apply({"params": p}, x))
  assert np.array_equal(jax.jit(apply_fn)(adapted, x), plain(params, x))

  def loss(p, batch, rng):
    return jnp.sum((apply_fn(p, batch["x"]) - batch["y"]) ** 2), {}

  trainable = freeze.by_patterns([lora.ADAPTER])
  step = jaxstep.make_train_step(loss, optax.adam(1e-2), grad_accum_steps=2, trainable=trainable)
  batch = {"x": x, "y": y, "loss_mask": np.ones(8)}
  state = step.init(adapted, 0)
  for _ in range(2):  # A's first gradient is 0 (B starts at 0): it moves from the second on
    state, _ = jax.jit(step)(state, batch)
  changed = {n for n, v in names(state.params).items() if not np.array_equal(v, names(adapted)[n])}
  assert changed == {"Dense_0/lora/lora_a", "Dense_0/lora/lora_b"}
  with pytest.raises(
    jaxstep.ConfigError, match="matches no kernel; the kernels are Dense_0, Dense_1"
  ):
    lora.add_adapters(params, ["attn"], rank=2, rng=jax.random.PRNGKey(1))


@pytest.mark.parametrize(
  "cfg",
  [
    LLAMA,
    pytest.param(dataclasses.replace(GPT, scan_layers=True, remat="block"), marks=pytest.mark.slow),
  ],
)
def test_adapter_dropout_acts_in_training_only_and_repeats_with_its_key(cfg):
  cfg = dataclasses.replace(cfg, lora=LoraConfig(rank=4, dropout=0.5))
  apply_fn, params = models.build(cfg, 0)
  rng = np.random.default_rng(2)
  params = jax.tree_util.tree_map_with_path(
    lambda p, x: (
      rng.normal(size=x.shape).astype(np.float32) if path_name(p).endswith("lora_b") else x
    ),
    params,
  )
  quiet_fn, _ = models.build(dataclasses.replace(cfg, lora=LoraConfig(rank=4)), 0, abstract=True)
  apply_fn, quiet_fn = (jax.jit(f, static_argnames="train") for f in (apply_fn, quiet_fn))
  key = jax.random.PRNGKey(5)
  train = apply_fn(params, IDS, rng=key, train=True)
  assert np.array_equal(train, apply_fn(params, IDS, rng=key, train=True))
  assert not np.allclose(train, apply_fn(params, IDS, rng=jax.random.PRNGKey(6), train=True))
  assert np.array_equal(apply_fn(params, IDS), quiet_fn(params, IDS))
  assert not np.allclose(train, quiet_fn(params, IDS, rng=key, train=True))
