"""A saved run's model (or a Hugging Face model folder's: ``saved_run.load_model_folder``)
scored on any data: token-weighted loss, perplexity, bits per byte.

The data is cut into windows exactly as training cuts them (the run's ``train.seq_len``
and ``data.pack``, the same loss masks: text targets every token but BOS, chat only the
assistant's); raw files are prepared with the run's own tokenizer first (cached like
training data; a model folder's: the folder's). Every window is scored once, in order,
``batch_size`` windows a batch (default ``train.global_batch_size``), never more than the
windows there are, so a short text does not pay for a batch of padding.

Bits per byte is tokenizer-independent: the nats of every masked target divided by
``ln 2 ×`` the UTF-8 bytes those targets stand for (EOS counts its nats and no bytes), so
runs with different vocabularies compare on the same text.
"""

from __future__ import annotations

import json
import logging
import pathlib

import jax

from jaxstep import data, models
from jaxstep.core import chunked_loss, device_memory
from jaxstep.data.readers import BUNDLED_PATHS, FORMATS
from jaxstep.data.strided import StridedWindows
from jaxstep.data.tokenizer import same_tokenizer
from jaxstep.errors import ConfigError, DataError
from jaxstep.trainer.evaluation.scoring import eval_record, summed
from jaxstep.trainer.plan.steps import make_eval_step
from jaxstep.trainer.saved_run.load import SavedRun, is_model_folder, saved_tokenizer_file

SPLITS = ("all", "train", "eval")
log = logging.getLogger("jaxstep")


def _tokenizer_spec(run_dir: pathlib.Path) -> str:
  """How ``prepare`` loads the run's tokenizer: a model folder itself, the run's saved
  file, else bytes."""
  if is_model_folder(run_dir):
    return str(run_dir)
  saved = saved_tokenizer_file(run_dir)
  return "byte" if saved is None else str(saved)


def run_data_format(cfg) -> str:
  """The format the run's own data was read in: what its prepared folder's manifest
  records (``jaxstep prepare --format``), else ``data.format``. Raw text read another way
  cuts other documents and windows, so it scores differently (a few % in bits per byte)."""
  folder = pathlib.Path(cfg.data.path)
  if cfg.data.path not in BUNDLED_PATHS and (folder / "manifest.json").is_file():
    try:
      fmt = json.loads((folder / "manifest.json").read_text())["settings"]["format"]
    except (OSError, ValueError, KeyError, TypeError):
      fmt = None
    if fmt in FORMATS:
      return fmt
    log.warning("%s records no data format; reading raw input as %s", folder, cfg.data.format)
  return cfg.data.format


def default_format(cfg, path: str) -> str:
  """How ``evaluate`` reads raw input given no ``--format``: one plain-text file is one text
  (``file``: its blank lines do not cut it into documents that each lose their context);
  anything else the way the run's data was read (``run_data_format``)."""
  fmt = run_data_format(cfg)
  single = pathlib.Path(path).is_file() and path not in BUNDLED_PATHS
  if single and fmt in ("auto", "txt") and pathlib.Path(path).suffix not in (".jsonl", ".json"):
    return "file"
  return fmt


def default_seq_len(saved: SavedRun) -> int:
  """The window ``evaluate`` scores in: a run's ``train.seq_len``; a model folder's whole
  context (``model.max_seq_len``), as long as one window fits one device beside the params
  (``eval_bytes``), else the longest that does."""
  cfg = saved.cfg
  if not saved.model_folder:
    return cfg.train.seq_len
  params = device_memory.bytes_per_device(saved.params)
  room = device_memory.device_memory_bytes() - params
  per_position = eval_bytes(cfg.model, 1, 1)
  return int(max(1, min(cfg.model.max_seq_len, room // max(per_position, 1))))


def load_data(
  saved: SavedRun,
  run_dir: pathlib.Path,
  path: str,
  fmt: str | None = None,
  seq_len: int | None = None,
) -> data.Dataset:
  """``path`` as windows of ``seq_len`` tokens (default the run's ``train.seq_len``): a
  prepared folder (its tokenizer must be the run's) or raw input prepared with the run's
  tokenizer and, unless ``fmt`` says otherwise, the run's data format; nothing held out."""
  cfg = saved.cfg
  seq_len = seq_len or cfg.train.seq_len
  if seq_len > cfg.model.max_seq_len:
    raise ConfigError(
      f"--seq-len {seq_len} is longer than the {cfg.model.max_seq_len} positions the model "
      f"takes; use at most {cfg.model.max_seq_len}"
    )
  prepared = (pathlib.Path(path) / "manifest.json").is_file()
  data_cfg = data.DataConfig(
    path=path,
    format=fmt or run_data_format(cfg),
    tokenizer="byte" if prepared else _tokenizer_spec(run_dir),
    pack=cfg.data.pack,
    eval_fraction=0.0,
  )
  dataset = data.load_dataset(data_cfg, seq_len)
  if not same_tokenizer(dataset.manifest["tokenizer"], saved.tokenizer.describe()):
    raise DataError(
      f"{path} was prepared with another tokenizer ({dataset.manifest['tokenizer']['kind']}, "
      f"{dataset.manifest['tokenizer']['vocab_size']} ids) than the run's "
      f"({saved.tokenizer.kind}, {saved.tokenizer.vocab_size} ids); pass the raw files, or "
      f"prepare them with --tokenizer {_tokenizer_spec(run_dir)}"
    )
  return dataset


def eval_bytes(model, rows: int, seq_len: int) -> int:
  """Bytes one eval batch of ``rows`` windows of ``seq_len`` holds at once beside the params,
  a floor, so what fits is never refused:

    rows × S × 4 × (3              its int32 inputs, targets and loss mask
                    + D            the fp32 residual stream
                    + max(V, r·D)) the fp32 logits, or a block's MLP hidden layer

  (V the vocabulary, D = ``d_model``, r·D the MLP's hidden width). A forward pass without a backward
  one frees each block's activations before the next and the last before the logits, so
  only the larger of the two counts, and the depth adds nothing."""
  widest = max(model.vocab_size, model.mlp_hidden)
  return rows * seq_len * 4 * (3 + model.d_model + widest)


def refuse_batch_that_cannot_fit(
  saved: SavedRun, batch_size: int = 0, option: str = "batch_size", seq_len: int = 0
) -> None:
  """``ConfigError`` naming ``option`` when a batch of ``batch_size`` windows (0: the run's
  ``train.global_batch_size``) of ``seq_len`` (0: ``train.seq_len``) would not fit one
  device beside the params (``eval_bytes``), before the data is read or anything of that
  size allocated."""
  cfg = saved.cfg
  rows = batch_size or cfg.train.global_batch_size
  seq_len = seq_len or cfg.train.seq_len
  params = device_memory.bytes_per_device(saved.params)
  device_memory.refuse_count_over_memory(
    option,
    rows,
    eval_bytes(cfg.model, 1, seq_len),
    params,
    device_memory.device_memory_bytes(),
    f"a batch of {rows:,} windows of {seq_len} tokens, and the params",
  )


def fitting_batch(saved: SavedRun, seq_len: int) -> int:
  """The most windows of ``seq_len`` one batch holds: ``train.global_batch_size``, or fewer
  when those would not fit one device beside the params (at least 1)."""
  params = device_memory.bytes_per_device(saved.params)
  room = device_memory.device_memory_bytes() - params
  fits = room // max(eval_bytes(saved.cfg.model, 1, seq_len), 1)
  return int(max(1, min(saved.cfg.train.global_batch_size, fits)))


def evaluate(
  saved: SavedRun,
  dataset: data.Dataset,
  *,
  split: str = "all",
  batch_size: int = 0,
  stride: int = 0,
) -> dict:
  """Sums over every window of ``split`` (``all``: train and eval) → loss, ppl, bpb; a
  ``batch_size`` that cannot fit one device is refused before anything is allocated.
  ``stride`` (0: none): windows that far apart, each token scored once with up to
  ``seq_len − stride`` tokens of context (``StridedWindows``)."""
  windows = [w for name, w in (("train", dataset.train), ("eval", dataset.eval))
             if w is not None and split in ("all", name)]  # fmt: skip
  if not windows:
    raise DataError(f"the data has no {split!r} split")
  seq_len = windows[0].seq_len
  if stride and not 1 <= stride <= seq_len:
    raise ConfigError(f"--stride {stride} must be between 1 and the window, {seq_len} tokens")
  if stride:
    windows = [
      StridedWindows(w.stream, seq_len, stride, w.starts is None, w.pad_id) for w in windows
    ]
  batch_size = batch_size or fitting_batch(saved, seq_len)
  refuse_batch_that_cannot_fit(saved, batch_size, seq_len=seq_len)
  decode_apply = models.decoder(saved.cfg.model).apply_fn

  def apply_fn(params, inputs, *, train=False, rng=None, **fields):
    return decode_apply(params, inputs, **fields)

  apply_fn = chunked_loss.like(apply_fn, decode_apply)
  m = saved.cfg.model
  step = jax.jit(
    make_eval_step(apply_fn, saved.tokenizer.token_bytes(), m.vocab_size, m.loss_chunk)
  )
  rows = min(batch_size or saved.cfg.train.global_batch_size, max(1, *map(len, windows)))
  batches = (batch for w in windows for batch in data.eval_batches(w, rows, dataset.pad_id))
  sums = summed(step(saved.params, batch) for batch in batches)
  sums = [0.0, 0.0, 0.0] if sums is None else [float(x) for x in sums]
  if sums[1] == 0:
    raise DataError("the data has no loss-masked target (chat data needs assistant turns)")
  record = {**eval_record(*sums, prefix=""), "windows": sum(len(w) for w in windows)}
  return {**record, "seq_len": seq_len, "stride": stride or seq_len}
