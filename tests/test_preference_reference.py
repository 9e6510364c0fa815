"""``preference.reference: precompute``: the reference's log-probs of every pair computed
once before training, stored with the key of the weights and the data they belong to, read
by the batches; a file of other weights or data, cut short or with changed bytes refused,
an interrupted computation continued from its parts, a refused write cleaned up."""

import json
import math

import jax
import numpy as np
import pytest
from fault_helpers import IO_EXIT, damage, enospc, failing_after, one_error
from test_preference_run import BASE, FULL, cfg_for, logged, sums_file

from jaxstep import models
from jaxstep.cli import train as train_cli
from jaxstep.cli._common import exit_code
from jaxstep.data import preference_pairs
from jaxstep.errors import DataError, RunIOError
from jaxstep.trainer import config_run
from jaxstep.trainer.plan import reference_logps
from jaxstep.trainer.plan.build import build

PRE = [*FULL, "preference.reference=precompute"]


def _by_hand(cfg, params, pairs) -> np.ndarray:
  """Each pair's summed completion log-probs, one pair at a time, log-softmax in numpy
  (float64): an independent computation of what the file should hold."""
  apply_fn, _ = models.build(cfg.model, jax.random.PRNGKey(0), abstract=True)
  out = np.zeros((len(pairs), 2))
  for i in range(len(pairs)):
    for j, side in enumerate(preference_pairs.SIDES):
      ids, targets, mask = (
        pairs.arrays[f"{side}_{part}"][i] for part in ("inputs", "targets", "mask")
      )
      logits = np.asarray(apply_fn(params, ids[None], train=False)[0], np.float64)
      top = logits.max(-1, keepdims=True)
      logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
      out[i, j] = np.sum(mask * logp[np.arange(len(ids)), targets])
  return out


@pytest.mark.slow
def test_precomputed_log_probs_are_the_starting_weights_and_train_as_a_live_copy(tmp_path):
  """The file holds every pair's reference log-probs under the starting weights (checked
  pair by pair against an independent computation) with the key of those weights and the
  data; the run's losses and metrics equal a run holding a live frozen copy."""
  result = config_run.train(cfg_for(tmp_path, *PRE))
  run, start, _ = build(cfg_for(tmp_path, *PRE, name="fresh"))
  with np.load(tmp_path / "run" / "reference_logps.npz") as f:
    logps, key = f["logps"], json.loads(str(f["key"]))
  pairs = run.dataset.pairs
  assert logps.shape == (len(pairs), 2) == (20, 2)
  want = _by_hand(run.cfg, jax.device_get(start.params), pairs)
  np.testing.assert_allclose(logps, want, rtol=1e-5, atol=1e-4)
  assert key == reference_logps.key_of(
    reference_logps.weights_digest(start.params), run.dataset.fingerprint, 20
  )
  assert result.state.model_state is None  # no copy of the model is held
  config_run.train(cfg_for(tmp_path, *FULL, name="live"))
  first = logged(tmp_path / "run")[0]
  assert first["loss"] == pytest.approx(math.log(2), abs=1e-5)
  for a, b in zip(logged(tmp_path / "run"), logged(tmp_path / "live"), strict=True):
    for name in ("loss", "grad_norm", "rewards/margins", "logps/chosen"):  # not a 0/1 count
      np.testing.assert_allclose(a[name], b[name], rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.slow
def test_a_lora_run_precomputes_with_the_adapters_off_and_k_micro_batches_agree(tmp_path):
  """On a LoRA run the reference is the base: the first loss is ln 2 (the policy is its
  reference), and K = 2 and 4 train as K = 1 with a padded last batch."""
  lora = ["model.lora.rank=4", "model.lora.alpha=8", *PRE]
  runs = {}
  for k in (1, 2, 4):
    config_run.train(cfg_for(tmp_path, *lora, f"train.grad_accum_steps={k}", name=f"k{k}"))
    runs[k] = logged(tmp_path / f"k{k}")
  assert runs[1][0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
  assert [r["tokens"] for r in runs[1]] == [8, 8, 4]
  for k in (2, 4):
    for a, b in zip(runs[1], runs[k], strict=True):
      for name in ("loss", "grad_norm", "rewards/margins"):
        np.testing.assert_allclose(b[name], a[name], rtol=2e-5, atol=1e-5, err_msg=name)


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
  """The reference file a one-update precompute run wrote (read, never changed, by tests)."""
  tmp_path = tmp_path_factory.mktemp("stored")
  config_run.train(cfg_for(tmp_path, *PRE, "train.max_steps=1"))
  return tmp_path / "run" / "reference_logps.npz"


@pytest.mark.parametrize(
  "other, words",
  [(["train.seed=1"], "other weights"), (["preference.max_prompt_len=8"], "other data")],
)
def test_a_file_of_other_weights_or_data_is_one_line_and_exit_2(
  tmp_path, capsys, stored, other, words
):
  path = sums_file(tmp_path)
  args = [*BASE, *PRE, f"data.path={path}", f"run_dir={tmp_path / 'other'}", *other]
  assert train_cli.main([*args, f"preference.reference_file={stored}"]) == 2
  err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
  assert len(err) == 1 and words in err[0] and "delete it" in err[0], err
  assert not (tmp_path / "other").exists()


def test_reference_file_without_precompute_is_refused(tmp_path, capsys):
  args = [*BASE, *FULL, f"data.path={sums_file(tmp_path)}", f"run_dir={tmp_path / 'run'}"]
  assert train_cli.main([*args, "preference.reference_file=x.npz"]) == 2
  assert "preference.reference=precompute" in capsys.readouterr().err


def test_an_interrupted_computation_continues_from_its_parts(tmp_path, monkeypatch):
  """With one batch per part: parts an earlier computation (same key) left are read, not
  computed again; parts of another computation are discarded."""
  monkeypatch.setattr(reference_logps, "CHUNK", 1)
  run, state, _ = build(cfg_for(tmp_path, *PRE))
  g, pairs = run.cfg.train.global_batch_size, run.dataset.pairs
  key = reference_logps.key_of("w", "d", len(pairs))
  path = tmp_path / "ref.npz"
  args = (run.reference_fn, state.params, pairs, g, run.batch_sharding)
  whole = reference_logps.compute(path, key, *args)
  assert not path.with_name("ref.npz.partial").exists()
  parts = path.with_name("ref.npz.partial")
  parts.mkdir()
  (parts / "key.json").write_text(json.dumps({**key, "global_batch_size": g, "chunk": 1}))
  np.save(parts / "part-00001.npy", np.full((g, 2), -7.0, np.float32))  # batch 1 "done"
  got = reference_logps.compute(path, key, *args)
  assert np.all(got[g : 2 * g] == -7.0)
  np.testing.assert_array_equal(
    np.delete(got, np.s_[g : 2 * g], 0), np.delete(whole, np.s_[g : 2 * g], 0)
  )
  parts.mkdir()
  (parts / "key.json").write_text(json.dumps({**key, "global_batch_size": g + 1, "chunk": 1}))
  np.save(parts / "part-00001.npy", np.full((g, 2), -7.0, np.float32))
  np.testing.assert_array_equal(reference_logps.compute(path, key, *args), whole)
  assert np.array_equal(reference_logps.read(path, key), whole)


@pytest.mark.parametrize("how", ["cut", "flipped"])
def test_a_cut_or_changed_file_is_refused_naming_it_and_what_to_do(tmp_path, how):
  """A file cut short, or with 16 bytes of its log-probs changed (the zip's CRC-32 of the
  array, checked as it is read whole), is one DataError (exit 2) naming it and the fix."""
  key = reference_logps.key_of("w", "d", 64)
  logps = np.linspace(-9.0, -1.0, 128, dtype=np.float32).reshape(64, 2)
  path = tmp_path / "reference_logps.npz"
  reference_logps.write(path, key, logps)
  assert np.array_equal(reference_logps.read(path, key), logps)
  damage(path, how, logps.tobytes())
  with pytest.raises(DataError, match="cannot be read as a file of precomputed") as e:
    reference_logps.read(path, key)
  assert str(path) in str(e.value) and "delete it to compute them again" in str(e.value)
  assert exit_code(e.value) == 2


@pytest.mark.parametrize("writes", [0, 2, 4], ids=["key", "part", "file"])
def test_a_write_the_disk_refuses_is_exit_74_and_leaves_nothing_partial(
  tmp_path, monkeypatch, writes
):
  """A full disk at the parts' key, at a part or at the finished file: one RunIOError
  (exit 74) naming the file, and neither the parts folder nor a temporary file is left
  (nothing that holds room or blocks the next try)."""
  from jaxstep.trainer.store import records

  monkeypatch.setattr(reference_logps, "CHUNK", 1)
  g = 4
  monkeypatch.setattr(
    reference_logps,
    "batch_logps",
    lambda fn, params, pairs, g, sharding, batches: np.full((len(batches) * g, 2), -1.0),
  )
  write = failing_after(writes, enospc, records.write_atomic)
  monkeypatch.setattr(records, "write_atomic", write)
  folder = tmp_path / "side"
  folder.mkdir()
  path, key = folder / "ref.npz", reference_logps.key_of("w", "d", 12)
  with pytest.raises(RunIOError) as e:
    reference_logps.compute(path, key, None, None, range(12), g, None)
  assert f"writing the reference log-probs to {path} failed (No space left" in str(e.value)
  assert exit_code(e.value) == IO_EXIT
  assert list(folder.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("how", ["cut", "flipped"])
def test_a_resume_over_a_cut_or_changed_file_is_one_line_and_exit_2(tmp_path, capsys, how):
  """The run's own file, damaged before a resume, is refused in one line before anything is
  written (a recomputation on another machine or mesh may differ in the last bits from the
  numbers the earlier updates used); deleting it, as the line says, lets the run go on."""
  config_run.train(cfg_for(tmp_path, *PRE, "train.max_steps=1"))
  run_dir = tmp_path / "run"
  stored = run_dir / "reference_logps.npz"
  with np.load(stored) as f:
    inside = f["logps"].tobytes()
  damage(stored, how, inside)
  metrics = (run_dir / "metrics.jsonl").read_bytes()
  args = [*BASE, *PRE, f"data.path={sums_file(tmp_path)}", f"run_dir={run_dir}"]
  assert train_cli.main([*args, "train.max_steps=2"]) == 2
  line = one_error(capsys)
  assert f"{stored} cannot be read as a file of precomputed" in line and "delete it" in line
  assert (run_dir / "metrics.jsonl").read_bytes() == metrics
  stored.unlink()
  assert train_cli.main([*args, "train.max_steps=2"]) == 0
  assert [r["step"] for r in logged(run_dir)] == [1, 2]


@pytest.mark.slow
def test_a_reference_file_on_a_full_disk_is_exit_74_and_the_next_try_runs(tmp_path, tmpfs, capsys):
  """``preference.reference_file`` on a full filesystem: one line and exit 74, nothing of
  the computation left there; with room made the same command runs."""
  point = tmpfs("16k")
  filler = point / "filler"
  with filler.open("wb", buffering=0) as f, pytest.raises(OSError, match="No space"):
    while True:
      f.write(b"x" * 1024)
  path = point / "ref.npz"
  args = [*BASE, *PRE, f"data.path={sums_file(tmp_path)}", f"run_dir={tmp_path / 'run'}"]
  args += ["train.max_steps=1", f"preference.reference_file={path}"]
  assert train_cli.main(args) == IO_EXIT
  line = one_error(capsys)
  assert f"writing the reference log-probs to {path} failed (No space left" in line
  assert list(point.iterdir()) == [filler]
  filler.unlink()
  assert train_cli.main(args) == 0
  assert sorted(p.name for p in point.iterdir()) == ["ref.npz"]


@pytest.mark.slow
def test_check_and_the_memory_ledger_take_a_precompute_config(tmp_path, capsys):
  from jaxstep.cli import check as check_cli
  from jaxstep.cli import memory as memory_cli

  args = [*BASE, *PRE, f"data.path={sums_file(tmp_path)}", f"run_dir={tmp_path / 'run'}"]
  check_cli.main([*args, "model.lora.rank=4"])
  assert "PASS: accumulation is exact" in capsys.readouterr().out
  assert memory_cli.main(args) == 0
  assert "computed once before training" in capsys.readouterr().out


@pytest.mark.slow
def test_a_precompute_run_killed_with_sigkill_resumes_bitwise(tmp_path):
  """The resumed run reads the stored log-probs (not computed again) and ends bitwise equal
  to the uninterrupted run."""
  from conftest import bitwise_same_checkpoints, straight_and_killed

  path = sums_file(tmp_path)
  args = [*BASE, *PRE, f"data.path={path}", "train.max_steps=6", "checkpoint.every=2"]
  straight, killed = straight_and_killed(tmp_path, [*args, "mesh.cpu_devices=1"], kill_at=2)
  step, _ = bitwise_same_checkpoints(straight, killed)
  assert step == 6
  files = [np.load(d / "reference_logps.npz")["logps"] for d in (straight, killed)]
  assert np.array_equal(*files)
  assert [r["loss"] for r in logged(straight)] == [r["loss"] for r in logged(killed)]


@pytest.mark.slow
def test_a_precompute_run_on_four_devices_equals_one_device(tmp_path):
  """The log-probs computed with the params over 4 devices (fsdp) and with the pairs over 4
  (data) equal one device's, and so do the runs' losses."""
  from test_preference_run import _cli_run

  pre = ["preference.reference=precompute"]
  one = _cli_run(tmp_path, "one", "mesh.cpu_devices=1", *pre)
  want = np.load(tmp_path / "one" / "reference_logps.npz")["logps"]
  for name, mesh in {"data": ["mesh.data=4"], "fsdp": ["mesh.fsdp=4", "mesh.data=1"]}.items():
    got = _cli_run(tmp_path, name, "mesh.cpu_devices=4", *mesh, *pre)
    logps = np.load(tmp_path / name / "reference_logps.npz")["logps"]
    np.testing.assert_allclose(logps, want, rtol=1e-5, atol=1e-5, err_msg=name)
    for a, b in zip(one, got, strict=True):
      for key in ("loss", "rewards/margins", "logps/rejected"):
        np.testing.assert_allclose(b[key], a[key], rtol=2e-5, atol=1e-5, err_msg=f"{name} {key}")
