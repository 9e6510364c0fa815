"""``jaxstep.Trainer``: the CLI run's driver for a model of your own — hooks at their
cadence, a stop from a hook, eval sets against an independent sum, data sources and how
each resumes, and (slow) an NNX CNN with dropout and BatchNorm killed with SIGKILL at
random moments, resumed to bitwise the same parameters and the same metrics lines."""

import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import killable, xla_flags
from tolerance import assert_close, assert_far

import jaxstep
from jaxstep.errors import BatchError, CheckpointError, ConfigError

G = 8
ROOT = pathlib.Path(__file__).resolve().parent.parent
TIMING = ("tokens_per_sec", "step_time", "mfu")


def linear_loss(params, batch, rng):
  """Σ of squared errors over the rows a mask keeps, and the count of rows as aux."""
  del rng
  err = batch["x"] @ params["w"] - batch["y"]
  mask = batch["loss_mask"]
  return jnp.sum(err**2 * mask), {"rows": jnp.sum(mask)}


def batch_of(i: int) -> dict:
  rng = np.random.default_rng(i)
  x = rng.normal(size=(G, 3)).astype(np.float32)
  mask = (rng.random(G) < 0.8).astype(np.float32)
  mask[0] = 1.0
  return {"x": x, "y": x @ np.array([1.0, -2.0, 0.5], np.float32), "loss_mask": mask}


def trainer(tmp_path, data=None, **kwargs):
  train = {"global_batch_size": G, "grad_accum_steps": 2, "max_steps": 12, "progress": False}
  train.update(kwargs.pop("train", {}))
  return jaxstep.Trainer(
    linear_loss,
    {"w": jnp.zeros(3)},
    optax.sgd(0.05),
    train_data=[batch_of(i) for i in range(100)] if data is None else data,
    run_dir=tmp_path / "run",
    train=train,
    checkpoint=kwargs.pop("checkpoint", {"every": 4}),
    **kwargs,
  )


def test_a_hook_runs_at_its_cadence_and_can_stop_the_run(tmp_path):
  seen, starts, ends = [], [], []
  t = trainer(tmp_path)
  t.add_hook(lambda loop: seen.append((loop.step, loop.last_record["step"])), every=3)
  t.add_hook(lambda loop: starts.append(loop.step), at_start=True)
  t.add_hook(lambda loop: ends.append(loop.step), at_end=True)

  def stopper(loop):
    if loop.step == 9:
      loop.stop("enough at 9")

  t.add_hook(stopper, every=1)
  result = t.fit()
  # every=3: after updates 3, 6, 9, each having seen its own update's metrics first
  assert seen == [(3, 3), (6, 6), (9, 9)]
  assert starts == [0] and ends == [9]
  assert result.step == 9 and result.stop_reason == "enough at 9"
  assert (tmp_path / "run" / "checkpoints" / "9").is_dir()
  lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in lines] == [9]  # log_every 10: the last update is always logged


def test_eval_sets_report_the_sums_of_an_independent_computation(tmp_path):
  sets = {"a": [batch_of(1000 + i) for i in range(3)], "b": lambda: [batch_of(2000)]}
  result = trainer(tmp_path, eval_sets=sets, train={"eval_every": 6}).fit()
  records = [json.loads(x) for x in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
  assert [(r["step"], r["set"]) for r in records] == [(6, "a"), (6, "b"), (12, "a"), (12, "b")]
  w = np.asarray(result.state.params["w"], np.float64)
  for name, batches in (("a", sets["a"]), ("b", sets["b"]())):
    sse = sum(np.sum((b["x"] @ w - b["y"]) ** 2 * b["loss_mask"]) for b in batches)
    rows = sum(b["loss_mask"].sum() for b in batches)
    got = result.evals[name]
    assert got["step"] == 12 and got["eval_tokens"] == rows and got["eval_rows"] == rows
    terms = 3 * G * len(batches)  # x @ w (3 terms) for every row, summed over the rows
    assert_close(got["eval_loss"], sse / rows, terms=terms)
    # the margin: the same set scored at step 6 (another step's params) is far outside it
    (earlier,) = [r for r in records if (r["step"], r["set"]) == (6, name)]
    assert_far(earlier["eval_loss"], sse / rows, terms=terms)
  again = trainer(tmp_path, eval_sets=sets, train={"eval_every": 6}).fit()  # writes nothing
  lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
  assert again.stop_reason == "already finished at update step 12"
  assert again.last_record == json.loads(lines[-1]) and again.evals == {
    "a": records[2],
    "b": records[3],
  }


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """The params after 12 uninterrupted updates on ``batch_of(0)``, ``batch_of(1)``, …"""
  return trainer(tmp_path_factory.mktemp("straight")).fit().state.params["w"]


def test_a_plain_iterable_resumes_by_skipping_what_was_consumed(tmp_path, straight):
  data = [batch_of(i) for i in range(40)]
  first = trainer(tmp_path / "k", data=data, train={"max_steps": 7}).fit()
  assert first.step == 7
  resumed = trainer(tmp_path / "k", data=data, train={"max_steps": 12}).fit()
  assert resumed.position == {"batches": 12, "data": None}
  np.testing.assert_array_equal(resumed.state.params["w"], straight)


def test_a_resumable_iterator_gets_its_state_back(tmp_path, straight):
  import grain

  data = grain.MapDataset.range(200).map(batch_of)
  trainer(tmp_path / "k", data=data, train={"max_steps": 5}).fit()
  resumed = trainer(tmp_path / "k", data=data).fit()
  assert resumed.position["data"] == {"next_index": 12}
  np.testing.assert_array_equal(resumed.state.params["w"], straight)


def test_data_that_ends_ends_the_run_with_its_state_saved(tmp_path):
  result = trainer(tmp_path, data=[batch_of(i) for i in range(5)]).fit()
  assert result.step == 5 and "train data ended" in result.stop_reason
  assert (tmp_path / "run" / "checkpoints" / "5").is_dir()


def test_bad_input_is_one_clear_error(tmp_path):
  short = dict(batch_of(0), x=np.zeros((G - 1, 3), np.float32))
  with pytest.raises(BatchError, match="train.global_batch_size = 8 rows"):
    trainer(tmp_path / "a", data=[short]).fit()
  with pytest.raises(ConfigError, match="train.max_steps"):
    trainer(tmp_path / "b", train={"max_steps": 0})
  with pytest.raises(ConfigError, match="one-shot iterator"):
    trainer(tmp_path / "c", eval_sets={"x": iter([batch_of(0)])})
  with pytest.raises(BatchError, match=r"eval_sets\['x'\]'s first batch is a list"):
    trainer(tmp_path / "e", eval_sets={"x": [[1.0, 2.0]]}).fit()  # found before training
  assert not (tmp_path / "e").exists()
  one_shot = (batch_of(i) for i in range(100))
  trainer(tmp_path / "d", data=one_shot, train={"max_steps": 2}).fit()
  with pytest.raises(ConfigError, match="cannot be resumed"):
    trainer(tmp_path / "d", data=(batch_of(i) for i in range(100))).fit()


def test_a_resume_with_another_global_batch_or_seed_is_refused(tmp_path):
  trainer(tmp_path, train={"max_steps": 4}).fit()
  with pytest.raises(CheckpointError, match="train.seed changed"):
    trainer(tmp_path, train={"seed": 1}).fit()


def test_a_failure_before_the_first_update_leaves_no_checkpoint(tmp_path):
  def broken(params, batch, rng):
    raise RuntimeError("a bug in the loss")

  t = jaxstep.Trainer(
    broken,
    {"w": jnp.zeros(3)},
    optax.sgd(0.1),
    train_data=[batch_of(0)],
    run_dir=tmp_path / "run",
    train={"global_batch_size": G, "grad_accum_steps": 1, "max_steps": 3, "progress": False},
  )
  with pytest.raises(RuntimeError, match="a bug in the loss"):
    t.fit()
  assert not list((tmp_path / "run" / "checkpoints").glob("*"))
  trainer(tmp_path, train={"seed": 5, "max_steps": 2}).fit()  # the fixed run starts cleanly


def test_a_write_failing_because_run_dir_went_away_says_so(tmp_path):
  """Whichever comes first after ``run_dir`` is moved away, the liveness check or a write
  that fails for want of its folder, the one error names the removal."""
  import shutil

  from jaxstep.errors import RunIOError

  def remove_then_write(loop):
    if loop.step == 5:
      loop.ckpt.wait()  # step 4's save has landed: only this hook's write can fail
      shutil.move(loop.run_dir, tmp_path / "moved")
      (loop.run_dir / "notes.txt").write_text("x")  # FileNotFoundError

  t = trainer(tmp_path)
  t.add_hook(remove_then_write, every=1)
  with pytest.raises(RunIOError, match="was removed or replaced during the run"):
    t.fit()


def test_a_failed_save_under_way_when_run_dir_went_away_is_named_not_denied(tmp_path):
  """orbax stops waiting for a save at its first failed write while the save's other writes
  go on: when the save under way failed, the line says its files may still land, and never
  that nothing more was written (here one lands just after the checkpointer is closed)."""
  import shutil
  import threading

  from jaxstep.errors import RunIOError

  late = []

  def remove_while_saving(loop):
    if loop.step != 5:
      return
    loop.ckpt.wait()  # step 4's save has landed: the straggler below is the only late write
    real_close = loop.ckpt.close

    def close_with_a_straggler():
      real_close()
      lands = tmp_path / "run" / "checkpoints" / "4.orbax-checkpoint-tmp"
      late.append(threading.Timer(0.2, lambda: lands.mkdir(parents=True)))
      late[0].start()
      raise RunIOError("writing the checkpoint of update step 4 failed (FileNotFoundError)")

    loop.ckpt.close, loop.ckpt.pending = close_with_a_straggler, 4
    shutil.move(loop.run_dir, tmp_path / "moved")

  t = trainer(tmp_path)
  t.add_hook(remove_while_saving, every=1)
  with pytest.raises(RunIOError, match="was removed or replaced during the run") as raised:
    t.fit()
  late[0].join()
  message = str(raised.value)
  assert "nothing more was written" not in message or not (tmp_path / "run").exists(), message
  assert "the checkpoint save of update step 4 that was under way failed" in message


def _records(run_dir: pathlib.Path) -> list[dict]:
  lines = (run_dir / "metrics.jsonl").read_text().splitlines()
  return [{k: v for k, v in json.loads(x).items() if k not in TIMING} for x in lines]


def _run_example(run_dir, steps, *, kill_after_step=None):
  """The example script; with ``kill_after_step``, SIGKILLed once metrics.jsonl shows that
  update step and a checkpoint is complete (plus a random few milliseconds, so the kill
  lands anywhere in a step, a save in flight included)."""
  command = [sys.executable, str(ROOT / "examples" / "trainer_own_model.py"), str(run_dir)]
  command += ["--steps", str(steps)]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  if kill_after_step is None:
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done
  proc = subprocess.Popen(
    command, env=killable(env), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
  )
  metrics, deadline = run_dir / "metrics.jsonl", time.time() + 300
  while True:
    assert proc.poll() is None and time.time() < deadline, "ended before the kill"
    text = metrics.read_text() if metrics.exists() else ""
    saved = [d for d in (run_dir / "checkpoints").glob("*") if d.name.isdigit()]
    if f'"step": {kill_after_step},' in text and saved:  # a kill before the first
      break  # checkpoint is complete leaves history without one: refused, not resumed
    time.sleep(0.01)
  time.sleep(random.uniform(0, 0.05))
  proc.send_signal(signal.SIGKILL)
  proc.communicate(timeout=60)
  return None


@pytest.mark.slow
def test_an_nnx_cnn_killed_at_random_moments_resumes_bitwise(tmp_path):
  random.seed(7)
  steps = 40
  _run_example(tmp_path / "straight", steps)
  killed = tmp_path / "killed"
  for after in sorted(random.sample(range(12, steps - 3), 3)):
    _run_example(killed, steps, kill_after_step=after)
  done = _run_example(killed, steps)
  assert "resumed from the checkpoint" in done.stderr
  a = np.load(tmp_path / "straight" / "final_params.npz")
  b = np.load(killed / "final_params.npz")
  assert sorted(a) == sorted(b)
  for name in a:
    np.testing.assert_array_equal(a[name], b[name], err_msg=name)
  assert _records(killed) == _records(tmp_path / "straight")
  evals = [(killed / "eval.jsonl").read_text(), (tmp_path / "straight" / "eval.jsonl").read_text()]
  assert evals[0] == evals[1]


def test_sigterm_saves_at_the_update_boundary_and_raises_interrupted(tmp_path):
  t = trainer(tmp_path, checkpoint={"every": 0})
  t.add_hook(lambda loop: os.kill(os.getpid(), signal.SIGTERM) if loop.step == 5 else None, every=1)
  with pytest.raises(jaxstep.errors.Interrupted, match="SIGTERM at update step 5"):
    t.fit()
  assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["5"]
  assert trainer(tmp_path).fit().step == 12  # and the same call resumes


def test_eval_batches_that_do_not_split_over_the_mesh_are_refused_up_front():
  import types

  from jaxstep.trainer.trainer_eval import check_first_batches

  four = types.SimpleNamespace(devices=np.zeros((2, 2)), shape={"data": 2, "fsdp": 2})
  check_first_batches({"e": lambda: [batch_of(0)]}, four)  # 8 rows over 4 devices
  odd = dict(batch_of(0), x=np.zeros((6, 3)), y=np.zeros(6), loss_mask=np.ones(6))
  with pytest.raises(BatchError, match=r"eval_sets\['e'\]'s first batch has 6 rows.* 4 dev"):
    check_first_batches({"e": lambda: [odd]}, four)
  check_first_batches({"e": lambda: [odd], "empty": lambda: []})  # one device: any rows


MESH_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np, optax, sys
sys.path.insert(0, {tests!r})
import jaxstep
from jaxstep import parallel
from test_trainer import batch_of, linear_loss
out = []
for name, mesh in (("one", None), ("four", parallel.make_mesh(data=2, fsdp=2))):
  t = jaxstep.Trainer(linear_loss, {{"w": jnp.zeros(4)}}, optax.adam(0.05),
    train_data=[dict(batch_of(i), x=np.pad(batch_of(i)["x"], ((0, 0), (0, 1)))) for i in range(40)],
    eval_sets={{"e": [batch_of(99) | {{"x": np.pad(batch_of(99)["x"], ((0, 0), (0, 1)))}}]}},
    run_dir={tmp!r} + "/" + name, mesh=mesh,
    train={{"global_batch_size": 8, "grad_accum_steps": 2, "max_steps": 6, "progress": False}})
  r = t.fit()
  out.append((np.asarray(r.state.params["w"]), r.evals["e"]["eval_loss"]))
np.testing.assert_allclose(out[0][0], out[1][0], rtol=1e-5, atol=1e-6)
np.testing.assert_allclose(out[0][1], out[1][1], rtol=1e-5)
print("same")
"""


@pytest.mark.slow
def test_a_trainer_on_a_four_device_mesh_equals_one_device(tmp_path):
  script = MESH_SCRIPT.format(tests=str(ROOT / "tests"), tmp=str(tmp_path))
  env = {**os.environ, "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=4")}
  done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
  assert done.returncode == 0 and "same" in done.stdout, done.stderr[-3000:]


def test_only_the_runs_writer_threads_stop_it():
  """A TensorBoard writer thread that dies stops the run; a library's own helper thread
  (a tracker's network thread, say) does not."""
  import threading

  from jaxstep.trainer.tracking.threads import watch_threads

  class Writer(threading.Thread):
    def run(self):
      raise OSError(28, "No space left on device")

  Writer.__module__ = "tensorboardX.event_file_writer"

  def helper():
    raise ConnectionError("a tracker's server went away")

  passed_on = []
  previous, threading.excepthook = threading.excepthook, lambda args: passed_on.append(args)
  try:
    with watch_threads() as errors:
      other = threading.Thread(target=helper)
      other.start()
      other.join()
      assert errors.errors == []
      assert [a.exc_type for a in passed_on] == [ConnectionError]  # to the hook before
      writer = Writer()
      writer.start()
      writer.join()
      with pytest.raises(OSError, match="No space"):
        errors.check()
      assert [a.exc_type for a in passed_on] == [ConnectionError]  # the writer's stayed here
  finally:
    threading.excepthook = previous


def test_a_second_fit_starts_the_data_from_its_beginning(tmp_path):
  t = trainer(tmp_path, train={"max_steps": 3})
  first = t.fit()
  again = t.fit(resume=False)  # the earlier run set aside: the same three batches again
  np.testing.assert_array_equal(first.state.params["w"], again.state.params["w"])
  assert again.position == {"batches": 3, "data": None}


def test_an_aux_named_loss_does_not_overwrite_the_eval_sums(tmp_path):
  def loss_with_mean(params, batch, rng):
    loss_sum, aux = linear_loss(params, batch, rng)
    return loss_sum, {**aux, "loss": loss_sum / aux["rows"]}

  sets = {"a": [batch_of(7)]}
  t = jaxstep.Trainer(
    loss_with_mean,
    {"w": jnp.zeros(3)},
    optax.sgd(0.0),
    train_data=[batch_of(i) for i in range(4)],
    eval_sets=sets,
    run_dir=tmp_path / "run",
    train={"global_batch_size": G, "grad_accum_steps": 1, "max_steps": 1, "progress": False},
  )
  got = t.fit().evals["a"]
  b = sets["a"][0]
  sse = float(np.sum(b["y"] ** 2 * b["loss_mask"]))
  means = (got["eval_loss"], got["eval_aux_loss"])
  expected = (sse / b["loss_mask"].sum(),) * 2
  assert_close(means, expected, terms=3 * G)  # x @ w (3 terms) for every row, over the rows
  # the margin: the sum divided by every row, the masked one too, is far outside it
  assert_far(tuple(m * b["loss_mask"].sum() / G for m in means), expected, terms=3 * G)


def test_only_the_echoes_of_a_reported_checkpoint_failure_are_dropped():
  """After a damaged checkpoint's failed reads, tensorstore's callbacks into orbax's closed
  loop raise "Event loop is closed" from threads: dropped, like a dead TensorBoard writer's
  OSError at exit; any other unraisable exception still reaches the hook before."""
  import sys
  from types import SimpleNamespace

  from jaxstep.trainer.store.orbax_echoes import drop_closed_loop_echoes

  class Writer:
    pass

  Writer.__module__ = "tensorboardX.event_file_writer"
  seen, previous = [], sys.unraisablehook
  sys.unraisablehook = seen.append
  try:
    drop_closed_loop_echoes()
    drop_closed_loop_echoes()  # once: not wrapped twice
    echoes = [
      SimpleNamespace(exc_value=RuntimeError("Event loop is closed"), object=None),
      SimpleNamespace(exc_value=OSError(28, "No space left on device"), object=Writer()),
    ]
    others = [
      SimpleNamespace(exc_value=RuntimeError("something else"), object=None),
      SimpleNamespace(exc_value=OSError(28, "No space left on device"), object=None),
    ]
    for unraisable in echoes + others:
      sys.unraisablehook(unraisable)
  finally:
    sys.unraisablehook = previous
  assert seen == others


def test_both_clients_take_their_resume_refusals_from_one_function(tmp_path, monkeypatch, capsys):
  """``jaxstep train`` and ``jaxstep.Trainer`` resume through ``store.resume.start`` and
  refuse a checkpoint of another run with the same function, in the same words: a changed
  seed, a changed G, and (with a jaxstep schedule) a re-planned lr schedule."""
  import shutil

  from test_old_run_resumes import ARGS

  from jaxstep.cli import train as train_cli
  from jaxstep.trainer.store import resume

  calls, refuse = [], resume.refuse_a_different_run

  def spy(saved, current, **kw):
    calls.append(kw["way_out"])
    return refuse(saved, current, **kw)

  monkeypatch.setattr(resume, "refuse_a_different_run", spy)

  def scheduled(max_steps, **change):
    return jaxstep.Trainer(
      linear_loss,
      {"w": jnp.zeros(3)},
      jaxstep.OptimConfig(lr=0.1, warmup_steps=0),
      train_data=[batch_of(i) for i in range(100)],
      run_dir=tmp_path / "run",
      train={"global_batch_size": G, "grad_accum_steps": 2, "max_steps": max_steps, **change},
      checkpoint={"every": 4},
    )

  scheduled(4).fit()
  refusals = [
    ({"seed": 1}, r"train.seed changed since the checkpoint \(0 → 1\)"),
    ({"global_batch_size": 4}, r"train.global_batch_size changed since the checkpoint \(8 → 4\)"),
  ]
  for change, words in refusals:
    with pytest.raises(CheckpointError, match=words + r".*fit\(resume=False\) to start over"):
      scheduled(4, **change).fit()
  with pytest.raises(CheckpointError, match="lr schedule was planned for 4 update steps, this"):
    scheduled(8).fit()
  # the CLI, on a run written earlier (a fixture with a checkpoint at update 2)
  shutil.copytree(ROOT / "tests" / "fixtures" / "run_before_rooms", tmp_path / "cli")
  monkeypatch.chdir(tmp_path / "cli")
  assert train_cli.main([*ARGS, "train.max_steps=4", "run_dir=run", "train.seed=1"]) == 2
  err = capsys.readouterr().err
  assert "train.seed changed since the checkpoint (0 → 1)" in err and "start a new run_dir" in err
  assert calls == [", or fit(resume=False) to start over"] * 3 + [", or start a new run_dir"]
