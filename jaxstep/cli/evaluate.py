"""``jaxstep evaluate PATH --data DATA``: a trained run's (or a Hugging Face model
folder's) loss, perplexity and bits per byte on any data — text, JSONL or chat files, a
directory, a glob, ``bundled:…`` or a prepared folder — with the run's tokenizer, window
length, packing and loss masks, and raw input read in the run's data format unless
``--format`` says otherwise.

``PATH`` is a run directory (``--step N`` picks a checkpoint) or a model folder
(``config.json`` and no ``config.yaml``): its weights and tokenizer, on one device or split
over ``--tensor N``. Windows are
``--seq-len`` tokens: by default a run's ``train.seq_len``, and a model folder's whole
context (as long as one window fits the device). ``--stride S`` scores sliding windows S
apart, each token once with up to ``seq_len − S`` tokens of context (the transformers
perplexity guide's method). One plain-text file is one text unless ``--format`` says
otherwise (other input is read in the run's data format). Batches hold
``train.global_batch_size`` windows, fewer when those would not fit (``--batch-size``).
The output states the format, the window, the stride and the tokens scored.

``--tasks hellaswag,arc_easy`` scores lm-evaluation-harness tasks instead (or as well): the
harness's results for the model ``jaxstep harness`` runs, offline (``--include-path`` a
folder of local task YAMLs), as ``harness/<task>/<metric>`` lines. Needs ``pip install
'jaxstep[eval]'``.

Bits per byte = the nats of all targets ÷ (ln 2 × the UTF-8 bytes they stand for); it does
not depend on the tokenizer, so runs with different vocabularies compare on one text.
"""

from __future__ import annotations

import argparse
import logging
import pathlib

from jaxstep.cli._common import add_tensor_arg, run_dir_command, run_dir_parser
from jaxstep.errors import ConfigError


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
  p.add_argument("--data", help="files, a directory, a glob, or a prepared folder")
  p.add_argument(
    "--format",
    default=None,
    choices=FORMATS,
    help="how raw input becomes documents (default: the format the run's data was read in)",
  )
  p.add_argument("--split", default="all", choices=SPLITS, help="a prepared folder's split")
  p.add_argument(
    "--seq-len",
    type=_count,
    default=0,
    help="tokens per window (0: a run's train.seq_len, a model folder's context)",
  )
  p.add_argument(
    "--stride",
    type=_count,
    default=0,
    help="sliding windows this far apart, each token scored once (0: windows side by side)",
  )
  p.add_argument(
    "--batch-size", type=_count, default=0, help="windows per batch (0: train.global_batch_size)"
  )
  p.add_argument("--tasks", help="lm-evaluation-harness tasks, comma-separated")
  p.add_argument("--include-path", help="a folder of the harness's task YAML files (local data)")
  p.add_argument("--limit", type=float, default=None, help="the first N documents of each task")
  p.add_argument("--num-fewshot", type=_count, default=None, help="examples in each task's prompt")
  p.add_argument("--apply-chat-template", action="store_true", help="prompts in the chat template")
  p.add_argument("--json", action="store_true", help="print one JSON object")
  add_tensor_arg(p)
  return p


def main(argv=None) -> int:
  return run_dir_command(evaluate, parser().parse_args(argv))


def evaluate(args) -> int:
  from jaxstep.trainer.saved_run.load import load_run

  if not args.data and not args.tasks:
    raise ConfigError("give --data (text to score) or --tasks (lm-evaluation-harness tasks)")
  saved = load_run(args.run_dir, args.step, tensor=args.tensor)
  if args.data:
    score_data(saved, args)
  if args.tasks:
    score_tasks(saved, args)
  return 0


def score_tasks(saved, args) -> None:
  from jaxstep.lmeval import require_harness

  require_harness()  # one line saying how to install it, not an ImportError
  from jaxstep.lmeval import model as lmeval_model
  from jaxstep.lmeval import tasks
  from jaxstep.trainer.store import records

  logging.getLogger("datasets").setLevel(logging.WARNING)  # its import's notes
  names = [n.strip() for n in args.tasks.split(",") if n.strip()]
  manager = tasks.check_tasks(names, args.include_path)  # before any model work
  model = lmeval_model.JaxstepLM(
    saved.cfg.model,
    saved.params,
    saved.tokenizer,
    chat_template=saved.chat_template,
    step=saved.step,
    path=args.run_dir,
    batch_size=args.batch_size or lmeval_model.DEFAULT_BATCH,
  )
  limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
  results = tasks.run_tasks(
    model,
    names,
    include_path=args.include_path,
    limit=limit,
    num_fewshot=args.num_fewshot,
    apply_chat_template=args.apply_chat_template,
    manager=manager,
  )
  if args.json:
    print(records.dumps({"step": saved.step, "tasks": args.tasks, **results}))
  else:
    for name, value in results.items():
      print(f"{name}  {value:.4f}")


def score_data(saved, args) -> None:
  from jaxstep.trainer.saved_run import evaluate as evaluation
  from jaxstep.trainer.store import records

  seq_len = args.seq_len or evaluation.default_seq_len(saved)
  if args.batch_size:
    evaluation.refuse_batch_that_cannot_fit(
      saved, args.batch_size, option="--batch-size", seq_len=seq_len
    )
  fmt = args.format or evaluation.default_format(saved.cfg, args.data)
  dataset = evaluation.load_data(saved, pathlib.Path(args.run_dir), args.data, fmt, seq_len)
  prepared = (pathlib.Path(args.data) / "manifest.json").is_file()
  fmt = dataset.manifest["settings"]["format"] if prepared else fmt
  result = {
    "step": saved.step,
    "data": args.data,
    "format": fmt,
    **evaluation.evaluate(
      saved, dataset, split=args.split, batch_size=args.batch_size, stride=args.stride
    ),
  }
  if args.json:
    print(records.dumps(result))
  else:
    source = "model folder" if saved.model_folder else f"update step {result['step']}"
    print(
      f"{source} on {args.data} (format {fmt}, windows of {result['seq_len']} tokens, stride "
      f"{result['stride']}): loss {result['loss']:.4f}  ppl {result['ppl']:.3f}  bits/byte "
      f"{result['bpb']:.4f}  ({result['tokens']} tokens scored, {result['bytes']} bytes, "
      f"{result['windows']} windows)"
    )
