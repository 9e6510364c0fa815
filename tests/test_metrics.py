"""metrics.jsonl / eval.jsonl: reading back, what a resumed run keeps of them, and records that
average the updates since the one before."""

import json

import numpy as np
import pytest

from jaxstep.trainer.store.records import read_records
from jaxstep.trainer.tracking.metrics import MetricsSink
from jaxstep.trainer.tracking.window import Window


def write_lines(path, *lines):
  path.write_text("".join(line + "\n" for line in lines))


def test_a_line_cut_short_by_a_kill_is_skipped_when_read(tmp_path):
  path = tmp_path / "metrics.jsonl"
  write_lines(path, json.dumps({"step": 1}), "", json.dumps({"step": 2}), '{"step": 3, "lo')
  assert read_records(path) == [{"step": 1}, {"step": 2}]
  assert read_records(tmp_path / "missing.jsonl") == []


def test_a_resumed_run_drops_lines_past_the_restored_step_and_a_cut_line(tmp_path):
  lines = [json.dumps({"step": s, "loss": 1.0}) for s in (2, 4, 6)]
  write_lines(tmp_path / "metrics.jsonl", *lines, '{"step": 8, "lo')
  write_lines(tmp_path / "eval.jsonl", json.dumps({"step": 4}), json.dumps({"step": 8}))
  MetricsSink(tmp_path, start_step=4, total_steps=10, progress=False).close()
  assert [r["step"] for r in read_records(tmp_path / "metrics.jsonl")] == [2, 4]
  assert (tmp_path / "metrics.jsonl").read_text() == "".join(line + "\n" for line in lines[:2])
  assert [r["step"] for r in read_records(tmp_path / "eval.jsonl")] == [4]


def test_a_record_every_n_updates_averages_them_and_keeps_the_last_lr(tmp_path):
  """Two runs of the same 6 updates, logged every update and every 4: the second's record
  at 4 holds the first's mean over updates 1-4 (loss, gradient norm, tokens) with the last
  lr and step, and its end, between two records, the mean of updates 5-6."""
  from conftest import make_cfg, read_lines

  from jaxstep.trainer import config_run

  every = {}
  for n in (1, 4):
    cfg = make_cfg(tmp_path / f"every{n}", f"train.log_every={n}", "train.max_steps=6",
                   "optim.warmup_steps=4")  # fmt: skip
    config_run.train(cfg)
    every[n] = read_lines(tmp_path / f"every{n}" / "run" / "metrics.jsonl")
  one, four = every[1], every[4]
  assert [r["step"] for r in four] == [4, 6]
  for record, updates in ((four[0], one[:4]), (four[1], one[4:])):
    for key in ("loss", "grad_norm"):
      assert record[key] == pytest.approx(np.mean([u[key] for u in updates]), rel=1e-6), key
    assert record["lr"] == updates[-1]["lr"] and record["step"] == updates[-1]["step"]
    assert record["tokens"] == round(np.mean([u["tokens"] for u in updates]))
  assert len({r["lr"] for r in one[:4]}) == 4  # the warm-up: the last lr is not the mean


def test_a_window_leaves_skipped_updates_out_of_its_means():
  window = Window()
  for loss, updated in ((2.0, True), (float("nan"), False), (4.0, True)):
    window.add({"step": 1, "loss": loss, "lr": loss, "updated": updated, "tokens": 3})
  assert window.mean() == {"step": 1, "loss": 3.0, "lr": 4.0, "updated": True, "tokens": 3}
  window.clear()
  assert window.mean() is None
  for speed in (10.0, None, 30.0, None):  # a number some updates report: their mean
    window.add({"step": 2, "loss": 1.0, "updated": True} | ({"speed": speed} if speed else {}))
  assert window.mean() == {"step": 2, "loss": 1.0, "updated": True, "speed": 20.0}


def test_a_run_dir_replaced_under_the_sink_gets_no_line(tmp_path):
  """A run dir removed and made again (a save still under way re-creates its parents) is not
  the run's: the sink refuses to start a history there and names the removal."""
  import shutil

  from jaxstep.trainer.store.run_dir import RemovedError

  run_dir = tmp_path / "run"
  run_dir.mkdir()
  sink = MetricsSink(run_dir, start_step=0, total_steps=2, progress=False, tensorboard=False)
  record = {"step": 1, "epoch": 0, "loss": 1.0, "lr": 0.1, "grad_norm": 1.0, "tokens_per_sec": 1}
  sink.train(record)
  shutil.rmtree(run_dir)
  (run_dir / "checkpoints").mkdir(parents=True)
  with pytest.raises(RemovedError, match="was removed or replaced during the run"):
    sink.train({**record, "step": 2})
  with pytest.raises(RemovedError):
    sink.eval({"step": 2, "set": "heldout", "eval_loss": 1.0})
  sink.close()
  assert [p.name for p in run_dir.iterdir()] == ["checkpoints"]


def _tensorboard_tags(folder) -> set:
  """The scalar tags of every event file under ``folder`` (TFRecord framing, read here)."""
  import struct

  from tensorboardX.proto import event_pb2

  tags = set()
  for path in folder.rglob("events.out.tfevents.*"):
    data, at = path.read_bytes(), 0
    while at < len(data):
      (length,) = struct.unpack("<Q", data[at : at + 8])
      event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
      tags |= {value.tag for value in event.summary.value}
      at += 16 + length
  return tags


def test_a_metric_named_module_colon_function_gets_a_tensorboard_tag_and_no_log_line(
  tmp_path, caplog
):
  """A reward named ``module:function`` names its metrics so: TensorBoard allows no ``:``.
  The tag takes ``_`` for it, as tensorboardX would, without its log line at every record."""
  import logging

  sink = MetricsSink(tmp_path, start_step=0, total_steps=2, progress=False)
  record = {"step": 1, "epoch": 0, "loss": 1.0, "lr": 0.1, "grad_norm": 1.0, "tokens_per_sec": 1}
  with caplog.at_level(logging.INFO):
    sink.train({**record, "rewards/digits:match/mean": 0.5})
    sink.eval({"step": 1, "set": "heldout", "eval_rewards/digits:match": 0.25})
    sink.close()
  assert "illegal" not in caplog.text
  tags = _tensorboard_tags(tmp_path / "tensorboard")
  assert {"train/rewards/digits_match/mean", "eval/rewards/digits_match"} <= tags
  assert read_records(tmp_path / "metrics.jsonl")[0]["rewards/digits:match/mean"] == 0.5
