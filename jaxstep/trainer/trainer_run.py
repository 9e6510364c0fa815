"""``jaxstep.Trainer``: the run driver behind ``jaxstep train``, for any model.

You bring a loss function and parameters (``jaxstep.models.from_nnx`` / ``from_linen``
turn a module into both), an optimizer, and data; the Trainer brings what the CLI run has:
the exact accumulation step, a run directory held by one process, asynchronous verified
checkpoints with keep-N, resume after a kill at any moment (state *and* data position),
SIGTERM/SIGINT saves, the non-finite policies, ``metrics.jsonl`` / ``eval.jsonl`` /
TensorBoard / progress, profiling, named eval sets, trackers, and hooks of your own — all
through the same loop (``jaxstep.trainer.loop.loop.Loop``) the CLI uses.

Settings are the CLI's own sections: ``train`` (``TrainConfig``: G, K, ``max_steps``,
seed, precision, cadences, ``nonfinite``, ``trackers`` …) and ``checkpoint``
(``CheckpointConfig``), as objects or dicts of their keys. The keys that describe the
bundled model's text data (``seq_len``, ``sample_*``, ``epochs``) do not apply here.
"""

from __future__ import annotations

import contextlib
import json
import logging
import pathlib
from collections.abc import Callable, Iterable, Mapping, Sequence

import jax
import yaml

from jaxstep import parallel
from jaxstep.core import freeze
from jaxstep.core.optim import OptimConfig, make_optimizer
from jaxstep.core.step import default_units_fn, make_train_step
from jaxstep.errors import ConfigError
from jaxstep.trainer import trainer_data
from jaxstep.trainer.config import loading as config_lib
from jaxstep.trainer.config.schema import CheckpointConfig, MlflowConfig, TrainConfig, WandbConfig
from jaxstep.trainer.loop import assembly
from jaxstep.trainer.loop.callbacks import Callback
from jaxstep.trainer.loop.hooks import Hook, as_hook
from jaxstep.trainer.loop.loop import Loop, LoopResult
from jaxstep.trainer.plan import steps
from jaxstep.trainer.store import resume as resume_lib
from jaxstep.trainer.store import run_dir as run_dir_lib
from jaxstep.trainer.store.param_layout import PARAM_LAYOUT
from jaxstep.trainer.tracking import trackers as trackers_lib
from jaxstep.trainer.trainer_eval import Evaluator, check_first_batches

log = logging.getLogger("jaxstep")
WAY_OUT = ", or fit(resume=False) to start over"  # a resume refusal's other choice


def _section(value, cls, name: str):
  if value is None:
    return cls()
  if isinstance(value, cls):
    return value
  if isinstance(value, Mapping):
    return config_lib.build_section(cls(), dict(value), f"{name}.")
  raise ConfigError(f"{name} must be a {cls.__name__} or a dict of its keys, got {value!r}")


class Trainer:
  """Trains your model with the CLI run's whole driver.

  Args:
    loss_fn: ``(params, micro_batch, rng) -> (loss_sum, aux)`` or, for a model with
      state, ``(params, micro_batch, rng, model_state) -> (loss_sum, aux, model_state)``,
      as for ``make_train_step``: the *sum* over the micro-batch, normalized by the global
      batch's units (``units_fn``, default ``batch["loss_mask"].sum()``).
    params: the initial parameters (copied).
    optimizer: an optax transformation, or an ``OptimConfig`` (AdamW + clipping + a
      schedule over ``train.schedule_steps`` or ``train.max_steps`` update steps).
    train_data: global batches (G rows each): a Grain dataset or ``DataLoader``, an
      iterable whose iterator has ``get_state``/``set_state``, or a plain iterable
      (``jaxstep.trainer.trainer_data`` says how each resumes).
    run_dir: the run's folder (created; one run at a time holds it).
    train: ``TrainConfig`` or a dict of its keys (``max_steps`` must be set).
    checkpoint: ``CheckpointConfig`` or a dict of its keys.
    model_state: the model's non-parameter state (BatchNorm statistics), or None.
    eval_sets: ``{name: batches}``, each a re-iterable of batches (or a function returning
      one), scored every ``train.eval_every`` update steps and at the end.
    eval_loss_fn: ``(params, batch[, model_state]) -> (loss_sum, aux)`` for evaluation
      (a model in eval mode); default: ``loss_fn`` with a fixed key.
    units_fn: ``batch -> N``, the normalization units of a global batch.
    mesh: a ``("data", "fsdp")`` mesh to shard the state and batches over.
    trainable: ``(name, leaf) -> bool``: the leaves that train (default: all; with an
      ``OptimConfig``, its ``trainable`` patterns).
    mlflow, wandb: tracker settings when ``train.trackers`` names them.
    hparams: extra hyper-parameters for the trackers and ``config.yaml``.
    callbacks: ``Callback`` objects (``on_step_end``, ``on_evaluate``).

  Example:
    >>> trainer = Trainer(loss_fn, params, OptimConfig(lr=1e-3), train_data=ds,
    ...                   run_dir="runs/cnn", train={"global_batch_size": 32,
    ...                   "grad_accum_steps": 4, "max_steps": 200})
    >>> trainer.add_hook(lambda loop: print(loop.step), every=50)
    >>> result = trainer.fit()   # run again after a kill: it resumes
  """

  def __init__(
    self,
    loss_fn: Callable,
    params,
    optimizer,
    *,
    train_data: Iterable,
    run_dir: str | pathlib.Path,
    train=None,
    checkpoint=None,
    model_state=None,
    eval_sets: Mapping[str, object] | None = None,
    eval_loss_fn: Callable | None = None,
    units_fn: Callable | None = None,
    mesh=None,
    trainable: freeze.Trainable | None = None,
    mlflow: MlflowConfig | None = None,
    wandb: WandbConfig | None = None,
    hparams: Mapping | None = None,
    callbacks: Sequence[Callback] = (),
  ):
    self.train_cfg = _section(train, TrainConfig, "train")
    self.checkpoint_cfg = _section(checkpoint, CheckpointConfig, "checkpoint")
    _check_train(self.train_cfg)
    trackers_lib.check_available(self.train_cfg.trackers)
    self.run_dir = pathlib.Path(run_dir)
    self.loss_fn, self.params, self.model_state = loss_fn, params, model_state
    self.units_fn = units_fn or default_units_fn
    self.eval_loss_fn, self.mesh = eval_loss_fn, mesh
    self.optimizer_cfg = optimizer if isinstance(optimizer, OptimConfig) else None
    self.schedule_steps = self.train_cfg.schedule_steps or self.train_cfg.max_steps
    self.optimizer = (
      make_optimizer(optimizer, self.schedule_steps) if self.optimizer_cfg else optimizer
    )
    if trainable is None and self.optimizer_cfg and self.optimizer_cfg.trainable:
      freeze.check_patterns(params, self.optimizer_cfg.trainable)
      trainable = freeze.by_patterns(self.optimizer_cfg.trainable)
    self.trainable = trainable
    self.train_data = trainer_data.require_iterable(train_data)  # refused here, not at fit()
    self.eval_sets = {k: trainer_data.eval_source(k, v) for k, v in (eval_sets or {}).items()}
    self.mlflow, self.wandb = mlflow or MlflowConfig(), wandb or WandbConfig()
    self.hparams, self.callbacks = dict(hparams or {}), list(callbacks)
    self.hooks: list[Hook] = []

  def add_hook(self, hook, *, every: int = 0, at_start: bool = False, at_end: bool = False):
    """Adds ``hook`` (a ``Hook``, or a function of the loop run ``every`` update steps
    and/or at the start / end); returns the ``Hook``. Hooks run after the built-in ones."""
    hook = as_hook(hook, every=every, at_start=at_start, at_end=at_end)
    self.hooks.append(hook)
    return hook

  # -- building ---------------------------------------------------------------------------

  def _step(self):
    t = self.train_cfg
    return make_train_step(
      self.loss_fn,
      self.optimizer,
      grad_accum_steps=t.grad_accum_steps,
      units_fn=self.units_fn,
      precision=t.precision,
      mesh=self.mesh,
      scan_unroll=t.scan_unroll,
      loss_scale=steps.loss_scaler(t),
      spike_factor=t.spike_factor,
      spike_window=t.spike_window,
      trainable=self.trainable,
    )

  def _jitted(self, step, state):
    if self.mesh is None:
      return jax.jit(step, donate_argnums=0), jax.device_put
    shardings = jax.tree.map(lambda x: x.sharding, state)
    batch_sh = parallel.batch_sharding(self.mesh)
    put = lambda b: parallel.put_batch(b, batch_sh, self.train_cfg.global_batch_size)  # noqa: E731
    return steps.jit_step(step, shardings, self.mesh), put

  def _model_section(self) -> dict | None:
    """The bundled model's config section, when this trainer knows its model is one."""
    return None

  def _layout(self) -> dict:
    """What a checkpoint records of the params' layout (``param_layout``): its version, and
    the model when known, so that a later layout reads it."""
    model = self._model_section()
    return {"param_layout": PARAM_LAYOUT, **({"model": model} if model else {})}

  def _identity(self) -> dict:
    """What a checkpoint of this run records besides the data position."""
    return {
      "global_batch_size": self.train_cfg.global_batch_size,
      "grad_accum_steps": self.train_cfg.grad_accum_steps,
      "seed": self.train_cfg.seed,
      "schedule_steps": self.schedule_steps,
    }

  def config(self) -> dict:
    """The run's settings as written to ``config.yaml`` and given to the trackers."""
    tree = {
      "train": config_lib.to_dict(self.train_cfg),
      "checkpoint": config_lib.to_dict(self.checkpoint_cfg),
      "run_dir": str(self.run_dir),
    }
    if self.optimizer_cfg:
      tree["optim"] = config_lib.to_dict(self.optimizer_cfg)
    return {**tree, **({"hparams": self.hparams} if self.hparams else {})}

  # -- running ----------------------------------------------------------------------------

  def fit(self, *, resume: bool = True) -> LoopResult:
    """Trains to ``train.max_steps`` (or a stop) and returns the ``LoopResult``.

    Re-running with the same ``run_dir`` resumes from its newest valid checkpoint (a
    finished run says so and writes nothing); ``resume=False`` sets the earlier run aside.
    Raises what ``jaxstep train`` exits with: ``Interrupted`` after a signal's save,
    ``NonFiniteError``, ``RunIOError`` (a failed write), ``CheckpointError`` …
    """
    run_dir_lib.check_shared(self.run_dir)  # multi-host: every host must see run_dir
    check_first_batches(self.eval_sets, self.mesh)
    step = self._step()
    state = step.init(self.params, self.train_cfg.seed, model_state=self.model_state)
    step_fn, put = self._jitted(step, state)
    source = self._source()
    with contextlib.closing(source), run_dir_lib.locked(self.run_dir) as run_dir:
      begun = resume_lib.start(
        run_dir,
        state,
        checkpoint=self.checkpoint_cfg,
        fits=lambda restored: self._fits(restored, source),
        way_out=WAY_OUT,
        resume=resume,
        model=self._model_section(),
      )
      _say_how_data_resumes(source)
      state, start = begun.state, int(begun.state.step)
      run_info = begun.fitted or {"trainer": self._identity(), "trackers": {}, **self._layout()}
      if start >= self.train_cfg.max_steps:
        begun.ckpt.close()
        position = source.position(source.mark())
        first = next(iter(self.eval_sets), "")
        return assembly.already_finished(state, start, position, run_dir, first, run_info)
      write = lambda: run_dir_lib.write_config(run_dir, self._config_yaml())  # noqa: E731
      run_dir_lib.first_writes(run_dir, begun.ckpt, state, write)
      return self._loop(run_dir, begun.ckpt, state, start, step_fn, put, run_info, source).run()

  def _source(self) -> trainer_data.TrainBatches:
    return trainer_data.TrainBatches(self.train_data, self.train_cfg.global_batch_size)

  def _fits(self, restored, source: trainer_data.TrainBatches) -> dict:
    """Checks a restored checkpoint belongs to this run (the refusals ``jaxstep train``
    makes too), moves ``source`` to its data position, and returns the run info to keep."""
    ours = self._identity()
    resume_lib.refuse_a_different_run(
      restored.metadata.get("trainer", {}),
      {**ours, "schedule_steps": ours["schedule_steps"] if self.optimizer_cfg else None},
      allow_schedule_change=self.checkpoint_cfg.allow_schedule_change,
      way_out=WAY_OUT,
    )
    source.restore(restored.metadata)
    trackers = dict(restored.metadata.get("trackers") or {})
    return {"trainer": ours, "trackers": trackers, **self._layout()}

  def _config_yaml(self) -> str:
    """``config.yaml``: the settings, hyper-parameters as plain JSON values."""
    plain = json.loads(json.dumps(self.config(), default=str))  # numpy values and the like
    return yaml.safe_dump(plain, sort_keys=False)

  def _evaluation(self) -> assembly.Evaluation:
    """The named eval sets, scored with the loss every ``train.eval_every`` update steps."""
    if not self.eval_sets:
      return assembly.Evaluation(None, None)
    evaluate = Evaluator(
      self.eval_sets,
      self.loss_fn,
      self.eval_loss_fn,
      self.units_fn,
      limit=self.train_cfg.eval_batches,
      mesh=self.mesh,
    )
    return assembly.Evaluation(evaluate, next(iter(self.eval_sets)))

  def _throughput(self) -> assembly.Throughput:
    return assembly.Throughput()  # tokens/s counts normalization units: the batch's N

  def _first_hooks(self) -> tuple[Hook, ...]:
    """Hooks of the run's kind, before the user's."""
    return ()

  def _loop(self, run_dir, ckpt, state, start, step_fn, put, run_info, source) -> Loop:
    t = self.train_cfg
    return assembly.assemble(
      state=state,
      step_fn=step_fn,
      put_batch=put,
      source=source,
      start_step=start,
      total_steps=t.max_steps,
      run_dir=run_dir,
      ckpt=ckpt,
      train=t,
      checkpoint_every=self.checkpoint_cfg.every,
      evaluation=self._evaluation(),
      tracking=assembly.Tracking(
        config=self.config(),
        mlflow=self.mlflow,
        wandb=self.wandb,
        ids=run_info.get("trackers", {}),
        resumed=bool(run_info.get("trackers")),
      ),
      throughput=self._throughput(),
      callbacks=self.callbacks,
      hooks=(*self._first_hooks(), *self.hooks),
      run_info=run_info,
    )


def _say_how_data_resumes(source: trainer_data.TrainBatches) -> None:
  """One line at each start on how ``train_data`` finds its place on resume: a warning when
  it cannot do so by itself."""
  if source.resumable:
    log.info("train_data: %s", source.describe())
  else:
    log.warning("train_data: %s", source.describe())


def _check_train(t: TrainConfig) -> None:
  """The ``train`` keys a Trainer cannot honour, refused by name."""
  if t.grad_accum_steps == "auto":
    raise ConfigError("train.grad_accum_steps=auto needs the bundled model; give a number")
  if not t.max_steps:
    raise ConfigError("set train.max_steps: a Trainer's data has no epoch length to stop at")
  if t.epochs:
    raise ConfigError("train.epochs needs the bundled data; a Trainer stops at train.max_steps")
