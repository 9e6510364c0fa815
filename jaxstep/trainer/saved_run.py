"""A finished (or running) run directory read back for use: its config, its tokenizer and
the params of one checkpoint — what ``jaxstep generate`` and ``jaxstep evaluate`` need.

Only the ``params`` of the checkpoint are read (orbax partial restore: the optimizer state
stays on disk), onto this process's first device, whatever mesh wrote them, and checked
against the checksums saved with them. The tokenizer
is the copy ``train`` leaves in the run directory (``tokenizer.json`` / ``tokenizer.model``;
none for bytes), so a deleted data cache does not orphan a run.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import shutil
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxstep import data, models
from jaxstep.errors import CheckpointError, JaxstepError, RunDirError
from jaxstep.trainer import block_layout, integrity
from jaxstep.trainer import config as config_lib
from jaxstep.trainer.checkpoint import (
  STATE,
  VERIFY,
  _first_line,
  _layout_problem,
  _shapes_mismatch,
  step_dirs,
)

log = logging.getLogger("jaxstep")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


@dataclasses.dataclass(frozen=True)
class SavedRun:
  cfg: config_lib.Config  # the run's config.yaml (the vocabulary resolved)
  tokenizer: Any
  params: Any  # on this process's first device
  step: int  # the update step of the checkpoint read


def save_tokenizer(run_dir: pathlib.Path, dataset: data.Dataset) -> None:
  """Copies the dataset's tokenizer file (if it has one) into ``run_dir``."""
  entry = dataset.manifest["tokenizer"]
  if entry["file"] is not None:
    suffix = pathlib.Path(entry["file"]).suffix
    shutil.copyfile(dataset.folder / entry["file"], run_dir / f"tokenizer{suffix}")


def saved_tokenizer_file(run_dir: pathlib.Path) -> pathlib.Path | None:
  """The copy of the tokenizer that ``save_tokenizer`` left in ``run_dir`` (None: bytes, or
  a run trained before runs kept one)."""
  return next((run_dir / n for n in TOKENIZER_FILES if (run_dir / n).is_file()), None)


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
  """``(params, step)`` from the newest usable (or exactly ``step``) checkpoint."""
  directory = directory.resolve()  # orbax reads relative paths as missing
  candidates = [(s, p) for s, p in step_dirs(directory) if step is None or s == step]
  if not candidates:
    what = f"no checkpoint of update step {step}" if step is not None else "no checkpoint"
    raise RunDirError(f"{directory} holds {what} (see: jaxstep checkpoints RUN_DIR)")
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
    jax.eval_shape(lambda: models.build(model_cfg, 0)[1]),
  )
  problems = []
  for s, path in candidates:
    try:
      return _restore(path, abstract), s
    except JaxstepError as e:
      problem = str(e)
    except Exception as e:  # noqa: BLE001 - any failure to read means unusable
      problem = _first_line(e)
    log.warning("checkpoint of update step %d is unusable (%s); trying an older one", s, problem)
    problems.append(f"step {s}: {problem}")
  raise CheckpointError(f"no checkpoint in {directory} restores ({'; '.join(problems)})")


def _restore(path: pathlib.Path, abstract):
  problem = _layout_problem(path)
  if problem:
    raise CheckpointError(problem)
  with ocp.PyTreeCheckpointer() as reader:
    saved = reader.metadata(path / STATE)
    saved = getattr(saved, "item_metadata", saved)
    saved_params = getattr(saved, "tree", saved)["params"]
    target, abstract = abstract, block_layout.like_saved(saved_params, abstract)
    mismatch = _shapes_mismatch(saved_params, abstract, "parameter")
    if mismatch:
      raise CheckpointError(f"it does not fit the run's config.yaml: {mismatch}")
    restored = reader.restore(
      path / STATE,
      args=ocp.args.PyTreeRestore(
        item={"params": abstract},
        restore_args={"params": ocp.checkpoint_utils.construct_restore_args(abstract)},
        partial_restore=True,
      ),
    )
  params = restored["params"]
  problem = integrity.mismatch(params, _params_checksums(path)) or integrity.nonfinite(
    {"params": params}
  )
  if problem:
    raise CheckpointError(problem)
  return params if abstract is target else block_layout.back_to(params, target)


def _params_checksums(path: pathlib.Path) -> dict:
  """The checksums saved with the params, keyed relative to ``params`` (none in a
  checkpoint written before checksums)."""
  if not (path / VERIFY).is_dir():
    return {}
  with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as reader:
    saved = reader.restore(path / VERIFY, args=ocp.args.JsonRestore()) or {}
  prefix = "params/"
  checksums = saved.get("checksums", {})
  return {k[len(prefix) :]: v for k, v in checksums.items() if k.startswith(prefix)}
