"""``jaxstep generate PATH``: continue text prompts (or answer them, ``--chat``) with a
trained run's model or a Hugging Face model folder's.

``PATH`` is a run directory (its ``config.yaml``, its tokenizer and the params of its newest
valid checkpoint, ``--step N`` for another) or a model folder (``config.json`` and no
``config.yaml``: its weights, tokenizer and chat template; no ``--step``), read onto this
process's first device (``--tensor N``: split over its first N, as training's tensor axis
splits it). Prompts come from ``--prompt`` (repeatable), ``--prompts-file`` (one
per line) or, with neither, ``train.sample_prompts``. Each prompt starts a document (BOS
first, as in training, unless the model's tokenizer starts texts with none); with ``--chat``
each is one user message rendered by the model's chat template with the assistant's turn
opened, and only the reply is printed. A row stops at a stop id (EOS, and a model folder's
end-of-turn ids), after ``--max-new-tokens``, or at the model's ``max_seq_len``.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import sys
import time

from jaxstep.cli._common import add_tensor_arg, run_dir_command, run_dir_parser
from jaxstep.errors import ConfigError, PromptError

log = logging.getLogger("jaxstep")


def parser() -> argparse.ArgumentParser:
  p = run_dir_parser("jaxstep generate", __doc__)
  p.add_argument("--prompt", action="append", default=[], help="text to continue (repeatable)")
  p.add_argument("--prompts-file", help="a UTF-8 file with one prompt per line")
  p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per continuation")
  p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
  p.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest (0 = off)")
  p.add_argument("--top-p", type=float, default=1.0, help="nucleus probability (1 = off)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--num-samples", type=int, default=1, help="continuations per prompt")
  p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="compute dtype")
  p.add_argument("--no-cache", action="store_true", help="recompute everything per token")
  p.add_argument("--json", action="store_true", help="one JSON object per sample per line")
  p.add_argument(
    "--chat", action="store_true", help="each prompt is a user message for the chat template"
  )
  add_tensor_arg(p)
  return p


def read_prompts(args, default: tuple[str, ...]) -> list[str]:
  prompts = list(args.prompt)
  if args.prompts_file:
    path = pathlib.Path(args.prompts_file)
    try:
      lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
      raise ConfigError(f"--prompts-file {path}: cannot read it ({e})") from None
    prompts += [line for line in lines if line.strip()]
    if not prompts:
      raise PromptError(f"--prompts-file {path} holds no prompt")
  return prompts or list(default)


def chat_prompt_ids(saved, prompts: list[str], where) -> list:
  """Each prompt as one user message rendered by the model's chat template with the
  assistant's turn opened (``add_generation_prompt``), tokenized as transformers'
  ``apply_chat_template(tokenize=True)`` does (``encode_rendered``: the template writes its
  own start token). ``ConfigError`` when ``where`` has no chat template."""
  from jaxstep.data.hf_folder import render_chat

  if saved.chat_template is None:
    raise ConfigError(
      f"{where} has no chat template (chat_template.jinja, or chat_template in "
      f"tokenizer_config.json): --chat needs one"
    )
  tokenizer, out = saved.tokenizer, []
  for i, prompt in enumerate(prompts):
    if not prompt:
      raise PromptError(f"prompt {i + 1} is empty; give a message")
    try:
      prompt.encode("utf-8")
    except UnicodeEncodeError as e:
      raise PromptError(f"prompt {i + 1} is not valid text ({e.reason})") from None
    chat = [{"role": "user", "content": prompt}]
    text = render_chat(
      saved.chat_template, chat, add_generation_prompt=True, **tokenizer.template_tokens
    )
    out.append(tokenizer.encode_rendered(text))
  return out


def main(argv=None) -> int:
  return run_dir_command(generate, parser().parse_args(argv))


def generate(args) -> int:
  import jax.numpy as jnp

  from jaxstep.generation import Generator, check_settings
  from jaxstep.trainer.saved_run.load import load_run

  check_settings(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.num_samples)
  saved = load_run(args.run_dir, args.step, tensor=args.tensor)
  prompts = read_prompts(args, saved.cfg.train.sample_prompts)
  encoded = chat_prompt_ids(saved, prompts, args.run_dir) if args.chat else None
  dtype = jnp.bfloat16 if args.precision == "bf16" else jnp.float32
  gen = Generator(
    saved.cfg.model, saved.params, saved.tokenizer, dtype=dtype, use_cache=not args.no_cache
  )
  gen.check_fits(
    prompts,
    max_new_tokens=args.max_new_tokens,
    num_samples=args.num_samples,
    option="--num-samples",
    encoded=encoded,
  )
  start = time.perf_counter()
  samples = gen.generate(
    prompts,
    max_new_tokens=args.max_new_tokens,
    temperature=args.temperature,
    top_k=args.top_k,
    top_p=args.top_p,
    seed=args.seed,
    num_samples=args.num_samples,
    encoded=encoded,
  )
  seconds = time.perf_counter() - start
  for i, s in enumerate(samples):
    if args.json:
      print(json.dumps(
        {"prompt": s.prompt, "text": s.text, "tokens": s.tokens, "stop_reason": s.stop_reason}
      ))  # fmt: skip
    else:
      source = "model folder" if saved.model_folder else f"update step {saved.step}"
      print(f"--- sample {i + 1} ({source}, stop: {s.stop_reason})")
      print(s.text if args.chat else s.prompt + s.text)
  sys.stdout.flush()
  new = sum(len(s.tokens) for s in samples)
  log.info("%d samples, %d new tokens in %.2f s (compile included)", len(samples), new, seconds)
  return 0
