"""``preference.reference: precompute``: the reference's log-probs of every pair, computed
once before the first update and stored in one file that training reads, so a full
fine-tuning run holds neither a second copy of the model nor runs a second forward pass.

The file (``preference.reference_file``, default ``RUN/reference_logps.npz``) holds
``logps``, float32[N, 2]: each pair's chosen and rejected completion log-probability, summed
over its tokens (``preference.reference_logps``), under the run's starting weights (on a
LoRA run: with the adapters off), for the N kept pairs in file order, train and held-out
alike; and the key they were computed for: a sha256 of those weights (every leaf's path,
dtype, shape and bytes), the data's fingerprint and N. A file whose key is not this run's is
refused in one line before anything is written: its numbers belong to other weights or other
pairs.

Computing is batched G pairs at a time (``train.global_batch_size``) with the params and the
batch sharded as the train step shards them, and resumable: every ``CHUNK`` batches land in
a part file under ``FILE.partial/``, so a computation that was killed continues from its
last part. The finished array is written whole (a temporary file, renamed) and the parts
removed; a write the disk refuses (full, read-only) removes them too, so nothing is left
that takes room or blocks the next try. On a resume the file is read back, so the resumed
run sees the same numbers bit for bit; a file cut short or with changed bytes is refused
rather than computed again, since the updates so far used its numbers, and computed again
on another machine or mesh their last bits may differ.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import pathlib
import shutil
import time
from collections.abc import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from jaxstep import parallel
from jaxstep.core import preference
from jaxstep.data.preference_pairs import PairSet, pair_batch
from jaxstep.errors import WRITE_REFUSED, ConfigError, DataError, RunIOError
from jaxstep.models import lora
from jaxstep.trainer.config import loading as config_lib
from jaxstep.trainer.store import records

log = logging.getLogger("jaxstep")

FORMAT = 1
CHUNK = 16  # global batches per part file of a computation in progress


def file_for(cfg: config_lib.Config) -> pathlib.Path:
  """Where a run's precomputed log-probs live: ``preference.reference_file``, or the run
  directory's ``reference_logps.npz``."""
  return pathlib.Path(
    cfg.preference.reference_file or pathlib.Path(cfg.run_dir, "reference_logps.npz")
  )


def reference_params(cfg: config_lib.Config, params):
  """The weights the reference is: ``params`` with a LoRA run's adapters switched off."""
  return lora.adapters_off(params) if cfg.model.lora.rank else params


def weights_digest(params) -> str:
  """sha256 over every leaf's path, dtype, shape and bytes (gathered across hosts); the
  GPT's fused q/k/v leaves also hash their column order (head-major), so that log-probs an
  older jaxstep computed with ``[q | k | v]`` columns do not pass for these weights'."""
  h = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    if not getattr(leaf, "is_fully_addressable", True):
      leaf = multihost_utils.process_allgather(leaf, tiled=True)
    value = np.ascontiguousarray(np.asarray(leaf))
    name = jax.tree_util.keystr(path)
    order = ":head-major" if "['qkv']" in name else ""
    h.update(f"{name}:{value.dtype}:{value.shape}{order}".encode())
    h.update(value.tobytes())
  return h.hexdigest()[:16]


def key_of(weights: str, data_fingerprint: str, pairs: int) -> dict:
  return {"format": FORMAT, "weights": weights, "data": data_fingerprint, "pairs": int(pairs)}


def read(path: pathlib.Path, key: dict) -> np.ndarray | None:
  """The log-probs stored at ``path`` for ``key``; None when there is no file yet.

  Raises:
    ConfigError: the file holds another key (other weights, other data), naming the fix.
    DataError: the file cannot be read as one of these files: cut short, bytes changed
      (every member's CRC-32 is checked), or another kind of file.
  """
  if not path.exists():
    return None
  try:
    stored = records.read_npz(path, ("key", "logps"))
    found, logps = json.loads(str(stored["key"])), np.asarray(stored["logps"], np.float32)
    if not isinstance(found, dict):
      raise ValueError(f"its key is {found!r}, not an object")
  except (OSError, ValueError) as e:
    raise DataError(
      f"{path} cannot be read as a file of precomputed reference log-probs ({e}); delete it "
      f"to compute them again, or point preference.reference_file elsewhere"
    ) from e
  if found != key:
    what = [w for w in ("weights", "data") if found.get(w) != key[w]] or ["settings"]
    raise ConfigError(
      f"{path} holds reference log-probs of other {' and '.join(what)} "
      f"({_describe(found)}; this run's: {_describe(key)}); delete it to compute them again, "
      f"or point preference.reference_file elsewhere"
    )
  if logps.shape != (key["pairs"], 2):
    raise DataError(f"{path} holds log-probs of shape {logps.shape}, not ({key['pairs']}, 2)")
  return logps


def _describe(key: dict) -> str:
  return f"weights {key.get('weights')}, data {key.get('data')}, {key.get('pairs')} pairs"


def pair_logps(apply_fn: Callable, params, batch) -> tuple[jax.Array, jax.Array]:
  """``(chosen, rejected)``, float32[G] each: every row's reference log-probs under
  ``params``, summed over its completion tokens, the model without dropout."""
  model = lambda p, inputs: apply_fn(p, inputs, train=False)  # noqa: E731
  return preference.reference_logps(model, params, preference.concatenated(batch))


def logps_fn(apply_fn: Callable, params_sharding, mesh) -> Callable:
  """Jitted ``(params, batch) -> float32[G, 2]`` (``pair_logps`` stacked), the params and
  batch sharded as the train step has them, the result replicated."""

  def stacked(params, batch):
    return jax.numpy.stack(pair_logps(apply_fn, params, batch), axis=-1)

  replicated = NamedSharding(mesh, PartitionSpec())
  return jax.jit(
    stacked,
    in_shardings=(params_sharding, parallel.batch_sharding(mesh)),
    out_shardings=replicated,
  )


def compute(
  path: pathlib.Path,
  key: dict,
  fn: Callable,
  params,
  pairs: PairSet,
  global_batch_size: int,
  sharding: NamedSharding,
) -> np.ndarray:
  """The log-probs of every pair of ``pairs`` under ``params`` (``fn``: ``logps_fn``),
  written to ``path`` with ``key``; parts finished by an earlier, interrupted computation
  with the same key and batch size are read instead of computed again.

  Raises:
    RunIOError: the disk refused a write (full, read-only, no permission); the parts
      folder is removed.
    ConfigError: the file cannot be written there otherwise (a missing folder, a file
      where a folder belongs).
  """
  g, n = global_batch_size, len(pairs)
  batches = -(-n // g)
  parts = path.with_name(path.name + ".partial")
  writer = jax.process_index() == 0
  partial_key = {**key, "global_batch_size": g, "chunk": CHUNK}
  if writer:
    _writing(path, parts, _open_parts, parts, partial_key)
  begun, out = time.perf_counter(), np.zeros((batches * g, 2), np.float32)
  done = 0
  for first in range(0, batches, CHUNK):
    part = parts / f"part-{first // CHUNK:05d}.npy"
    lo, hi = first * g, min(first + CHUNK, batches) * g
    if part.exists():
      out[lo:hi] = np.load(part)
      done += hi - lo
      continue
    out[lo:hi] = batch_logps(fn, params, pairs, g, sharding, range(first, hi // g))
    if writer:
      _writing(path, parts, _save_atomic, part, lambda f, v=out[lo:hi]: np.save(f, v))
  logps = out[:n]
  if writer:
    _writing(path, parts, write, path, key, logps)
    shutil.rmtree(parts, ignore_errors=True)
  log.info(
    "reference log-probs: %d pairs in %d batches of %d, %.1f s (%d pairs read from an "
    "interrupted computation), stored in %s",
    n,
    batches,
    g,
    time.perf_counter() - begun,
    min(done, n),
    path,
  )
  return logps


def batch_logps(fn, params, pairs: PairSet, g: int, sharding, batches: range) -> np.ndarray:
  """float32[len(batches)·g, 2]: the log-probs of global batches ``batches`` of ``pairs``
  (batch b: pairs [b·g, (b+1)·g), the rows past the last pair zeros)."""
  out = np.zeros((len(batches) * g, 2), np.float32)
  for i, b in enumerate(batches):
    index = np.arange(b * g, min((b + 1) * g, len(pairs)))
    batch = parallel.put_batch(pair_batch(pairs, index, g), sharding)
    out[i * g : (i + 1) * g] = np.asarray(fn(params, batch))
  return out


def write(path: pathlib.Path, key: dict, logps: np.ndarray) -> None:
  """``logps`` with ``key`` as the file ``read`` reads, written whole or not at all."""
  _save_atomic(path, lambda f: np.savez(f, logps=logps, key=json.dumps(key, sort_keys=True)))


def _writing(path: pathlib.Path, parts: pathlib.Path, save: Callable, *args) -> None:
  """``save(*args)``, one of a computation's writes; a failure is one line naming ``path``.

  A write the disk refuses (``WRITE_REFUSED``) is exit 74's error, as every other refused
  write of a run, and removes the parts: on a full disk they hold room the next try needs
  (which computes them again).
  """
  try:
    save(*args)
  except OSError as e:
    if e.errno in WRITE_REFUSED:
      shutil.rmtree(parts, ignore_errors=True)
      raise RunIOError(
        f"writing the reference log-probs to {path} failed ({e.strerror or e}); nothing "
        f"partial was left: make room or point preference.reference_file at a writable "
        f"place, then run the same command again"
      ) from None
    raise ConfigError(
      f"cannot write the reference log-probs next to {path} ({e.strerror or e}); point "
      f"preference.reference_file at a writable place"
    ) from None


def _open_parts(parts: pathlib.Path, partial_key: dict) -> None:
  """``parts`` ready for this computation: kept when an earlier one had the same key (its
  parts are reused), else replaced by an empty folder."""
  marker = parts / "key.json"
  if parts.exists():
    try:
      same = json.loads(marker.read_text()) == partial_key
    except (OSError, ValueError):
      same = False
    if same:
      return
    log.info("reference log-probs: %s is from another computation; starting over", parts)
    shutil.rmtree(parts)
  parts.mkdir(parents=True)
  records.write_atomic(marker, json.dumps(partial_key, sort_keys=True))


def _save_atomic(path: pathlib.Path, save: Callable) -> None:
  """``save(file)``'s bytes written to ``path`` whole or not at all (``records.write_atomic``)."""
  buffer = io.BytesIO()
  save(buffer)
  records.write_atomic(path, buffer.getvalue())
