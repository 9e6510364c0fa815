"""``jaxstep export RUN_DIR --out DIR``: a run's checkpoint as a Hugging Face model folder.

Writes ``config.json``, the weights as safetensors (``model.safetensors``, or shards and
``model.safetensors.index.json`` past ``--max-shard-gb``) and the run's tokenizer files
(with the chat template and generation config of the folder it was imported from), so
``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` loads it. ``--step N`` exports
another checkpoint than the newest valid one; ``--dtype bf16`` halves the files. ``DIR``
must be new, empty or an earlier export of jaxstep's (replaced whole), never the run's base
model or a folder with files jaxstep did not write; the folder appears whole or not at all.

A LoRA run (``model.lora.rank > 0``) exports with its adapters merged into the weights
(``W + (α/r)·A·B``). ``--adapter`` writes the adapters alone in PEFT's format instead
(``adapter_config.json`` + ``adapter_model.safetensors``, plus the tokenizer files), for
``peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), DIR)``;
``--dtype`` then applies to the adapter tensors.
"""

from __future__ import annotations

from jaxstep.cli._common import run_dir_command, run_dir_parser

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def main(argv=None) -> int:
  p = run_dir_parser("jaxstep export", __doc__)
  p.add_argument("--out", required=True, help="the model folder to write")
  p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32", help="of the written weights")
  p.add_argument("--max-shard-gb", type=float, default=5.0, help="largest weights file (GiB)")
  p.add_argument(
    "--adapter", action="store_true", help="write a LoRA run's adapters alone, in PEFT's format"
  )
  return run_dir_command(export, p.parse_args(argv))


def export(args) -> int:
  from jaxstep.errors import ConfigError
  from jaxstep.trainer.saved_run.export import export_run

  if not args.max_shard_gb > 0:
    raise ConfigError(f"--max-shard-gb must be > 0, got {args.max_shard_gb}")
  out, step = export_run(
    args.run_dir,
    args.out,
    step=args.step,
    dtype=DTYPES[args.dtype],
    max_shard_bytes=int(args.max_shard_gb * 2**30),
    adapter=args.adapter,
  )
  what = "the adapters of update step" if args.adapter else "update step"
  print(f"exported {what} {step} of {args.run_dir} to {out}")
  return 0
