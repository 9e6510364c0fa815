"""The package's layers: nothing imports a layer above it, nor the package root
(docs/design.md has the table); ``import jaxstep`` alone stays cheap, and every public name
still resolves."""

import ast
import importlib
import importlib.util
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jaxstep"

# layer -> the jaxstep layers its modules may import (itself always allowed). The package
# root is no layer: only the root itself may import from ``jaxstep`` (``import jaxstep``,
# ``from jaxstep import X`` where X is not a layer).
ALLOWED = {
  "_version": set(),
  "errors": set(),
  "core": {"errors"},
  "parallel": {"errors", "core"},
  "data": {"errors"},
  "models": {"errors", "core", "data"},
  "generation": {"errors", "core", "models"},
  "lmeval": {"errors", "core", "models", "data", "generation"},
  "trainer": {"_version", "errors", "core", "parallel", "models", "data", "generation", "lmeval"},
  "cli": {
    "_version",
    "errors",
    "core",
    "parallel",
    "models",
    "data",
    "generation",
    "lmeval",
    "trainer",
  },
}

# modules that pull in a heavy dependency: ``import jaxstep`` must import none of them
HEAVY = ("orbax", "grain", "tensorboardX", "tqdm", "matplotlib")

SUBPACKAGES = ("jaxstep.data", "jaxstep.generation", "jaxstep.models", "jaxstep.parallel")


def layer_of(module: str) -> str:
  """``jaxstep.core.step`` -> ``core``; the top-level command shims count as ``cli``."""
  parts = module.split(".")[1:]
  if not parts or parts[0] == "__init__":
    return "jaxstep"
  return parts[0] if parts[0] in ALLOWED else "cli"


def imports(path: pathlib.Path) -> set[str]:
  """Every ``jaxstep…`` module imported anywhere in the file (function-level ones too)."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found |= {a.name for a in node.names if a.name.split(".")[0] == "jaxstep"}
    elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jaxstep"):
      found |= {f"{node.module}.{a.name}" for a in node.names}
  return found


def allowed(source_layer: str, target: str) -> bool:
  """Whether a module of ``source_layer`` may import ``target``; the root (``jaxstep``, or a
  name it re-exports such as ``jaxstep.__version__``) is never allowed."""
  parts = target.split(".")[1:]
  if not parts or parts[0] not in ALLOWED:
    return False
  return parts[0] == source_layer or parts[0] in ALLOWED[source_layer]


def test_no_module_imports_a_layer_above_it():
  bad = []
  for path in sorted(PACKAGE.rglob("*.py")):
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    module = ".".join(relative.parts)
    source = layer_of(module)
    if source == "jaxstep":  # the package root re-exports the public API from every layer
      continue
    bad += [f"{module} -> {t}" for t in imports(path) if not allowed(source, t)]
  assert not bad, bad


def test_the_layout_rule_catches_an_upward_import(tmp_path):
  # The check itself must fail on the thing it guards against.
  assert not allowed("core", "jaxstep.trainer.config.loading")
  assert not allowed("models", "jaxstep.trainer.config.loading")
  assert allowed("trainer", "jaxstep.core.step") and not allowed("core", "jaxstep.parallel.mesh")
  assert allowed("trainer", "jaxstep._version.__version__")
  # the package root, from every layer, however it is spelled
  module = tmp_path / "upward.py"
  module.write_text(
    "import jaxstep\nfrom jaxstep import __version__, Checkpointer\nimport jaxstep.errors\n"
  )
  found = imports(module)
  assert found == {"jaxstep", "jaxstep.__version__", "jaxstep.Checkpointer", "jaxstep.errors"}
  for layer in ALLOWED:
    assert not [t for t in found - {"jaxstep.errors"} if allowed(layer, t)], layer
  assert allowed("trainer", "jaxstep.errors") and not allowed("trainer", "jaxstep")


# The trainer's rooms, each above the ones it may import (docs/design.md draws the map):
# a run's data flows config → plan and build → store → loop → hooks → store + tracking, and
# imports only ever point down this list. The two clients (``config_run``, ``trainer_run``
# with ``trainer_data``) sit on top and may import every room.
ROOMS = {
  "config": set(),
  "store": {"config"},
  "tracking": {"config", "store"},
  "evaluation": {"config", "store"},
  "plan": {"config", "store", "tracking", "evaluation"},
  "loop": {"config", "store", "tracking", "evaluation"},
  "saved_run": {"config", "store", "evaluation", "plan"},
  "rl": {"config", "store", "tracking", "evaluation", "plan", "loop"},
}
MAX_LINES = 400  # a module longer than this holds more than one thing


def room_of(module: str) -> str | None:
  """``jaxstep.trainer.store.resume`` -> ``store``; None outside the rooms (a client,
  another layer)."""
  parts = module.split(".")
  if parts[:2] != ["jaxstep", "trainer"] or len(parts) < 3:
    return None
  return parts[2] if parts[2] in ROOMS else None


def room_allows(source: str, target: str) -> bool:
  """Whether a module of room ``source`` may import ``target``: its own room, a room below
  it, or anything outside the trainer (the layer rule governs those); never a client."""
  if not target.startswith("jaxstep.trainer"):
    return True
  room = room_of(target)
  return room is not None and (room == source or room in ROOMS[source])


def upward_imports(path: pathlib.Path, module: str) -> list[str]:
  source = room_of(module)
  if source is None:
    return []
  return [f"{module} -> {t}" for t in sorted(imports(path)) if not room_allows(source, t)]


def module_name(path: pathlib.Path) -> str:
  return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")


def test_no_room_of_the_trainer_imports_a_room_above_it():
  bad = []
  for path in sorted((PACKAGE / "trainer").rglob("*.py")):
    bad += upward_imports(path, module_name(path))
  assert not bad, bad


def test_the_room_rule_catches_an_upward_import_planted_on_purpose(tmp_path):
  planted = tmp_path / "resume.py"
  planted.write_text(
    "from jaxstep.trainer.store import records\n"
    "from jaxstep.trainer.loop.loop import Loop  # the store reaching up into the loop\n"
    "def f():\n  from jaxstep.trainer import config_run  # and into a client\n"
  )
  bad = upward_imports(planted, "jaxstep.trainer.store.resume")
  assert bad == [
    "jaxstep.trainer.store.resume -> jaxstep.trainer.config_run",
    "jaxstep.trainer.store.resume -> jaxstep.trainer.loop.loop.Loop",
  ]
  assert room_allows("loop", "jaxstep.trainer.store.records.read_records")
  assert not room_allows("config", "jaxstep.trainer.tracking.trackers")


def is_module(name: str) -> bool:
  try:
    return importlib.util.find_spec(name) is not None
  except (ImportError, AttributeError):  # a name inside a module, not a submodule
    return False


def private_uses(path: pathlib.Path) -> list[str]:
  """Private names (``_x``, not dunders) one module takes from another jaxstep module:
  ``from jaxstep.m import _x`` and ``alias._x`` where ``alias`` is an imported jaxstep
  module."""
  tree, found, aliases = ast.parse(path.read_text()), [], set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxstep"):
      for a in node.names:
        if a.name.startswith("_") and not a.name.startswith("__"):
          found.append(f"{node.module}.{a.name}")
        elif is_module(f"{node.module}.{a.name}"):
          aliases.add(a.asname or a.name)
    elif isinstance(node, ast.Import):
      aliases |= {a.asname for a in node.names if a.asname and a.name.startswith("jaxstep")}
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
      name = node.attr
      if node.value.id in aliases and name.startswith("_") and not name.startswith("__"):
        found.append(f"{node.value.id}.{name}")
  return found


def test_no_private_name_is_used_across_modules():
  bad = {}
  for path in sorted(PACKAGE.rglob("*.py")):
    if uses := private_uses(path):
      bad[module_name(path)] = uses
  assert not bad, bad


def test_the_private_name_rule_catches_a_planted_use(tmp_path):
  planted = tmp_path / "m.py"
  planted.write_text(
    "from jaxstep.trainer.config import loading as config_lib\n"
    "from jaxstep.data.tokenizer import _planted\n"
    "x = config_lib._build\n"
  )
  assert private_uses(planted) == ["jaxstep.data.tokenizer._planted", "config_lib._build"]


def test_every_trainer_module_is_short():
  long = {}
  for path in sorted((PACKAGE / "trainer").rglob("*.py")):
    if (n := len(path.read_text().splitlines())) > MAX_LINES:
      long[module_name(path)] = n
  assert not long, long


def test_commands_are_cli_modules_and_have_a_python_m_entry():
  from jaxstep.cli import COMMANDS

  for name, (module, _) in COMMANDS.items():
    assert module == f"jaxstep.cli.{name}"
    assert (PACKAGE / "cli" / f"{name}.py").is_file()
    assert f'run("{name}")' in (PACKAGE / f"{name}.py").read_text()


def run_python(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=PACKAGE.parent
  )


def test_import_jaxstep_imports_no_heavy_dependency():
  code = f"import jaxstep, sys; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
  proc = run_python("-c", code)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.strip() == "[]"


def test_every_public_name_resolves():
  import jaxstep

  for package in (jaxstep, *map(importlib.import_module, SUBPACKAGES), jaxstep.trainer):
    missing = [n for n in package.__all__ if getattr(package, n, None) is None]
    assert not missing, (package.__name__, missing)
    assert set(package.__all__) <= set(dir(package)), package.__name__
  star = {}
  exec("from jaxstep import *", star)
  assert set(jaxstep.__all__) <= set(star)
  from jaxstep.data import BatchLoader

  assert BatchLoader.__module__ == "jaxstep.data.loader"


COMMAND_NAMES = """
import jaxstep
from jaxstep import prepare, train
from jaxstep.cli import COMMANDS

assert callable(prepare) and not isinstance(prepare, type(jaxstep))
assert prepare is jaxstep.data.prepare and train is jaxstep.trainer.train
for name in COMMANDS:
  try:
    value = getattr(jaxstep, name)
  except ImportError as e:  # a command with no one function says what to use instead
    assert "command" in str(e)
  else:
    assert callable(value) and not isinstance(value, type(jaxstep)), name
try:
  from jaxstep import generate
except ImportError as e:
  assert "jaxstep.Generator" in str(e)
else:
  raise AssertionError("from jaxstep import generate gave the python -m module")
print("ok")
"""


@pytest.mark.slow
def test_a_command_name_at_the_root_is_a_function_not_its_python_m_module():
  # a fresh interpreter: importing a ``python -m`` module in this one (other tests do) binds
  # its name on the package, as any submodule import does
  proc = run_python("-c", COMMAND_NAMES)
  assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
  # ... while ``python -m jaxstep.<command>`` still runs the command
  proc = run_python("-m", "jaxstep.prepare", "--help")
  assert proc.returncode == 0 and "usage: jaxstep prepare" in proc.stdout, proc.stderr
