"""``python -m jaxstep <command> …``: the same as the ``jaxstep`` console script."""

from jaxstep.cli import console_main

console_main()
