"""The run driver in-process: update-step accounting, epochs, tail batches, eval, control."""

import dataclasses
import math

import numpy as np
import pytest
from conftest import make_cfg, read_lines
from tolerance import assert_close, assert_far

from jaxstep import NonFiniteError, models, trainer
from jaxstep.core.losses import masked_nll
from jaxstep.data import eval_batches
from jaxstep.trainer.loop.callbacks import Callback
from jaxstep.trainer.tracking.metrics import TRAIN_FIELDS


@pytest.mark.slow
def test_max_steps_counts_update_steps_not_micro_steps(tmp_path):
  cfg = make_cfg(
    tmp_path,
    "train.global_batch_size=8",
    "train.grad_accum_steps=4",
    "train.max_steps=3",
    "train.log_every=1",
  )
  result = trainer.train(cfg)
  assert int(result.state.step) == 3 and result.run_state.step == 3
  assert (result.run_state.epoch, result.run_state.step_in_epoch) == (0, 3)  # 12 micro-batches of 2
  assert [r["step"] for r in read_lines(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3]


@pytest.mark.slow
def test_one_metrics_line_per_logged_update_step(tmp_path):
  cfg = make_cfg(tmp_path, "train.max_steps=5", "train.log_every=2", "train.eval_every=0")
  trainer.train(cfg)
  lines = read_lines(tmp_path / "run" / "metrics.jsonl")
  assert [r["step"] for r in lines] == [2, 4, 5]
  assert set(lines[0]) >= set(TRAIN_FIELDS)


def test_epochs_end_the_run_and_the_tail_batch_still_updates(tmp_path):
  cfg = make_cfg(
    tmp_path,
    "train.global_batch_size=8",
    "train.grad_accum_steps=2",
    "train.max_steps=0",
    "train.epochs=2",
    "train.log_every=1",
    "data.eval_fraction=0",
    docs=12,
  )
  r, _, _ = trainer.build(cfg)
  n = len(r.dataset.train)
  assert n % 8 != 0
  result = trainer.train(cfg)
  spe = math.ceil(n / 8)
  assert result.run_state.step == 2 * spe and result.run_state.epoch == 2
  lines = read_lines(tmp_path / "run" / "metrics.jsonl")
  tail = lines[spe - 1]
  assert tail["updated"] and tail["epoch"] == 0
  order = np.random.default_rng([cfg.train.seed, 0]).permutation(n)
  tail_rows = order[(spe - 1) * 8 :]
  tail_batch = r.dataset.train.rows(tail_rows, 8, r.dataset.pad_id)
  assert tail["tokens"] == int(tail_batch["loss_mask"].sum())


@pytest.mark.slow
def test_eval_loss_is_token_weighted_over_the_eval_split(tmp_path):
  cfg = make_cfg(
    tmp_path,
    "train.max_steps=2",
    "train.global_batch_size=4",
    "train.grad_accum_steps=1",
    "data.eval_fraction=0.2",
  )
  r, state, _ = trainer.build(cfg)
  got = trainer.evaluate(r, state.params)
  nll = tokens = 0.0
  apply_fn, _ = models.build(r.cfg.model, 0)  # the resolved model: vocabulary from the data
  for batch in eval_batches(r.dataset.eval, 4, r.dataset.pad_id):
    s, _ = masked_nll(apply_fn(state.params, batch["inputs"]), batch["targets"], batch["loss_mask"])
    nll, tokens = nll + float(s), tokens + float(batch["loss_mask"].sum())
  assert got["eval_tokens"] == tokens
  # per-token NLLs (the longest sum: the MLP's down projection or the softmax over the
  # vocabulary) summed over the split's tokens
  m = r.cfg.model
  terms = max(m.mlp_ratio * m.d_model, m.vocab_size) * int(tokens)
  assert_close(got["eval_loss"], nll / tokens, terms=terms)
  assert_close(math.log(got["eval_ppl"]), nll / tokens, terms=terms)  # ppl = exp(loss)
  # the margin: the sum divided by the windows instead of the tokens is far outside it
  assert_far(got["eval_loss"] * tokens / len(r.dataset.eval), nll / tokens, terms=terms)


def test_a_long_evaluation_keeps_only_a_few_batches_in_flight(tmp_path, monkeypatch):
  """Thousands of eval batches dispatched at once abort XLA:CPU's collective rendezvous
  (40 s timeout): the host fetches each result at most ``EVAL_IN_FLIGHT`` batches later,
  and the sums are those of every batch."""
  from jaxstep.trainer import config_run as loop
  from jaxstep.trainer.evaluation import scoring

  cfg = make_cfg(
    tmp_path, "train.global_batch_size=2", "train.grad_accum_steps=1", "data.eval_fraction=0.3"
  )
  r, state, _ = trainer.build(cfg)
  dispatched, fetched, ahead = [], [], []
  eval_fn, device_get = r.eval_fn, loop.jax.device_get

  def counting_eval(params, batch):
    out = eval_fn(params, batch)
    dispatched.append(out)
    ahead.append(len(dispatched) - len(fetched))
    return out

  def counting_get(x):
    fetched.append(x)
    return device_get(x)

  monkeypatch.setattr(loop.jax, "device_get", counting_get)
  got = loop.evaluate(dataclasses.replace(r, eval_fn=counting_eval), state.params)
  assert len(dispatched) > 3 * scoring.EVAL_IN_FLIGHT and len(fetched) == len(dispatched)
  assert max(ahead) == scoring.EVAL_IN_FLIGHT
  sums = np.sum([np.asarray(device_get(x), np.float64) for x in dispatched], axis=0)
  assert got["eval_loss"] == sums[0] / sums[1] and got["eval_tokens"] == sums[1]


@pytest.mark.slow
def test_callback_should_stop_ends_the_run_after_that_step(tmp_path):
  class StopAtTwo(Callback):
    def on_step_end(self, step, metrics, control):
      if step == 2:
        control.stop("enough")

  result = trainer.train(make_cfg(tmp_path, "train.max_steps=10"), callbacks=[StopAtTwo()])
  # Metrics come back one step late, so step 3 was already dispatched when step 2 reported.
  assert result.run_state.step == 3 and result.stop_reason == "enough"


@pytest.mark.slow
def test_early_stopping_on_eval_loss(tmp_path):
  cfg = make_cfg(
    tmp_path,
    "train.max_steps=40",
    "train.eval_every=1",
    "train.early_stopping_patience=1",
    "optim.lr=1e-9",
    "optim.schedule=constant",
  )
  result = trainer.train(cfg)
  assert result.run_state.step < 40 and "early stopping" in result.stop_reason


@pytest.mark.slow
def test_nonfinite_halt_stops_with_the_step_number(tmp_path):
  cfg = make_cfg(
    tmp_path,
    "train.max_steps=6",
    "train.nonfinite=halt",
    "optim.lr=1e30",
    "optim.clip_grad_norm=0",
    "optim.schedule=constant",
  )
  with pytest.raises(NonFiniteError, match=r"update step \d was non-finite"):
    trainer.train(cfg)


@pytest.mark.slow
def test_nonfinite_skip_keeps_going_and_counts(tmp_path):
  cfg = make_cfg(
    tmp_path,
    "train.max_steps=6",
    "optim.lr=1e30",
    "optim.clip_grad_norm=0",
    "optim.schedule=constant",
    "train.log_every=1",
  )
  result = trainer.train(cfg)
  assert result.run_state.step == 6 and int(result.state.skipped) >= 1
  assert not all(r["updated"] for r in read_lines(tmp_path / "run" / "metrics.jsonl"))


def test_a_resume_on_data_with_another_tokenizer_names_the_data_not_the_model():
  import dataclasses

  from jaxstep import CheckpointError
  from jaxstep.trainer.store.resume import reconcile
  from jaxstep.trainer.store.run_state import RunState

  model = {"vocab_size": 264, "d_model": 32, "n_layers": 1}
  saved = RunState(
    step=3, step_in_epoch=3, dataset_fingerprint="aaaa", global_batch_size=8, model=model
  ).to_json()
  current = RunState(
    dataset_fingerprint="bbbb", global_batch_size=8, model={**model, "vocab_size": 400}
  )
  for allow in (False, True):  # a new vocabulary cannot resume even with allow_data_change
    with pytest.raises(CheckpointError) as e:
      reconcile(saved, current, state_step=3, steps_per_epoch=10, allow_data_change=allow)
    message = str(e.value)
    assert "tokenizer" in message and "264 → 400" in message, message
    assert "the model changed" not in message
  same_vocab = dataclasses.replace(current, model=model)
  with pytest.raises(CheckpointError, match="the dataset changed.*allow_data_change=true"):
    reconcile(saved, same_vocab, state_step=3, steps_per_epoch=10, allow_data_change=False)
  bigger = dataclasses.replace(current, dataset_fingerprint="aaaa")  # same data, own change
  with pytest.raises(CheckpointError, match="the model changed.*model.vocab_size 264 → 400"):
    reconcile(saved, bigger, state_step=3, steps_per_epoch=10, allow_data_change=False)


@pytest.mark.slow
def test_resuming_a_run_on_data_with_another_tokenizer_blames_the_data(tmp_path):
  from jaxstep import CheckpointError
  from jaxstep.data import prepare

  prepare(["bundled:text"], tmp_path / "bpe", train_bpe_vocab=300, progress=False)
  trainer.train(make_cfg(tmp_path, "train.max_steps=1", "train.global_batch_size=4"))
  with pytest.raises(CheckpointError) as e:
    trainer.train(
      make_cfg(
        tmp_path, "train.max_steps=2", "train.global_batch_size=4", f"data.path={tmp_path / 'bpe'}"
      )
    )
  assert "tokenizer changed" in str(e.value) and "the model changed" not in str(e.value)
