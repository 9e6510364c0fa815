"""The package's layers: nothing imports a layer above it (docs/design.md has the table)."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jaxstep"

# layer -> the jaxstep layers its modules may import (itself always allowed)
ALLOWED = {
  "errors": set(),
  "core": {"errors"},
  "parallel": {"errors", "core"},
  "models": {"errors"},
  "data": {"errors"},
  "generation": {"errors", "core", "models"},
  "trainer": {"errors", "core", "parallel", "models", "data", "generation", "jaxstep"},
  "cli": {"errors", "core", "parallel", "models", "data", "generation", "trainer", "jaxstep"},
}


def layer_of(module: str) -> str:
  """``jaxstep.core.step`` -> ``core``; the top-level command shims count as ``cli``."""
  parts = module.split(".")[1:]
  if not parts:
    return "jaxstep"
  if parts[0] in ALLOWED:
    return parts[0]
  return "cli" if parts[0] not in ("__init__",) else "jaxstep"


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
  parts = target.split(".")[1:]
  if not parts or parts[0] == "__version__":
    return "jaxstep" in ALLOWED[source_layer]
  if parts[0] == source_layer:
    return True
  rules = ALLOWED[source_layer]
  return parts[0] in rules or ".".join(parts[:2]) in rules


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
  assert not allowed("models", "jaxstep.core.step")
  assert allowed("trainer", "jaxstep.core.step") and not allowed("core", "jaxstep.parallel.layout")
  assert not allowed("core", "jaxstep.parallel.mesh")


def test_commands_are_cli_modules_and_have_a_python_m_entry():
  from jaxstep.cli import COMMANDS

  for name, (module, _) in COMMANDS.items():
    assert module == f"jaxstep.cli.{name}"
    assert (PACKAGE / "cli" / f"{name}.py").is_file()
    assert f'run("{name}")' in (PACKAGE / f"{name}.py").read_text()
