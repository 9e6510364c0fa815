"""Inputs walked by ``prepare``: symlink loops read each real file once, recursive globs
match what Python's ``glob`` finds."""

import json
import os
import pathlib
import subprocess
import sys

from prepare_helpers import write_corpus

from jaxstep.data.preparation import prepare


def test_a_symlink_loop_in_a_walked_folder_reads_each_file_once(tmp_path):
  from jaxstep.data.readers import scan

  root = tmp_path / "texts"
  (root / "sub").mkdir(parents=True)
  write_corpus(root / "sub" / "a.txt", n=5)
  (root / "sub" / "back").symlink_to(root, target_is_directory=True)  # a loop
  (root / "again.txt").symlink_to(root / "sub" / "a.txt")  # the same file twice
  listing = scan(str(root))
  assert [f.name for f in listing.files] == ["again.txt"]
  assert sorted(listing.skipped["symlink loop or repeat"]) == ["sub/a.txt", "sub/back"]
  manifest = prepare([str(root)], tmp_path / "p", progress=False)
  assert len(manifest["sources"]) == 1
  walked = scan(str(root / "**" / "*.txt"))  # a glob's ** meets the loop too
  assert len(walked.files) == 1 and walked.skipped["symlink loop or repeat"]


def test_a_recursive_glob_over_two_symlink_loops_walks_each_real_folder_once(tmp_path):
  """Python's recursive glob walks every path through the loops before anything can drop
  repeats: two loops make that exponential in the link depth, a hang. A child process
  with a deadline keeps a regression from hanging the suite."""
  root = tmp_path / "texts"
  for sub in ("a", "b", ".hidden"):
    (root / sub).mkdir(parents=True)
    (root / sub / f"{sub.strip('.')}.txt").write_text(f"{sub}\n")
    (root / sub / "up").symlink_to("..", target_is_directory=True)  # a loop each
  (root / "top.txt").write_text("top\n")
  (root / ".dot.txt").write_text("hidden\n")
  code = (
    "import json, sys\n"
    "from jaxstep.data.readers import scan\n"
    "listing = scan(sys.argv[1])\n"
    "print(json.dumps([[str(f) for f in listing.files], listing.skipped]))\n"
  )
  proc = subprocess.run(
    [sys.executable, "-c", code, str(root / "**" / "*.txt")],
    capture_output=True,
    text=True,
    timeout=30,
  )
  assert proc.returncode == 0, proc.stderr
  files, skipped = json.loads(proc.stdout)
  assert files == [str(root / "a" / "a.txt"), str(root / "b" / "b.txt"), str(root / "top.txt")]
  assert skipped == {"symlink loop or repeat": [str(root / "a" / "up"), str(root / "b" / "up")]}


def test_a_recursive_glob_without_loops_matches_what_python_glob_finds(tmp_path):
  """Walking ``**`` by hand keeps glob's answer where glob ends: hidden names left out,
  ``**`` also matching no folder at all, patterns before and after it, a link to a folder
  followed like any folder, and of two names for one file the first in sorted order read."""
  import glob

  from jaxstep.data.readers import scan

  root = tmp_path / "t"
  for folder in ("a/b/c", "a/x", "d", ".git/e", "a/.h", "../outside"):
    (root / folder).mkdir(parents=True, exist_ok=True)
    (root / folder / "f.txt").write_text("x\n")
    (root / folder / ".g.txt").write_text("x\n")
  (root / "0link").symlink_to(root / "a" / "x", target_is_directory=True)  # read, not a/x
  (root / "link").symlink_to(tmp_path / "outside", target_is_directory=True)
  (root / "top.txt").write_text("x\n")  # "*/**" matches it, but nothing lies under it
  patterns = ("**/*.txt", "a/**/f.txt", "*/**/c/*.txt", "**/b/**/*.txt", "a/**", "**", "*/**")
  for pattern in patterns:
    found = sorted(
      pathlib.Path(f) for f in glob.glob(str(root / pattern), recursive=True) if os.path.isfile(f)
    )
    first = {}
    for f in found:
      first.setdefault(f.resolve(), f)
    expected = sorted(first.values())
    assert expected and scan(str(root / pattern)).files == expected, pattern
