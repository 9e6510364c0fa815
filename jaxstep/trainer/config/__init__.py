"""The run's settings: the whole schema (``schema``: every section's dataclass and the names
its keys accept), YAML files with ``key=value`` overrides read into it (``loading``,
``values``). Imports no other room of the trainer, so a ``--help`` or a config error never
waits for JAX, orbax or TensorBoard."""
