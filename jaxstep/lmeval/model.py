"""A jaxstep model as an lm-evaluation-harness ``LM`` (``--model jaxstep``).

The three request types, each as the harness's own HF model (``--model hf``) answers it, so
the two give the same numbers on the same folder:

- ``loglikelihood``: the harness splits (context, continuation) into ids (its
  ``_encode_pair``: trailing spaces of the context go to the continuation; an empty context
  is the prefix token); ``Scorer`` sums the continuation's log-probs, longest requests
  first, ``batch_size`` rows a compiled batch.
- ``loglikelihood_rolling``: a whole text's log-likelihood in disjoint windows of
  ``max_length`` (the harness's ``get_rolling_token_windows`` with one token of context),
  the first conditioned on the prefix token; each token is scored once.
- ``generate_until``: the context's last ``max_length − max_gen_toks`` ids continued by the
  KV-cache ``Generator`` (greedy unless the task samples), every id of the vocabulary
  allowed as transformers allows it, cut at the first stop string (the task's ``until``
  and the decoded EOS).

Text becomes ids as a transformers tokenizer's ``encode`` makes them: BOS first where the
model's texts start with one (a folder's post-processor, ``add_bos_token``; a jaxstep run's
documents always do) unless the text already starts with it, and special tokens written in
the text (a rendered chat template's) are their ids. The prefix token is BOS, else EOS.
"""

from __future__ import annotations

import itertools

import numpy as np
from lm_eval import utils as harness_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import (
  Collator,
  handle_stop_sequences,
  normalize_gen_kwargs,
  postprocess_generated_text,
)
from tqdm import tqdm

from jaxstep import models
from jaxstep.errors import ConfigError, DataError
from jaxstep.generation import Generator
from jaxstep.lmeval.scoring import Scorer, width_bucket

DEFAULT_BATCH = 8
DEFAULT_GEN_TOKS = 256  # the harness's HF model's default max_gen_toks
# what a task's generation_kwargs may hold (after the harness's normalize_gen_kwargs)
GENERATION_SETTINGS = {"do_sample", "temperature", "top_k", "top_p", "until", "max_gen_toks"}


class JaxstepLM(TemplateLM):
  """A model's params and tokenizer as an lm-evaluation-harness ``LM``.

  ``--model jaxstep`` is the subclass that reads a run directory or a model folder
  (``jaxstep.trainer.saved_run.harness``); this class takes the parts themselves, e.g. a
  training run's.

  Args:
    model: a ``GPTConfig`` or ``LlamaConfig``.
    params: its params.
    tokenizer: a ``jaxstep.data`` tokenizer (a model folder's: its special ids).
    chat_template: the model's chat template (``--apply_chat_template``), if any.
    step: the update step the params are of (reported with the results).
    path: where the model was read from (reported with the results).
    batch_size: requests per compiled batch (the harness's ``--batch_size``; "auto" = 8).
    max_length: the most positions a request takes (default: the model's context).
    max_gen_toks: the default tokens a ``generate_until`` request may add.
    add_bos_token: True/False overrides whether a text starts with BOS.
    seed: the seed of sampled generations (greedy ones need none).
  """

  def __init__(
    self,
    model,
    params,
    tokenizer,
    *,
    chat_template: str | None = None,
    step: int = 0,
    path: str = "",
    batch_size: int | str = DEFAULT_BATCH,
    max_length: int | None = None,
    max_gen_toks: int = DEFAULT_GEN_TOKS,
    add_bos_token: bool | None = None,
    seed: int = 1234,
    **unused,
  ):
    super().__init__()
    unused.pop("device", None)  # jax places the work; the harness passes its --device
    unused.pop("max_batch_size", None)
    if unused:
      raise ConfigError(
        f"--model_args {', '.join(sorted(unused))}: not options of --model jaxstep (it takes "
        f"path, step, batch_size, max_length, max_gen_toks, add_bos_token, seed)"
      )
    self.path, self.step = str(path), int(step)
    self.jax_tokenizer, self.template = tokenizer, chat_template
    self._max_length = int(max_length or model.max_seq_len)
    if not 1 <= self._max_length <= model.max_seq_len:
      raise ConfigError(
        f"max_length={max_length}: the model takes 1 to {model.max_seq_len} positions"
      )
    self._max_gen_toks, self.seed = int(max_gen_toks), int(seed)
    self._batch = DEFAULT_BATCH if str(batch_size).startswith("auto") else int(batch_size)
    self._bos = _bool(add_bos_token)
    self.progress = True  # progress bars (the harness's command line); off inside a run
    self._batches = itertools.count()  # generate_until batches so far: their seeds differ
    self.scorer = Scorer(
      models.decoder(model).apply_fn,
      params,
      rows=self._batch,
      max_length=self._max_length,
      pad_id=tokenizer.PAD,
      chunk=model.loss_chunk,
    )
    self.generator = Generator(model, params, tokenizer, ban_specials=False)

  @classmethod
  def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
    """``--model_args`` (``k=v,…``) and the harness's own settings (``--batch_size``,
    ``--device``), a setting in ``--model_args`` winning over the harness's."""
    return cls.create_from_arg_obj(
      harness_utils.simple_parse_args_string(arg_string), additional_config
    )

  @classmethod
  def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
    given = {k: v for k, v in (additional_config or {}).items() if v is not None}
    return cls(**{**given, **arg_dict})

  def set_params(self, params) -> None:
    """Scores and generates with ``params`` from now on (a training run's newer step): the
    compiled programs are kept. None lets go of them (and of their copies on other
    devices) until the next call."""
    self.scorer.set_params(params)
    self.generator.params = params

  # ---------------------------------------------------------------- what the harness asks
  @property
  def eot_token_id(self) -> int:
    return self.jax_tokenizer.EOS

  @property
  def prefix_token_id(self) -> int:
    """The declared BOS (even where texts do not start with it), else EOS, as the HF model."""
    tok = self.jax_tokenizer
    bos = getattr(tok, "bos_id", tok.BOS)  # a folder's declared BOS, or None
    return tok.EOS if bos is None else bos

  @property
  def max_length(self) -> int:
    return self._max_length

  @property
  def max_gen_toks(self) -> int:
    return self._max_gen_toks

  @property
  def batch_size(self) -> int:
    return self._batch

  @property
  def tokenizer_name(self) -> str:
    return getattr(self.jax_tokenizer, "kind", "jaxstep").replace("/", "__")

  def chat_template(self, chat_template: bool | str = False) -> str | None:
    return self.template if chat_template not in (False, None) else None

  def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True):
    """``chat_history`` rendered as the HF model renders it: transformers'
    ``apply_chat_template`` with ``continue_final_message`` when no generation prompt is
    asked for (a task's ``gen_prefix``: the text stops right after the final message), and
    once more without the system turn when the template refuses it."""
    if self.template is None:
      raise ConfigError(
        f"{self.path or 'this model'} has no chat template: drop --apply_chat_template"
      )
    try:
      return self._render(chat_history, add_generation_prompt)
    except DataError:
      if not any(m.get("role") == "system" for m in chat_history):
        raise
      return self._render(
        [m for m in chat_history if m.get("role") != "system"], add_generation_prompt
      )

  def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
    from jaxstep.data.chat_template import render_chat

    tokens = getattr(self.jax_tokenizer, "template_tokens", {})
    text = render_chat(
      self.template,
      messages,
      bos_token=tokens.get("bos_token"),
      eos_token=tokens.get("eos_token"),
      add_generation_prompt=add_generation_prompt,
      **{k: v for k, v in tokens.items() if k not in ("bos_token", "eos_token")},
    )
    final = str(messages[-1].get("content", "")).strip() if messages else ""
    if add_generation_prompt or not final or final not in text:
      return text
    return text[: text.rindex(final) + len(final)]  # transformers' continue_final_message

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kw) -> list[int]:
    tok = self.jax_tokenizer
    encode = getattr(tok, "encode_rendered", tok.encode)  # special tokens' text → their ids
    ids = [int(i) for i in encode(string)]
    has_bos = bool(getattr(tok, "has_bos", True))  # a jaxstep run's documents start with BOS
    if add_special_tokens is None:  # the tokenizer's rule, never a second BOS
      add = (has_bos if self._bos is None else self._bos) and ids[:1] != [tok.BOS]
    else:
      add = add_special_tokens and has_bos
    return [tok.BOS, *ids] if add else ids

  def tok_decode(self, ids) -> str:
    return self.jax_tokenizer.decode(ids)

  # ---------------------------------------------------------------- the three request types
  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kw):
    def longest_first(req):
      ids = req[1] + req[2]
      return -len(ids), tuple(ids)

    order = Collator(requests, sort_fn=longest_first)
    out = []
    bar = self._bar(len(requests), disable_tqdm, "loglikelihood requests")
    for chunk in order.get_batched(n=self._batch):
      answers = self.scorer.score([(ctx, cont) for _, ctx, cont in chunk])
      for (key, _, _), answer in zip(chunk, answers, strict=True):
        if key is not None:
          self.cache_hook.add_partial("loglikelihood", key, answer)
      out.extend(answers)
      bar.update(len(chunk))
    bar.close()
    return order.get_original(out)

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    windows, owner = [], []
    for index, (text,) in enumerate(req.args for req in requests):
      rolling = harness_utils.get_rolling_token_windows(
        token_list=self.tok_encode(text),
        prefix_token=self.prefix_token_id,
        max_seq_len=self._max_length,
        context_len=1,
      )
      for context, predicted in map(harness_utils.make_disjoint_window, rolling):
        windows.append((None, context, predicted))
        owner.append(index)
    totals = [0.0] * len(requests)
    scored = self._loglikelihood_tokens(windows, disable_tqdm)
    for index, (logp, _) in zip(owner, scored, strict=True):
      totals[index] += logp
    for req, total in zip(requests, totals, strict=True):
      self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
    return totals

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    def longest_first(req):
      return -len(self.tok_encode(req[0])), req[0]

    order = Collator([r.args for r in requests], sort_fn=longest_first, group_by="gen_kwargs",
                     group_fn=lambda r: r[1])  # fmt: skip
    eos = self.jax_tokenizer.decode([self.eot_token_id]) or None
    out = []
    bar = self._bar(len(requests), disable_tqdm, "generate_until requests")
    for chunk in order.get_batched(n=self._batch):
      contexts, settings = zip(*chunk, strict=True)
      texts = self._generate(list(contexts), dict(settings[0]), eos)
      for context, setting, text in zip(contexts, settings, texts, strict=True):
        self.cache_hook.add_partial("generate_until", (context, setting), text)
      out.extend(texts)
      bar.update(len(chunk))
    bar.close()
    return order.get_original(out)

  def _generate(self, contexts: list[str], settings: dict, eos: str | None) -> list[str]:
    kwargs = normalize_gen_kwargs(settings, self._max_gen_toks)
    unknown = sorted(set(kwargs) - GENERATION_SETTINGS)
    if unknown:
      raise ConfigError(
        f"a task's generation_kwargs {', '.join(unknown)}: not supported by --model jaxstep "
        f"(it takes {', '.join(sorted(GENERATION_SETTINGS))})"
      )
    until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
    new_tokens = int(kwargs.pop("max_gen_toks"))
    room = self._max_length - new_tokens
    if room <= 0:
      raise ConfigError(
        f"a task asks for {new_tokens} new tokens; the model takes {self._max_length} "
        f"positions: lower max_gen_toks or raise max_length"
      )
    prompts = [np.asarray(self.tok_encode(c)[-room:], np.int32) for c in contexts]
    padded = prompts + [prompts[0]] * (self._batch - len(prompts))  # one compiled batch shape
    ids, _, _ = self.generator.sample_ids(
      padded,
      max_new_tokens=new_tokens,
      temperature=float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0,
      top_k=int(kwargs.get("top_k") or 0),
      top_p=float(kwargs.get("top_p") or 1.0),
      seed=self.seed + next(self._batches),  # each batch its own draws (a task's repeats)
      prefill_to=width_bucket(max(map(len, prompts)), room),
    )
    return [
      postprocess_generated_text(self.tok_decode(row), until, None) for row in ids[: len(prompts)]
    ]

  def _bar(self, total: int, off: bool, what: str):
    return tqdm(total=total, disable=off or not self.progress, desc=what)

  def get_model_info(self) -> dict:
    return {"model_path": self.path, "step": self.step}


def _bool(value) -> bool | None:
  """A ``--model_args`` flag: None, a bool, or the text ``true``/``false``."""
  if value is None or isinstance(value, bool):
    return value
  return str(value).strip().lower() in ("1", "true", "yes")
