"""A distillation run's teacher read back (``distill.teacher``: a model folder or a run
directory, as ``jaxstep generate`` reads either): its params in ``distill.teacher_dtype``,
once its vocabulary is checked against the student's (``plan.teacher``)."""

from __future__ import annotations

import logging

import jax

from jaxstep.errors import ConfigError
from jaxstep.models import hf_weights
from jaxstep.trainer.config import loading as config_lib
from jaxstep.trainer.plan import teacher
from jaxstep.trainer.saved_run import load as saved_run

log = logging.getLogger("jaxstep")


def load(cfg: config_lib.Config, tokenizer) -> tuple:
  """``(params, identity)`` of the teacher: its params (on this process's first device, in
  ``distill.teacher_dtype``) for a student whose data ``tokenizer`` gives
  ``cfg.model.vocab_size`` logits, and ``RunState.teacher`` (``{"path", "step",
  "fingerprint"}``); ``(None, {})`` without a teacher. ``ConfigError`` for a path that is
  neither kind, another vocabulary, or fewer positions than ``train.seq_len``."""
  path = cfg.distill.teacher
  if not path:
    return None, {}
  teacher.teacher_config(path)  # a path that is neither kind: one line naming the key
  saved = saved_run.load_run(path)
  teacher.check_vocabulary(cfg, saved.cfg.model.vocab_size, saved.tokenizer, tokenizer)
  if saved.cfg.model.max_seq_len < cfg.train.seq_len:
    raise ConfigError(
      f"distill.teacher {path} takes {saved.cfg.model.max_seq_len} positions, the student's "
      f"windows train.seq_len {cfg.train.seq_len}: lower train.seq_len or use a teacher of "
      f"a longer context"
    )
  identity = {"path": str(path), "step": saved.step}
  if saved.model_folder:
    identity["fingerprint"] = hf_weights.fingerprint(path)
  log.info(
    "distill: teacher %s (%s, %s parameters, %s), mode %s",
    path,
    "model folder" if saved.model_folder else f"run directory, update step {saved.step}",
    f"{sum(x.size for x in jax.tree.leaves(saved.params)):,}",
    cfg.distill.teacher_dtype,
    cfg.distill.resolved_mode(bool(cfg.rl.rewards)),
  )
  return teacher.cast(cfg, saved.params), identity
