"""A benchmark contender in its own process: ``python -m benchmarks.worker SPEC_JSON``.

Prints ``ready {info}`` once built and warmed up, then ``result {…}`` for every ``run`` line
on stdin. ``SPEC["kind"]`` names a factory in ``CONTENDERS``.
"""

from __future__ import annotations

import json
import logging
import sys


def contenders():
  from benchmarks import data_bench, generate_bench, hf_bench, loop_bench, memory_bench, step_bench

  try:
    from benchmarks import torch_bench

    torch_contenders = torch_bench.CONTENDERS
  except ImportError:  # torch is optional: the benchmarks without it still run
    torch_contenders = {}
  return {
    **data_bench.CONTENDERS,
    **generate_bench.CONTENDERS,
    **hf_bench.CONTENDERS,
    **loop_bench.CONTENDERS,
    **memory_bench.CONTENDERS,
    **step_bench.CONTENDERS,
    **torch_contenders,
  }


def main() -> None:
  logging.basicConfig(level=logging.ERROR)
  spec = json.loads(sys.argv[1])
  info, run_once = contenders()[spec["kind"]](spec)
  print("ready " + json.dumps(info), flush=True)
  for line in sys.stdin:
    if line.strip() == "run":
      print("result " + json.dumps(run_once()), flush=True)


if __name__ == "__main__":
  main()
