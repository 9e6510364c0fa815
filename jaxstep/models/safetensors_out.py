"""Weights written as safetensors files, the way transformers' ``save_pretrained`` splits
them: ``model.safetensors``, or shards ``model-00001-of-0000N.safetensors`` and
``model.safetensors.index.json`` (``hf_export``); one file of adapters (``peft_export``).

Each tensor is gathered to the host on its own, cast and laid out as the file wants, and
each file is written by the safetensors library from one shard's tensors: the host holds
one shard at a time, never the whole model. The library reports a failed write (a full
disk) as its own ``SafetensorError`` with the I/O error in its text; ``write_file`` raises
it as the ``OSError`` it was, with its errno, so a caller tells a full or read-only disk
(exit 74) from anything else.
"""

from __future__ import annotations

import errno
import json
import math
import os
import pathlib
import re
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from jaxstep.models.hf_weights import INDEX, SINGLE

SHARD = "model-{:05d}-of-{:05d}.safetensors"


class Tensor(NamedTuple):
  """One tensor to write: its HF name, how to fetch it (jaxstep layout, maybe on device),
  whether it is transposed on the way out, and its shape as the file lays it."""

  name: str
  fetch: Callable[[], object]
  transposed: bool
  shape: tuple


def plan_shards(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
  """Tensor names per weights file, as ``huggingface_hub`` splits a state dict: in order,
  a new file when the next tensor would push the current one past ``max_bytes``; a tensor
  larger than ``max_bytes`` alone in a file of its own."""
  shards, current, size = [], [], 0
  for name, nbytes in sizes:
    if nbytes > max_bytes:
      shards.append([name])
      continue
    if size + nbytes > max_bytes:
      shards.append(current)
      current, size = [], 0
    current.append(name)
    size += nbytes
  return [*shards, current] if current else shards


def numpy_dtype(dtype: str):
  """The numpy dtype a file's tensors are written in: ``bfloat16`` (``ml_dtypes``') or
  ``float32``."""
  import ml_dtypes

  return ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32


def host(tensor: Tensor, dtype) -> np.ndarray:
  """The tensor on the host as the file lays it (cast to ``dtype``, transposed, contiguous):
  gathered here, one tensor at a time."""
  import jax

  array = np.asarray(jax.device_get(tensor.fetch())).astype(dtype, copy=False)
  return np.ascontiguousarray(array.T if tensor.transposed else array)


def write_weights(folder: pathlib.Path, tensors: list[Tensor], dtype: str, max_bytes: int):
  """The safetensors files (and, for more than one, the index) into ``folder``, one file's
  tensors on the host at a time."""
  itemsize = np.dtype(numpy_dtype(dtype)).itemsize
  sizes = [(t.name, math.prod(t.shape) * itemsize) for t in tensors]
  shards = plan_shards(sizes, max_bytes)
  by_name = {t.name: t for t in tensors}
  weight_map = {}
  for i, names in enumerate(shards, 1):
    file = SINGLE if len(shards) == 1 else SHARD.format(i, len(shards))
    write_file(folder / file, [by_name[name] for name in names], dtype)
    weight_map.update(dict.fromkeys(names, file))
  if len(shards) > 1:
    metadata = {
      "total_parameters": sum(math.prod(t.shape) for t in tensors),
      "total_size": sum(n for _, n in sizes),
    }
    index = {"metadata": metadata, "weight_map": weight_map}
    (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


# how the library's Rust writer quotes the I/O error it failed with
_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def write_file(path: pathlib.Path, tensors: list[Tensor], dtype: str) -> None:
  """``tensors`` as one safetensors file at ``path``, in ``dtype`` (``float32`` or
  ``bfloat16``), with ``"format": "pt"`` as transformers writes it.

  Raises:
    OSError: the write failed, with the errno of the I/O error the library met
      (``ENOSPC`` for a full disk; ``EIO`` when its message names none).
  """
  from safetensors import SafetensorError
  from safetensors.numpy import save_file

  np_dtype = numpy_dtype(dtype)
  arrays = {t.name: host(t, np_dtype) for t in tensors}
  try:
    save_file(arrays, str(path), metadata={"format": "pt"})
  except SafetensorError as e:
    found = _OS_ERROR.search(str(e))
    code = int(found.group(1)) if found else errno.EIO
    raise OSError(code, os.strerror(code), str(path)) from e
