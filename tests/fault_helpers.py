"""Helpers the fault-suite files share: the small run's overrides, one ``error:`` line read
back, the CLI's I/O exit code, an ``ENOSPC`` error, the CLI run in this process, checks
that a run dir is resumable, and a side file cut short or with bytes changed."""

import pathlib

from conftest import SMALL_MODEL, make_cfg

from jaxstep.cli import train as train_cli

SMALL = [*SMALL_MODEL, "train.sample_every=0"]


def one_error(capsys) -> str:
  err = capsys.readouterr().err
  errors = [line for line in err.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "Traceback" not in err, err
  return errors[0]


IO_EXIT = 74


def enospc(filename=None):
  import errno
  import os

  return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)


def train_main(tmp_path, *overrides) -> int:
  """The CLI in this process (its device set is already fixed by conftest's JAX)."""
  make_cfg(tmp_path)  # writes the corpus
  return train_cli.main(
    [
      *SMALL,
      f"data.path={tmp_path / 'corpus.txt'}",
      f"run_dir={tmp_path / 'run'}",
      "train.max_steps=12",
      "train.log_every=1",
      "checkpoint.every=4",
      *overrides,
    ]
  )


def assert_resumable_from(run_dir: pathlib.Path, step: int) -> None:
  from jaxstep.trainer.store.checkpoint import list_checkpoints, step_dirs

  assert step_dirs(run_dir / "checkpoints")[0][0] == step
  assert all(info.problem is None for info in list_checkpoints(run_dir / "checkpoints"))


def newest_in(line: str) -> int:
  import re

  return int(re.search(r"the newest complete checkpoint is update step (\d+)", line).group(1))


def failing_after(calls: int, error_fn, original):
  count = {"n": 0}

  def wrapped(*args, **kwargs):
    count["n"] += 1
    if count["n"] > calls:
      raise error_fn()
    return original(*args, **kwargs)

  return wrapped


def damage(path: pathlib.Path, how: str, inside: bytes = b"") -> None:
  """``path`` broken as a disk or a kill breaks a file: ``"cut"`` keeps its first half;
  ``"flipped"`` inverts 16 bytes in the middle of ``inside`` (an array's bytes as the file
  stores them: ``np.savez`` keeps them uncompressed), so only a checksum can tell."""
  raw = bytearray(path.read_bytes())
  if how == "cut":
    path.write_bytes(bytes(raw[: len(raw) // 2]))
    return
  at = raw.find(inside)
  assert how == "flipped" and len(inside) >= 32 and at >= 0 and raw.count(inside) == 1
  at += len(inside) // 2 - 8
  raw[at : at + 16] = bytes(b ^ 0xFF for b in raw[at : at + 16])
  path.write_bytes(bytes(raw))
