"""Document masking in packed windows: the batch fields ``Windows.rows`` adds
(``segment_ids``, ``positions``) on hand-made streams, and the models' exactness with them:
each document of a packed window gets the losses (and, summed, the gradients) it gets run
alone from position 0, on every attention backend this host runs; cuDNN's fallback with
the platform mocked as a GPU."""

import functools
import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tolerance import assert_close, assert_far

from jaxstep import models
from jaxstep.core.losses import DOCUMENT_FIELDS, document_fields, next_token_loss
from jaxstep.data import ByteTokenizer, DataConfig, load_dataset
from jaxstep.data.shards import TokenStream, Windows
from jaxstep.errors import BatchError
from jaxstep.models import backends, cpu_kernels

PAD = 0
S = 16  # the models' window
VOCAB = 32


# --- Windows.rows: the batch fields ------------------------------------------------------


def hand_made(tmp_path, lengths, seq_len, pack):
  """A one-shard stream of documents of ``lengths``: document ``d`` is ``BOS=1`` then
  tokens ``10·(d+1) + i``, so every token says where it came from."""
  docs = [np.array([1] + [10 * (d + 1) + i for i in range(1, n)]) for d, n in enumerate(lengths)]
  np.concatenate(docs).astype(np.uint16).tofile(tmp_path / "t.bin")
  np.cumsum([0, *lengths[:-1]]).astype(np.uint64).tofile(tmp_path / "d.bin")
  entry = {"shards": [{"file": "t.bin"}], "docs": {"file": "d.bin"}}
  return Windows(TokenStream(tmp_path, entry, "uint16"), seq_len, pack, PAD)


def test_rows_number_each_windows_documents_and_restart_positions(tmp_path):
  # documents at stream offsets 0, 5, 12, 15, 24; windows start at 0, 8, 16, 24
  w = hand_made(tmp_path, [5, 7, 3, 9, 2], seq_len=8, pack=True)
  got = w.rows(np.arange(4), 5, PAD, document_mask=True)
  assert got["segment_ids"].tolist() == [
    [1, 1, 1, 1, 1, 2, 2, 2],
    [1, 1, 1, 1, 2, 2, 2, 3],  # starts mid-document: its tail is segment 1
    [1, 1, 1, 1, 1, 1, 1, 1],  # all one document's middle
    [1, 1, 0, 0, 0, 0, 0, 0],  # the stream's end: padding is segment 0
    [0] * 8,  # a padding row
  ]
  assert got["positions"].tolist() == [
    [0, 1, 2, 3, 4, 0, 1, 2],
    [0, 1, 2, 3, 0, 1, 2, 0],  # the tail counts from 0: the window holds no earlier token
    [0, 1, 2, 3, 4, 5, 6, 7],
    [0, 1, 0, 0, 0, 0, 0, 0],
    [0] * 8,
  ]
  # a segment starts exactly where an input is a document's BOS (or the window starts)
  starts = (got["positions"] == 0) & (got["segment_ids"] > 0)
  bos = got["inputs"] == 1
  assert (bos <= starts).all() and (starts[:, 1:] == bos[:, 1:]).all()
  for name in DOCUMENT_FIELDS:
    assert got[name].dtype == np.int32 and got[name].shape == (5, 8)


def test_rows_without_the_flag_are_unchanged(tmp_path):
  w = hand_made(tmp_path, [5, 7, 3, 9, 2], seq_len=8, pack=True)
  plain, masked = w.rows(np.array([3, 1]), 3, PAD), w.rows(np.array([3, 1]), 3, PAD, True)
  assert sorted(plain) == ["inputs", "loss_mask", "targets"]
  assert sorted(masked) == sorted([*plain, *DOCUMENT_FIELDS])
  for k, v in plain.items():
    assert v.dtype == masked[k].dtype and np.array_equal(v, masked[k])


def test_unpacked_windows_hold_one_segment(tmp_path):
  w = hand_made(tmp_path, [5, 7, 3, 9, 2], seq_len=8, pack=False)
  got = w.rows(np.arange(len(w)), len(w), PAD, document_mask=True)
  real = [min(n, 8) for n in (5, 7, 3, 9, 2)]  # input tokens per document's one window
  for row, n in enumerate(real):
    assert got["segment_ids"][row].tolist() == [1] * n + [0] * (8 - n)
    assert got["positions"][row].tolist() == [*range(n), *[0] * (8 - n)]


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_prepared_documents_are_segments(tmp_path, kind):
  """Through ``prepare``: every text document and every conversation starts a segment
  (the document offsets written at prepare time, which hold for a chat template that writes
  no BOS as well)."""
  docs = ["ab", "cdefg", "h", "ijklmnopq"]
  if kind == "chat":
    docs = [[{"role": "user", "content": d}, {"role": "assistant", "content": d}] for d in docs]
  path = tmp_path / "c.jsonl"
  lines = [json.dumps({"messages": d} if kind == "chat" else {"text": d}) for d in docs]
  path.write_text("\n".join(lines) + "\n")
  fmt = "chat" if kind == "chat" else "jsonl"
  ds = load_dataset(DataConfig(path=str(path), format=fmt, pack=True, eval_fraction=0.0), 8)
  got = ds.train.rows(np.arange(len(ds.train)), len(ds.train), PAD, document_mask=True)
  seg, pos, bos = got["segment_ids"], got["positions"], got["inputs"] == ByteTokenizer().BOS
  real = seg > 0
  assert bos[real].sum() == len(docs) and (pos[bos & real] == 0).all()
  for row in range(len(seg)):  # a segment starts where a position restarts, and only there
    r = real[row]
    assert r[: r.sum()].all()  # padding only at the end
    np.testing.assert_array_equal(seg[row][r], np.cumsum(pos[row][r] == 0))
    np.testing.assert_array_equal(np.diff(pos[row][r])[pos[row][r][1:] != 0], 1)


# --- the models: a packed window equals its documents run alone ----------------------------

# Two packed rows: three whole documents; a document's tail, a whole one, then padding.
DOCS = [[5, 7, 4], [6, 6]]


def packed_batch():
  """``{"inputs", "targets", "loss_mask", "segment_ids", "positions"}`` ``[2, S]`` of
  ``DOCS``' lengths, random tokens, and per row the (start, length) of each document."""
  tokens = np.array(jax.random.randint(jax.random.key(3), (2, S + 1), 2, VOCAB))
  seg, pos = np.zeros((2, S), np.int32), np.zeros((2, S), np.int32)
  spans = []
  for row, lengths in enumerate(DOCS):
    at, row_spans = 0, []
    for d, n in enumerate(lengths):
      seg[row, at : at + n], pos[row, at : at + n] = d + 1, np.arange(n)
      row_spans.append((at, n))
      at += n
    tokens[row, at:] = PAD
    spans.append(row_spans)
  mask = (seg > 0).astype(np.int32)
  batch = {
    "inputs": tokens[:, :-1],
    "targets": tokens[:, 1:],
    "loss_mask": mask,
    "segment_ids": seg,
    "positions": pos,
  }
  return {k: jnp.asarray(v) for k, v in batch.items()}, spans


BATCH, SPANS = packed_batch()
SHAPE = dict(vocab_size=VOCAB, max_seq_len=S, d_model=32, n_layers=2, n_heads=4)
TERMS = 4 * 32  # the longest sum in the models: the MLP's down projection (4 × d_model)
CONFIGS = {
  "gpt": lambda **kw: models.GPTConfig(**SHAPE, tie_embeddings=False, **kw),
  "llama": lambda **kw: models.LlamaConfig(
    **SHAPE, n_kv_heads=2, intermediate_size=48, qk_norm=True, **kw
  ),
}


@jax.jit
def token_nll(logits, targets):
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)


@functools.cache
def built(cfg):
  """``models.build(cfg, 0)`` with the ``apply_fn`` jitted (one compile per shape), shared by
  the tests of the same model (none changes its params)."""
  apply_fn, params = models.build(cfg, 0)
  return jax.jit(apply_fn, static_argnames="train"), params


def documents_alone():
  """Every document of ``BATCH`` as its own row, from position 0, padded after its end:
  ``(inputs, targets, weights)`` ``[documents, S]`` with weight 1 on the document's own
  tokens. Attention is causal, so a document's outputs do not depend on the padding after
  it: one call runs every document alone (and compiles once)."""
  inputs, targets, weights = [], [], []
  for row, row_spans in enumerate(SPANS):
    for at, n in row_spans:
      pad = (0, S - n)
      inputs.append(np.pad(np.asarray(BATCH["inputs"][row, at : at + n]), pad))
      targets.append(np.pad(np.asarray(BATCH["targets"][row, at : at + n]), pad))
      weights.append(np.pad(np.ones(n, np.float32), pad))
  return jnp.asarray(np.stack(inputs)), jnp.asarray(np.stack(targets)), jnp.asarray(weights)


def packed_and_alone(apply_fn, params):
  """Per-token NLL of the packed batch with document masking, and of each document run
  alone (its own sequence, positions from 0), laid out like the packed one."""
  packed = token_nll(apply_fn(params, BATCH["inputs"], **document_fields(BATCH)), BATCH["targets"])
  inputs, targets, _ = documents_alone()
  each = np.asarray(token_nll(apply_fn(params, inputs), targets))
  alone, d = np.zeros(packed.shape, np.float32), 0
  for row, row_spans in enumerate(SPANS):
    for at, n in row_spans:
      alone[row, at : at + n], d = each[d, :n], d + 1
  return np.asarray(packed), alone


@pytest.mark.parametrize(
  "family,attention",
  [
    pytest.param("gpt", "blocked", marks=pytest.mark.slow),  # the segment kernel's own test
    ("gpt", "xla"),  # is fast; these compile the whole model
    pytest.param("llama", "blocked", marks=pytest.mark.slow),
    ("llama", "xla"),
  ],
)
def test_packed_losses_equal_each_document_alone(family, attention):
  apply_fn, params = built(CONFIGS[family](attention=attention))
  packed, alone = packed_and_alone(apply_fn, params)
  real = np.asarray(BATCH["loss_mask"]) > 0
  assert_close(packed[real], alone[real], terms=TERMS)
  # and without the mask they differ: the later documents would see the earlier ones
  plain = np.asarray(token_nll(apply_fn(params, BATCH["inputs"]), BATCH["targets"]))
  assert_far(plain[real], alone[real], terms=TERMS)


def packed_grads(cfg):
  """∇ Σ NLL over the packed documents, and Σ over the documents of ∇ Σ NLL alone."""
  apply_fn, params = built(cfg)
  weights = BATCH["loss_mask"].astype(jnp.float32)

  def packed_loss(p):
    logits = apply_fn(p, BATCH["inputs"], **document_fields(BATCH))
    return jnp.sum(token_nll(logits, BATCH["targets"]) * weights)

  inputs, targets, alone_weights = documents_alone()

  def alone_loss(p):  # Σ over the documents, each run alone
    return jnp.sum(token_nll(apply_fn(p, inputs), targets) * alone_weights)

  total = jax.jit(jax.grad(alone_loss))(params)
  return jax.jit(jax.grad(packed_loss))(params), total


@pytest.mark.parametrize(
  "family,changes",
  [
    ("gpt", {}),
    pytest.param("gpt", dict(scan_layers=True, remat="block"), marks=pytest.mark.slow),
    pytest.param("llama", {}, marks=pytest.mark.slow),
    pytest.param("llama", dict(scan_layers=True, remat="dots"), marks=pytest.mark.slow),
  ],
)
def test_blocked_kernel_gradients_equal_the_sum_over_documents(family, changes):
  packed, alone = packed_grads(CONFIGS[family](attention="blocked", **changes))
  assert_close(packed, alone, terms=TERMS)
  assert_far(jax.tree.map(lambda g: 2 * g, packed), alone, terms=TERMS)  # a doubled count


@pytest.mark.slow
def test_xla_gradients_equal_the_sum_over_documents():
  packed, alone = packed_grads(CONFIGS["gpt"](attention="xla"))
  assert_close(packed, alone, terms=TERMS)


@pytest.mark.parametrize("attention", ["blocked", "xla"])
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_a_window_of_one_document_equals_no_masking(family, attention):
  apply_fn, params = built(CONFIGS[family](attention=attention))
  inputs = BATCH["inputs"]
  positions = jnp.tile(jnp.arange(S), (2, 1))
  one = {"segment_ids": jnp.ones_like(inputs), "positions": positions}
  plain = apply_fn(params, inputs)
  assert_close(apply_fn(params, inputs, **one), plain, terms=TERMS)
  # the margin: a window cut into two documents at its middle is far outside the tolerance
  two = {"segment_ids": 1 + (positions >= S // 2), "positions": positions % (S // 2)}
  assert_far(apply_fn(params, inputs, **two), plain, terms=TERMS)


def test_positions_restart_the_position_embeddings():
  """The GPT's learned position embeddings read ``positions``: the first token of the
  second document gets the logits of a lone run only with its position restarted at 0
  (the segment mask alone leaves it at its window offset). The Llama's RoPE needs no such
  test: its scores depend on position differences only, which are the same either way."""
  apply_fn, params = built(CONFIGS["gpt"](attention="blocked"))
  at, inputs = SPANS[0][1][0], BATCH["inputs"][:1]
  alone = apply_fn(params, inputs[:, at : at + 1])[0, 0]
  both = apply_fn(params, inputs, **{k: v[:1] for k, v in document_fields(BATCH).items()})
  assert_close(both[0, at], alone, terms=TERMS)
  segments_only = apply_fn(params, inputs, segment_ids=BATCH["segment_ids"][:1])
  assert_far(segments_only[0, at], alone, terms=TERMS)


def test_fields_of_another_shape_are_a_batch_error():
  apply_fn, params = models.build(CONFIGS["gpt"](attention="blocked"), 0)
  with pytest.raises(BatchError, match=r"segment_ids has shape \(2, 15\), the inputs \(2, 16\)"):
    apply_fn(params, BATCH["inputs"], segment_ids=BATCH["segment_ids"][:, 1:])


def test_the_loss_passes_the_fields_only_when_the_batch_has_them():
  seen = []

  def apply_fn(params, inputs, *, rng=None, train=False, **fields):
    seen.append(sorted(fields))
    return jax.nn.one_hot(inputs, VOCAB)

  loss_fn = next_token_loss(apply_fn)
  plain = {k: BATCH[k] for k in ("inputs", "targets", "loss_mask")}
  loss_fn(None, plain, None)
  loss_fn(None, BATCH, None)
  assert seen == [[], sorted(DOCUMENT_FIELDS)]
  assert document_fields(plain) == {}


def test_the_packed_loss_is_the_sum_of_the_documents_losses():
  apply_fn, params = built(CONFIGS["gpt"](attention="blocked"))
  packed, _ = next_token_loss(apply_fn)(params, BATCH, None)
  _, alone = packed_and_alone(apply_fn, params)
  per_token = alone * np.asarray(BATCH["loss_mask"])
  assert_close(packed, per_token.sum(), terms=TERMS * per_token.size)
  assert_far(packed, per_token.sum() / per_token.size, terms=TERMS * per_token.size)  # a mean


def test_the_segment_kernel_masks_inside_its_blocks():
  """The blocked kernel with segment ids against plain masked softmax attention, forward
  and backward, over enough tokens (160) for several query blocks."""
  b, s, h, dh = 2, 160, 2, 8
  q, k, v = jax.random.normal(jax.random.key(0), (3, b, s, h, dh))
  seg = jnp.asarray(np.repeat([[1, 2, 3, 4, 0], [1, 1, 2, 2, 2]], 32, axis=1), jnp.int32)

  def reference(q, k, v):
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(dh)
    causal = jnp.tril(jnp.ones((s, s), bool))
    visible = causal & (seg[:, :, None] == seg[:, None, :])
    p = jax.nn.softmax(jnp.where(visible[:, None], scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)

  def total(fn):
    return lambda q, k, v: jnp.sum(fn(q, k, v) * jnp.cos(jnp.arange(dh)))

  kernel = lambda q, k, v: cpu_kernels.segment_causal_attention(q, k, v, seg)  # noqa: E731
  expected = jax.jit(reference)(q, k, v)
  assert_close(jax.jit(kernel)(q, k, v), expected, terms=s)  # a softmax over keys
  got = jax.jit(jax.grad(total(kernel), argnums=(0, 1, 2)))(q, k, v)
  want = jax.jit(jax.grad(total(reference), argnums=(0, 1, 2)))(q, k, v)
  assert_close(got, want, terms=s)
  # the margin: the kernel without the segments (attention across documents) is far off
  across = jax.jit(cpu_kernels.causal_attention)(q, k, v)
  assert_far(across, expected, terms=s)


# --- cuDNN ------------------------------------------------------------------------------


def test_cudnn_falls_back_to_xla_for_segments_with_one_log_line(monkeypatch, caplog):
  monkeypatch.setattr(backends, "platform", lambda: "gpu")
  monkeypatch.setattr(backends, "_logged", set())
  calls = []
  original = jax.nn.dot_product_attention

  def recording(*args, implementation=None, **kw):
    calls.append((implementation, kw.get("mask") is not None))
    return original(*args, implementation="xla", **kw)

  monkeypatch.setattr(jax.nn, "dot_product_attention", recording)
  q, k, v = jax.random.normal(jax.random.key(0), (3, 2, S, 4, 8), jnp.bfloat16)
  seg = BATCH["segment_ids"]
  with caplog.at_level(logging.WARNING, logger="jaxstep"):
    for choice in ("cudnn", "auto", "cudnn"):
      out = backends.causal_attention(q, k, v, choice, segment_ids=seg)
  assert calls == [("xla", True)] * 3
  lines = [r.getMessage() for r in caplog.records]
  assert len(lines) == 1 and "xla" in lines[0] and "segment" in lines[0], lines
  want = original(q, k, v, mask=(seg[:, :, None] == seg[:, None, :])[:, None], is_causal=True)
  np.testing.assert_array_equal(out, want)
  # without segment ids cuDNN is still the kernel
  calls.clear()
  backends.causal_attention(q, k, v, "cudnn")
  assert calls == [("cudnn", False)]


@pytest.mark.parametrize(
  "path, setting, pack, expected",
  [
    ("bundled:chat", "auto", True, True),  # packed chat: each conversation on its own
    ("bundled:text", "auto", True, False),  # pre-training text packs across documents
    ("bundled:text", True, True, True),
    ("bundled:chat", True, False, False),  # unpacked windows hold one document already
    ("bundled:chat", False, True, False),
  ],
)
def test_the_config_switch_reaches_every_window_of_the_run(path, setting, pack, expected):
  from jaxstep.data import DataConfig, load_dataset

  ds = load_dataset(DataConfig(path=path, document_mask=setting, pack=pack), 64)
  for split in (ds.train, ds.eval):
    assert split.document_mask is expected
    rows = split.rows(np.arange(2), 3, ds.pad_id)
    assert ("segment_ids" in rows) is expected and ("positions" in rows) is expected
