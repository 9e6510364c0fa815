"""``manifest.json`` of a prepared folder: what it records, and reading it back checked
(structure, agreement with the shard files, sizes, and checksums where a file's time moved).
``preparation`` writes it."""

from __future__ import annotations

import hashlib
import json
import pathlib

import numpy as np

from jaxstep.errors import DataError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
AGAIN = "prepare the data again"


def sha256(path: pathlib.Path) -> str:
  h = hashlib.sha256()
  with path.open("rb") as f:
    for chunk in iter(lambda: f.read(1 << 22), b""):
      h.update(chunk)
  return h.hexdigest()


def manifest_files(manifest: dict) -> list[dict]:
  """Every data file a manifest lists (shards, flags, document offsets), as its entries."""
  return [
    entry
    for split in manifest["splits"].values()
    for entry in [*split["shards"], *(split.get("flags") or []), split["docs"]]
  ]


def file_times(folder: pathlib.Path, splits: dict) -> dict[str, int]:
  """Each data file's modification time (ns) as written: a later start-up hashes only a
  file whose time moved."""
  names = [e["file"] for e in manifest_files({"splits": splits})]
  return {n: (folder / n).stat().st_mtime_ns for n in names}


def read_manifest(folder: str | pathlib.Path, *, verify: bool | None = None) -> dict:
  """The manifest of a prepared folder, checked: a known format version, and every file
  present with its recorded size.

  ``verify``: True hashes every file against its sha256 (on demand: minutes for a large
  corpus); False checks sizes only; None (the default, what training's start-up does)
  hashes only a file whose modification time is not the one ``prepare`` recorded — an edit
  or a copy that did not keep times — so start-up costs the same whatever the corpus size.

  Raises:
    DataError: naming the file that is missing, truncated, changed or of a newer format.
  """
  folder = pathlib.Path(folder)
  path = folder / MANIFEST
  try:
    manifest = json.loads(path.read_text())
  except FileNotFoundError:
    raise DataError(f"{folder} holds no {MANIFEST}: prepare it with jaxstep prepare") from None
  except json.JSONDecodeError as e:
    raise DataError(f"{path}: not valid JSON ({e.msg})") from None
  if not isinstance(manifest, dict):
    raise DataError(f"{path} is not a manifest object ({type(manifest).__name__}); {AGAIN}")
  version = manifest.get("format_version")
  if not isinstance(version, int) or version > FORMAT_VERSION:
    raise DataError(
      f"{path}: format version {version!r} is newer than this jaxstep reads "
      f"({FORMAT_VERSION}); upgrade jaxstep or prepare the data again"
    )
  _check_structure(manifest, path)
  times = manifest.get("file_times") or {}
  for entry in manifest_files(manifest):
    _check_file(folder / entry["file"], entry, verify, times.get(entry["file"]))
  return manifest


def verify_folder(folder: str | pathlib.Path) -> dict:
  """Re-hashes every data file of a prepared folder against its sha256 in the manifest, in
  the manifest's order: ``jaxstep prepare --verify``.

  Start-up compares sizes and times only, so it cannot see a file changed in place with its
  time put back (a bit flip on disk, a tool that keeps times); this reads every byte
  (minutes for a large corpus, at the disk's read speed).

  Returns:
    ``{"files": count, "bytes": total size}`` of the files checked.

  Raises:
    DataError: naming the first file that is missing, of another size, or does not match
      its checksum (or a manifest that is missing, malformed or of a newer format).
  """
  folder = pathlib.Path(folder)
  files = manifest_files(read_manifest(folder, verify=True))
  return {"files": len(files), "bytes": sum((folder / e["file"]).stat().st_size for e in files)}


def _check_structure(manifest: dict, path: pathlib.Path) -> None:
  """The manifest agrees with itself: the keys readers need, a known dtype the vocabulary
  fits, and every shard's recorded bytes = its tokens × the dtype's size (a manifest edited
  or mixed up with another folder's would otherwise be read as garbage tokens)."""
  for key, kind in (("splits", dict), ("tokenizer", dict), ("dtype", str), ("kind", str)):
    if not isinstance(manifest.get(key), kind):
      raise DataError(f"{path} lacks {key!r} (or it is not a {kind.__name__}); {AGAIN}")
  dtype, vocab = manifest["dtype"], manifest["tokenizer"].get("vocab_size")
  if dtype not in ("uint16", "uint32"):
    raise DataError(f"{path}: dtype {dtype!r} is not uint16 or uint32; {AGAIN}")
  if not isinstance(vocab, int) or vocab < 1 or vocab > np.iinfo(dtype).max + 1:
    raise DataError(f"{path}: a vocabulary of {vocab} ids does not fit its dtype {dtype}; {AGAIN}")
  missing = [k for k in ("pad_id", "bos_id", "eos_id") if not isinstance(
    manifest["tokenizer"].get(k), int)]  # fmt: skip
  if missing:
    raise DataError(f"{path}: the tokenizer entry lacks {', '.join(missing)}; {AGAIN}")
  if "train" not in manifest["splits"]:
    raise DataError(f"{path} has no 'train' split; {AGAIN}")
  size = np.dtype(dtype).itemsize
  for name, split in manifest["splits"].items():
    try:
      files = [split["docs"], *split["shards"], *(split.get("flags") or [])]
      if not all(isinstance(e["file"], str) for e in files):
        raise TypeError
      if not all(isinstance(split[k], int) for k in ("tokens", "targets", "documents")):
        raise TypeError
    except (KeyError, TypeError):
      raise DataError(
        f"{path}: split {name!r} lacks its shards, docs or token counts; {AGAIN}"
      ) from None
    for entry in split["shards"]:
      if "tokens" in entry and "bytes" in entry and entry["bytes"] != entry["tokens"] * size:
        raise DataError(
          f"{path}: {entry['file']} has {entry['bytes']} bytes, not {entry['tokens']} tokens "
          f"× {size} ({dtype}); {AGAIN}"
        )


def _check_file(path: pathlib.Path, entry: dict, verify: bool | None, mtime_ns) -> None:
  if not path.is_file():
    raise DataError(f"{path} is missing (listed in {MANIFEST}); prepare the data again")
  stat = path.stat()
  if "bytes" in entry and stat.st_size != entry["bytes"]:
    raise DataError(
      f"{path} has {stat.st_size} bytes, {MANIFEST} says {entry['bytes']}: truncated "
      f"or changed; prepare the data again"
    )
  if verify is None:
    verify = stat.st_mtime_ns != mtime_ns  # no recorded time (an older manifest): hash
  if verify and sha256(path) != entry["sha256"]:
    raise DataError(f"{path} does not match its checksum in {MANIFEST}; prepare the data again")
