"""``python -m jaxstep.train [--config FILE] [key=value …]``: train from a config.

Exit codes: 0 done; 2 bad config, data or checkpoints (one readable line); 1 a run-time stop
such as an empty global batch or a non-finite update under ``train.nonfinite=halt``;
128 + signal number after SIGTERM/SIGINT (a checkpoint was saved first).
"""

from __future__ import annotations

import argparse
import logging
import sys

from jaxstep import config as config_lib
from jaxstep.errors import CheckpointError, ConfigError, DataError, Interrupted, JaxstepError


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
    prog="python -m jaxstep.train",
    description="Train a model from a YAML config (default: the bundled tiny config on the "
    "bundled corpus). Overrides use dotted keys, e.g. "
    "train.global_batch_size=32 optim.lr=3e-4 run_dir=runs/x.",
    epilog="config keys: " + ", ".join(config_lib.valid_keys()),
  )
  config_lib.add_config_args(p)
  resume = p.add_mutually_exclusive_group()
  resume.add_argument(
    "--resume-from",
    metavar="PATH",
    help="start from this checkpoint (a step directory, a checkpoints "
    "directory or a run_dir) instead of run_dir's own",
  )
  resume.add_argument(
    "--no-resume",
    action="store_true",
    help="start at step 0 even if run_dir has checkpoints (they are moved "
    "to run_dir/previous-<time>/, not deleted)",
  )
  p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
  return p


def main(argv=None) -> int:
  args = parser().parse_args(argv)
  logging.basicConfig(
    level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stderr
  )
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.ERROR)  # "no TPU" noise on CPU
  logging.getLogger("absl").setLevel(logging.WARNING)  # orbax's per-save INFO chatter
  try:
    cfg = config_lib.load(args.config, args.overrides)
    from jaxstep import run, sharding  # heavy imports only after the config is valid
    from jaxstep.cpu import configure_cpu_defaults

    configure_cpu_defaults(cfg)
    m = cfg.mesh
    sharding.initialize_distributed(m.coordinator, m.num_processes, m.process_id)
    result = run.train(cfg, resume=not args.no_resume, resume_from=args.resume_from)
  except Interrupted as e:
    print(f"error: {e}", file=sys.stderr)
    return 128 + e.signum
  except (ConfigError, DataError, CheckpointError) as e:
    if args.debug:
      raise
    print(f"error: {e}", file=sys.stderr)
    return 2
  except JaxstepError as e:
    if args.debug:
      raise
    print(f"error: {e}", file=sys.stderr)
    return 1
  last = result.last_metrics
  summary = f"final step {result.run_state.step}: loss {last.get('loss', float('nan')):.4f}"
  if result.last_eval:
    summary += f", eval loss {result.last_eval['eval_loss']:.4f}"
  print(f"{summary} ({result.stop_reason}); outputs in {cfg.run_dir}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
