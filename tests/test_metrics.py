"""metrics.jsonl / eval.jsonl: reading back, and what a resumed run keeps of them."""

import json

from jaxstep.trainer.store.records import read_records
from jaxstep.trainer.tracking.metrics import MetricsSink


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
