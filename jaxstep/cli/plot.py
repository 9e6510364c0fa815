"""``jaxstep plot RUN_DIR``: ``RUN_DIR/loss.png`` with train/eval loss, lr, grad norm.

The x axis is the update step throughout.
"""

from __future__ import annotations

from jaxstep.cli._common import Parser, report
from jaxstep.errors import RunDirError, RunIOError
from jaxstep.trainer.tracking.loss_plot import plot_run


def main(argv=None) -> int:
  p = Parser(prog="jaxstep plot", description=__doc__)
  p.add_argument("run_dir")
  args = p.parse_args(argv)
  try:
    print(plot_run(args.run_dir))
  except (RunDirError, RunIOError) as e:
    return report(e)
  return 0
