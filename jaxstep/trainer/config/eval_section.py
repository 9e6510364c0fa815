"""Config section ``eval``: named evaluation sets besides the held-out split, and the
lm-evaluation-harness tasks scored during training, with the checks their values pass."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

from jaxstep.errors import ConfigError

EVAL_SET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


HARNESS_SET = "harness"  # the eval set lm-evaluation-harness results report under


HELDOUT = "heldout"  # the name the run's own held-out split reports under


MAX_EVAL_SETS = 32  # each set costs a pass over its windows at every eval


def check_eval_sets(sets: Mapping[str, str]) -> dict[str, str]:
  """``eval.sets`` checked: at most ``MAX_EVAL_SETS`` entries, each name matching ``EVAL_SET_NAME``
  and not ``heldout``, each path a non-empty string; returned as a plain dict.

  Raises:
    ConfigError: naming ``eval.sets`` and the bad entry.
  """
  if not isinstance(sets, Mapping):
    raise ConfigError(f"eval.sets must map names to data paths, got {type(sets).__name__}")
  if len(sets) > MAX_EVAL_SETS:
    raise ConfigError(f"eval.sets has {len(sets)} sets; at most {MAX_EVAL_SETS} are scored")
  for name, path in sets.items():
    if not isinstance(name, str) or not EVAL_SET_NAME.fullmatch(name):
      raise ConfigError(
        f"eval.sets name {name!r}: use letters, digits, '_', '.' and '-', starting with a "
        f"letter or digit"
      )
    if name in (HELDOUT, HARNESS_SET):
      what = "the run's own held-out split" if name == HELDOUT else "eval.harness_tasks' results"
      raise ConfigError(f"eval.sets name {name!r} is {what}; choose another name")
    if not isinstance(path, str) or not path.strip():
      raise ConfigError(f"eval.sets.{name} must be a non-empty data path, got {path!r}")
  return dict(sets)


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """Named evaluation sets besides the held-out split, scored at ``train.eval_every``, and
  lm-evaluation-harness tasks (``pip install 'jaxstep[eval]'``), read from local files."""

  sets: dict[str, str] = dataclasses.field(default_factory=dict)  # {name: path}, like data.path
  harness_tasks: tuple[str, ...] = ()  # task names, e.g. [hellaswag, arc_easy] (none: no tasks)
  harness_every: int = 0  # update steps between task runs (0: train.eval_every); also at the end
  harness_include_path: str = ""  # a folder of task YAML files (local data) besides the harness's
  harness_limit: int = 0  # score the first N documents of each task (0: all)
  harness_batch_size: int = 8  # requests per compiled batch

  def __post_init__(self):
    object.__setattr__(self, "sets", check_eval_sets(self.sets))
    tasks = tuple(n.strip() for t in self.harness_tasks for n in str(t).split(",") if n.strip())
    object.__setattr__(self, "harness_tasks", tasks)  # a=b,c on the command line: two tasks
    for name in ("harness_every", "harness_limit"):
      if getattr(self, name) < 0:
        raise ConfigError(f"eval.{name} must be >= 0, got {getattr(self, name)}")
    if self.harness_batch_size < 1:
      raise ConfigError(f"eval.harness_batch_size must be >= 1, got {self.harness_batch_size}")
