"""check_accumulation and ``jaxstep check``: pass on a summed loss, name the stage where a
mean-type loss diverges."""

import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import regression_loss
from flax import nnx

from jaxstep import check_accumulation, models
from jaxstep.cli import check
from jaxstep.core.losses import masked_nll
from jaxstep.trainer.config import loading as config_lib


@pytest.mark.slow
def test_default_config_passes_through_the_cli():
  proc = subprocess.run(
    [sys.executable, "-m", "jaxstep.check"], capture_output=True, text=True, timeout=300
  )
  assert proc.returncode == 0, proc.stderr
  for stage in ("logits", "loss", "gradients", "update", "new params"):
    assert stage in proc.stdout
  assert "PASS: accumulation is exact" in proc.stdout


def test_a_seed_out_of_its_domain_is_exit_2_with_one_line_naming_it(capsys):
  """A config error stops ``check`` before anything is built: exit 2, nothing on stdout,
  one ``error:`` line on stderr that names the key."""
  assert check.main(["train.seed=-1"]) == 2
  captured = capsys.readouterr()
  err = captured.err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error:") and "train.seed" in err[0], captured.err
  assert captured.out == ""


def per_micro_batch_mean_loss(apply_fn):
  """The classic bug: each micro-batch averages over its own tokens (mean of means)."""

  def loss_fn(params, batch, rng):
    nll_sum, aux = masked_nll(
      apply_fn(params, batch["inputs"]), batch["targets"], batch["loss_mask"]
    )
    return nll_sum / jnp.maximum(jnp.sum(batch["loss_mask"]), 1), aux

  return loss_fn


@pytest.mark.slow
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


class DropoutNet(nnx.Module):
  def __init__(self, rngs, batch_norm=False):
    self.lin = nnx.Linear(4, 8, rngs=rngs)
    self.bn = nnx.BatchNorm(8, use_running_average=False, rngs=rngs) if batch_norm else None
    self.drop = nnx.Dropout(0.0 if batch_norm else 0.5, rngs=rngs)
    self.out = nnx.Linear(8, 3, rngs=rngs)

  def __call__(self, x):
    h = self.lin(x)
    return self.out(self.drop(nnx.relu(self.bn(h) if self.bn is not None else h)))


def classification_batch(g=8):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(g, 4)).astype(np.float32)
  return {
    "x": jnp.asarray(x),
    "y": jnp.asarray((x[:, 0] > 0).astype(np.int32)),
    "loss_mask": jnp.asarray([1, 1, 0, 1, 1, 1, 1, 0], jnp.float32),
  }


def nll_sum(logits, batch):
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
  return jnp.sum(nll * batch["loss_mask"])


def test_a_random_loss_is_reported_as_random_not_as_a_loss_bug():
  model = models.from_nnx(DropoutNet(nnx.Rngs(0)))

  def loss_fn(train):
    def loss(params, batch, rng):  # a correct summed loss
      return nll_sum(model.apply_fn(params, batch["x"], rng=rng, train=train)[0], batch), {}

    return loss

  batch, opt = classification_batch(), optax.sgd(0.1)
  report = check_accumulation(loss_fn(True), model.params, batch, opt, 2)
  assert report.random_loss and not report.passed
  assert report.first_divergence is None  # not a divergence the split made
  assert "random" in str(report) and "train=False" in str(report)
  assert "first divergence at 'loss'" not in str(report)
  deterministic = check_accumulation(loss_fn(False), model.params, batch, opt, 2)
  assert deterministic.passed and not deterministic.random_loss


def test_a_model_state_loss_is_checked_and_batch_statistics_are_explained():
  model = models.from_nnx(DropoutNet(nnx.Rngs(0), batch_norm=True))
  assert set(model.model_state["bn"]) == {"mean", "var"}

  def loss_fn(train):
    def loss(params, batch, rng, model_state):
      logits, model_state = model.apply_fn(
        params, batch["x"], rng=rng, train=train, model_state=model_state
      )
      return nll_sum(logits, batch), {}, model_state

    return loss

  batch, opt = classification_batch(), optax.sgd(0.1)
  args = (model.params, batch, opt, 2)
  evaluation = check_accumulation(loss_fn(False), *args, model_state=model.model_state)
  assert evaluation.passed  # running statistics: K micro-batches are one batch exactly
  training = check_accumulation(loss_fn(True), *args, model_state=model.model_state)
  assert training.first_divergence == "loss"  # each micro-batch has its own statistics
  assert "batch statistics" in str(training) and "train=False" in str(training)
