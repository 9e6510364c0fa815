"""``jaxstep plot``: the picture of a run's metrics, from whatever lines are usable, and one
error line when it cannot be drawn or written."""

import errno

import matplotlib.figure
import pytest

from jaxstep.cli import plot
from jaxstep.trainer.store import records


def _metrics(run_dir, lines):
  run_dir.mkdir(exist_ok=True)
  (run_dir / "metrics.jsonl").write_text("".join(records.dumps(r) + "\n" for r in lines))


GOOD = [{"step": s, "loss": 3.0 / s, "lr": 1e-3, "grad_norm": 1.0} for s in (1, 2, 3)]


def test_lines_without_a_field_are_passed_over(tmp_path):
  _metrics(tmp_path, [{"step": 0, "lr": 1e-3}, *GOOD, {"loss": 1.0}, {"step": 4, "loss": "x"}])
  (tmp_path / "eval.jsonl").write_text('{"step": 2, "eval_loss": 1.5}\n{"step": 3}\n')
  assert plot.main([str(tmp_path)]) == 0
  assert (tmp_path / "loss.png").stat().st_size > 10_000


def test_no_usable_line_is_one_error_line(tmp_path, capsys):
  _metrics(tmp_path, [{"step": 1, "lr": 1e-3}, {"loss": 2.0}])
  assert plot.main([str(tmp_path)]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "no line with step, loss, lr, grad_norm" in err


def test_a_folder_that_cannot_be_written_is_exit_74(tmp_path, monkeypatch, capsys):
  _metrics(tmp_path, GOOD)

  def read_only(*_, **__):
    raise OSError(errno.EROFS, "Read-only file system")

  monkeypatch.setattr(matplotlib.figure.Figure, "savefig", read_only)
  assert plot.main([str(tmp_path)]) == 74
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "Read-only file system" in err


@pytest.mark.slow
def test_a_read_only_mount_is_exit_74(tmpfs, capsys):
  point = tmpfs("1m")
  _metrics(point, GOOD)
  tmpfs.read_only(point)
  assert plot.main([str(point)]) == 74
  assert "error: cannot write" in capsys.readouterr().err
