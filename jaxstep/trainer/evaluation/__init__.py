"""Scoring: named eval sets of a config (``eval_sets``), the one scoring loop with batches in
flight that every evaluation sums through (``scoring``), and text samples during training
(``text_samples``)."""
