"""The package's layers: nothing imports a layer above it, nor the package root
(docs/design.md has the table); ``import jaxstep`` alone stays cheap, and every public name
still resolves."""

import ast
import importlib
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
  "models": {"errors", "core"},
  "data": {"errors"},
  "generation": {"errors", "core", "models"},
  "trainer": {"_version", "errors", "core", "parallel", "models", "data", "generation"},
  "cli": {"_version", "errors", "core", "parallel", "models", "data", "generation", "trainer"},
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
  assert not allowed("core", "jaxstep.trainer.config")
  assert not allowed("models", "jaxstep.trainer.config")
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
