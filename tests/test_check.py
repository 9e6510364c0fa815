"""jaxstep.check: passes on the default config, names the stage where a broken loss diverges."""

import subprocess
import sys

import jax.numpy as jnp

from jaxstep.cli import check
from jaxstep.core.losses import masked_nll
from jaxstep.trainer import config as config_lib


def test_default_config_passes_through_the_cli():
  proc = subprocess.run(
    [sys.executable, "-m", "jaxstep.check"], capture_output=True, text=True, timeout=300
  )
  assert proc.returncode == 0, proc.stderr
  for stage in ("logits", "loss", "gradients", "clipped update", "new params"):
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
    ],
  )
  apply_fn, _ = models.build(cfg.model, 0)
  stages = check.check_config(cfg, loss_fn=per_micro_batch_mean_loss(apply_fn))
  by_name = {s.name: s for s in stages}
  assert by_name["logits"].passed and not by_name["loss"].passed
  assert not by_name["gradients"].passed
  text = check.format_stages(stages, 4, "fp32")
  assert "FAIL: first divergence at stage 'loss'" in text

  monkeypatch.setattr(check, "check_config", lambda cfg: stages)
  assert check.main([]) == 1
  assert "FAIL" in capsys.readouterr().out
