"""CPU defaults: how many virtual devices the CLI makes of one CPU."""

import pytest

from jaxstep.parallel.cpu_devices import configure_cpu_defaults, cpu_device_count, extra_xla_flags
from jaxstep.trainer import config as config_lib


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
  assert cpu_device_count(config_lib.load(None, overrides), cores) == expected


def test_nothing_changes_once_the_backend_runs(monkeypatch):
  import jax

  jax.devices()  # the backend is up in this process
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  configure_cpu_defaults(config_lib.load())
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
