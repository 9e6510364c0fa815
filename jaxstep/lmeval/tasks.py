"""lm-evaluation-harness tasks run on a jaxstep model, offline.

``run_tasks(lm, names)`` is the harness's ``simple_evaluate`` on a ``JaxstepLM`` with the
Hugging Face Hub switched off (``HF_HUB_OFFLINE``/``HF_DATASETS_OFFLINE``): a task whose
data is a local file (``dataset_path: json`` + ``dataset_kwargs.data_files``, in a folder
of task YAMLs given as ``include_path``) runs, and one that would download its data is
one ``ConfigError`` line naming it and saying how to point it at local files (``check_tasks``
loads every task first, a group's members too). Data the ``datasets`` cache already holds
is read from there.

Results come back flat, as the trackers and ``eval.jsonl`` take them:
``harness/<task>/<metric>`` (``…/<metric>/<filter>`` for a filter other than ``none``),
the standard errors left out.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import os
import pathlib
import weakref
from collections.abc import Sequence

import yaml

from jaxstep.errors import ConfigError
from jaxstep.lmeval import require_harness

log = logging.getLogger("jaxstep")
# the TaskManagers ``task_manager`` built from ``include_path`` alone (it held every task)
_LOCAL = weakref.WeakSet()


@contextlib.contextmanager
def offline():
  """The Hub switched off for ``datasets``/``huggingface_hub`` inside the block (their
  settings read when they are imported, and their live flags), restored after it."""
  names = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
  flags = []
  for where in ("datasets.config", "huggingface_hub.constants"):  # imported first: their
    with contextlib.suppress(ImportError):  # own values are the ones to restore
      module = importlib.import_module(where)
      flags.append((module, "HF_HUB_OFFLINE", module.HF_HUB_OFFLINE))
      module.HF_HUB_OFFLINE = True
  before = {n: os.environ.get(n) for n in names}
  os.environ.update(dict.fromkeys(names, "1"))
  try:
    yield
  finally:
    for module, name, value in flags:
      setattr(module, name, value)
    for name, value in before.items():
      if value is None:
        os.environ.pop(name, None)
      else:
        os.environ[name] = value


def task_manager(names: Sequence[str], include_path: str | None = None):
  """The harness's ``TaskManager``: only the tasks in ``include_path`` when they hold every
  name asked for (indexing the harness's own thousands of tasks takes seconds), else all;
  ``ConfigError`` for a name neither knows, naming a file of ``include_path`` that is not
  YAML (``unreadable_task_files``) rather than calling its task unknown."""
  from lm_eval.tasks import TaskManager

  if include_path is not None and not os.path.isdir(include_path):
    raise ConfigError(f"--include-path {include_path} is not a directory of task YAML files")
  manager = None
  broken = []
  if include_path is not None:
    manager = TaskManager(include_path=include_path, include_defaults=False)
    missing = [n for n in names if n not in manager.task_index]
    broken = unreadable_task_files(include_path) if missing else []
    for path, why, text in broken:  # a file that names a task asked for is that task's
      if named := [n for n in missing if n in text or n == path.stem]:
        raise ConfigError(f"task {', '.join(named)}: {_unreadable(path, why)}")
  if manager is None or any(n not in manager.task_index for n in names):
    manager = TaskManager(include_path=include_path)
  else:
    _LOCAL.add(manager)
  unknown = [n for n in names if n not in manager.task_index and not _path_or_glob(n)]
  if unknown and broken:
    path, why, _ = broken[0]
    raise ConfigError(f"task {', '.join(unknown)}: {_unreadable(path, why)}")
  if unknown:
    where = f" nor in {include_path}" if include_path else ""
    raise ConfigError(
      f"task {', '.join(unknown)}: not a task lm-evaluation-harness knows{where} (list "
      f"them with: lm_eval ls tasks)"
    )
  return manager


def unreadable_task_files(include_path: str) -> list[tuple[pathlib.Path, str, str]]:
  """``(file, why, text)`` of each task YAML under ``include_path`` that is not YAML (a
  syntax error, not UTF-8): the harness skips such a file without a word, so its task
  would read as one it does not know. Only the syntax is checked (``yaml.compose``), so
  the harness's own tags (``!function``) pass."""
  out = []
  for path in sorted(pathlib.Path(include_path).glob("**/*.yaml")):
    if "__pycache__" in path.parts or not path.is_file():
      continue
    text = ""
    try:
      text = path.read_text(encoding="utf-8")
      list(yaml.compose_all(text, Loader=yaml.SafeLoader))
    except UnicodeDecodeError as e:
      out.append((path, f"not UTF-8 text: {e.reason} at byte {e.start}", text))
    except OSError as e:
      out.append((path, f"cannot be read: {e.strerror}", text))
    except yaml.YAMLError as e:
      out.append((path, _yaml_problem(e), text))
  return out


def _yaml_problem(error: yaml.YAMLError) -> str:
  """A YAML error in one line: what is wrong and where (PyYAML's own text spans lines)."""
  mark = getattr(error, "problem_mark", None)
  what = " ".join(filter(None, (getattr(error, "context", None), getattr(error, "problem", None))))
  where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
  return f"{what or str(error).splitlines()[0]}{where}"


def _unreadable(path: pathlib.Path, why: str) -> str:
  return (
    f"{path} is not a task YAML the harness can read ({why}); lm-evaluation-harness skips "
    f"such a file, and the tasks it defines are unknown: fix the file"
  )


def _path_or_glob(name: str) -> bool:
  """A task named by its YAML file or a glob, as the harness also takes them."""
  return os.path.exists(name) or any(c in name for c in "*?[")


def check_tasks(names: Sequence[str], include_path: str | None = None):
  """The ``TaskManager`` of ``names`` once every task (a group's members too) has loaded
  offline: ``ConfigError`` for a name the harness does not know or a task whose data is
  neither local nor in the ``datasets`` cache. Loads each task's data, as running it will."""
  require_harness()
  with offline():
    manager = task_manager(names, include_path)
    try:
      manager.load(list(names))
    except ConnectionError as e:  # datasets, offline, for data it would download
      raise ConfigError(hub_message(", ".join(names), str(e))) from None
  return manager


@contextlib.contextmanager
def same_index(manager):
  """Inside the block, a ``TaskManager`` lm-eval's command line builds indexes what
  ``manager`` (``check_tasks``') indexed: ``--include-path`` alone when every task asked
  for is there, not the harness's own thousands of task files (their index is 7 s of each
  ``jaxstep harness`` start on a 2-core CPU)."""
  import lm_eval.tasks

  if manager not in _LOCAL:
    yield
    return
  original = lm_eval.tasks.TaskManager

  class LocalTaskManager(original):
    def __init__(self, *args, include_defaults: bool = False, **kwargs):
      super().__init__(*args, include_defaults=include_defaults, **kwargs)

  lm_eval.tasks.TaskManager = LocalTaskManager
  try:
    yield
  finally:
    lm_eval.tasks.TaskManager = original


def hub_message(names: str, why: str) -> str:
  return (
    f"task {names}: its data is on the Hugging Face Hub ({why}) and jaxstep never downloads: "
    f"save the data as local files and point a task YAML at them (dataset_path: json, "
    f"dataset_kwargs: {{data_files: …}}) in a folder given with --include-path"
  )


def run_tasks(
  lm,
  names: Sequence[str],
  *,
  include_path: str | None = None,
  limit: int | float | None = None,
  num_fewshot: int | None = None,
  apply_chat_template: bool = False,
  manager=None,
) -> dict[str, float]:
  """The harness's results of ``names`` on ``lm`` (a ``JaxstepLM``), flat (see the module);
  ``manager``: what ``check_tasks`` returned for them (else it runs here)."""
  require_harness()
  import lm_eval

  names = [n.strip() for n in names if n.strip()]
  if not names:
    raise ConfigError("give one or more task names (e.g. --tasks hellaswag,arc_easy)")
  manager = manager or check_tasks(names, include_path)
  harness_log = logging.getLogger("lm_eval")
  level, progress = harness_log.level, lm.progress
  harness_log.setLevel(logging.WARNING)  # its per-task notes: not a run's log
  lm.progress = False
  try:
    with offline():
      results = lm_eval.simple_evaluate(
        model=lm,
        tasks=list(names),
        task_manager=manager,
        limit=limit,
        num_fewshot=num_fewshot,
        apply_chat_template=apply_chat_template,
        log_samples=False,
        random_seed=None,  # the process's own generators are left as they are
        numpy_random_seed=None,
        torch_random_seed=None,
      )
  finally:
    harness_log.setLevel(level)
    lm.progress = progress
  return flatten(results["results"])


def flatten(results: dict) -> dict[str, float]:
  """``{task: {"acc,none": v, "acc_stderr,none": s, …}}`` → ``{"harness/task/acc": v}``."""
  out = {}
  for task, metrics in results.items():
    for key, value in metrics.items():
      metric, _, filt = key.partition(",")
      if not filt or metric.endswith("_stderr") or isinstance(value, bool):
        continue
      if not isinstance(value, int | float) or not math.isfinite(value):
        continue
      out["/".join(["harness", task, metric] + ([filt] if filt != "none" else []))] = value
  return out
