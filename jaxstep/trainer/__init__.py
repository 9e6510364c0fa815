"""The run driver behind ``jaxstep train`` and ``jaxstep.Trainer``: config → data, mesh and
jitted step → one update loop with hooks for checkpoints, metrics, evaluation, guards,
callbacks and trackers.

``config`` and ``sections`` (the schema and YAML loading), ``plan`` (every derived value
resolved once: vocabulary, K, run and schedule length, mesh), ``steps`` (the jitted train
and eval steps of a config), ``build`` (everything built once), ``driver`` (the one update
loop, ``Loop``), ``hooks`` (what a hook is and when it is called), ``run_hooks`` (the
built-in hooks both clients use), ``loop`` (``train``: the bundled models' client),
``fit`` / ``fit_eval`` / ``sources`` (``Trainer``: any model's client, its eval sets and
data sources), ``eval_sets`` (named eval sets of a config), ``trackers`` (MLflow, W&B),
``run_state`` (the host-side position), ``checkpoint``, ``checkpoint_read`` and ``resume``
(orbax saves, the one verified read path, restore and reconcile), ``run_dir`` (the output
folder), ``records`` (kept files: JSON lines, atomic rewrites), ``metrics`` (JSONL,
TensorBoard, progress, one-update-late read-back), ``guards`` (skipped updates),
``callbacks``, ``signals`` (SIGTERM/SIGINT), ``perf`` (MFU), ``memory`` (the ledger) and
``loss_plot``.
"""

from jaxstep.trainer.build import Run, build
from jaxstep.trainer.callbacks import Callback, EarlyStopping, TrainerControl
from jaxstep.trainer.loop import TrainResult, evaluate, train
from jaxstep.trainer.run_state import RunState

__all__ = [
  "Callback",
  "EarlyStopping",
  "Run",
  "RunState",
  "TrainResult",
  "TrainerControl",
  "build",
  "evaluate",
  "train",
]
