"""A finished (or running) run directory read back for use: its config, its tokenizer and
the params of one checkpoint — what ``jaxstep generate`` and ``jaxstep evaluate`` need.

Only the ``params`` of the checkpoint are read (``checkpoint_read`` with ``params_only``:
the optimizer state stays on disk), onto this process's first device, whatever mesh wrote
them, and verified as a resume would (checksums, finiteness); the source is never written
to. The tokenizer
is the copy ``train`` leaves in the run directory (``tokenizer.json`` / ``tokenizer.model``;
none for bytes), so a deleted data cache does not orphan a run.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
from typing import Any

import jax

from jaxstep import data, models
from jaxstep.errors import CheckpointError, RunDirError
from jaxstep.trainer import checkpoint_read, records
from jaxstep.trainer import config as config_lib

log = logging.getLogger("jaxstep")
BASE_CONFIG = "hf_config.json"
TOKENIZER_FILES = ("tokenizer", "tokenizer.json", "tokenizer.model")  # "tokenizer": a folder's


@dataclasses.dataclass(frozen=True)
class SavedRun:
  cfg: config_lib.Config  # the run's config.yaml (the vocabulary resolved)
  tokenizer: Any
  params: Any  # on this process's first device
  step: int  # the update step of the checkpoint read


def save_tokenizer(run_dir: pathlib.Path, dataset: data.Dataset) -> None:
  """Copies the dataset's tokenizer file (if it has one; a model folder's tokenizer files
  into ``run_dir/tokenizer/``) into ``run_dir``, each file atomically: a kill during the
  copy leaves the previous copy, never a cut one generate would fail on."""
  entry = dataset.manifest["tokenizer"]
  source = None if entry["file"] is None else dataset.folder / entry["file"]
  if source is not None and source.is_dir():
    (run_dir / "tokenizer").mkdir(exist_ok=True)
    for file in source.iterdir():
      records.write_atomic(run_dir / "tokenizer" / file.name, file.read_bytes())
  elif source is not None:
    suffix = pathlib.Path(entry["file"]).suffix
    copy = (dataset.folder / entry["file"]).read_bytes()
    records.write_atomic(run_dir / f"tokenizer{suffix}", copy)


def save_base_config(run_dir: pathlib.Path, model_cfg) -> None:
  """A run started from a model folder keeps that folder's ``config.json`` as
  ``run_dir/hf_config.json`` (atomically): an export writes its fields jaxstep does not
  know (token ids, generation settings) back out, whatever became of the folder."""
  if model_cfg.init_from:
    source = pathlib.Path(model_cfg.init_from) / "config.json"
    records.write_atomic(run_dir / BASE_CONFIG, source.read_bytes())


def saved_tokenizer_file(run_dir: pathlib.Path) -> pathlib.Path | None:
  """The copy of the tokenizer that ``save_tokenizer`` left in ``run_dir`` (None: bytes, or
  a run trained before runs kept one)."""
  return next((run_dir / n for n in TOKENIZER_FILES if (run_dir / n).exists()), None)


def run_tokenizer(run_dir: pathlib.Path, cfg: config_lib.Config):
  """The run's tokenizer: its saved copy, else what its data config names."""
  saved = saved_tokenizer_file(run_dir)
  if saved is not None:
    return data.load_tokenizer(str(saved))
  folder = pathlib.Path(cfg.data.path)
  if (folder / "manifest.json").is_file():
    return data.prepared_tokenizer(folder, data.read_manifest(folder, verify=False))
  return data.load_tokenizer(cfg.data.tokenizer)


def read_config(run_dir: str | pathlib.Path) -> config_lib.Config:
  """``run_dir/config.yaml``; ``RunDirError`` when the folder is not a run directory."""
  run_dir = pathlib.Path(run_dir)
  if not run_dir.is_dir():
    raise RunDirError(f"run directory {run_dir} does not exist")
  if not (run_dir / "config.yaml").is_file():
    raise RunDirError(f"{run_dir} has no config.yaml: not a run directory (train into it first)")
  cfg = config_lib.load(run_dir / "config.yaml")
  if cfg.model.vocab_size == 0:
    raise RunDirError(f"{run_dir / 'config.yaml'} has no resolved model.vocab_size")
  return cfg


def load_run(run_dir: str | pathlib.Path, step: int | None = None) -> SavedRun:
  """The run's config, tokenizer and the params of update step ``step`` (default: the
  newest checkpoint that restores; a newer damaged one is skipped with a warning)."""
  run_dir = pathlib.Path(run_dir)
  cfg = read_config(run_dir)
  tokenizer = run_tokenizer(run_dir, cfg)
  params, found = restore_params(run_dir / "checkpoints", cfg.model, step)
  return SavedRun(cfg, tokenizer, params, found)


def restore_params(directory: pathlib.Path, model_cfg, step: int | None = None):
  """``(params, step)`` from the newest usable (or exactly ``step``) checkpoint, read-only."""
  directory = directory.resolve()
  if not any(step is None or s == step for s, _ in checkpoint_read.step_dirs(directory)):
    what = f"no checkpoint of update step {step}" if step is not None else "no checkpoint"
    raise RunDirError(f"{directory} holds {what} (see: jaxstep checkpoints RUN_DIR)")
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
    jax.eval_shape(lambda: models.build(model_cfg, 0)[1]),
  )
  read, skipped = checkpoint_read.newest(directory, abstract, step=step, params_only=True)
  if read is None:
    problems = "; ".join(f"step {r.step}: {r.problem}" for r in skipped)
    raise CheckpointError(f"no checkpoint in {directory} restores ({problems})")
  return read.state, read.step
