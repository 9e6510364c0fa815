"""A benchmark contender in its own process: ``python -m benchmarks.worker SPEC_JSON``.

Prints ``ready {info}`` once built and warmed up, then ``result {…}`` for every ``run`` line
on stdin; a ``build SPEC_JSON`` line replaces the contender with that spec's (``ready`` again).
``SPEC["kind"]`` names a factory in one of ``MODULES``' ``CONTENDERS``.
"""

from __future__ import annotations

import importlib
import json
import logging
import sys

# The modules that hold contenders, those quick to import first: a worker imports only as
# far as the module of its kind (loop_bench and memory_bench import jax and jaxstep's
# trainer at the top, which a data or PyTorch worker does not need).
MODULES = (
  "data_bench",
  "generate_bench",
  "hf_bench",
  "step_bench",
  "torch_bench",
  "moe_bench",
  "family_bench",
  "preference_bench",
  "rl_bench",
  "eval_bench",
  "memory_bench",
  "chunked_loss_bench",
  "qlora_bench",
  "loop_bench",
)


def _modules():
  for name in MODULES:
    try:
      yield importlib.import_module(f"benchmarks.{name}")
    except ImportError:  # torch is optional: the benchmarks without it still run
      if name != "torch_bench":
        raise


def contenders() -> dict:
  """Every kind's factory."""
  return {kind: f for module in _modules() for kind, f in module.CONTENDERS.items()}


def contender(kind: str):
  """The factory of ``kind``, importing no module after the one that holds it."""
  for module in _modules():
    if kind in module.CONTENDERS:
      return module.CONTENDERS[kind]
  raise KeyError(f"no benchmark contender {kind!r}")


def main() -> None:
  logging.basicConfig(level=logging.ERROR)
  spec = json.loads(sys.argv[1])
  info, run_once = contender(spec["kind"])(spec)
  print("ready " + json.dumps(info), flush=True)
  for line in sys.stdin:
    if line.strip() == "run":
      print("result " + json.dumps(run_once()), flush=True)
    elif line.startswith("build "):  # a quick run's next contender (harness.REUSABLE)
      spec = json.loads(line[len("build ") :])
      run_once = None  # the last contender's state goes before the next one's is built
      info, run_once = contender(spec["kind"])(spec)
      print("ready " + json.dumps(info), flush=True)


if __name__ == "__main__":
  main()
