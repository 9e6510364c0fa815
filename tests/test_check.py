"""check_accumulation and ``jaxstep check``: pass on a summed loss, name the stage where a
mean-type loss diverges."""

import subprocess
import sys

import jax.numpy as jnp
import optax
from conftest import regression_loss

from jaxstep import check_accumulation
from jaxstep.cli import check
from jaxstep.core.losses import masked_nll
from jaxstep.trainer import config as config_lib


def test_default_config_passes_through_the_cli():
  proc = subprocess.run(
    [sys.executable, "-m", "jaxstep.check"], capture_output=True, text=True, timeout=300
  )
  assert proc.returncode == 0, proc.stderr
  for stage in ("logits", "loss", "gradients", "update", "new params"):
    assert stage in proc.stdout
  assert "PASS: accumulation is exact" in proc.stdout


def per_micro_batch_mean_loss(apply_fn):
  """The classic bug: each micro-batch averages over its own tokens (mean of means)."""

  def loss_fn(params, batch, rng):
    nll_sum, aux = masked_nll(
      apply_fn(params, batch["inputs"]), batch["targets"], batch["loss_mask"]
    )
    return nll_sum / jnp.maximum(jnp.sum(batch["loss_mask"]), 1), aux

  return loss_fn


def test_a_mean_of_means_loss_fails_at_the_loss_stage(monkeypatch, capsys):
  from jaxstep import models

  cfg = config_lib.load(
    None,
    [
      "train.global_batch_size=8",
      "train.grad_accum_steps=4",
      "data.path=bundled:chat",
      "data.pack=false",
      "model.vocab_size=264",
    ],
  )
  apply_fn, _ = models.build(cfg.model, 0)
  report = check.check_config(cfg, loss_fn=per_micro_batch_mean_loss(apply_fn))
  by_name = {s.name: s for s in report.stages}
  assert by_name["logits"].passed and not by_name["loss"].passed
  assert not by_name["gradients"].passed
  assert not report.passed and report.first_divergence == "loss"
  assert "FAIL: first divergence at 'loss'" in str(report)

  monkeypatch.setattr(check, "check_config", lambda cfg: report)
  assert check.main([]) == 1
  assert "FAIL" in capsys.readouterr().out


def regression_batch():
  return {
    "x": jnp.asarray([1.0, 3.0, 1.0, 5.0, 2.0, 4.0]),
    "y": jnp.asarray([-2.0, 0.0, -2.0, 0.0, 1.0, 2.0]),
    "loss_mask": jnp.asarray([1.0, 1.0, 1.0, 0.0, 1.0, 0.0]),
  }


def test_from_python_a_summed_loss_passes_and_a_mean_loss_fails_at_loss():
  params, batch, opt = {"w": jnp.float32(1.0)}, regression_batch(), optax.sgd(0.1)
  report = check_accumulation(regression_loss, params, batch, opt, 2)
  assert report.passed and report.first_divergence is None
  assert [s.name for s in report.stages] == ["loss", "gradients", "update", "new params"]

  def mean_loss(params, batch, rng):  # the optax.MultiSteps habit: a mean per micro-batch
    loss_sum, aux = regression_loss(params, batch, rng)
    return loss_sum / jnp.maximum(jnp.sum(batch["loss_mask"]), 1.0), aux

  report = check_accumulation(mean_loss, params, batch, opt, 2)
  assert report.first_divergence == "loss" and "FAIL" in str(report)
