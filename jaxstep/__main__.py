"""``python -m jaxstep <command> …``: the same as the ``jaxstep`` console script."""

import sys

from jaxstep.cli import main

sys.exit(main())
