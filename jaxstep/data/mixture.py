"""A deterministic mixture of several corpora by weight, whose position is one integer.

``data.sources: [{name, path, weight}, …]``: every training sample (row of a global batch)
is drawn from one source. The samples of the run are numbered ``t = 0, 1, 2, …`` (global
batch ``b`` holds ``t ∈ [b·G, (b+1)·G)``); which source sample ``t`` comes from, and which
of that source's windows, are pure functions of ``(seed, t)``:

- **Blocks.** Samples go in blocks of ``BLOCK`` = 2048. Every block holds exactly ``q_s``
  samples of source ``s``, the largest-remainder apportionment of ``BLOCK`` by the weights
  (so each source's share is its weight to within ``1 / BLOCK`` at every block boundary),
  in an order shuffled per block by ``(seed, block)`` (Levanter's mixture does the same).
- **Within a source.** The ``k``-th sample drawn from source ``s`` (``k = block·q_s`` plus
  its draws earlier in the block) is window ``order_s(k mod n_s)`` of its
  ``k div n_s``-th pass over its ``n_s`` windows, ``order_s`` a fresh permutation per pass
  (the loader's keyed permutation, ``shuffled_index``, keyed by the seed, the source's index
  and the pass: O(1) per window whatever ``n_s`` is). An exhausted
  source therefore cycles as a new epoch of that source; the others go on undisturbed.

So a run resumes from the number of global batches consumed, with nothing replayed:
finding batch ``b`` costs one block's shuffle (``O(BLOCK)``), whatever ``b`` is.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Callable, Sequence

import numpy as np

from jaxstep.data.permutation import shuffled_index
from jaxstep.data.tokenizer import same_tokenizer
from jaxstep.errors import ConfigError, DataError

BLOCK = 2048  # samples per mixing block: shares are exact at every block boundary
MIX_KEY = 0x6D6978  # separates the block shuffles' random streams from the epoch orders'


@dataclasses.dataclass(frozen=True)
class Source:
  """One corpus of a mixture: its name, its windows (``Windows``-like: ``len`` and
  ``rows(index, num_rows, pad_id)``) and its weight (> 0; weights need not sum to 1)."""

  name: str
  windows: object
  weight: float


def quotas(weights: Sequence[float], block: int = BLOCK) -> np.ndarray:
  """Samples per block of each source: ``block × w_s / Σw`` rounded by largest remainder
  (ties to the earlier source), each at least 1 — a weight too small for one sample per
  block is refused by name (``data.sources``)."""
  w = np.asarray(weights, np.float64)
  exact = block * w / w.sum()
  q = np.floor(exact).astype(np.int64)
  short = block - int(q.sum())
  order = np.argsort(-(exact - q), kind="stable")
  q[order[:short]] += 1
  if (q == 0).any():
    i = int(np.argmax(q == 0))
    raise ConfigError(
      f"data.sources[{i}] weight {weights[i]} is below one sample in {block} "
      f"({w[i] / w.sum():.2e} of the total); raise it or drop the source"
    )
  return q


class Mixture:
  """The training samples of a mixture of ``sources`` (see the module docstring).

  ``len`` is the windows of all sources together; a mixture has no epochs (``endless``):
  a run on one ends at ``train.max_steps``. The seed comes with each call (``train.seed``).
  """

  endless = True

  def __init__(self, sources: Sequence[Source]):
    if not sources:
      raise ConfigError("data.sources is empty; name at least one source")
    for s in sources:
      if len(s.windows) == 0:
        raise ConfigError(f"data.sources {s.name!r} has no training windows")
    self.sources = list(sources)
    self.q = quotas([s.weight for s in sources])
    self.sizes = [len(s.windows) for s in sources]

  def __len__(self) -> int:
    return int(sum(self.sizes))

  @functools.lru_cache(maxsize=4)  # noqa: B019 - a handful of blocks, freed with the run
  def _block(self, seed: int, j: int) -> tuple[np.ndarray, np.ndarray]:
    """Block ``j``: the source of each of its samples, and each sample's draw number within
    its source for this block (0, 1, … in block order)."""  # O(BLOCK), cached
    base = np.repeat(np.arange(len(self.q)), self.q)
    owner = base[np.random.default_rng([seed, MIX_KEY, j]).permutation(len(base))]
    within = np.zeros(len(owner), np.int64)
    for s in range(len(self.q)):
      at = owner == s
      within[at] = np.arange(int(at.sum()))
    return owner, within

  def draws(self, seed: int, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Samples ``t`` → (source of each, its draw number ``k`` within that source)."""
    blocks, offsets = np.divmod(np.asarray(t, np.int64), BLOCK)
    source = np.empty(len(blocks), np.int64)
    draw = np.empty(len(blocks), np.int64)
    for j in np.unique(blocks):
      sel = blocks == j
      owner, within = self._block(seed, int(j))
      source[sel] = owner[offsets[sel]]
      draw[sel] = int(j) * self.q[source[sel]] + within[offsets[sel]]
    return source, draw

  def window_of(self, seed: int, s: int, k: np.ndarray) -> np.ndarray:
    """Source ``s``'s ``k``-th draws → its window indices (a new order every pass)."""
    n = self.sizes[s]
    passes, index = np.divmod(k, n)
    out = np.empty(len(k), np.int64)
    for p in np.unique(passes):
      sel = passes == p
      out[sel] = shuffled_index(seed + 1 + s, int(p), n, index[sel])
    return out

  def global_batch(
    self, seed: int, b: int, g: int, pad_id: int, rows: np.ndarray | None = None
  ) -> dict[str, np.ndarray]:
    """Global batch ``b`` (``G = g`` rows, or only ``rows`` of it): the usual fields plus
    ``source`` (int32, the source index of each row)."""
    rows = np.arange(g) if rows is None else np.asarray(rows)
    source, draw = self.draws(seed, b * g + rows)
    parts = {}
    for s in np.unique(source):
      sel = np.flatnonzero(source == s)
      idx = self.window_of(seed, int(s), draw[sel])
      parts[int(s)] = (sel, self.sources[int(s)].windows.rows(idx, len(sel), pad_id))
    first = next(iter(parts.values()))[1]
    out = {k: np.empty((len(rows), *v.shape[1:]), v.dtype) for k, v in first.items()}
    for sel, part in parts.values():
      for k, v in part.items():
        out[k][sel] = v
    out["source"] = source.astype(np.int32)
    return out

  def source_tokens(self, batch: dict) -> dict[str, int]:
    """``tokens_<name>``: the loss-masked targets of each source in ``batch``."""
    per_row = np.asarray(batch["loss_mask"]).reshape(len(batch["source"]), -1).sum(1)
    totals = np.bincount(batch["source"], weights=per_row, minlength=len(self.sources))
    return {f"tokens_{s.name}": int(n) for s, n in zip(self.sources, totals, strict=True)}


def load_mixture(data_cfg, seq_len: int, progress: bool = False, *, load_source: Callable):
  """The ``Dataset`` of ``data_cfg.sources``: each source read like ``data.path`` (raw
  input prepared with ``data.tokenizer`` and ``data.format``, ``data.eval_fraction`` held
  out; a prepared folder as it is), all with one tokenizer; ``train`` is their
  ``Mixture``, and each source's held-out split is an eval set under its name.

  ``load_source(data_cfg, seq_len, progress)`` reads one source's ``DataConfig`` (its
  ``path``, no ``sources``) into a ``Dataset``: ``single_corpus.load_single_corpus``, passed
  in by ``dataset.load_dataset`` so that neither loader imports the other."""
  loaded = []
  for entry in data_cfg.sources:
    one = dataclasses.replace(data_cfg, path=entry["path"], sources=())
    try:
      loaded.append(load_source(one, seq_len, progress))
    except DataError as e:
      raise DataError(f"data.sources {entry['name']!r}: {e}") from None
  first = loaded[0]
  for entry, ds in zip(data_cfg.sources[1:], loaded[1:], strict=True):
    if not same_tokenizer(ds.manifest["tokenizer"], first.manifest["tokenizer"]):
      raise DataError(
        f"data.sources {entry['name']!r} was prepared with another tokenizer than "
        f"{data_cfg.sources[0]['name']!r}; a mixture has one tokenizer: prepare it again "
        f"with that one (or give raw files)"
      )
  sources = [
    Source(e["name"], ds.train, e["weight"]) for e, ds in zip(data_cfg.sources, loaded, strict=True)
  ]
  identity = [
    [e["name"], e["weight"], ds.fingerprint] for e, ds in zip(data_cfg.sources, loaded, strict=True)
  ]
  return dataclasses.replace(
    first,
    train=Mixture(sources),
    eval=None,
    fingerprint=hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:16],
    source_evals={
      e["name"]: ds.eval for e, ds in zip(data_cfg.sources, loaded, strict=True) if ds.eval
    },
  )
