"""``jaxstep prepare INPUT… --out DIR``: tokenize a corpus once into shards + a manifest.
``jaxstep prepare --verify DIR``: re-hash a prepared folder's files against its manifest.

INPUT is a file, a directory or a glob; several may be given. A directory is walked for the
files the format reads (text: any UTF-8 file; jsonl/chat: .jsonl); skipped files are reported.
Training then reads the shards through memory maps (``data.path=DIR``).

Exit codes: 0 done (--verify: every file matches); 2 bad input or --out (--verify: a
damaged file, named); 74 a write failed (disk full or read-only); 1 a worker process died
(killed, e.g. out of memory); 128 + signal number after SIGINT/SIGTERM. Whenever it fails,
DIR is left as it was and no temporary folder remains.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading

from jaxstep.cli._common import Parser, report, setup_logging
from jaxstep.data.readers import FORMATS
from jaxstep.errors import Interrupted, JaxstepError

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def parser() -> argparse.ArgumentParser:
  p = Parser(prog="jaxstep prepare", description=__doc__)
  p.add_argument("inputs", nargs="*", metavar="INPUT")
  p.add_argument(
    "--out",
    help="the prepared folder: new, empty, or a prepared folder (replaced); never inside an input",
  )
  p.add_argument(
    "--tokenizer",
    default="byte",
    help="byte (default), a tokenizer.json or a SentencePiece .model file",
  )
  p.add_argument(
    "--train-bpe",
    type=int,
    default=0,
    metavar="VOCAB_SIZE",
    help="train a byte-level BPE of this size on the inputs first (saved as tokenizer.json)",
  )
  p.add_argument(
    "--format",
    default="auto",
    choices=FORMATS,
    help="txt: documents split at blank lines; file: one document per file (source code); "
    "auto: .jsonl by its first record, anything else txt",
  )
  p.add_argument("--eval-fraction", type=float, default=0.05, help="documents held out")
  p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizer processes")
  p.add_argument(
    "--shard-tokens", type=int, default=None, help="tokens per shard file (default 2^26)"
  )
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  p.add_argument(
    "--force",
    action="store_true",
    help="replace a prepared --out made from other inputs or settings",
  )
  p.add_argument(
    "--verify",
    metavar="DIR",
    help="instead of preparing: re-hash every file of the prepared DIR against its manifest",
  )
  return p


def main(argv=None) -> int:
  from jaxstep.data.preparation import SHARD_TOKENS, prepare

  p = parser()
  args = p.parse_args(argv)
  if args.verify is not None:
    if args.inputs or args.out is not None:
      p.error("--verify DIR takes no INPUT and no --out")
    return _verify(args.verify)
  if not args.inputs or args.out is None:
    p.error("INPUT… and --out DIR are required (or --verify DIR)")
  setup_logging()
  try:
    with _stop_signals_raise():
      manifest = prepare(
        args.inputs,
        args.out,
        tokenizer=args.tokenizer,
        train_bpe_vocab=args.train_bpe,
        fmt=args.format,
        eval_fraction=args.eval_fraction,
        workers=args.workers,
        shard_tokens=SHARD_TOKENS if args.shard_tokens is None else args.shard_tokens,
        progress=not args.no_progress,
        force=args.force,
      )
  except JaxstepError as e:
    return report(e)
  tok, splits = manifest["tokenizer"], manifest["splits"]
  counts = ", ".join(
    f"{name} {s['tokens']:,} tokens in {s['documents']:,} documents" for name, s in splits.items()
  )
  print(f"{args.out}: {counts}; tokenizer {tok['kind']} ({tok['vocab_size']:,} ids)")
  return 0


def _verify(folder: str) -> int:
  """Prints ``DIR: OK …`` and returns 0, or reports the first damaged file (exit 2)."""
  from jaxstep.data.manifest import verify_folder

  try:
    checked = verify_folder(folder)
  except JaxstepError as e:
    return report(e)
  print(f"{folder}: OK, {checked['files']} files ({checked['bytes']:,} bytes) match their sha256")
  return 0


@contextlib.contextmanager
def _stop_signals_raise():
  """SIGINT and SIGTERM raise ``Interrupted`` meanwhile: on its way out the prepare stops
  its workers and removes its temporary folder, then exits 128 + the signal's number. A
  second signal does not wait for that (a later prepare removes what is left)."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  previous = {s: signal.signal(s, _interrupt) for s in STOP_SIGNALS}
  try:
    yield
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)


def _interrupt(signum, frame):
  for s in STOP_SIGNALS:
    signal.signal(s, _exit_at_once)
  name = signal.Signals(signum).name
  raise Interrupted(f"jaxstep prepare interrupted ({name}); run it again to prepare", signum)


def _exit_at_once(signum, frame):
  sys.stderr.write(f"error: jaxstep prepare interrupted ({signal.Signals(signum).name})\n")
  sys.stderr.flush()
  os._exit(128 + signum)
