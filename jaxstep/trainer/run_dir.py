"""The run directory: created once, earlier outputs set aside on ``--no-resume``, and the
one way folders that must not collide are named (``<name>-<YYYYmmdd-HHMMSS>``)."""

from __future__ import annotations

import logging
import pathlib
import shutil
import time

import jax

log = logging.getLogger("jaxstep")
RUN_OUTPUTS = ("checkpoints", "checkpoints.corrupt", "metrics.jsonl", "eval.jsonl", "tensorboard")


def stamped(name: str) -> str:
  """``name`` with the local time appended: ``previous-20261130-204253``."""
  return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def prepare(run_dir: str | pathlib.Path, config_yaml: str) -> pathlib.Path:
  """Creates ``run_dir`` and (process 0) writes the resolved config to ``config.yaml``."""
  run_dir = pathlib.Path(run_dir)
  run_dir.mkdir(parents=True, exist_ok=True)
  if jax.process_index() == 0:
    (run_dir / "config.yaml").write_text(config_yaml)
  return run_dir


def archive_previous(run_dir: pathlib.Path) -> None:
  """``--no-resume``: moves an earlier run's outputs into ``run_dir/previous-<time>/``."""
  present = [name for name in RUN_OUTPUTS if (run_dir / name).exists()]
  if not present:
    return
  dest = run_dir / stamped("previous")
  dest.mkdir()
  for name in present:
    shutil.move(str(run_dir / name), dest / name)
  log.warning("--no-resume: moved the previous run's %s to %s", ", ".join(present), dest)
