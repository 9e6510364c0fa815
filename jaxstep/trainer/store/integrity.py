"""Checksums that tell a restored checkpoint from one whose bytes changed on disk.

orbax verifies structure (metadata, commit marker) but not array bytes: a checkpoint whose
array file was overwritten in place restores "fine". So every save records, per leaf, a
32-bit position-weighted sum of the leaf's raw bits, ``Σ_i bits_i · (2654435761·i + 1) mod
2³²``, computed where the state lives — with numpy when every array is in this host's CPU
memory (no compile), else in one jitted program on the devices (wrap-around integer sums
are exact in any order, so the value depends neither on the sharding nor on the path).
Restore recomputes it and compares; a zeroed or flipped word changes the sum with
probability 1 − 2⁻³². Restored params and optimizer state must also be finite. The
run-state JSON saved beside the arrays gets a SHA-256 of its canonical text
(``json_checksum``), so an edited position or epoch is caught too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np

from jaxstep.core.trees import path_name

MULTIPLIER = 2654435761  # Knuth's multiplicative hash constant, odd: a bijection mod 2^32


def _words(x: jax.Array) -> jax.Array:
  """The raw bits of ``x`` as a flat uint32 vector (narrower types zero-extended)."""
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    return x.reshape(-1).astype(jnp.uint32)
  size = x.dtype.itemsize
  if size == 8:
    return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
  unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[size]
  return jax.lax.bitcast_convert_type(x, unsigned).reshape(-1).astype(jnp.uint32)


def _leaf_sum(x: jax.Array) -> jax.Array:
  words = _words(x)
  weights = jnp.arange(words.size, dtype=jnp.uint32) * jnp.uint32(MULTIPLIER) + jnp.uint32(1)
  return jnp.sum(words * weights, dtype=jnp.uint32)


@jax.jit
def _sums(leaves):
  return [_leaf_sum(x) for x in leaves]


def _on_host(leaves) -> bool:
  """Every leaf is a numpy array or a CPU array this process holds whole."""
  return all(
    isinstance(x, np.ndarray)
    or (
      isinstance(x, jax.Array)
      and x.is_fully_addressable
      and all(d.platform == "cpu" for d in x.devices())
    )
    for x in leaves
  )


def _host_words(x) -> np.ndarray:
  if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  x = np.asarray(x)
  if x.dtype == np.bool_:
    return x.reshape(-1).astype(np.uint32)
  unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}[x.dtype.itemsize]
  return np.ascontiguousarray(x).view(unsigned).reshape(-1).astype(np.uint32, copy=False)


def _host_sum(x) -> int:
  words = _host_words(x)
  terms = np.arange(words.size, dtype=np.uint32)  # one buffer, updated in place
  np.multiply(terms, np.uint32(MULTIPLIER), out=terms)
  terms += np.uint32(1)
  np.multiply(terms, words, out=terms)
  return int(terms.sum(dtype=np.uint32))


def checksums(state) -> dict[str, list]:
  """``{leaf path: [checksum, dtype]}`` of every array leaf of ``state`` (JSON-able)."""
  flat = jax.tree_util.tree_flatten_with_path(state)[0]
  leaves = [leaf for _, leaf in flat]
  if _on_host(leaves):
    values = [_host_sum(x) for x in leaves]
  else:
    values = [int(np.asarray(v.addressable_data(0))) for v in _sums(leaves)]
  return {
    path_name(path): [v, str(leaf.dtype)] for (path, leaf), v in zip(flat, values, strict=True)
  }


def mismatch(state, expected: dict[str, list]) -> str | None:
  """The first leaf whose checksum differs from ``expected``, or that has none recorded
  (an unverifiable leaf is not trusted), as a message; or None. Leaves restored into
  another dtype than they were saved in are not compared."""
  actual = checksums(state)
  unrecorded = sorted(actual.keys() - expected.keys())
  if unrecorded:
    return f"no checksum recorded for {unrecorded[0]}: it cannot be verified"
  for name, (value, dtype) in expected.items():
    if name in actual and actual[name][1] == dtype and actual[name][0] != value:
      return f"the bytes of {name} changed since it was saved (checksum mismatch)"
  return None


def json_checksum(value) -> str:
  """SHA-256 of ``value``'s canonical JSON text (sorted keys, no spaces): equal for a dict
  and the same dict read back from a JSON file (tuples become lists, keys strings)."""
  value = json.loads(json.dumps(value))
  text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
  return hashlib.sha256(text.encode()).hexdigest()


def _checked_parts(state):
  """What must be finite: a train state's params and optimizer state (a ``TrainState``, or
  one read back as a dict), else every leaf."""
  if dataclasses.is_dataclass(state) and hasattr(state, "params"):
    return {"params": state.params, "opt_state": getattr(state, "opt_state", None)}
  if isinstance(state, dict) and "params" in state:
    return {"params": state["params"], "opt_state": state.get("opt_state")}
  return {"state": state}


@jax.jit
def _finite_flags(leaves):
  return [jnp.all(jnp.isfinite(x)) for x in leaves]


def nonfinite(state) -> str | None:
  """The first floating leaf of the params / optimizer state holding NaN or inf; or None."""
  flat = [
    (path, leaf)
    for path, leaf in jax.tree_util.tree_flatten_with_path(_checked_parts(state))[0]
    if jnp.issubdtype(leaf.dtype, jnp.floating)
  ]
  leaves = [leaf for _, leaf in flat]
  if _on_host(leaves):
    flags = [bool(np.isfinite(np.asarray(x)).all()) for x in leaves]
  else:
    flags = [bool(np.asarray(ok.addressable_data(0))) for ok in _finite_flags(leaves)]
  for (path, _), ok in zip(flat, flags, strict=True):
    if not ok:
      return f"{path_name(path)} holds NaN or inf"
  return None
