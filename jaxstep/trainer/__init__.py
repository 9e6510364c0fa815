"""The trainer behind ``jaxstep train``: config → data, mesh and jitted step → the update
loop with checkpoints, metrics, evaluation, guards and callbacks.

``config`` (the schema and YAML loading), ``plan`` (every derived value resolved once:
vocabulary, K, run and schedule length, mesh), ``steps`` (the jitted train and eval steps of
a config), ``build`` (everything built once), ``loop`` (the update loop and ``train``),
``run_state`` (the host-side position), ``checkpoint``, ``checkpoint_read`` and ``resume``
(orbax saves, the one verified read path, restore and reconcile), ``run_dir`` (the output
folder), ``records`` (kept files: JSON lines, atomic rewrites), ``metrics`` (JSONL,
TensorBoard, progress, one-update-late read-back), ``guards`` (skipped updates),
``callbacks``, ``signals`` (SIGTERM/SIGINT), ``perf`` (MFU) and ``memory`` (the ledger).
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
