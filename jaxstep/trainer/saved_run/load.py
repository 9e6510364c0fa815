"""A finished (or running) run directory — or a Hugging Face model folder — read back for
use: its config, its tokenizer, its chat template and the params of one checkpoint — what
``jaxstep generate`` and ``jaxstep evaluate`` need.

Only the ``params`` of the checkpoint are read (``checkpoint_read`` with ``params_only``:
the optimizer state stays on disk), onto this process's first device — or, with ``tensor``
> 1, split over its first ``tensor`` devices the way a tensor-parallel run splits them, for a
model one device does not hold — whatever mesh wrote them, and verified as a resume would
(checksums, finiteness); the source is never written to. The tokenizer
is the copy ``train`` leaves in the run directory (``tokenizer.json`` / ``tokenizer.model``;
none for bytes; a model folder's tokenizer files in ``tokenizer/``), so a deleted data cache
does not orphan a run.

A folder with ``config.json`` and no ``config.yaml`` is a model folder (``load_model_folder``):
its config is what a run started from it would record (``model.init_from``; the other
sections at their defaults), its params are its weights (update step 0) and its tokenizer
and chat template are its own.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import pathlib
from typing import Any

import jax
from jax.sharding import Mesh

from jaxstep import data, models
from jaxstep.core import freeze, layout
from jaxstep.errors import CheckpointError, ConfigError, RunDirError
from jaxstep.trainer.config import loading as config_lib
from jaxstep.trainer.plan import steps
from jaxstep.trainer.plan.init_from import is_model_folder  # noqa: F401 - read as load's
from jaxstep.trainer.store import checkpoint_read, records

log = logging.getLogger("jaxstep")
BASE_CONFIG = "hf_config.json"
TOKENIZER_FILES = ("tokenizer", "tokenizer.json", "tokenizer.model")  # "tokenizer": a folder's


@dataclasses.dataclass(frozen=True)
class SavedRun:
  cfg: config_lib.Config  # the run's config.yaml (the vocabulary resolved)
  tokenizer: Any
  params: Any  # on this process's first device, or split over a tensor mesh's
  step: int  # the update step of the checkpoint read (0: a model folder's weights)
  chat_template: str | None = None  # the model folder's (or a run's copy of it), if any
  model_folder: bool = False  # read from a Hugging Face model folder, not a run directory


def save_tokenizer(run_dir: pathlib.Path, dataset: data.Dataset) -> None:
  """Copies the dataset's tokenizer file (if it has one; a model folder's tokenizer files
  into ``run_dir/tokenizer/``) into ``run_dir``, each file atomically: a kill during the
  copy leaves the previous copy, never a cut one generate would fail on."""
  if hasattr(dataset, "tokenizer_files"):  # a preference run's pairs: the tokenizer itself
    _copy_tokenizer_files(run_dir, dataset.tokenizer_spec, dataset.tokenizer_files())
    return
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


def _copy_tokenizer_files(run_dir: pathlib.Path, spec: str, files: list[pathlib.Path]) -> None:
  """A model folder's tokenizer files into ``run_dir/tokenizer/``, a tokenizer file as
  ``run_dir/tokenizer<suffix>`` (nothing for bytes), as a prepared corpus's are copied."""
  if pathlib.Path(spec).is_dir():
    (run_dir / "tokenizer").mkdir(exist_ok=True)
    for file in files:
      records.write_atomic(run_dir / "tokenizer" / file.name, file.read_bytes())
  for file in [] if pathlib.Path(spec).is_dir() else files:
    records.write_atomic(run_dir / f"tokenizer{file.suffix}", file.read_bytes())


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


def tensor_mesh(model_cfg, tensor: int) -> Mesh | None:
  """None for ``tensor`` 1 (one device); else a mesh of this process's first ``tensor``
  devices on a tensor axis, once the model is checked to split over it (``ConfigError``
  naming the numbers otherwise; key/value heads that do not split stay whole)."""
  from jaxstep import parallel
  from jaxstep.trainer.config.schema import MeshConfig
  from jaxstep.trainer.plan import tensor_split

  if tensor < 1:
    raise ConfigError(f"--tensor must be >= 1, got {tensor}")
  if tensor == 1:
    return None
  have = jax.local_device_count()
  if tensor > have:
    raise ConfigError(
      f"--tensor {tensor} splits the model over {tensor} devices; this process has {have}"
    )
  try:
    tensor_split.check(model_cfg, MeshConfig(tensor=tensor), seq_len=tensor)
  except ConfigError as e:  # named as this command spells it
    raise ConfigError(str(e).replace("mesh.tensor=", "--tensor ")) from None
  log.info("the model split over %d devices on a tensor axis (heads, MLP, vocabulary)", tensor)
  return parallel.make_mesh(1, 1, devices=jax.local_devices()[:tensor], tensor=tensor)


def load_run(run_dir: str | pathlib.Path, step: int | None = None, *, tensor: int = 1) -> SavedRun:
  """The run's config, tokenizer and the params of update step ``step`` (default: the
  newest checkpoint that restores; a newer damaged one is skipped with a warning), on one
  device or split over ``tensor`` devices (``tensor_mesh``). A model folder is read by
  ``load_model_folder`` (it has no steps: ``step`` must be None)."""
  run_dir = pathlib.Path(run_dir)
  if is_model_folder(run_dir):
    if step is not None:
      raise ConfigError(
        f"{run_dir} is a Hugging Face model folder (config.json, no config.yaml): it has no "
        f"checkpoints to pick a step from; drop --step"
      )
    return load_model_folder(run_dir, tensor=tensor)
  if run_dir.is_dir() and not (run_dir / "config.yaml").is_file():
    raise RunDirError(
      f"{run_dir} has neither config.yaml (a run directory: train into it first) nor "
      f"config.json (a Hugging Face model folder)"
    )
  cfg = read_config(run_dir)
  tokenizer = run_tokenizer(run_dir, cfg)
  mesh = tensor_mesh(cfg.model, tensor)
  kept = steps.stored(cfg)  # a LoRA run's checkpoints hold its adapters; its base: the folder
  cast = functools.partial(steps.frozen_cast, cfg)
  params, found, run = restore_params(
    run_dir / "checkpoints", cfg.model, step, stored=kept, cast=cast, mesh=mesh
  )
  if kept is not None:
    params = with_base(cfg, params, kept, run, mesh)
  folder = run_dir / "tokenizer"  # a model folder's tokenizer files, template included
  template = None
  if folder.is_dir():
    from jaxstep.data import hf_folder  # jinja2: only for runs trained from a model folder

    template = hf_folder.chat_template(folder)
  return SavedRun(cfg, tokenizer, params, found, chat_template=template)


def load_model_folder(path: str | pathlib.Path, *, tensor: int = 1) -> SavedRun:
  """A Hugging Face model folder as a ``SavedRun``: the config a run started from it would
  record (``model.init_from`` resolved; ``data.tokenizer`` the folder; ``train`` at its
  defaults, ``train.seq_len`` at most the positions the model takes), its fp32 weights on
  this process's first device (step 0; or each tensor split over ``tensor`` devices as it
  is read), its tokenizer and chat template. ``ConfigError`` for a folder
  ``load_pretrained`` refuses (no config.json, another architecture, …)."""
  from jaxstep.models.pretrained import load_pretrained
  from jaxstep.trainer.plan import init_from

  folder = pathlib.Path(path)
  cfg = init_from.folder_config(folder)
  model, longest = cfg.model, cfg.model.max_seq_len
  mesh, device = tensor_mesh(model, tensor), jax.local_devices()[0]

  def place(path, array):
    return jax.device_put(
      array, device if mesh is None else layout.leaf_sharding(path, array.shape, mesh)
    )

  pre = load_pretrained(
    folder,
    place=place,
    max_seq_len=longest,
    attention=model.attention,
  )
  return SavedRun(cfg, pre.tokenizer, pre.params, 0, pre.chat_template, model_folder=True)


def with_base(cfg, params, kept, run: dict | None, mesh: Mesh | None = None):
  """``params`` (the stored part) completed by the frozen leaves of ``model.init_from``'s
  weights, once the folder is checked to hold the weights the run was trained on (the
  fingerprint of the read that loads them against the run's; an older run's sampled one
  by ``hf_weights.matches``), placed on ``mesh`` (None: the first device)."""
  from jaxstep import parallel
  from jaxstep.models import hf_weights
  from jaxstep.trainer.plan import init_from

  folder = cfg.model.init_from
  mesh = mesh or parallel.make_mesh(1, 1, devices=jax.local_devices()[:1])
  base, fingerprint = init_from.read_base(cfg.model, mesh, cfg.train.seed, steps.base_leaf(cfg))
  recorded = ((run or {}).get("base") or {}).get("fingerprint")
  if recorded and not hf_weights.matches(recorded, folder, fingerprint)[0]:
    raise CheckpointError(
      f"the base weights in {folder} changed since this run's checkpoint was written; "
      f"its checkpoints hold the trained parameters only and need the base they were "
      f"trained on"
    )
  base = steps.frozen_cast(cfg, base)
  return freeze.combine(params, freeze.partition(base, kept)[1])


def restore_params(
  directory: pathlib.Path, model_cfg, step: int | None = None, *, stored=None, cast=None, mesh=None
):
  """``(params, step, run-state JSON)`` from the newest usable (or exactly ``step``)
  checkpoint, read-only; ``stored``: the checkpoint holds only those params leaves (the
  others come back None); ``cast``: the params' dtypes as the run keeps them (abstract);
  ``mesh``: a tensor mesh to split them over (None: the first device)."""
  directory = directory.resolve()
  if not any(step is None or s == step for s, _ in checkpoint_read.step_dirs(directory)):
    what = f"no checkpoint of update step {step}" if step is not None else "no checkpoint"
    raise RunDirError(f"{directory} holds {what} (see: jaxstep checkpoints RUN_DIR)")
  abstract = jax.eval_shape(lambda: models.build(model_cfg, 0)[1])
  if cast is not None:
    abstract = cast(abstract)
  if mesh is None:
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    places = jax.tree.map(lambda _: device, abstract)
  else:
    places = layout.tree_shardings(abstract, mesh)
  abstract = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, places
  )
  if stored is not None:
    abstract = freeze.partition(abstract, stored)[0]
  read, skipped = checkpoint_read.newest(directory, abstract, step=step, params_only=True)
  if read is None:
    problems = "; ".join(f"step {r.step}: {r.problem}" for r in skipped)
    raise CheckpointError(f"no checkpoint in {directory} restores ({problems})")
  return read.state, read.step, read.run
