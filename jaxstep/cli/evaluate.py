"""``jaxstep evaluate PATH --data DATA``: a trained run's (or a Hugging Face model
folder's) loss, perplexity and bits per byte on any data — text, JSONL or chat files, a
directory, a glob, ``bundled:…`` or a prepared folder — with the run's tokenizer, window
length, packing and loss masks, and raw input read in the run's data format unless
``--format`` says otherwise.

``PATH`` is a run directory (``--step N`` picks a checkpoint) or a model folder
(``config.json`` and no ``config.yaml``): its weights and tokenizer, with the defaults a run
started from it would have: windows of ``train.seq_len`` 128 tokens (fewer when the model
takes fewer positions), ``train.global_batch_size`` 32 windows a batch (``--batch-size``),
never more than the windows there are.

Bits per byte = the nats of all targets ÷ (ln 2 × the UTF-8 bytes they stand for); it does
not depend on the tokenizer, so runs with different vocabularies compare on one text.
"""

from __future__ import annotations

import argparse
import pathlib

from jaxstep.cli._common import run_dir_command, run_dir_parser


def _count(text: str) -> int:
  """A whole number ≥ 0 (argparse names the option when it is not)."""
  try:
    value = int(text)
  except ValueError:
    value = -1
  if value < 0:
    raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {text!r}")
  return value


def parser() -> argparse.ArgumentParser:
  from jaxstep.data.readers import FORMATS
  from jaxstep.trainer.saved_run.evaluate import SPLITS

  p = run_dir_parser("jaxstep evaluate", __doc__)
  p.add_argument("--data", required=True, help="files, a directory, a glob, or a prepared folder")
  p.add_argument(
    "--format",
    default=None,
    choices=FORMATS,
    help="how raw input becomes documents (default: the format the run's data was read in)",
  )
  p.add_argument("--split", default="all", choices=SPLITS, help="a prepared folder's split")
  p.add_argument(
    "--batch-size", type=_count, default=0, help="windows per batch (0: train.global_batch_size)"
  )
  p.add_argument("--json", action="store_true", help="print one JSON object")
  return p


def main(argv=None) -> int:
  return run_dir_command(evaluate, parser().parse_args(argv))


def evaluate(args) -> int:
  from jaxstep.trainer.saved_run import evaluate as evaluation
  from jaxstep.trainer.saved_run.load import load_run
  from jaxstep.trainer.store import records

  saved = load_run(args.run_dir, args.step)
  evaluation.refuse_batch_that_cannot_fit(saved, args.batch_size, option="--batch-size")
  fmt = args.format or evaluation.run_data_format(saved.cfg)
  dataset = evaluation.load_data(saved, pathlib.Path(args.run_dir), args.data, fmt)
  prepared = (pathlib.Path(args.data) / "manifest.json").is_file()
  fmt = dataset.manifest["settings"]["format"] if prepared else fmt
  result = {
    "step": saved.step,
    "data": args.data,
    "format": fmt,
    **evaluation.evaluate(saved, dataset, split=args.split, batch_size=args.batch_size),
  }
  if args.json:
    print(records.dumps(result))
  else:
    source = "model folder" if saved.model_folder else f"update step {result['step']}"
    print(
      f"{source} on {args.data} (format {fmt}): loss {result['loss']:.4f}  ppl "
      f"{result['ppl']:.3f}  bits/byte {result['bpb']:.4f}  ({result['tokens']} tokens, "
      f"{result['bytes']} bytes, {result['windows']} windows)"
    )
  return 0
