"""Training from prepared data: the Grain loader, the vocabulary from the tokenizer, exact
resume on shards, the loader's position in the checkpoint, damaged shards at start."""

import os
import subprocess
import sys

import chex
import numpy as np
import pytest
from conftest import SMALL_MODEL, make_cfg, read_lines

from jaxstep import DataError, trainer
from jaxstep.data import BatchLoader, DataConfig, global_batch, load_dataset, prepare
from jaxstep.trainer.loop.callbacks import Callback
from jaxstep.trainer.plan.numbers import resolve_vocab
from jaxstep.trainer.store.checkpoint import list_checkpoints


@pytest.fixture(scope="module")
def bpe_data(tmp_path_factory):
  folder = tmp_path_factory.mktemp("prepared") / "bpe"
  prepare(["bundled:text"], folder, train_bpe_vocab=400, progress=False)
  return folder


def test_the_loader_yields_the_global_batches_in_order_across_epochs():
  ds = load_dataset(DataConfig(eval_fraction=0.0), seq_len=32)
  g, spe = 64, -(-len(ds.train) // 64)
  with BatchLoader(ds.train, seed=3, global_batch_size=g, pad_id=ds.pad_id) as loader:
    loader.start(0, spe - 2)
    for epoch, step in [(0, spe - 2), (0, spe - 1), (1, 0), (1, 1)]:
      expected = global_batch(ds.train, 3, epoch, step, g, ds.pad_id)
      got = next(loader)
      for key in expected:
        np.testing.assert_array_equal(got[key], expected[key])
    assert loader.state() == {"next_index": spe + 2}


def test_a_resumed_loader_gives_bitwise_the_batches_a_straight_one_gives_from_there():
  ds = load_dataset(DataConfig(eval_fraction=0.0), seq_len=32)
  g = 48
  spe = -(-len(ds.train) // g)
  with BatchLoader(ds.train, seed=5, global_batch_size=g, pad_id=ds.pad_id) as straight:
    straight.start(0, 0)
    batches = [next(straight) for _ in range(spe + 3)]  # across the end of epoch 0
  for b in (1, spe - 1, spe + 1):
    with BatchLoader(ds.train, seed=5, global_batch_size=g, pad_id=ds.pad_id) as resumed:
      resumed.start(*divmod(b, spe))
      for expected in batches[b:]:
        got = next(resumed)
        for key in expected:
          assert got[key].dtype == expected[key].dtype
          np.testing.assert_array_equal(got[key], expected[key])


class FakeWindows:
  """A split of ``n`` windows whose rows are their window numbers: the index path alone."""

  def __init__(self, n):
    self.n = n

  def __len__(self):
    return self.n

  def rows(self, index, num_rows, pad_id):
    out = np.full((num_rows, 1), pad_id, np.int64)
    out[: len(index), 0] = index
    return {"inputs": out}


def test_a_global_batch_costs_the_same_at_any_corpus_size():
  import time

  def cost(n):
    split = FakeWindows(n)
    global_batch(split, 1, 2, 3, 256, -1)  # warm
    t = time.perf_counter()
    for step in range(20):
      global_batch(split, 1, 2, step, 256, -1)
    return (time.perf_counter() - t) / 20

  assert cost(10**12) < 0.02  # an O(n) permutation of 10^12 windows could not even be built
  seen = np.concatenate(
    [global_batch(FakeWindows(1000), 9, 0, s, 256, -1)["inputs"][:, 0] for s in range(4)]
  )
  assert sorted(seen[seen >= 0].tolist()) == list(range(1000))


def test_the_vocabulary_follows_the_tokenizer_unless_set(bpe_data):
  model = trainer.build(make_cfg_for(bpe_data, "train.max_steps=1"))[0].cfg.model
  assert model.vocab_size == 400  # a multiple of 8 already (below 1024 ids)
  big = resolve_vocab(model.__class__(vocab_size=0), 50257)
  assert big.vocab_size == 50304  # a multiple of 64
  with pytest.raises(DataError, match="set model.vocab_size >= 400"):
    trainer.build(make_cfg_for(bpe_data, "model.vocab_size=300"))


def make_cfg_for(folder, *overrides):
  return make_cfg(folder.parent / "run-cfg", f"data.path={folder}", *overrides)


class StopAfter(Callback):
  def __init__(self, n):
    self.n = n

  def on_step_end(self, step, metrics, control):
    if step >= self.n:
      control.stop("test")


@pytest.mark.slow
def test_resume_on_prepared_shards_is_bitwise_and_records_one_position(tmp_path, bpe_data):
  args = [f"data.path={bpe_data}", "train.max_steps=9", "train.log_every=1", "checkpoint.every=3"]
  args += ["train.global_batch_size=16", "train.grad_accum_steps=2", "model.dropout=0.1"]
  straight = trainer.train(make_cfg(tmp_path / "a", *args))
  cfg = make_cfg(tmp_path / "b", *args)
  first = trainer.train(cfg, callbacks=[StopAfter(3)])
  resumed = trainer.train(cfg)
  assert first.run_state.step == 4 and resumed.run_state.step == 9
  chex.assert_trees_all_equal(resumed.state.params, straight.state.params)
  chex.assert_trees_all_equal(resumed.state.opt_state, straight.state.opt_state)
  a, b = (
    read_lines(tmp_path / "a" / "run" / "metrics.jsonl"),
    read_lines(tmp_path / "b" / "run" / "metrics.jsonl"),
  )
  assert [r["loss"] for r in a] == [r["loss"] for r in b]
  spe = -(-len(load_dataset(DataConfig(path=str(bpe_data)), seq_len=16).train) // 16)
  for info in list_checkpoints(tmp_path / "b" / "run" / "checkpoints"):
    run = info.run  # the position is (epoch, step_in_epoch), once: no second copy to disagree
    assert "loader" not in run and run["epoch"] * spe + run["step_in_epoch"] == run["step"]


@pytest.mark.slow
def test_damaged_shards_stop_the_cli_before_anything_runs(tmp_path, bpe_data):
  import shutil

  broken = tmp_path / "broken"
  shutil.copytree(bpe_data, broken)
  shard = broken / "train-00000.bin"
  shard.write_bytes(shard.read_bytes()[:-2])
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "jaxstep.train",
      *SMALL_MODEL,
      f"data.path={broken}",
      f"run_dir={tmp_path / 'run'}",
    ],
    capture_output=True,
    text=True,
    timeout=300,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
  assert proc.returncode == 2 and len(errors) == 1, proc.stderr
  assert "train-00000.bin has" in errors[0] and "prepare the data again" in errors[0]
  assert not (tmp_path / "run").exists()
