"""The plan: every derived value of a config (vocabulary, K, run and schedule length, mesh)
resolved once, and build, memory and check all reading the same plan."""

import dataclasses

import jax
import numpy as np
import pytest
from conftest import make_cfg

from jaxstep import ConfigError
from jaxstep import config as config_lib
from jaxstep.data import load_dataset, steps_per_epoch
from jaxstep.trainer.plan.numbers import make_plan, resolve_vocab, split_k, total_update_steps


def test_derived_values_come_from_the_data(tmp_path):
  cfg = make_cfg(tmp_path, "train.max_steps=0", "train.epochs=3", "train.schedule_steps=0")
  plan = make_plan(cfg)
  dataset = load_dataset(cfg.data, cfg.train.seq_len)
  spe = steps_per_epoch(len(dataset.train), cfg.train.global_batch_size)
  assert plan.steps_per_epoch == spe > 0
  assert plan.total_steps == 3 * spe == plan.schedule_steps  # schedule 0: the run's length
  assert plan.cfg.model.vocab_size == resolve_vocab(cfg.model, dataset.vocab_size).vocab_size
  assert plan.cfg.model.vocab_size == 264  # bytes: 259 ids padded to a multiple of 8
  assert plan.grad_accum_steps == cfg.train.grad_accum_steps and plan.devices == 1


def test_the_shorter_limit_ends_the_run(tmp_path):
  t = make_cfg(tmp_path, "train.max_steps=5", "train.epochs=2").train
  assert total_update_steps(t, 10) == 5
  assert total_update_steps(dataclasses.replace(t, max_steps=0), 10) == 20
  assert total_update_steps(dataclasses.replace(t, epochs=0), None) == 5


def test_no_data_is_read_when_no_value_needs_it(tmp_path):
  cfg = make_cfg(tmp_path, "model.vocab_size=264", "train.max_steps=7", "train.schedule_steps=0")
  cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(tmp_path / "none")))
  plan = make_plan(cfg)
  assert plan.dataset is None and plan.steps_per_epoch is None
  assert plan.total_steps == plan.schedule_steps == 7


def test_the_mesh_is_checked_before_the_data_is_read(tmp_path):
  cfg = make_cfg(tmp_path, "mesh.data=3")  # this process has one device
  cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(tmp_path / "none")))
  with pytest.raises(ConfigError, match="mesh"):
    make_plan(cfg)


def test_auto_counts_as_one_until_chosen(tmp_path):
  cfg = make_cfg(tmp_path, "train.grad_accum_steps=auto")
  assert split_k(cfg.train) == 1
  with pytest.raises(ConfigError, match="auto on cpu needs train.memory_budget_gb"):
    make_plan(cfg)


@pytest.mark.slow
def test_build_memory_and_check_read_one_plan(tmp_path, monkeypatch):
  from jaxstep.cli import check
  from jaxstep.trainer.plan import build as assemble
  from jaxstep.trainer.plan import memory
  from jaxstep.trainer.plan import numbers as plan

  cfg = make_cfg(tmp_path, "train.max_steps=3", "train.schedule_steps=0")
  seen = []
  real = plan.make_plan

  def spy(*args, **kwargs):
    seen.append(real(*args, **kwargs))
    return seen[-1]

  monkeypatch.setattr(plan, "make_plan", spy)  # memory and check import it when called
  monkeypatch.setattr(assemble, "make_plan", spy)
  run = assemble.build(cfg)[0]
  mem = memory.compiled_memory(cfg)
  check.check_config(cfg)
  assert len(seen) == 3
  assert run.cfg == mem["cfg"] == seen[2].cfg
  assert run.schedule_steps == run.total_steps == 3 == seen[1].schedule_steps


def test_a_schedule_that_is_all_warmup_is_named(tmp_path, caplog):
  import logging

  cfg = make_cfg(tmp_path, "train.max_steps=20", "train.schedule_steps=0", "optim.warmup_steps=20")
  with caplog.at_level(logging.WARNING, logger="jaxstep"):
    make_plan(cfg)
  assert "optim.warmup_steps 20 ≥ the schedule's 20 update steps" in caplog.text
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger="jaxstep"):
    make_plan(make_cfg(tmp_path, "train.max_steps=20", "optim.warmup_steps=20"))  # schedule 64
  assert "warmup" not in caplog.text


@pytest.mark.parametrize(
  "override, names",
  [
    ("model.d_model=1048576", "model.d_model"),
    ("model.vocab_size=100000000000", "model.vocab_size"),
    ("train.global_batch_size=1000000000000", "train.global_batch_size"),
    ("train.spike_window=1000000000000", "train.spike_window"),
  ],
)
def test_values_out_of_reach_are_refused_before_anything_is_allocated(tmp_path, override, names):
  cfg = make_cfg(tmp_path, "model.n_heads=1", override)
  with pytest.raises(ConfigError, match=names):
    make_plan(cfg)
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
  "overrides",
  [
    ("model.max_seq_len=100000000", "model.d_model=1024"),  # 10¹¹ parameters: TBs on any host
    ("model.max_seq_len=1000000000000",),
  ],
)
def test_a_gpt_too_long_for_its_positions_names_max_seq_len(tmp_path, overrides):
  """The GPT learns one position vector per token slot: ``max_seq_len × d_model``
  parameters, so the length alone can outgrow the device, and the refusal must name it
  rather than the keys that play no part (vocabulary, layers)."""
  cfg = make_cfg(tmp_path, "model.n_heads=1", *overrides)
  with pytest.raises(ConfigError) as refused:
    make_plan(cfg)
  message = str(refused.value)
  assert "model.max_seq_len" in message and "model.d_model" in message, message
  assert "model.vocab_size" not in message and "model.n_layers" not in message, message
  assert not (tmp_path / "run").exists()


def test_what_fits_is_not_refused():
  from jaxstep.trainer.plan.numbers import approx_num_params, refuse_what_cannot_fit

  cfg = config_lib.load("gpt-1.3b", ["train.grad_accum_steps=4"])
  assert 1.25e9 < approx_num_params(cfg.model) < 1.35e9  # the config says 1.316 B
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "fsdp"))
  refuse_what_cannot_fit(cfg, mesh, 80 * 2**30)  # an 80 GiB device holds its 15 GiB state
  with pytest.raises(ConfigError, match="training state alone needs 14.7 GiB"):
    refuse_what_cannot_fit(cfg, mesh, 8 * 2**30)


def test_adapters_too_large_to_allocate_are_refused_naming_the_rank(tmp_path):
  """``rank × (in + out)`` per adapted projection: a rank of billions is refused before the
  model is built, and the message names model.lora.rank, not the model's shape."""
  from jaxstep.trainer.plan.numbers import approx_num_params

  small = make_cfg(tmp_path, "model.lora.rank=4", "model.lora.targets=[fc]")
  plain = make_cfg(tmp_path)
  d, hidden = small.model.d_model, small.model.mlp_hidden
  assert approx_num_params(small.model) - approx_num_params(plain.model) == 4 * (d + hidden)
  cfg = make_cfg(tmp_path, "model.lora.rank=3000000000")
  with pytest.raises(
    ConfigError, match=r"the LoRA adapters hold 100% of them: shrink model\.lora\.rank"
  ):
    make_plan(cfg)
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
  "overrides, warned",
  [
    (
      ["model.lora.targets=[fc]", "model.lora.alpha=32"],
      "model.lora.rank is 0, so adapters are off",
    ),
    (["data.document_mask=true", "data.pack=false"], "data.document_mask: true has no effect"),
    (["model.lora.rank=4", "model.lora.alpha=32"], None),
    (["data.document_mask=true"], None),
  ],
)
def test_a_setting_the_rest_of_the_config_switches_off_is_one_warning(
  tmp_path, caplog, overrides, warned
):
  make_plan(make_cfg(tmp_path, *overrides))
  lines = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
  without_effect = [line for line in lines if "no effect" in line]
  assert len(without_effect) == (warned is not None), lines
  assert warned is None or without_effect[0].startswith(warned)


@pytest.mark.parametrize(
  "overrides, warned",
  [
    (
      ["preference.reference=precompute", "rl.beta=0.1"],
      "preference.reference=precompute, rl.beta=0.1 have no effect: this run is supervised "
      "(preference.loss makes a preference run, rl.rewards an RL run, distill.teacher names a "
      "teacher); drop them",
    ),
    (
      ["preference.loss=dpo", "preference.beta=0.2", "rl.top_k=5"],
      "rl.top_k=5 has no effect: this run is a preference run (preference.loss makes a "
      "preference run, rl.rewards an RL run, distill.teacher names a teacher); drop it",
    ),
    (["preference.loss=dpo", "preference.reference=precompute"], None),
    (
      ["distill.mode=gkd"],
      "distill.mode=gkd has no effect: this run is supervised (preference.loss makes a "
      "preference run, rl.rewards an RL run, distill.teacher names a teacher); drop it",
    ),
  ],
)
def test_keys_of_another_kind_of_run_are_one_warning_naming_them(caplog, overrides, warned):
  """``preference.*`` keys outside a preference run (``preference.loss``) and ``rl.*`` keys
  outside an RL run (``rl.rewards``) change nothing; a run that sets them is told so."""
  from jaxstep.trainer.plan.numbers import _warn_settings_without_effect

  _warn_settings_without_effect(config_lib.load(None, overrides))
  lines = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
  assert lines == ([warned] if warned else [])
