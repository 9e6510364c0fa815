"""Where a CLI run stands on the host: the JSON-able ``RunState`` saved next to the
``TrainState`` in every checkpoint (the step never sees it)."""

from __future__ import annotations

import dataclasses
import pathlib

import yaml

from jaxstep.trainer.store.param_layout import PARAM_LAYOUT


@dataclasses.dataclass(frozen=True)
class RunState:
  """Host-side position of a run, JSON-able; checkpointed next to ``TrainState``.

  Attributes:
    step: update steps done (mirrors ``TrainState.step`` without a device read).
    epoch: current pass over the data (0-based).
    step_in_epoch: global batches of this epoch already consumed.
    dataset_fingerprint: hash of the tokenized training samples + data config.
    global_batch_size: G, samples per update step.
    grad_accum_steps: K, micro-steps per update step.
    config_digest: hash of the resolved config.
    jaxstep_version: the version that wrote it.
    seed: ``train.seed`` (data order, init, dropout).
    schedule_steps: update steps the lr schedule was planned for.
    lr_schedule: ``optim.schedule`` (a warmup-stable-decay run may change its length).
    model: the resolved ``model`` config section.
    trainable: ``optim.trainable``, the patterns of the leaves that train (the optimizer
      state holds those leaves only).
    base: ``{"path", "fingerprint"}`` of the ``model.init_from`` weights a run reloads
      at every start because its checkpoints hold only the trainable parameters; else {}.
    trackers: ``{tracker: run id}`` of the external trackers (MLflow, W&B), so a resumed
      run continues the same tracker runs.
    param_layout: the bundled models' parameter layout (``param_layout.PARAM_LAYOUT``; a
      run state without it: 1, read by ``param_layout.upgrade``).
    optim: ``{"name", "groups"}``: ``optim.name`` and ``optim.groups``, which lay out the
      optimizer state (``optimizer_of``), so a resume that changes them is named as such.
    teacher: ``{"path", "step", "fingerprint"}`` of a distillation run's teacher, read again
      at every start (a run directory's checkpoint step; a model folder's weights'
      fingerprint), so a resume from another teacher is refused; else {}.
  """

  step: int = 0
  epoch: int = 0
  step_in_epoch: int = 0
  dataset_fingerprint: str = ""
  global_batch_size: int = 0
  grad_accum_steps: int = 1
  config_digest: str = ""
  jaxstep_version: str = ""
  seed: int = 0
  schedule_steps: int = 0
  lr_schedule: str = ""
  model: dict = dataclasses.field(default_factory=dict)
  trainable: list = dataclasses.field(default_factory=list)
  base: dict = dataclasses.field(default_factory=dict)
  trackers: dict = dataclasses.field(default_factory=dict)
  param_layout: int = PARAM_LAYOUT
  optim: dict = dataclasses.field(default_factory=dict)
  teacher: dict = dataclasses.field(default_factory=dict)

  def advanced(self, *, steps_per_epoch: int) -> RunState:
    """The position after consuming one global batch (one update step)."""
    step_in_epoch = self.step_in_epoch + 1
    if step_in_epoch == steps_per_epoch:
      return dataclasses.replace(self, step=self.step + 1, epoch=self.epoch + 1, step_in_epoch=0)
    return dataclasses.replace(self, step=self.step + 1, step_in_epoch=step_in_epoch)

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


def optimizer_of(optim) -> dict:
  """``RunState.optim`` of an ``optim`` config section, or of its mapping in a
  ``config.yaml`` (one written before ``optim.name`` existed: AdamW, the only optimizer)."""
  if isinstance(optim, dict):
    return {"name": optim.get("name", "adamw"), "groups": list(optim.get("groups") or [])}
  return {"name": optim.name, "groups": [dict(g) for g in optim.groups]}


def saved_optimizer(run: dict | None, run_dir: pathlib.Path) -> dict:
  """A checkpoint's ``RunState.optim``; for a checkpoint written before run states kept it,
  the ``optim`` section of ``run_dir/config.yaml`` (the config of the run that wrote it);
  {} when neither says."""
  if (run or {}).get("optim"):
    return run["optim"]
  try:
    optim = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))["optim"]
    return optimizer_of(optim)
  except (OSError, UnicodeDecodeError, yaml.YAMLError, TypeError, KeyError):
    return {}


def optimizer_change(old: dict, new: dict) -> tuple[str, str]:
  """``(key, "written with …; resuming with …")`` for the one of ``optim.name`` and
  ``optim.groups`` (``optimizer_of``) that differs between a checkpoint's ``old`` and this
  run's ``new`` in a way that lays the optimizer state out anew (a group's ``lr_scale`` or
  ``weight_decay`` does not); ``("", "")`` when neither does or ``old`` is unknown."""
  if not old.get("name"):
    return "", ""
  if old["name"] != new["name"]:
    return "optim.name", f"optim.name={old['name']}; resuming with {new['name']}"

  def layout(groups):  # a group's leaves and its optimizer shape the state
    return [(g.get("match"), g.get("optimizer", old["name"])) for g in groups]

  if layout(old["groups"]) == layout(new["groups"]):
    return "", ""
  return "optim.groups", (
    f"optim.groups={_flow(old['groups'])}; resuming with optim.groups={_flow(new['groups'])}"
  )


def _flow(groups: list) -> str:
  """Groups as one line of YAML, as a ``key=value`` override takes them."""
  return yaml.safe_dump(groups, default_flow_style=True, sort_keys=False, width=10**6).strip()


def teacher_change(old: dict, new: dict) -> str:
  """Why a distillation run cannot resume against this teacher (``RunState.teacher`` of the
  checkpoint and of this run): another path, checkpoint step or folder fingerprint; "" when
  it can (the same teacher, or one added to or dropped from the run: a change of objective
  the config says)."""
  if not (old and new) or old == new:
    return ""
  if old.get("fingerprint") and old.get("fingerprint") == new.get("fingerprint"):
    return ""  # the same folder weights, moved or named another way
  what = " and ".join(
    f"{k} {old.get(k)} → {new.get(k)}" for k in ("path", "step", "fingerprint")
    if old.get(k) != new.get(k)
  )  # fmt: skip
  return (
    f"the distillation teacher changed since the checkpoint ({what}); put it back (a run "
    f"directory's teacher is its newest checkpoint: set newer ones of it aside), or start a "
    f"new run_dir"
  )
