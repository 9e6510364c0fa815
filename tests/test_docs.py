"""Docs and docstrings name only things that exist: files, links and their sections, config
keys, commands. And none cites material a reader of the repository cannot open."""

import ast
import functools
import importlib.util
import pathlib
import re

from jaxstep.cli import COMMANDS
from jaxstep.trainer.config import loading as config_lib

ROOT = pathlib.Path(__file__).resolve().parent.parent
MARKDOWN = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHON = sorted(
  p for d in ("jaxstep", "benchmarks", "examples", "tests") for p in (ROOT / d).rglob("*.py")
)
SECTIONS = ("model", "data", "train", "optim", "checkpoint", "mesh")
GENERATED = {"benchmarks/results/quick/"}  # written by a command, not in the repository
TOP = "jaxstep|docs|configs|benchmarks|examples|tests|\\.ci"  # folders a path may start in
PATH = re.compile(rf"(?<![\w/.-])((?:{TOP})/[\w/.-]*)")
# not a dotted name that goes on (``model.layers.0.mlp``: a Hugging Face tensor name)
KEY = re.compile(rf"(?<![\w./])((?:{'|'.join(SECTIONS)})\.[a-z_]+)(?![\w(*]|\.[\w{{])")
FILE_SUFFIXES = (
  "py",
  "md",
  "yaml",
  "sh",
  "json",
  "jsonl",
  "txt",
  "toml",
  "png",
  "safetensors",
  "jinja",
)
PYTHON_BLOCK = re.compile(r"```python\n.*?```", re.S)
TYPO_EXAMPLE = re.compile(r"unknown config key '[^']*'")  # the docs show a typo on purpose
COMMAND = re.compile(r"python -m ([\w.]+\w)|`jaxstep (\w+)")
DOTTED = re.compile(r"`(jaxstep(?:\.\w+)+)")  # `jaxstep.parallel.make_mesh`
LINK = re.compile(r"\]\(([^)\s]+)\)")
CITATIONS = re.compile(r"DESIGN §|PERF_NOTES|shared/(?:DESIGN|STYLE)|\bissue[- ]#?\d")


# A string literal (any prefix, either quote, triple-quoted or not, escapes) or a ``#``
# comment (group 1), whichever starts first: a "#" inside a string goes with the string.
# What ``tokenize`` finds as COMMENT tokens, at a fraction of its cost (it runs in Python).
STRING_OR_COMMENT = re.compile(
  r"""[rRbBuUfF]{0,2}(?:'''(?:\\.|[^\\])*?'''|\"\"\"(?:\\.|[^\\])*?\"\"\"|"""
  r"""'(?:\\.|[^\\'\n])*'|"(?:\\.|[^\\"\n])*")|(#[^\r\n]*)""",
  re.S,
)
DEFINITIONS = ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
# the fields of statements, handlers and match cases that hold statements (a definition may
# stand in any of them); expressions, most of a tree, hold none and are not walked
STATEMENT_LISTS = ("body", "orelse", "finalbody", "handlers", "cases")


def docstrings(node: ast.AST):
  """The docstrings of ``node`` and of the definitions within it, in source order."""
  if isinstance(node, DEFINITIONS) and (doc := ast.get_docstring(node, clean=False)):
    yield doc
  for field in STATEMENT_LISTS:
    for child in getattr(node, field, ()):
      yield from docstrings(child)


def docstrings_and_comments(path: pathlib.Path) -> str:
  """The prose of a Python file: its docstrings and ``#`` comments, not its code."""
  source = path.read_text()
  comments = (m.group(1) for m in STRING_OR_COMMENT.finditer(source) if m.group(1))
  return "\n".join([*docstrings(ast.parse(source)), *comments])


@functools.cache
def texts() -> dict[pathlib.Path, str]:
  """Every doc, and every Python file's prose: read when a test first needs them, so that a
  test process that collects this module without running it does not parse every file."""
  return {p: p.read_text() for p in MARKDOWN} | {p: docstrings_and_comments(p) for p in PYTHON}


def names(pattern, text):
  return {next(g for g in m.groups() if g) for m in pattern.finditer(text)}


def slug(heading: str) -> str:
  """GitHub's anchor for a markdown heading."""
  text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
  return text.replace(" ", "-")


def anchors(md: pathlib.Path) -> set[str]:
  return {slug(line.lstrip("#")) for line in md.read_text().splitlines() if line.startswith("#")}


def problems(find) -> dict[str, list[str]]:
  """``find(path, text) -> [problem, …]`` over every doc and Python file, failures only."""
  found = {str(p.relative_to(ROOT)): sorted(find(p, text)) for p, text in texts().items()}
  return {name: items for name, items in found.items() if items}


def missing_files(path, text):
  named = {name.rstrip(".") for name in names(PATH, text)}
  placeholders = {n for n in named if "*" in n or pathlib.Path(n).stem.isupper()}
  return [n for n in named - GENERATED - placeholders if not (ROOT / n).exists()]


def unknown_keys(path, text):
  keys = config_lib.valid_keys()
  valid = set(keys) | {k.rsplit(".", 1)[0] for k in keys if k.count(".") > 1}  # + sections
  prose = PYTHON_BLOCK.sub("", TYPO_EXAMPLE.sub("", text))  # Python names variables
  named = names(KEY, prose)
  return [k for k in named if k not in valid and k.split(".")[1] not in FILE_SUFFIXES]


def unknown_commands(path, text):
  bad = []
  for m in COMMAND.finditer(text):
    module, command = m.groups()
    if module and module.startswith(("jaxstep", "benchmarks")):
      if importlib.util.find_spec(module) is None:
        bad.append(module)
    elif command and command not in COMMANDS:
      bad.append(f"jaxstep {command}")
  return bad


def resolves(dotted: str) -> bool:
  """A dotted name: the longest importable module prefix, then attributes."""
  parts = dotted.split(".")
  for i in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module(".".join(parts[:i]))
    except ImportError:
      continue
    for attr in parts[i:]:
      if not hasattr(obj, attr):
        return False
      obj = getattr(obj, attr)
    return True
  return False


def unresolved_names(path, text):
  return [n for n in names(DOTTED, text) if "__main__" not in n and not resolves(n)]


def broken_links(path, text):
  if path.suffix != ".md":
    return []
  broken = []
  for target in names(LINK, text):
    if target.startswith(("http://", "https://")):
      continue
    file, _, anchor = target.partition("#")
    dest = (path.parent / file).resolve() if file else path
    if not dest.exists() or (anchor and anchor not in anchors(dest)):
      broken.append(target)
  return broken


def test_named_files_exist():
  assert not problems(missing_files)


def test_named_config_keys_exist():
  assert not problems(unknown_keys)


def test_named_commands_exist():
  assert not problems(unknown_commands)


def test_named_modules_and_attributes_exist():
  assert not problems(unresolved_names)


def test_links_and_their_sections_exist():
  assert not problems(broken_links)


def test_nothing_cites_material_outside_the_repository():
  assert not problems(lambda path, text: CITATIONS.findall(text))


def test_the_checks_catch_what_they_guard_against():
  doc = ROOT / "docs" / "cli.md"
  assert missing_files(doc, "see docs/nope.md and `jaxstep/core/step.py`") == ["docs/nope.md"]
  assert unknown_keys(doc, "set train.max_step=3, not cfg.train.x, data.load_dataset(") == [
    "train.max_step"
  ]
  assert sorted(unknown_commands(doc, "`jaxstep trian` or python -m jaxstep.trian")) == [
    "jaxstep trian",
    "jaxstep.trian",
  ]
  assert unresolved_names(doc, "`jaxstep.sharding` and `jaxstep.parallel.make_mesh`") == [
    "jaxstep.sharding"
  ]
  assert broken_links(doc, "[a](design.md#no-such-section) [b](design.md#state)") == [
    "design.md#no-such-section"
  ]
  assert CITATIONS.search("as DESIGN §2 says") and CITATIONS.search("see issue 7")
  assert slug("Session: micro-batches one at a time") == "session-micro-batches-one-at-a-time"


def test_the_prose_of_a_python_file_is_its_docstrings_and_comments(tmp_path):
  path = tmp_path / "module.py"
  path.write_text(
    '"""Module."""\n'
    'x = "# a string"  # a comment\n'
    "y = f'''{x!r} # still a string\n'''  # another\n"
    "z = r'\\\\' + '#'\n"
    "class A:\n"
    '  """Class."""\n'
    "  try:\n"
    "    pass\n"
    "  except OSError:\n"
    "    def f():\n"
    '      """Nested."""\n'
    "      return {'doc': 'not one'}  # a 'quote\n"
  )
  assert docstrings_and_comments(path).splitlines() == [
    "Module.",
    "Class.",
    "Nested.",
    "# a comment",
    "# another",
    "# a 'quote",
  ]


def test_readme_is_a_front_door():
  readme = (ROOT / "README.md").read_text()
  lines = readme.splitlines()
  assert len(lines) <= 200
  commands = [line for line in lines[:6] if line.startswith("python3 -m venv")]
  assert len(commands) == 2 and "jaxstep.train" in commands[0] and "pytest" in commands[1]
  assert "<!-- benchmarks:start -->" not in readme  # the table lives in results.md
