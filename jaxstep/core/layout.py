"""Sharding rules as pure functions (no I/O): how params, optimizer state and batches lie
on a ``("data", "fsdp")`` mesh, or a ``("data", "fsdp", "tensor")`` one.
``jaxstep.parallel.mesh`` builds meshes and feeds batches.

* The batch: its rows over ``data`` × ``fsdp`` (replicated over ``tensor``).
* A leaf over ``tensor``: each dimension has a *logical* name (``embed``, ``heads``,
  ``kv_heads``, ``mlp``, ``vocab``), given by a table of leaf-path patterns (``AXIS_NAMES``:
  the bundled GPT and Llama; ``name_axes`` adds a model of your own), and ``RULES`` maps a
  logical name to the mesh axis it is split over — the shape of MaxText's logical axis
  rules, so models hold no mesh code. A path matches wherever it sits (params, Adam's
  moments, a frozen reference copy), a LoRA adapter follows its projection (``lora_a`` the
  input's name, ``lora_b`` the output's), and a stacked layer dimension comes first. A
  dimension the tensor size does not divide stays whole (replicated).
* A leaf over ``fsdp``: its largest other dimension that the fsdp size divides.
"""

from __future__ import annotations

import contextlib
import contextvars
import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXES = ("data", "fsdp")  # the batch's axes (the step's manual ones)
TENSOR = "tensor"
# expert parallelism: an MoE layer's experts split over it; the rest of the model treats it
# as one more batch axis (its devices hold other rows), so it is a manual axis of the step
EXPERT = "expert"
# logical name -> mesh axis; "seq" is the activations' sequence dimension between the
# tensor-parallel regions (set to "tensor": sequence parallelism)
DEFAULT_RULES = {"heads": TENSOR, "kv_heads": TENSOR, "mlp": TENSOR, "vocab": TENSOR, "seq": None}
RULES = dict(DEFAULT_RULES)
_IN_STEP = contextvars.ContextVar("jaxstep_tensor_in_step", default=0)
_MANUAL_ROWS = contextvars.ContextVar("jaxstep_manual_rows", default=())
_COLUMN, _ROW = ("embed", "heads"), ("heads", "embed")
AXIS_NAMES: list[tuple[str, tuple[str | None, ...]]] = [
  # the bundled GPT
  (r"\['qkv'\]\['kernel'\]", _COLUMN),
  (r"\['qkv'\]\['bias'\]", ("heads",)),
  (r"\['proj'\]\['kernel'\]", _ROW),
  (r"\['fc'\]\['kernel'\]", ("embed", "mlp")),
  (r"\['fc'\]\['bias'\]", ("mlp",)),
  (r"\['out'\]\['kernel'\]", ("mlp", "embed")),
  (r"\['embed'\]\['embedding'\]", ("vocab", "embed")),
  (r"\['head'\]\['kernel'\]", ("embed", "vocab")),
  # the Llama family
  (r"\['q_proj'\]\['kernel'\]", _COLUMN),
  (r"\['q_proj'\]\['bias'\]", ("heads",)),
  (r"\['[kv]_proj'\]\['bias'\]", ("kv_heads",)),
  (r"\['[kv]_proj'\]\['kernel'\]", ("embed", "kv_heads")),
  (r"\['o_proj'\]\['kernel'\]", _ROW),
  (r"\['(gate|up)_proj'\]\['kernel'\]", ("embed", "mlp")),
  (r"\['down_proj'\]\['kernel'\]", ("mlp", "embed")),
  (r"\['embed_tokens'\]\['embedding'\]", ("vocab", "embed")),
  (r"\['lm_head'\]\['kernel'\]", ("embed", "vocab")),
  # mixture-of-experts layers: the stacked experts' leading axis
  (r"\['experts'\]\['(gate|up)_proj'\]", ("experts", "embed", "mlp")),
  (r"\['experts'\]\['down_proj'\]", ("experts", "mlp", "embed")),
  # their adapters (lora.ExpertAdapter), named as if a kernel: A [E, in, r], B [E, r, out]
  (r"\['experts'\]\['gate_up'\]\['kernel'\]", ("experts", "embed", "mlp")),
  (r"\['experts'\]\['down'\]\['kernel'\]", ("experts", "mlp", "embed")),
]


def split_rules(**axes: str | None) -> None:
  """Sets where logical names go (``RULES``; None: not split), e.g. ``kv_heads=None`` for
  a model whose key/value heads do not divide the tensor size. The CLI sets it from the
  model before it lays anything out."""
  RULES.clear()
  RULES.update({**DEFAULT_RULES, **axes})


@contextlib.contextmanager
def inside_step(mesh: Mesh):
  """While the train step traces its model on ``mesh``: activation constraints apply."""
  token = _IN_STEP.set(dict(mesh.shape).get(TENSOR, 1))
  rows = _MANUAL_ROWS.set(batch_axes(mesh))
  try:
    yield
  finally:
    _IN_STEP.reset(token)
    _MANUAL_ROWS.reset(rows)


def sum_over_batch(tree):
  """``tree``'s leaves summed over every device's rows of the global batch: a ``psum`` over
  the batch axes inside the sharded step (``accumulate.sharded_accumulate``, where each
  device sees its own rows), else the leaves as they are (a plain jit's arrays are global
  already). For sums a loss needs over the whole global batch."""
  axes = tuple(a for a in _MANUAL_ROWS.get() if jax.lax.axis_size(a) > 1)
  return jax.lax.psum(tree, axes) if axes else tree


def expert_shards() -> int:
  """Inside the sharded step, how many ways the ``expert`` axis splits the experts (1:
  none, or outside the step): an MoE layer then holds ``num_experts / expert_shards()``."""
  return jax.lax.axis_size(EXPERT) if EXPERT in _MANUAL_ROWS.get() else 1


def _splits_sequence(x) -> bool:
  """Whether ``x`` ``[B, S, D]`` is traced inside the train step with sequence parallelism
  on and S divisible by the tensor size."""
  tensor = _IN_STEP.get()
  return tensor > 1 and RULES.get("seq") == TENSOR and x.ndim == 3 and x.shape[1] % tensor == 0


def constrain_sequence(x):
  """``x`` ``[B, S, D]`` between tensor-parallel regions: split on S over ``tensor`` when
  ``RULES["seq"]`` says so (sequence parallelism: norms, residual adds and dropout work on
  1/tensor of the positions; the compiler all-gathers before a column-parallel layer and
  reduce-scatters after a row-parallel one), inside the train step only; else ``x``."""
  if not _splits_sequence(x):
    return x
  return jax.lax.with_sharding_constraint(x, PartitionSpec(None, TENSOR, None))


def gather_sequence(x):
  """``x`` ``[B, S, D]`` entering a column-parallel layer under sequence parallelism: whole
  on S on every tensor device (Megatron-SP's all-gather, once, where the layer starts), so
  the compiler does not carry the position split into attention and reshard keys and
  values there; else ``x``."""
  if not _splits_sequence(x):
    return x
  return jax.lax.with_sharding_constraint(x, PartitionSpec(None, None, None))


def name_axes(pattern: str, names: tuple[str | None, ...]) -> None:
  """Names the dimensions of your model's leaves whose path (``jax.tree_util.keystr``, e.g.
  ``['mlp']['w_in']``) ends with ``pattern`` (a regex), for tensor parallelism."""
  AXIS_NAMES.append((pattern, tuple(names)))


def logical_names(path: str, ndim: int) -> tuple[str | None, ...]:
  """The logical name of each dimension of the leaf at ``path`` (None: unnamed). A
  quantized weight's ``codes`` and ``scale`` (``models/quant.py``: ``[..., in/2 or in,
  out]`` and ``[..., in/block, out]``) are named as the weight."""
  path = re.sub(r"\.(codes|scale)$", "", path)
  adapter = re.search(r"\['lora'\]\['lora_([ab])'\]$", path)
  base = path[: adapter.start()] + "['kernel']" if adapter else path
  names = next((n for pattern, n in AXIS_NAMES if re.search(pattern + "$", base)), ())
  if adapter and len(names) >= 2:  # A: [..., in, r], B: [..., r, out]
    low = (names[-2], None) if adapter.group(1) == "a" else (None, names[-1])
    names = (*names[:-2], *low)
  if len(names) > ndim:
    return (None,) * ndim
  return (None,) * (ndim - len(names)) + tuple(names)  # a stacked layer axis comes first


def leaf_spec(
  shape: tuple[int, ...],
  fsdp_size: int,
  names: tuple | None = None,
  tensor_size: int = 1,
  expert_size: int = 1,
) -> PartitionSpec:
  """``expert`` on the dimension named ``experts`` (when ``expert_size`` divides it);
  ``tensor`` on the dimensions ``names`` maps to it (``RULES``) that ``tensor_size``
  divides; ``fsdp`` on the largest other dimension ``fsdp_size`` divides (first on ties);
  else replicated."""
  axes = [None] * len(shape)
  if expert_size > 1 and names and "experts" in names:
    d = names.index("experts")
    if shape[d] % expert_size == 0:
      axes[d] = EXPERT
  if tensor_size > 1 and names:
    for d, name in enumerate(names):
      if RULES.get(name) == TENSOR and shape[d] % tensor_size == 0:
        axes[d] = TENSOR
        break
  if fsdp_size > 1:
    dims = [d for d in range(len(shape)) if axes[d] is None and shape[d] % fsdp_size == 0]
    if dims:
      axes[max(dims, key=lambda d: (shape[d], -d))] = "fsdp"
  return PartitionSpec(*axes) if any(axes) else PartitionSpec()


def tree_specs(tree, mesh: Mesh):
  """``leaf_spec`` for every array leaf of ``tree`` (params, opt_state, a whole TrainState)."""
  return jax.tree_util.tree_map_with_path(
    lambda path, x: _named_spec(jax.tree_util.keystr(path), np.shape(x), mesh), tree
  )


def _named_spec(path: str, shape: tuple, mesh: Mesh) -> PartitionSpec:
  """``leaf_spec`` of the leaf at ``path`` (``jax.tree_util.keystr``'s spelling) on ``mesh``."""
  fsdp, tensor = mesh.shape["fsdp"], dict(mesh.shape).get(TENSOR, 1)
  expert = dict(mesh.shape).get(EXPERT, 1)
  names = logical_names(path, len(shape)) if tensor > 1 or expert > 1 else None
  return leaf_spec(tuple(shape), fsdp, names, tensor, expert)


def tree_shardings(tree, mesh: Mesh):
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec), tree_specs(tree, mesh))


def leaf_sharding(path: tuple, shape: tuple, mesh: Mesh) -> NamedSharding:
  """Where the leaf at ``path`` (keys, e.g. ``("blocks", 0, "qkv", "kernel")``) goes, as
  ``tree_shardings`` places it: for a tensor read one at a time onto its final place."""
  keys = "".join(f"[{k!r}]" for k in path)  # jax.tree_util.keystr's spelling
  return NamedSharding(mesh, _named_spec(keys, shape, mesh))


def manual_spec(spec: PartitionSpec) -> PartitionSpec:
  """``spec`` on the step's manual axes only (``tensor`` entries dropped: that axis is left
  to the compiler inside the step's ``shard_map``)."""
  return PartitionSpec(*[None if a == TENSOR else a for a in spec])


def has_tensor(mesh: Mesh) -> bool:
  return TENSOR in mesh.axis_names


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
  """The mesh axes the batch's rows split over: data, fsdp and, if the mesh has one, expert
  (the tensor axis shares rows)."""
  return (*AXES, EXPERT) if EXPERT in dict(mesh.shape) else AXES


def batch_shards(mesh: Mesh) -> int:
  """How many ways the batch's rows split: data × fsdp × expert."""
  return int(np.prod([mesh.shape[a] for a in batch_axes(mesh)]))


def rows_here(sharding: NamedSharding, n: int) -> np.ndarray:
  """The rows of an ``n``-row array laid out by ``sharding`` that this process's devices
  hold, sorted."""
  index = sharding.addressable_devices_indices_map((n,))
  return np.unique(np.concatenate([np.arange(n)[sl[0]] for sl in index.values()]))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (sample) dimension over every device: ``P(("data", "fsdp"))`` (and
  ``"expert"`` when the mesh has it)."""
  return NamedSharding(mesh, PartitionSpec(batch_axes(mesh)))
