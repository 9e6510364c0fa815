"""CPU defaults: how many virtual devices the CLI makes of one CPU."""

import pytest

from jaxstep.parallel.cpu_devices import cpu_device_count, extra_xla_flags
from jaxstep.trainer.config import loading as config_lib
from jaxstep.trainer.plan.numbers import configure_devices, split_k


@pytest.mark.parametrize(
  "overrides, cores, expected",
  [
    ([], 2, 2),  # tiny: G=32, K=4 → 2 × 4 divides 32
    ([], 3, 2),  # 3 × 4 does not divide 32: the most that fits
    (["train.global_batch_size=8", "train.grad_accum_steps=8"], 4, 1),
    (["mesh.data=2", "mesh.fsdp=2"], 2, 4),  # an explicit mesh wins
    (["mesh.cpu_devices=3", "train.global_batch_size=24"], 8, 3),
  ],
)
def test_device_count_fits_the_batch(overrides, cores, expected):
  cfg = config_lib.load(None, overrides)
  m = cfg.mesh
  g, k = cfg.train.global_batch_size, split_k(cfg.train)
  assert cpu_device_count(g, k, cores, data=m.data, fsdp=m.fsdp, cpu_devices=m.cpu_devices) == (
    expected
  )


def test_auto_splits_as_if_k_were_one():
  # any K the search may choose must divide G over the devices, so the split assumes K = 1
  cfg = config_lib.load(None, ["train.grad_accum_steps=auto", "train.global_batch_size=6"])
  assert split_k(cfg.train) == 1
  assert cpu_device_count(6, split_k(cfg.train), 4) == 3


@pytest.mark.parametrize(
  "overrides, cpu_devices",
  [
    ([], 0),  # the split: one device per core that fits the batch
    (["model.lora.rank=8"], 1),  # a frozen base is held once, not once per device
    (["optim.trainable=[head]"], 1),
    (["model.lora.rank=8", "mesh.cpu_devices=2"], 2),  # the user's choice
    (["model.lora.rank=8", "mesh.fsdp=2"], 0),  # a mesh asked for: its devices
  ],
)
def test_a_frozen_base_runs_on_one_cpu_device_unless_told(monkeypatch, overrides, cpu_devices):
  import jaxstep.parallel.cpu_devices as cpu

  seen = {}
  monkeypatch.setattr(cpu, "configure_cpu_defaults", lambda *a, **kw: seen.update(kw))
  configure_devices(config_lib.load(None, overrides))
  assert seen["cpu_devices"] == cpu_devices


def test_nothing_changes_once_the_backend_runs(monkeypatch):
  import jax

  jax.devices()  # the backend is up in this process
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  configure_devices(config_lib.load())
  import os

  assert "XLA_FLAGS" not in os.environ


@pytest.mark.parametrize(
  "devices, flags, version, expected",
  [
    (2, "", "0.10.2", "--xla_cpu_multi_thread_eigen=false"),  # YNN fusions stay on
    (1, "", "0.10.2", "--xla_cpu_experimental_ynn_fusion_type="),
    (1, "--xla_cpu_experimental_ynn_fusion_type=dot", "0.10.2", ""),  # the user's choice
    (1, "", "0.12.0", ""),  # not measured there: leave XLA's default
  ],
)
def test_extra_xla_flags(devices, flags, version, expected):
  assert extra_xla_flags(devices, flags, version) == expected
