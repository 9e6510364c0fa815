"""The pure-JAX core: no file, network or logging I/O, no config objects.

``step`` (``make_train_step``: one update from one global batch), ``accumulate`` (the scan
over micro-batches and its ``shard_map`` form), ``session`` (micro-batches one at a time),
``state`` (``TrainState``), ``losses``, ``optim``, ``loss_scale`` (fp16), ``precision``,
``geometry`` (how G, K and devices must divide), ``layout`` (where arrays lie on a
``("data", "fsdp")`` mesh), ``check`` (K micro-steps vs one batch,
stage by stage) and ``trees`` (leaf names).
"""

# ``preference`` (DPO, IPO, SimPO, ORPO losses on one-row-per-pair batches): its entry points,
# imported on first use, so ``import jaxstep.core`` alone still imports no JAX.
PREFERENCE_EXPORTS = ("pair_units", "preference_loss", "sequence_logps")


def __getattr__(name: str):
  if name in PREFERENCE_EXPORTS:
    from jaxstep.core import preference

    return getattr(preference, name)
  raise AttributeError(f"module 'jaxstep.core' has no attribute {name!r}")
