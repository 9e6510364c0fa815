"""Speed and memory measurements (never asserted in tests). ``python -m benchmarks.run``."""
