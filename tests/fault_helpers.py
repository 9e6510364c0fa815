"""Helpers the fault-suite files share: the small run's overrides, one ``error:`` line read
back, the CLI's I/O exit code, an ``ENOSPC`` error, the CLI run in this process, and checks
that a run dir is resumable."""

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
  import jax

  jax.devices()  # the backend is up: the CLI leaves this process's devices alone
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
