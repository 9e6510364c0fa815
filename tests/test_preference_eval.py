"""Evaluation sets of pairs (``eval.sets`` on a preference run): each JSONL file of pairs is
encoded and cut as the training pairs are and scored whole, with the run's loss and TRL's
metric names; with a precomputed reference its log-probs are computed at the start."""

import json

import jax
import numpy as np
import pytest
from conftest import read_lines
from test_preference_run import BASE, DPO, FULL, cfg_for, sums_file

from jaxstep import models
from jaxstep.cli import train as train_cli
from jaxstep.data import preference_pairs
from jaxstep.trainer import config_run
from jaxstep.trainer.config.schema import HELDOUT
from jaxstep.trainer.plan import preference_plan
from jaxstep.trainer.plan.build import build

EVAL = ["train.max_steps=2", "train.eval_every=2"]


def _eval_file(tmp_path, n=11):
  other = tmp_path / "other"
  other.mkdir(exist_ok=True)
  return sums_file(other, n=n, seed=1)


def _records(run_dir, name):
  return [r for r in read_lines(run_dir / "eval.jsonl") if r.get("set") == name]


@pytest.mark.slow
def test_an_eval_set_of_pairs_is_scored_whole_as_one_big_batch(tmp_path):
  """11 pairs, scored in global batches of 8 (the second padded): the record's means equal
  the same loss over all 11 pairs in one batch, computed from the final params."""
  sets = f"eval.sets={{sums: {_eval_file(tmp_path)}}}"
  cfg = cfg_for(tmp_path, *DPO, *EVAL, sets)
  result = config_run.train(cfg)
  (record,) = _records(tmp_path / "run", "sums")
  assert record["step"] == 2 and record["eval_pairs"] == 11
  run = build(cfg)[0]
  t = run.cfg.train
  rows = preference_pairs.read_pairs(str(_eval_file(tmp_path)))
  pairs = preference_pairs.pair_set(
    rows,
    run.dataset.tokenizer,
    seq_len=t.seq_len,
    max_prompt_len=run.cfg.preference.prompt_len(t.seq_len),
  )
  batch = preference_pairs.pair_batch(pairs, np.arange(11), 11)
  apply_fn, _ = models.build(run.cfg.model, jax.random.PRNGKey(0), abstract=True)
  step = preference_plan.make_eval_step(run.cfg, apply_fn)
  want = preference_plan.eval_record(jax.device_get(step(result.state.params, batch)))
  for name in ("eval_loss", "eval_rewards/margins", "eval_logps/chosen", "eval_rewards/chosen"):
    np.testing.assert_allclose(record[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.slow
def test_a_precomputed_reference_scores_eval_sets_as_a_live_copy_does(tmp_path):
  sets = f"eval.sets={{sums: {_eval_file(tmp_path)}}}"
  """Both the held-out pairs (whose log-probs are in the stored file) and an eval set."""
  both = [*FULL, *EVAL, sets, "data.eval_fraction=0.25"]
  config_run.train(cfg_for(tmp_path, *both, "preference.reference=precompute"))
  config_run.train(cfg_for(tmp_path, *both, name="live"))
  for split in ("sums", HELDOUT):
    (pre,), (live,) = _records(tmp_path / "run", split), _records(tmp_path / "live", split)
    for name in ("eval_loss", "eval_rewards/margins", "eval_rewards/chosen", "eval_logps/chosen"):
      np.testing.assert_allclose(pre[name], live[name], rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize(
  "row, words", [({"prompt": "1 + 1 = ", "rejected": "3"}, "eval.sets.bad: "), ({}, "eval.sets")]
)
def test_a_bad_eval_set_is_one_line_naming_it(tmp_path, capsys, row, words):
  bad = tmp_path / "bad.jsonl"
  bad.write_text(json.dumps(row) + "\n" if row else "")
  args = [*BASE, *DPO, f"data.path={sums_file(tmp_path)}", f"run_dir={tmp_path / 'run'}"]
  assert train_cli.main([*args, f"eval.sets={{bad: {bad}}}"]) == 2
  err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
  assert len(err) == 1 and words in err[0], err
  assert not (tmp_path / "run").exists()
