"""``jaxstep train [--config FILE] [key=value …]``: train from a config.

Exit codes: 0 done; 2 bad config, data or checkpoints (one readable line); 1 a run-time stop
such as an empty global batch or a non-finite update under ``train.nonfinite=halt``;
128 + signal number after SIGTERM/SIGINT (a checkpoint was saved first).
"""

from __future__ import annotations

import argparse

from jaxstep.cli import compile_cache
from jaxstep.cli._common import Parser, add_config_args, report, setup_logging
from jaxstep.errors import JaxstepError, RunDirError
from jaxstep.trainer.config import loading as config_lib


def parser(prog: str = "jaxstep train") -> argparse.ArgumentParser:
  p = Parser(
    prog=prog,
    description="Train a model from a YAML config (default: the bundled tiny config on the "
    "bundled corpus). Overrides use dotted keys, e.g. "
    "train.global_batch_size=32 optim.lr=3e-4 run_dir=runs/x.",
    epilog="config keys: " + ", ".join(config_lib.valid_keys()),
  )
  add_config_args(p)
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
  args = parser().parse_intermixed_args(argv)
  setup_logging()
  try:
    cfg = config_lib.load(args.config, args.overrides)
    compile_cache.enable(cfg.xla_cache)
    # heavy imports only after the config is valid
    from jaxstep.parallel import initialize_distributed
    from jaxstep.trainer.config_run import train
    from jaxstep.trainer.plan.numbers import configure_devices
    from jaxstep.trainer.store.run_dir import check_shared

    configure_devices(cfg)
    m = cfg.mesh
    initialize_distributed(m.coordinator, m.num_processes, m.process_id, m.initialization_timeout)
    check_shared(cfg.run_dir)  # every host must see run_dir before anything is written there
    result = train(cfg, resume=not args.no_resume, resume_from=args.resume_from)
  except JaxstepError as e:
    if args.debug and not isinstance(e, RunDirError):
      raise
    return report(e)
  last = result.last_metrics
  summary = f"final step {result.run_state.step}: loss {last.get('loss', float('nan')):.4f}"
  if result.last_eval and "eval_loss" in result.last_eval:
    summary += f", eval loss {result.last_eval['eval_loss']:.4f}"
  elif result.last_eval and "eval_reward" in result.last_eval:
    summary += f", eval reward {result.last_eval['eval_reward']:.4f}"
  print(f"{summary} ({result.stop_reason}); outputs in {cfg.run_dir}")
  return 0
