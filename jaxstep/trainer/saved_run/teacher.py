"""A distillation run's teacher read back (``distill.teacher``: a model folder or a run
directory): its params in ``distill.teacher_dtype``, each tensor onto the run's mesh as it
is read (the layout rules the student's params follow), once its vocabulary is checked
against the student's (``plan.teacher``)."""

from __future__ import annotations

import functools
import logging
import pathlib

import jax

from jaxstep import data, parallel
from jaxstep.errors import CheckpointError, ConfigError, RunDirError
from jaxstep.trainer.config import loading as config_lib
from jaxstep.trainer.plan import init_from, steps, teacher
from jaxstep.trainer.saved_run import load as saved_run

log = logging.getLogger("jaxstep")


def load(cfg: config_lib.Config, tokenizer, mesh=None) -> tuple:
  """``(params, identity)`` of the teacher: its params in ``distill.teacher_dtype`` on
  ``mesh`` (None: this process's first device), for a student whose data ``tokenizer``
  gives ``cfg.model.vocab_size`` logits, and ``RunState.teacher`` (``{"path", "step",
  "fingerprint"}``); ``(None, {})`` without a teacher. ``ConfigError`` for a path that is
  neither kind, another vocabulary, or fewer positions than ``train.seq_len``."""
  path = cfg.distill.teacher
  if not path:
    return None, {}
  own = teacher.teacher_config(path)  # a path that is neither kind: one line naming the key
  mesh = mesh or parallel.make_mesh(1, 1, devices=jax.local_devices()[:1])
  if saved_run.is_model_folder(path):
    tok = data.load_tokenizer(path)
    check(cfg, own, tok, tokenizer)
    dtype = cfg.distill.teacher_dtype
    params, fingerprint = init_from.read_base(
      own.model, mesh, 0, lambda _, a: teacher.cast(a, dtype)
    )
    identity, where = {"path": str(path), "step": 0, "fingerprint": fingerprint}, "model folder"
  else:
    run_dir = pathlib.Path(path)
    tok = saved_run.run_tokenizer(run_dir, own)
    check(cfg, own, tok, tokenizer)
    try:
      params, step = _run_params(run_dir, own, mesh)
    except (RunDirError, CheckpointError) as e:  # named as the key that points there
      raise type(e)(f"distill.teacher {path}: {e}") from None
    params = teacher.cast(params, cfg.distill.teacher_dtype)
    identity, where = {"path": str(path), "step": step}, f"run directory, update step {step}"
  log.info(
    "distill: teacher %s (%s, %s parameters, %s), mode %s",
    path,
    where,
    f"{sum(x.size for x in jax.tree.leaves(params)):,}",
    cfg.distill.teacher_dtype,
    cfg.distill.resolved_mode(bool(cfg.rl.rewards)),
  )
  return params, identity


def check(cfg: config_lib.Config, own: config_lib.Config, teacher_tok, student_tok) -> None:
  """The teacher scores the student's windows: its vocabulary (``plan.teacher``) and its
  positions (at least ``train.seq_len``)."""
  teacher.check_vocabulary(cfg, own.model.vocab_size, teacher_tok, student_tok)
  if own.model.max_seq_len < cfg.train.seq_len:
    raise ConfigError(
      f"distill.teacher {cfg.distill.teacher} takes {own.model.max_seq_len} positions, the "
      f"student's windows train.seq_len {cfg.train.seq_len}: lower train.seq_len or use a "
      f"teacher of a longer context"
    )


def _run_params(run_dir: pathlib.Path, own: config_lib.Config, mesh) -> tuple:
  """A run directory's params of its newest checkpoint that restores, on ``mesh`` (a LoRA
  run's base read from its folder onto it too), and the checkpoint's update step."""
  kept = steps.stored(own)
  cast = functools.partial(steps.frozen_cast, own)
  params, step, run = saved_run.restore_params(
    run_dir / "checkpoints", own.model, stored=kept, cast=cast, mesh=mesh
  )
  if kept is not None:
    params = saved_run.with_base(own, params, kept, run, mesh)
  return params, step
