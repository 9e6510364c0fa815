"""Generates the bundled corpus (``jaxstep/data/corpus/``) so the default config needs no files.

Text with learnable structure: paragraphs of two-digit arithmetic (``17 + 25 = 42``) and of
sentences from a small grammar; plus a tiny chat set of arithmetic questions, the same two
tasks as preference pairs (the right answer chosen, a near miss rejected), sums as RL prompts
with their answers, and the other two-digit sums one per document (supervised data for the
RL demo's start). Deterministic:
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


def _near_miss(r: random.Random, answer: int) -> int:
  """A wrong answer a model could give: off by 1 to 10, never negative."""
  wrong = answer + r.choice([-1, 1]) * r.randint(1, 10)
  return wrong if wrong >= 0 and wrong != answer else answer + r.randint(1, 10)


def pair_records(n: int = 600, seed: int = 2) -> list[dict]:
  """The text corpus's sums as string pairs: prompt ``"a + b = "``, chosen the sum, rejected
  a near miss."""
  r = random.Random(seed)
  records = []
  for _ in range(n):
    a, b = r.randrange(100), r.randrange(100)
    wrong = _near_miss(r, a + b)
    records.append({"prompt": f"{a} + {b} = ", "chosen": f"{a + b}", "rejected": f"{wrong}"})
  return records


def sum_prompt_records(n: int = 1000, seed: int = 4) -> list[dict]:
  """The corpus's sums as RL prompts: ``"a + b = "`` and the ``answer`` a reward checks."""
  r = random.Random(seed)
  return [
    {"prompt": f"{a} + {b} = ", "answer": f"{a + b}"}
    for a, b in ((r.randrange(100), r.randrange(100)) for _ in range(n))
  ]


def sum_documents(seed: int = 6) -> list[str]:
  """Every two-digit sum ``a + b = c`` whose prompt is not one of ``sum_prompt_records``',
  each its own document, shuffled: supervised data that teaches the tiny model to add
  without showing it any prompt RL trains or evaluates on (``configs/sft-sums.yaml``)."""
  held = {row["prompt"] for row in sum_prompt_records()}
  sums = [(a, b) for a in range(100) for b in range(100) if f"{a} + {b} = " not in held]
  random.Random(seed).shuffle(sums)
  return [f"{a} + {b} = {a + b}" for a, b in sums]


def chat_sum_prompt_records(n: int = 400, seed: int = 5) -> list[dict]:
  """Sums asked in a chat, answered with the number alone: RL prompts for a chat model."""
  r = random.Random(seed)
  records = []
  for _ in range(n):
    a, b = r.randrange(50), r.randrange(50)
    question = f"What is {a} + {b}? Answer with the number only."
    records.append({"prompt": [{"role": "user", "content": question}], "answer": f"{a + b}"})
  return records


def chat_pair_records(n: int = 400, seed: int = 3) -> list[dict]:
  """The chat set's questions as conversational pairs, answered right (chosen) or nearly."""
  r = random.Random(seed)
  records = []
  for _ in range(n):
    a, b = r.randrange(50), r.randrange(50)
    wrong = _near_miss(r, a + b)
    prompt = [{"role": "user", "content": f"what is {a} plus {b}?"}]
    chosen, rejected = ([{"role": "assistant", "content": f"{a} plus {b} is {c}."}]
                        for c in (a + b, wrong))  # fmt: skip
    records.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
  return records


def _jsonl(records: list[dict]) -> str:
  return "".join(json.dumps(rec) + "\n" for rec in records)


def main() -> None:
  BUNDLED_PATHS["bundled:text"].write_text("\n\n".join(text_documents()) + "\n")
  BUNDLED_PATHS["bundled:chat"].write_text(_jsonl(chat_records()))
  BUNDLED_PATHS["bundled:pairs"].write_text(_jsonl(pair_records()))
  BUNDLED_PATHS["bundled:chat-pairs"].write_text(_jsonl(chat_pair_records()))
  BUNDLED_PATHS["bundled:sums"].write_text(_jsonl(sum_prompt_records()))
  BUNDLED_PATHS["bundled:chat-sums"].write_text(_jsonl(chat_sum_prompt_records()))
  BUNDLED_PATHS["bundled:sum-docs"].write_text("\n\n".join(sum_documents()) + "\n")


if __name__ == "__main__":
  main()
