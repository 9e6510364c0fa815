"""Text generation: prompts in, continuations out, one jitted prefill + decode loop.

A batch of prompts of different lengths runs together, right-padded: row ``b``'s prompt
fills positions ``0 … len_b − 1`` and its continuation is written from ``len_b`` on, so
every token keeps the position it would have alone and rows never see each other's
padding (a query attends only up to its own position). With the bundled GPT's key/value
cache (``models.decoder``) the prompt is one forward pass (prefill) and each new token one
pass over a single position; any other model is run the reference way, the whole buffer
again for every token (``use_cache=False`` forces that for the GPT too).

A row stops at a stop id (EOS, and a pretrained model folder's other ``stop_ids``), after
``max_new_tokens``, or when prompt + continuation fill the model's ``max_seq_len``;
``Sample.stop_reason`` says which ("eos" for any stop id). Prompts are text (encoded by
``encode_prompt``) or, with ``encoded=``, ids already made (a chat template rendered and
tokenized with ``encode_rendered``: it writes its own start token). Row ``b``'s draw at step ``i``
uses ``fold_in(fold_in(PRNGKey(seed), b), i)``, so output is a pure function of the seed,
the row and the settings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxstep import models
from jaxstep.core import device_memory
from jaxstep.core.layout import rows_here
from jaxstep.core.precision import cast_floating
from jaxstep.core.sampling import draw
from jaxstep.errors import ConfigError, PromptError
from jaxstep.generation.sampling import allowed_ids, stop_ids
from jaxstep.models.rope import LongRope

STOP_REASONS = ("eos", "max_new_tokens", "max_seq_len")  # codes 1, 2, 3; 0 = still going


@dataclasses.dataclass(frozen=True)
class Sample:
  prompt: str
  text: str  # the continuation only, decoded (the stop id not included)
  tokens: list[int]  # the continuation's ids (the stop id included when it stopped there)
  stop_reason: str  # eos | max_new_tokens | max_seq_len


class Generator:
  """Generates continuations of text prompts from a model's params and its tokenizer.

  Args:
    model: a ``GPTConfig`` or ``LlamaConfig`` (decoded over a key/value cache) or any
      ``apply_fn(params, tokens [B, S]) -> logits [B, S, V]`` (full recompute per token;
      then ``max_seq_len`` is required).
    params: the model's params (e.g. ``state.params``).
    tokenizer: a ``jaxstep.data`` tokenizer (``encode``/``decode``, PAD/BOS/EOS ids); a
      model folder's also has ``stop_ids`` (each ends a row) and ``has_bos`` (whether a
      prompt starts with BOS).
    dtype: compute dtype (params and cache are cast to it); fp32 by default.
    use_cache: False runs the GPT the reference way (the whole buffer per token).
    ban_specials: False lets every id of the model's vocabulary be drawn, PAD and BOS
      included, as transformers' ``generate`` does (its results are then compared token
      for token); by default a continuation never holds PAD or BOS.

  Example:
    >>> gen = Generator(cfg.model, state.params, data.ByteTokenizer())
    >>> gen.generate(["the "], max_new_tokens=40, temperature=0)[0].text
  """

  def __init__(
    self,
    model,
    params,
    tokenizer,
    *,
    max_seq_len: int | None = None,
    dtype=jnp.float32,
    use_cache: bool = True,
    ban_specials: bool = True,
  ):
    if isinstance(model, models.GPTConfig | models.LlamaConfig):
      dec = models.decoder(model)
      self._apply, self._decode = dec.apply_fn, (dec if use_cache else None)
      self.max_seq_len, vocab = model.max_seq_len, model.vocab_size
    elif callable(model):
      if not max_seq_len:
        raise ConfigError("Generator(apply_fn, …) needs max_seq_len= (the longest input)")
      self._apply, self._decode = model, None
      self.max_seq_len, vocab = max_seq_len, None
    else:
      raise ConfigError(
        f"model must be a GPTConfig, a LlamaConfig or an apply_fn, got {type(model).__name__}"
      )
    self.params, self.tokenizer, self.dtype = params, tokenizer, dtype
    self._vocab, self._ban_specials = vocab, ban_specials
    self._cache_model = model if self._decode is not None else None
    self._model_cfg = model if isinstance(model, models.LlamaConfig) else None
    self._compiled = jax.jit(self._loop, static_argnames=("max_new", "prefill", "stops"))

  def encode_prompt(self, prompt: str, index: int = 0) -> np.ndarray:
    """``[BOS] + encode(prompt)``, as a training document starts (see ``_start``);
    ``PromptError`` for an empty prompt, one the tokenizer cannot encode, or one with no
    room left to generate."""
    if not prompt:
      raise PromptError(f"prompt {index + 1} is empty; give some text to continue")
    try:
      ids = self.tokenizer.encode(prompt)
    except UnicodeEncodeError as e:
      raise PromptError(f"prompt {index + 1} is not valid text ({e.reason})") from None
    unknown = getattr(self.tokenizer, "unknown_id", None)
    if unknown is not None and np.any(ids == unknown):
      raise PromptError(
        f"prompt {index + 1} has characters the tokenizer cannot encode (they become its "
        f"unknown token); remove them"
      )
    start = self._start(ids)
    ids = np.concatenate([start, ids]).astype(np.int32)
    if not len(ids):
      raise PromptError(f"prompt {index + 1} encodes to no tokens; give some text to continue")
    if len(ids) >= self.max_seq_len:
      raise PromptError(
        f"prompt {index + 1} is {len(ids)} tokens{' with BOS' if start else ''}; the model's "
        f"max_seq_len is {self.max_seq_len}: shorten it to at most "
        f"{self.max_seq_len - 1 - len(start)} tokens"
      )
    return ids

  def _start(self, ids) -> list[int]:
    """What goes before a prompt's ids: ``[BOS]``, or nothing when the tokenizer says its
    model's texts start with no BOS (``has_bos`` False: Qwen) or, for a tokenizer that
    declares ``has_bos``, when the prompt already starts with it (a rendered Llama 3 chat
    begins with ``<|begin_of_text|>``), so that it is never doubled."""
    if not getattr(self.tokenizer, "has_bos", True):
      return []
    if hasattr(self.tokenizer, "has_bos") and len(ids) and ids[0] == self.tokenizer.BOS:
      return []
    return [self.tokenizer.BOS]

  def generate(
    self,
    prompts: Sequence[str],
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.8,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    num_samples: int = 1,
    encoded: Sequence[Sequence[int]] | None = None,
  ) -> list[Sample]:
    """``num_samples`` continuations of each prompt (prompt-major order), in one batch.
    ``encoded``: each prompt's ids, used as they are (no BOS added; ``check_prompt_ids``),
    the prompts then only naming the samples (e.g. a chat's user message)."""
    check_settings(max_new_tokens, temperature, top_k, top_p, num_samples)
    encoded = self._encode_all(prompts, encoded)
    self._refuse_unfit(encoded, max_new_tokens, num_samples, "num_samples")
    rows = [ids for ids in encoded for _ in range(num_samples)]
    ids, reasons = self.generate_ids(
      rows, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
      seed=seed,
    )  # fmt: skip
    out = []
    for row, (cont, reason) in enumerate(zip(ids, reasons, strict=True)):
      text = self.tokenizer.decode(cont[:-1] if reason == "eos" else cont)  # no stop id
      out.append(Sample(prompts[row // num_samples], text, cont, reason))
    return out

  def check_fits(
    self,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    num_samples: int = 1,
    option: str = "num_samples",
    encoded: Sequence[Sequence[int]] | None = None,
  ) -> None:
    """``ConfigError`` naming ``option`` when ``num_samples`` continuations of each prompt
    would not fit one device (``generation_bytes`` beside the params), so that a command can
    refuse its own option's value before anything is allocated. ``encoded``: as for
    ``generate``."""
    self._refuse_unfit(self._encode_all(prompts, encoded), max_new_tokens, num_samples, option)

  def check_prompt_ids(self, ids: Sequence[int], index: int = 0) -> np.ndarray:
    """``ids`` (a prompt encoded elsewhere) as int32, used as they are; ``PromptError`` for
    no ids, an id outside the model's vocabulary, or no room left to generate."""
    ids = np.asarray(ids, np.int32).reshape(-1)
    if not len(ids):
      raise PromptError(f"prompt {index + 1} encodes to no tokens; give some text to continue")
    if self._vocab is not None and not np.all((ids >= 0) & (ids < self._vocab)):
      raise PromptError(f"prompt {index + 1} has ids outside the model's {self._vocab} ids")
    if len(ids) >= self.max_seq_len:
      raise PromptError(
        f"prompt {index + 1} is {len(ids)} tokens; the model's max_seq_len is "
        f"{self.max_seq_len}: shorten it to at most {self.max_seq_len - 1} tokens"
      )
    return ids

  def _encode_all(self, prompts: Sequence[str], encoded=None) -> list[np.ndarray]:
    if isinstance(prompts, str) or not prompts:
      raise PromptError("give a list of one or more prompts")
    if encoded is None:
      return [self.encode_prompt(p, i) for i, p in enumerate(prompts)]
    if len(encoded) != len(prompts):
      raise PromptError(f"{len(encoded)} encoded prompts for {len(prompts)} prompts: give one each")
    return [self.check_prompt_ids(ids, i) for i, ids in enumerate(encoded)]

  def _refuse_unfit(self, encoded, max_new_tokens: int, num_samples: int, option: str) -> None:
    """The memory check of ``check_fits`` on prompts already encoded."""
    prefill = max(len(p) for p in encoded)
    width = min(self.max_seq_len, prefill + max_new_tokens)
    itemsize = jnp.dtype(self.dtype).itemsize
    per_sample = generation_bytes(
      len(encoded), prefill, width, self._vocab or 0, itemsize, self._cache_model
    )
    params = device_memory.bytes_per_device(self.params)
    what = f"{len(encoded) * num_samples:,} rows of up to {width} tokens, and the params"
    memory = device_memory.device_memory_bytes()
    device_memory.refuse_count_over_memory(option, num_samples, per_sample, params, memory, what)

  def generate_ids(
    self,
    prompts: Sequence[np.ndarray],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
  ) -> tuple[list[list[int]], list[str]]:
    """Continuations of already-encoded prompts (each ``1 ≤ len < max_seq_len``): the new
    ids per row and each row's stop reason."""
    ids, reasons, _ = self.sample_ids(
      prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
      top_p=top_p, seed=seed,
    )  # fmt: skip
    return ids, reasons

  def sample_ids(
    self,
    prompts: Sequence[np.ndarray],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    prefill_to: int = 0,
    sharding=None,
    global_rows: int | None = None,
  ) -> tuple[list[list[int]], list[str], list[np.ndarray]]:
    """``generate_ids`` with each new token's log-prob under the distribution it was drawn
    from (``jaxstep.core.sampling``: the allowed ids, the temperature, top-k and top-p;
    at temperature 0 the argmax's log-prob at temperature 1), float32 per row.
    ``prefill_to``: prefill at least this many positions, so that batches of prompts of
    other lengths reuse one compiled loop (a row never sees the positions past its prompt).
    ``sharding``: where the rows go (e.g. a train step's batch sharding: each device decodes
    its own rows); None: the default device. A sharding over several processes takes only
    this process's rows as ``prompts`` (``parallel.local_rows`` of ``global_rows``) and
    returns theirs: every process decodes its own rows, in one program; each row keeps the
    draws of its global index, and ``prefill_to`` must cover every process's prompts."""
    lengths = np.array([len(p) for p in prompts], np.int32)
    split = sharding is not None and not sharding.is_fully_addressable
    if split and int(lengths.max()) > prefill_to:
      raise ConfigError(
        f"a prompt of {int(lengths.max())} tokens is longer than prefill_to={prefill_to}: "
        f"processes that decode their own rows need one buffer width"
      )
    longest = max(int(lengths.max()), min(prefill_to, self.max_seq_len - 1))
    width = min(self.max_seq_len, longest + max_new_tokens)  # the token buffer
    _check_longrope(self._model_cfg, lengths, width)
    buffer = np.full((len(prompts), width), self.tokenizer.PAD, np.int32)
    for row, p in enumerate(prompts):
      buffer[row, : len(p)] = p
    vocab = self._vocab or self._vocab_of(buffer)

    def place(rows):
      if not split:
        return rows if sharding is None else jax.device_put(rows, sharding)
      return jax.make_array_from_process_local_data(sharding, rows, (global_rows, *rows.shape[1:]))

    outputs = self._compiled(
      self.params,
      place(buffer),
      place(lengths),
      allowed_ids(vocab, self.tokenizer) if self._ban_specials else np.ones(vocab, bool),
      np.uint32(seed % 2**32),  # any Python int is a seed
      np.float32(temperature),
      np.int32(min(top_k, vocab)),  # top_k >= vocab keeps every id, as vocab does
      np.float32(top_p),
      max_new=min(max_new_tokens, self.max_seq_len),  # the same stops; no int32 overflow
      prefill=longest,
      stops=stop_ids(self.tokenizer),
    )
    if split:
      here = rows_here(sharding, global_rows)
      tokens, ends, reasons, logps = (_host_rows(x, here) for x in outputs)
    else:
      tokens, ends, reasons, logps = jax.device_get(outputs)
    ids = [tokens[r, lengths[r] : ends[r]].tolist() for r in range(len(prompts))]
    logps = [logps[r, lengths[r] : ends[r]] for r in range(len(prompts))]
    return ids, [STOP_REASONS[c - 1] for c in reasons], logps

  def _vocab_of(self, buffer) -> int:
    """An apply_fn's vocabulary, from the shape of its output."""
    self._vocab = jax.eval_shape(self._apply, self.params, buffer).shape[-1]
    return self._vocab

  def _loop(self, params, tokens, lengths, allowed, seed, temperature, top_k, top_p, *,
            max_new: int, prefill: int, stops: tuple[int, ...]):  # fmt: skip
    """The jitted prefill + decode loop: the filled buffer, each row's end, its stop code,
    and each new token's log-prob (at its position in the buffer)."""
    params = cast_floating(params, self.dtype)
    rows, width = jnp.arange(tokens.shape[0]), tokens.shape[1]
    logits_at = _logits_at(self._apply, self._decode, params, tokens, prefill, self.dtype)
    last, cache = logits_at.prefill(lengths)
    base = jax.random.PRNGKey(seed)
    row_keys = jax.vmap(lambda r: jax.random.fold_in(base, r))(rows)

    def body(carry):
      i, tokens, logps, pos, last, cache, reason = carry
      keys = jax.vmap(lambda k: jax.random.fold_in(k, i))(row_keys)
      nxt, logp = draw(last, keys, allowed, temperature, top_k, top_p)
      active = reason == 0
      at = jnp.minimum(pos, width - 1)
      tokens = tokens.at[rows, at].set(jnp.where(active, nxt, tokens[rows, at]))
      logps = logps.at[rows, at].set(jnp.where(active, logp, logps[rows, at]))
      pos = pos + active
      reason = jnp.select(
        [
          ~active,
          jnp.isin(nxt, jnp.array(stops)),
          pos - lengths >= max_new,
          pos >= self.max_seq_len,
        ],
        [reason, 1, 2, 3],
        0,
      )
      last, cache = jax.lax.cond(
        jnp.any(reason == 0),
        lambda: logits_at.step(tokens, nxt, at, cache),
        lambda: (last, cache),
      )
      return i + 1, tokens, logps, pos, last, cache, reason

    logps = jnp.zeros(tokens.shape, jnp.float32)
    init = (jnp.int32(0), tokens, logps, lengths, last, cache, jnp.zeros_like(lengths))
    _, tokens, logps, pos, _, _, reason = jax.lax.while_loop(
      lambda c: jnp.any(c[-1] == 0), body, init
    )
    return tokens, pos, reason, logps


def _host_rows(array, rows: np.ndarray) -> np.ndarray:
  """``rows`` (sorted global indices) of a global ``array``, from this process's shards."""
  out = np.empty((len(rows), *array.shape[1:]), array.dtype)
  for shard in array.addressable_shards:
    held = np.arange(array.shape[0])[shard.index[0]]
    at = np.searchsorted(rows, held)
    ok = (at < len(rows)) & (rows[np.minimum(at, len(rows) - 1)] == held)
    out[at[ok]] = np.asarray(shard.data)[ok]
  return out


def _logits_at(apply_fn, decoder, params, tokens, prefill: int, dtype):
  """How the loop gets next-token logits: through the cache, or the whole buffer again."""
  rows, (batch, width) = jnp.arange(tokens.shape[0]), tokens.shape
  if decoder is None:

    def full(tokens, at):
      return apply_fn(params, tokens)[rows, at].astype(jnp.float32)

    return _Steps(
      lambda lengths: (full(tokens, lengths - 1), ()), lambda t, n, at, c: (full(t, at), c)
    )

  def prefill_fn(lengths):
    positions = jnp.broadcast_to(jnp.arange(prefill), (batch, prefill))
    cache = decoder.init_cache(batch, width, dtype)
    logits, cache = decoder.decode_fn(params, tokens[:, :prefill], positions, cache)
    return logits[rows, lengths - 1].astype(jnp.float32), cache

  def step_fn(tokens, nxt, at, cache):
    logits, cache = decoder.decode_fn(params, nxt[:, None], at[:, None], cache)
    return logits[:, 0].astype(jnp.float32), cache

  return _Steps(prefill_fn, step_fn)


@dataclasses.dataclass(frozen=True)
class _Steps:
  prefill: Callable
  step: Callable


def generation_bytes(rows, prefill, width, vocab, itemsize=4, cache_model=None) -> int:
  """Bytes ``rows`` continuations hold at once beside the params, a floor (every term is an
  array the loop materialises; the blocks' activations come on top), so what fits is never
  refused. With W the token buffer's width (longest prompt + new tokens, at most
  ``max_seq_len``), P the longest prompt, V the vocabulary, b the compute dtype's bytes:

    rows × (4·W          the int32 token buffer
            + 4·V        the fp32 next-token logits
            + P·V·b      the prefill's logits (W·V·b: the whole buffer, without a cache)
            + 2·L·W·C·b) the key/value cache (L blocks, keys and values; C = cached heads ×
                         head_dim: ``kv_cache_width``)

  ``cache_model``: the model config whose cache the loop keeps (None: no cache)."""
  per_row = 4 * width + 4 * vocab
  if cache_model is None:
    return rows * (per_row + width * vocab * itemsize)
  cache = 2 * cache_model.n_layers * width * cache_model.kv_cache_width * itemsize
  return rows * (per_row + prefill * vocab * itemsize + cache)


def check_settings(max_new_tokens, temperature, top_k, top_p, num_samples) -> None:
  """``ConfigError`` for a sampling setting out of range."""
  problems = [
    (max_new_tokens < 1, f"max_new_tokens must be >= 1, got {max_new_tokens}"),
    (not temperature >= 0, f"temperature must be >= 0 (0 = greedy), got {temperature}"),
    (top_k < 0, f"top_k must be >= 0 (0 = off), got {top_k}"),
    (not 0 < top_p <= 1, f"top_p must be in (0, 1] (1 = off), got {top_p}"),
    (num_samples < 1, f"num_samples must be >= 1, got {num_samples}"),
  ]
  for bad, message in problems:
    if bad:
      raise ConfigError(message)


def _check_longrope(cfg, lengths: np.ndarray, width: int) -> None:
  """``ConfigError`` when a row's positions would cross LongRoPE's original length ``L``:
  transformers recomputes the whole sequence with the long factors once its input passes
  ``L``, where a cache holds keys rotated with the short ones. A buffer of ``width`` tokens
  feeds positions up to ``width − 2`` (the last token is not fed back), every row prefilled
  to the longest prompt: within ``L`` (``width ≤ L + 1``), or with every prompt past it, the
  rows decode as transformers does."""
  scaling = getattr(cfg, "rope_scaling", None)
  if not isinstance(scaling, LongRope) or width <= scaling.original_max_position_embeddings + 1:
    return
  original = scaling.original_max_position_embeddings
  if int(lengths.min()) <= original:
    raise ConfigError(
      f"the model's LongRoPE changes factors after {original} positions, and a batch with "
      f"prompts of {int(lengths.min())}-{int(lengths.max())} tokens decoding to {width - 1} "
      f"positions crosses it (the cache's keys keep the factors they were rotated with): "
      f"keep prompt + max_new_tokens <= {original + 1}, or every prompt longer than {original}"
    )
