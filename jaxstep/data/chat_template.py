"""Chat templates rendered exactly as transformers' ``apply_chat_template`` renders them (same
sandboxed Jinja environment and helpers), and which characters of a rendering are the
assistant's (``assistant_spans``), for training on assistant tokens only.

Assistant text is what transformers' ``return_assistant_tokens_mask=True`` marks: in a
template with ``{% generation %}…{% endgeneration %}`` blocks, the text those render. A
template without them (most real ones) is read incrementally: assistant message ``i`` is the
text between the rendering of ``messages[:i]`` with the generation prompt and that of
``messages[:i+1]``, less the whitespace after its end-of-turn token (ChatML's ``4.<|im_end|>``
without its ``\\n``, as transformers' own ChatML example marks it). Both renderings must be
prefixes of the whole chat's; a template that rewrites earlier turns once later ones come
(Qwen3 drops the reasoning of past turns) is refused with a ``DataError``, never guessed.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from contextvars import ContextVar
from datetime import datetime

import jinja2
import numpy as np
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from jaxstep.errors import DataError

# transformers' named special tokens: a template sees only those that are set.
TOKEN_KEYS = {f"{r}_token" for r in ("bos", "eos", "unk", "sep", "pad", "cls", "mask")}
# ``{% generation %}`` (or ``{%- generation -%}``): the template marks assistant text itself
GENERATION_TAG = re.compile(r"\{%[-+]?\s*generation\s*[-+]?%\}")


def assistant_spans(
  template: str, messages: list[dict], **tokens
) -> tuple[str, list[tuple[int, int]]]:
  """The whole chat rendered (as ``render_chat(template, messages, **tokens)``) and the
  ``[start, end)`` character spans of its assistant text, in order (module docstring).

  Raises:
    DataError: the template does not render, or (without generation blocks) does not render
      turns incrementally.
  """
  if GENERATION_TAG.search(template):
    return _render(template, messages, tokens, track=True)
  text, _ = _render(template, messages, tokens)
  spans = []
  for i, message in enumerate(messages):
    if message.get("role") != "assistant":
      continue
    before, _ = _render(template, messages[:i], {**tokens, "add_generation_prompt": True})
    through, _ = _render(template, messages[: i + 1], tokens)
    if not (through.startswith(before) and text.startswith(through)):
      raise DataError(
        f"chat template does not render turns incrementally: the chat before message {i + 1} "
        f"(with the generation prompt) and through it do not render as prefixes of the whole "
        f"chat, so that assistant message's tokens cannot be told; mark assistant text with "
        f"{{% generation %}} in the template"
      )
    spans.append((len(before), max(len(before), len(through.rstrip()))))
  return text, spans


def token_mask(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
  """int8 per token (``offsets``: ``[n, 2]`` character ranges): 1 where the token overlaps a
  span, transformers' rule for its assistant masks (a token cut by a span's edge counts)."""
  flags = np.zeros(len(offsets), np.int8)
  if not spans or not len(offsets):
    return flags
  starts, ends = np.asarray(spans, np.int64).T
  nxt = np.searchsorted(ends, offsets[:, 0], side="right")  # first span ending after start
  inside = nxt < len(spans)
  flags[inside] = offsets[inside, 1] > starts[nxt[inside]]
  return flags


def render_chat(
  template: str,
  messages: list[dict],
  *,
  bos_token: str | None,
  eos_token: str | None,
  add_generation_prompt: bool = False,
  **extra,
) -> str:
  """``messages`` rendered by ``template`` as transformers' ``apply_chat_template(...,
  tokenize=False)`` renders them: message keys whose value is None dropped, reasoning also
  under ``thinking``/``reasoning_content``, all data copied to plain types, a None special
  token left undefined (``{{ bos_token }}`` renders nothing for Qwen), ``tools`` and
  ``documents`` None unless ``extra`` gives them. ``DataError`` when the template is not
  valid Jinja, refuses the messages (``raise_exception``) or fails while rendering (a
  division by zero, an undefined filter), with the template's own message and the first
  message at which it fails."""
  given = {"bos_token": bos_token, "eos_token": eos_token, **extra}
  given["add_generation_prompt"] = add_generation_prompt
  return _render(template, messages, given)[0]


def _render(
  template: str, messages: list[dict], given: dict, track: bool = False
) -> tuple[str, list[tuple[int, int]]]:
  """``render_chat``'s text, and (``track``) the character spans its generation blocks
  rendered, found as transformers finds them: by the length of the output so far."""
  given = {"add_generation_prompt": False, **given}
  kwargs = _plain({k: v for k, v in given.items() if v is not None or k not in TOKEN_KEYS})
  tools, documents = kwargs.pop("tools", None), kwargs.pop("documents", None)
  chat = _alias_reasoning(_plain([{k: v for k, v in m.items() if v is not None} for m in messages]))
  blocks, spans = [], []
  mark = _TRACK.set((blocks, spans) if track else None)
  try:  # block by block, so that a generation block sees the output before it
    for block in _compile(template).generate(
      messages=chat, tools=tools, documents=documents, **kwargs
    ):
      blocks.append(block)
  except MemoryError:
    raise
  except Exception as e:  # noqa: BLE001 - a template may raise anything Python can
    where = _failing_turn(template, chat, tools, documents, kwargs) if chat else ""
    raise DataError(f"chat template: {type(e).__name__}: {e}{where}") from None
  finally:
    _TRACK.reset(mark)
  return "".join(blocks), spans


def _failing_turn(template: str, chat: list[dict], tools, documents, kwargs: dict) -> str:
  """`` (at message i, role r)``: the first message whose conversation so far the template
  cannot render (a role it refuses, a field it computes on); ``""`` when it fails without
  any message too (a broken template) or with none of the prefixes."""
  for i in range(len(chat) + 1):
    try:
      "".join(
        _compile(template).generate(messages=chat[:i], tools=tools, documents=documents, **kwargs)
      )
    except MemoryError:
      raise
    except Exception:  # noqa: BLE001 - the same failure, found at this turn
      return f" (at message {i - 1}, role {chat[i - 1].get('role')!r})" if i else ""
  return ""


# The names a message's reasoning goes by; templates read the first.
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(chat: list[dict]) -> list[dict]:
  """Each message's reasoning also under ``thinking`` and ``reasoning_content``."""
  out = []
  for m in chat:
    reasoning = next((m[k] for k in REASONING_KEYS if m.get(k) is not None), None)
    if reasoning is not None:
      m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
    out.append(m)
  return out


def _plain(value):
  """``value`` rebuilt from plain JSON-like types (subclasses cut back to their base); any
  other object becomes ``"<TypeName>"``, so a template never reaches an object's methods."""
  if value is None or type(value) in (str, int, float, bool):
    return value
  for base in (str, int, float):
    if isinstance(value, base):
      return base(value)
  if isinstance(value, Mapping):
    return {_plain(k): _plain(v) for k, v in value.items()}
  if isinstance(value, list):
    return [_plain(v) for v in value]
  if isinstance(value, tuple):
    return tuple(_plain(v) for v in value)
  if isinstance(value, np.generic):
    return _plain(value.item())
  return f"<{type(value).__name__}>"


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
  """``template`` compiled in transformers' chat-template environment: sandboxed, immutable,
  ``trim_blocks``/``lstrip_blocks``, loop controls, and its globals and ``tojson``."""
  env = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, "jinja2.ext.loopcontrols"]
  )
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
  env.globals["dict"] = _TemplateDict()
  env.globals["namespace"] = _Namespace
  return env.from_string(template)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
  """transformers' ``tojson``: ``json.dumps``, without Jinja's HTML escaping."""
  return json.dumps(
    x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
  )


def _raise_exception(message):
  raise jinja2.exceptions.TemplateError(message)


class _TemplateDict:
  """``dict(...)`` and ``dict.fromkeys(...)`` in a template, and nothing else of the type."""

  def __call__(self, *args, **kwargs):
    return dict(*args, **kwargs)

  def fromkeys(self, *args, **kwargs):
    return dict.fromkeys(*args, **kwargs)


def _check_name(name) -> None:
  if isinstance(name, str) and name.startswith("_"):
    raise jinja2.exceptions.SecurityError(
      f"chat templates cannot store underscore-prefixed attributes on a namespace: {name!r}"
    )


class _Namespace(jinja2.utils.Namespace):
  """Jinja's ``namespace``, refusing underscore names (a way into CPython internals)."""

  def __init__(*args, **kwargs):  # Jinja's signature trick: ``namespace(self=...)`` works
    self, args = args[0], args[1:]
    attrs = dict(*args, **kwargs)
    for name in attrs:
      _check_name(name)
    jinja2.utils.Namespace.__init__(self, attrs)

  def __setitem__(self, name, value):
    _check_name(name)
    jinja2.utils.Namespace.__setitem__(self, name, value)


# (output so far, spans) while ``_render`` tracks generation blocks; None otherwise
_TRACK: ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = ContextVar(
  "generation_spans", default=None
)


class _Generation(Extension):
  """``{% generation %}…{% endgeneration %}``, which marks assistant text for transformers'
  assistant masks: renders its body unchanged, and records where it went while tracked."""

  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

  def _body(self, caller):
    text = caller()
    if (tracking := _TRACK.get()) is not None:
      blocks, spans = tracking
      start = sum(map(len, blocks))
      spans.append((start, start + len(text)))
    return text
