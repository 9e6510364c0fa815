"""Generates the bundled corpus (``jaxstep/data/corpus/``) so the default config needs no files.

Text with learnable structure: paragraphs of two-digit arithmetic (``17 + 25 = 42``) and of
sentences from a small grammar; plus a tiny chat set of arithmetic questions. Deterministic:
``python -m jaxstep.data.corpus`` rewrites the same bytes.
"""

from __future__ import annotations

import json
import random

from jaxstep.data.readers import BUNDLED_PATHS

NOUNS = ["cat", "dog", "bird", "fox", "child", "robot", "teacher", "farmer"]
ADJECTIVES = ["small", "red", "quick", "quiet", "old", "happy", "green"]
VERBS = ["sees", "follows", "helps", "finds", "likes", "calls"]
PLACES = ["in the garden", "near the river", "at the school", "on the hill"]


def _noun_phrase(r: random.Random) -> str:
  adjective = f"{r.choice(ADJECTIVES)} " if r.random() < 0.5 else ""
  return f"the {adjective}{r.choice(NOUNS)}"


def _sentence(r: random.Random) -> str:
  place = f" {r.choice(PLACES)}" if r.random() < 0.4 else ""
  return f"{_noun_phrase(r)} {r.choice(VERBS)} {_noun_phrase(r)}{place}."


def _equation(r: random.Random) -> str:
  a, b = r.randrange(100), r.randrange(100)
  if r.random() < 0.5:
    return f"{a} + {b} = {a + b}"
  a, b = max(a, b), min(a, b)
  return f"{a} - {b} = {a - b}"


def text_documents(n: int = 1600, seed: int = 0) -> list[str]:
  r = random.Random(seed)
  make = [_equation, _sentence]
  return ["\n".join(make[i % 2](r) for _ in range(r.randint(4, 9))) for i in range(n)]


def chat_records(n: int = 400, seed: int = 1) -> list[dict]:
  r = random.Random(seed)
  records = []
  for _ in range(n):
    a, b = r.randrange(50), r.randrange(50)
    messages = [
      {"role": "user", "content": f"what is {a} plus {b}?"},
      {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
    ]
    if r.random() < 0.3:
      messages = [{"role": "system", "content": "answer briefly."}, *messages]
    records.append({"messages": messages})
  return records


def main() -> None:
  BUNDLED_PATHS["bundled:text"].write_text("\n\n".join(text_documents()) + "\n")
  BUNDLED_PATHS["bundled:chat"].write_text(
    "".join(json.dumps(rec) + "\n" for rec in chat_records())
  )


if __name__ == "__main__":
  main()
