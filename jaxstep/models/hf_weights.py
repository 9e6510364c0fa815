"""A Hugging Face model folder's weights (``model.safetensors`` or a sharded
``model.safetensors.index.json``) as jaxstep params, read with ``safetensors`` into numpy
(bf16 through ``ml_dtypes``; no torch).

Names map one to one (``hf_name``): ``model.layers.{i}.self_attn.q_proj.weight`` is
``params["blocks"][i]["q_proj"]["kernel"]``, transposed, since PyTorch's ``Linear`` stores
``[out, in]`` and flax's ``[in, out]``; norms' ``weight`` is ``scale``; a tied model has no
``lm_head.weight``. A mixture of experts' per-expert tensors each fill their expert's slice
of a stacked ``[E, …]`` leaf, and a fused ``gate_up_proj`` fills two leaves
(``hf_moe.mlp_names``). Tensors are read one at a time, each a block of rows at a time (copied
out of the file, then cast and transposed, or for the GPT's fused q/k/v column-permuted
(``hf_gpt2.columns``), into place: no whole-tensor intermediate) into
its final layout and dtype, and handed to ``place`` (e.g. ``jax.device_put`` onto its
target sharding) before the next is read. Each tensor opens its file anew, so the mapped
file's pages leave the process as soon as the tensor is copied: host memory holds what
``place`` keeps plus about one tensor, not the file as well. Given a ``FingerprintDigest``,
the read also hashes every byte it copies into the folder's full fingerprint (what a LoRA
run records of its base), so the fingerprint costs no read of its own.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import pathlib
from collections.abc import Callable, Iterator

import numpy as np

from jaxstep.errors import ConfigError, first_line
from jaxstep.models import hf_gpt2, hf_moe
from jaxstep.models.gpt import GPTConfig
from jaxstep.models.hf_dense import PHI3
from jaxstep.models.llama import LlamaConfig

SINGLE = "model.safetensors"
POST_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm")
BOTH_NORMS = ("post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
INDEX = "model.safetensors.index.json"
# Buffers some older checkpoints carry that are recomputed here, not parameters.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors' names of the dtypes read
# Bytes of one block of rows copied (cast, transposed) from the file at a time.
BLOCK_BYTES = 4 << 20


def weight_files(folder: str | pathlib.Path) -> dict[str, pathlib.Path]:
  """``{tensor name: file}`` of the folder's safetensors weights (one file or sharded)."""

  folder = pathlib.Path(folder)
  if (folder / INDEX).is_file():
    try:
      weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise ConfigError(f"{folder / INDEX} cannot be read ({e})") from None
    files = {name: folder / file for name, file in weight_map.items()}
    missing = sorted({str(f) for f in files.values() if not f.is_file()})
    if missing:
      raise ConfigError(f"{folder / INDEX} names missing files: {', '.join(missing[:3])}")
    return files
  if (folder / SINGLE).is_file():
    with _opened(folder / SINGLE) as f:
      return dict.fromkeys(f.keys(), folder / SINGLE)
  raise ConfigError(
    f"{folder} has no {SINGLE} or {INDEX}: only safetensors weights are read (convert "
    f"PyTorch .bin weights with transformers' save_pretrained)"
  )


def hf_names(
  cfg: LlamaConfig | GPTConfig, names=(), architecture: str | None = None
) -> Iterator[tuple[tuple, str, bool]]:
  """``(params path, HF tensor name, transposed)`` for every parameter of ``cfg``'s model in
  the per-block layout, spelled as the checkpoint tensor ``names`` are, if given (GPT-2's
  prefix; an MoE block's expert layout), else as ``architecture`` saves them. An MoE
  block's experts: ``hf_moe.mlp_names`` (a path ending with an expert's index is that
  expert's slice of the stacked leaf, ``leaf_of``)."""
  if isinstance(cfg, GPTConfig):
    yield from hf_gpt2.hf_names(cfg, hf_gpt2.prefix_of(names) if names else hf_gpt2.PREFIX)
    return
  yield ("embed_tokens", "embedding"), "model.embed_tokens.weight", False
  for i in range(cfg.n_layers):
    hf, ours = f"model.layers.{i}.", ("blocks", i)
    post_norms = cfg.block_norms == "post"  # OLMo 2: on the attention's and MLP's outputs
    # Phi-3: q, k, v rows of one qkv_proj; gate, up rows of one gate_up_proj
    fused = architecture == PHI3 or f"{hf}self_attn.qkv_proj.weight" in names
    if not post_norms:
      yield (*ours, "input_layernorm", "scale"), f"{hf}input_layernorm.weight", False
    for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
      name = "qkv_proj" if fused and p != "o_proj" else p
      yield (*ours, p, "kernel"), f"{hf}self_attn.{name}.weight", True
      if cfg.attention_bias and p != "o_proj":
        yield (*ours, p, "bias"), f"{hf}self_attn.{p}.bias", False
    if cfg.qk_norm:
      for p in ("q_norm", "k_norm"):
        yield (*ours, p, "scale"), f"{hf}self_attn.{p}.weight", False
    norms = {"pre": ("post_attention_layernorm",), "post": POST_NORMS, "both": BOTH_NORMS}
    for norm in norms[cfg.block_norms]:
      yield (*ours, norm, "scale"), f"{hf}{norm}.weight", False
    if cfg.moe_layers[i]:
      yield from hf_moe.mlp_names(cfg, i, names, architecture)
      continue
    for p in ("gate_proj", "up_proj", "down_proj"):
      name = "gate_up_proj" if fused and p != "down_proj" else p
      yield (*ours, p, "kernel"), f"{hf}mlp.{name}.weight", True
  yield ("norm", "scale"), "model.norm.weight", False
  if not cfg.tie_embeddings:
    yield ("lm_head", "kernel"), "lm_head.weight", True


def fingerprint(folder: str | pathlib.Path) -> str:
  """The folder's full fingerprint (``FingerprintDigest``'s), reading every byte of its weight
  files: for a caller that does not read the weights anyway (``read_params`` with a
  ``digest`` gives the same value from the read it does)."""
  digest = FingerprintDigest()
  digest.finish(weight_files(folder).values())
  return digest.value


class FingerprintDigest:
  """The full fingerprint of a folder's weight files, ``"xxh3:"`` and 32 hex digits: an
  xxh3-128 over, file by file (sorted by name), the file's name, its size and its
  safetensors header (every tensor's name, dtype, shape and offsets), then each of its
  tensors' names (sorted) with the xxh3-128 of the tensor's bytes. The header's offsets
  leave no byte of a safetensors file outside a tensor, so every byte of the weights counts:
  any edit changes it (a non-cryptographic hash: it catches a changed or damaged base, not
  a forger). ``read_params(..., digest=)`` hashes each tensor's bytes as they come out of
  the file, in the order it reads them, and ``finish`` adds the headers and the tensors it
  did not read (buffers it ignores), so the value costs no extra read of the weights;
  ``fingerprint`` computes the same value from the files alone."""

  def __init__(self):
    self._tensors: dict[tuple[str, str], bytes] = {}  # (file name, tensor) -> xxh3-128
    self.value = ""  # set by ``finish``

  def tensor(self, file: pathlib.Path, name: str, hasher) -> None:
    """Records tensor ``name`` of ``file``, whose bytes ``hasher`` (``new_hasher()``) took."""
    self._tensors[(file.name, name)] = hasher.digest()

  def finish(self, files) -> str:
    """The fingerprint of ``files`` (a folder's weight files), hashing the tensors not
    recorded by ``tensor`` from the files; also kept as ``value``."""
    whole = new_hasher()
    for file in sorted(set(files), key=lambda f: f.name):
      header, offsets, start, size = _header(file)
      whole.update(f"{file.name}\0{size}\0{len(header)}\0".encode())
      whole.update(header)
      for name in sorted(offsets):
        if (file.name, name) not in self._tensors:
          begin, end = offsets[name]
          self._tensors[(file.name, name)] = _hash_range(file, start + begin, start + end)
        whole.update(name.encode() + b"\0" + self._tensors[(file.name, name)])
    self.value = PREFIX + whole.hexdigest()
    return self.value


PREFIX = "xxh3:"  # of ``FingerprintDigest``'s values: older runs recorded ``sampled_fingerprint``


def new_hasher():
  """A streaming xxh3-128 (``update(buffer)``, ``digest()``, ``hexdigest()``)."""
  import xxhash

  return xxhash.xxh3_128()


def _header(file: pathlib.Path) -> tuple[bytes, dict, int, int]:
  """``(header bytes, {tensor: (begin, end)}, offset of the data, file size)`` of a
  safetensors file (the tensors' offsets are relative to the data's)."""
  size = file.stat().st_size
  with open(file, "rb") as f:
    length = int.from_bytes(f.read(8), "little")
    header = f.read(min(length, size))
  try:
    entries = json.loads(header)
    offsets = {
      name: tuple(int(x) for x in entry["data_offsets"])
      for name, entry in entries.items()
      if name != "__metadata__"
    }
  except (ValueError, KeyError, TypeError, AttributeError):
    raise ConfigError(f"{file} is not a readable safetensors file (its header)") from None
  return header, offsets, 8 + length, size


def _hash_range(file: pathlib.Path, begin: int, end: int) -> bytes:
  """The xxh3-128 of ``file``'s bytes ``[begin, end)``, read a block at a time."""
  hasher = new_hasher()
  with open(file, "rb") as f:
    f.seek(begin)
    while begin < end:
      chunk = f.read(min(BLOCK_BYTES, end - begin))
      if not chunk:
        raise ConfigError(f"{file} is cut short: a tensor's data ends past the file's end")
      hasher.update(chunk)
      begin += len(chunk)
  return hasher.digest()


def matches(recorded: str | None, folder: str | pathlib.Path, current: str) -> tuple[bool, str]:
  """``(same, now)``: whether the folder still holds the base whose fingerprint a run
  recorded, and the folder's fingerprint in ``recorded``'s form. ``current``: the folder's
  full fingerprint (from the read that loaded it). A run written before full fingerprints
  recorded ``sampled_fingerprint`` (16 hex digits, no ``PREFIX``): that is compared, so
  such a run still resumes."""
  if recorded and not recorded.startswith(PREFIX):
    current = sampled_fingerprint(folder)
  return recorded == current, current


def sampled_fingerprint(
  folder: str | pathlib.Path, sample: int = 1 << 16, every: int = 1 << 26
) -> str:
  """The fingerprint runs recorded before ``FingerprintDigest`` (kept to check those runs'
  bases, never recorded any more): sha256 over the folder's weight files: each file's name,
  size, safetensors header and ``sample`` bytes of every ``every`` bytes of its data and of
  its end; an edit between the samples goes unseen."""
  import hashlib

  h = hashlib.sha256()
  for file in sorted(set(weight_files(folder).values())):
    size = file.stat().st_size
    h.update(f"{file.name}\0{size}\0".encode())
    with open(file, "rb") as f:
      header = int.from_bytes(f.read(8), "little")
      h.update(f.read(min(header, size)))
      for offset in [*range(8 + header, size, every), max(size - sample, 0)]:
        f.seek(offset)
        h.update(f.read(sample))
  return h.hexdigest()[:16]


def expected_shapes(cfg: LlamaConfig | GPTConfig) -> dict[tuple, tuple]:
  """Each params path of ``hf_names`` with its shape (per-block layout), from the config's
  arithmetic (building the model, even abstractly, costs a second at real sizes); an
  expert's path (``leaf_of``) has its slice's shape."""
  return {path: _shape(cfg, path) for path, _, _ in hf_names(cfg)}


def leaf_of(path: tuple) -> tuple[tuple, int | None]:
  """``(leaf path, expert)``: a path of ``hf_names`` that ends with an expert's index is
  that expert's slice of the stacked leaf before it; any other is a leaf (expert None)."""
  if isinstance(path[-1], int):
    return path[:-1], path[-1]
  return path, None


def _shape(cfg, path: tuple) -> tuple:
  """The shape of the leaf at ``path`` (``hf_names``' paths) in ``cfg``'s model."""
  d, v = cfg.d_model, cfg.vocab_size
  module, leaf = path[-2], path[-1]
  if not isinstance(cfg, GPTConfig) and (moe := hf_moe.mlp_shape(cfg, path)) is not None:
    return moe
  if isinstance(cfg, GPTConfig):
    widths = {"qkv": (d, 3 * d), "proj": (d, d), "fc": (d, cfg.mlp_hidden)}
    widths |= {"out": (cfg.mlp_hidden, d), "head": (d, v)}
    fixed = {"embed": (v, d), "pos_embed": (cfg.max_seq_len, d)}
  else:
    h, kv = cfg.n_heads * cfg.resolved_head_dim, cfg.kv_cache_width
    i = cfg.intermediate_size
    widths = {"q_proj": (d, h), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (h, d)}
    widths |= {"gate_proj": (d, i), "up_proj": (d, i), "down_proj": (i, d), "lm_head": (d, v)}
    fixed = {"embed_tokens": (v, d)}
    if module in ("q_norm", "k_norm"):
      if cfg.qk_norm_scope == "projection":  # one norm over the whole projection
        return (h if module == "q_norm" else kv,)
      return (cfg.resolved_head_dim,)
  if module in fixed:
    return fixed[module]
  if module in widths:
    return widths[module] if leaf == "kernel" else widths[module][1:]
  return (d,)  # a norm's scale or bias


def read_params(
  folder: str | pathlib.Path,
  cfg: LlamaConfig,
  *,
  dtype=np.float32,
  place: Callable[[tuple, np.ndarray], object] | None = None,
  digest: FingerprintDigest | None = None,
) -> dict:
  """The params of ``cfg``'s model (per-block layout) from the folder's weights, each tensor
  cast to ``dtype`` and passed through ``place(path, array)`` (default: kept as numpy).
  ``digest``: also computes the folder's full fingerprint (``digest.value``) from the bytes
  read, each tensor's hashed as it comes out of the file.

  Raises:
    ConfigError: a tensor is missing, has another shape (named, with both shapes), is
      stored as integers (a header that declares another dtype than the data), or holds
      NaN or infinite values (all such tensors counted, checked block by block as they
      are copied: no extra pass over the weights).
  """
  folder = pathlib.Path(folder)
  files = weight_files(folder)
  wanted = list(hf_names(cfg, files))
  missing = [name for _, name, _ in wanted if name not in files]
  if missing:
    raise ConfigError(
      f"{folder}: the weights lack {len(missing)} tensor(s) this config needs, e.g. "
      f"{', '.join(missing[:3])}"
    )
  params: dict = {}
  stacks: dict = {}  # stacked expert leaves being filled: path -> [array, experts to come]
  not_finite = []
  # entries that share a tensor (a fused gate_up_proj) are read together, in one pass
  for name, entries in itertools.groupby(wanted, key=lambda entry: entry[1]):
    entries = list(entries)
    paths, transposed, file = [p for p, _, _ in entries], entries[0][2], files[name]
    targets = [_target(cfg, path, dtype, stacks) for path in paths]
    # several leaves of one tensor: Phi-3's kernels' rows in turn, else an MoE's experts'
    rows = len(paths) > 1 and paths[0][-1] == "kernel"
    needed = _stored_shape([t.shape for t in targets], transposed, rows)  # as the file lays it
    hasher = None if digest is None else new_hasher()
    with _opened(file) as f:  # one opening per tensor: its mapped pages leave with it
      columns = hf_gpt2.columns(cfg, paths[0], to_hf=False)
      finite = _read(f, file, name, needed, transposed, hasher, columns, targets, rows)
    if digest is not None:
      digest.tensor(file, name, hasher)
    if not finite:
      not_finite.append(name)
    for path, target in zip(paths, targets, strict=True):
      leaf, expert = leaf_of(path)
      if expert is not None:  # placed once every expert's slice is in
        stacks[leaf][1] -= 1
        if stacks[leaf][1]:
          continue
        target = stacks.pop(leaf)[0]
      _set(params, leaf, place(leaf, target) if place else target)
    del targets, target  # a copying ``place`` has its own: not held while the next is read
  if not_finite:
    raise ConfigError(
      f"{folder}: {len(not_finite)} tensor(s) hold NaN or infinite values, e.g. "
      f"{', '.join(not_finite[:3])}: the weights are damaged (re-download or re-export them)"
    )
  if digest is not None:
    digest.finish(files.values())
  return params


def _target(cfg, path: tuple, dtype, stacks: dict) -> np.ndarray:
  """The array the tensor at ``path`` is read into: a new one for a leaf, the expert's slice
  of its stacked leaf (made on its first expert, kept in ``stacks``) for an expert."""
  leaf, expert = leaf_of(path)
  if expert is None:
    return _aligned_empty(_shape(cfg, path), dtype)
  if leaf not in stacks:
    shape = _shape(cfg, leaf)
    stacks[leaf] = [_aligned_empty(shape, dtype), shape[0]]
  return stacks[leaf][0][expert]


def _rows_into(stored_rows: np.ndarray, first: int, into: list[np.ndarray]) -> bool:
  """Copies the file's rows ``first …`` into the arrays ``into`` (``[in, out_j]`` each, the
  j-th taking the next ``out_j`` rows of the file), transposed; whether they are finite."""
  finite, start = True, 0
  for out in into:
    lo, hi = max(first, start), min(first + len(stored_rows), start + out.shape[1])
    if lo < hi:
      block = out[:, lo - start : hi - start]
      block[...] = stored_rows[lo - first : hi - first].T
      finite = finite and bool(np.isfinite(block).all())
    start += out.shape[1]
  return finite


def _swapped(shape: tuple) -> tuple:
  """``shape`` with its last two axes swapped (a matrix's, or each expert's)."""
  return (*shape[:-2], shape[-1], shape[-2])


def _stored_shape(shapes: list[tuple], transposed: bool, rows: bool = False) -> tuple:
  """The file's shape of a tensor read into arrays of ``shapes``: each transposed back if
  ``transposed``, several concatenated along axis 1 (an MoE's fused ``gate_up_proj``) or,
  with ``rows``, along axis 0 (Phi-3's ``qkv_proj`` and ``gate_up_proj``)."""
  parts = [_swapped(s) if transposed else s for s in shapes]
  if len(parts) == 1:
    return parts[0]
  if rows:
    return (sum(p[0] for p in parts), *parts[0][1:])
  return (parts[0][0], sum(p[1] for p in parts), *parts[0][2:])


def _read(f, file, name: str, needed: tuple, transposed: bool, hasher, columns, into, by_row=False):
  """Reads tensor ``name`` of the open file into the arrays ``into``; returns whether it is
  finite (no NaN or infinity, checked per block). The tensor is checked against ``needed``
  (the file's layout) and a float dtype, cast to ``into``'s dtype and transposed if asked
  (each matrix's last two axes swapped; or its last axis reordered by ``columns``), a block
  of rows (about ``BLOCK_BYTES``; a vector is one block) at a time: besides the result only
  one block is ever held. Several arrays in ``into`` split it in equal parts along axis 1
  (a fused ``gate_up_proj``: each expert's gate rows, then its up rows) or, with
  ``by_row``, take its rows in turn (Phi-3's q, k, v rows; gate, up rows), each transposed.
  The arrays are 64-byte aligned (``_aligned_empty``), so a CPU ``jax.device_put`` adopts
  them instead of copying. ``hasher``: updated with each block's bytes as stored in the
  file (before the cast)."""
  try:
    source = f.get_slice(name)
    shape, stored = tuple(source.get_shape()), source.get_dtype()
  except Exception as e:  # noqa: BLE001 - a shard the index names may lack it
    raise ConfigError(f"{file}: tensor {name} cannot be read ({first_line(e)})") from None
  if shape != needed:
    raise ConfigError(f"{file.name}: tensor {name} has shape {shape}, config.json needs {needed}")
  if stored not in FLOAT_DTYPES:
    raise ConfigError(
      f"{file.name}: tensor {name} is stored as {stored}, a model's weights are floats "
      f"({', '.join(FLOAT_DTYPES)}): the file's header does not describe its data"
    )
  rows = max(1, BLOCK_BYTES // max(1, into[0].itemsize * int(np.prod(shape[1:]))))
  if columns is not None and len(shape) == 1:
    rows = shape[0]  # a vector's columns are its rows
  finite = True
  try:
    for i in range(0, shape[0], rows):
      end = min(i + rows, shape[0])  # safetensors refuses a slice past the end
      stored_rows = source[i:end]  # a contiguous copy of the file's bytes
      if hasher is not None:
        hasher.update(stored_rows)
      if by_row:
        finite = _rows_into(stored_rows, i, into) and finite
        continue
      parts = np.split(stored_rows, len(into), axis=1) if len(into) > 1 else [stored_rows]
      for out, part in zip(into, parts, strict=True):
        block = out[:, i:end] if transposed and out.ndim == 2 else out[i:end]
        block[...] = np.swapaxes(part, -1, -2) if transposed else (columns or _same)(part)
        finite = finite and bool(np.isfinite(block).all())
  except MemoryError:
    raise
  except Exception as e:  # noqa: BLE001 - the data cannot be read or cast
    raise ConfigError(f"{file}: tensor {name} cannot be read ({first_line(e)})") from None
  return finite


def _same(x):
  return x


def _aligned_empty(shape: tuple, dtype, alignment: int = 64) -> np.ndarray:
  """``np.empty(shape, dtype)`` whose data starts on an ``alignment``-byte boundary."""
  nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
  raw = np.empty(nbytes + alignment, np.uint8)
  start = -raw.ctypes.data % alignment
  return raw[start : start + nbytes].view(dtype).reshape(shape)


@contextlib.contextmanager
def _opened(file: pathlib.Path):
  """``safe_open`` of ``file``; a damaged or unreadable file is a ``ConfigError`` naming it."""
  from safetensors import safe_open

  try:
    handle = safe_open(str(file), framework="np")
  except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
    raise ConfigError(f"{file} is not a readable safetensors file ({first_line(e)})") from None
  with handle as f:
    yield f


def _set(tree: dict, path: tuple, value) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def unused_tensors(folder: str | pathlib.Path, cfg: LlamaConfig) -> list[str]:
  """Tensors in the folder that no parameter of ``cfg`` takes (known buffers left out)."""
  files = weight_files(folder)
  used = {name for _, name, _ in hf_names(cfg, files)}
  gpt = isinstance(cfg, GPTConfig)
  return sorted(
    n
    for n in files
    if n not in used
    and not n.endswith(IGNORED_SUFFIXES)
    and not (gpt and hf_gpt2.is_ignored(n, cfg))
  )
