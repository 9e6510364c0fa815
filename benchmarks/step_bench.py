"""Step contenders (issue 7): filled in by the step benchmark."""

CONTENDERS = {}
