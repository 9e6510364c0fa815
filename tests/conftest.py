"""Shared fixtures: tiny models whose gradients can be checked by hand or by jax.grad."""

import atexit
import json
import os
import pathlib
import shutil
import sys
import tempfile

# Byte-compiled modules are kept (in the git-ignored __pycache__ folders) even where the
# environment says not to (container images set PYTHONDONTWRITEBYTECODE): otherwise every
# pytest-xdist worker rewrites the asserts of every test module again, and every one of the
# suite's subprocesses compiles jaxstep's sources again, each time it starts.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# The reference implementations (transformers, peft, bitsandbytes' kernel loader, datasets)
# never reach the Hugging Face Hub from a test, on a machine with a network too: every folder
# a test reads is built locally, and a call that would download fails at once instead.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def session_folder(variable: str, prefix: str) -> None:
  """Points ``variable`` at a new temporary folder unless the environment names one already.
  The process that makes it (the session's first: pytest-xdist's workers and the tests'
  subprocesses inherit the variable and make none) removes it as it exits, after them: a
  session's caches (~170 MB of compiled programs for both tiers) are not left in the
  temporary dir of every run."""
  if os.environ.get(variable):
    return
  os.environ[variable] = tempfile.mkdtemp(prefix=prefix)
  atexit.register(shutil.rmtree, os.environ[variable], True)


# Raw data is prepared into a cache on first use: one per test session, never the user's.
session_folder("JAXSTEP_CACHE", "jaxstep-test-cache-")
# What ``once_per_session`` keeps for the session's other pytest-xdist workers.
session_folder("JAXSTEP_TEST_SESSION", "jaxstep-test-session-")
# Compiled programs too: the many subprocess runs of the same small configs compile each
# program once per session instead of once per process. Processes a test kills pass
# ``killable(env)``: jax writes cache entries in place, so each such process reads a
# snapshot of the session's cache (hard links, taken as it starts) and a kill mid-write
# truncates an entry of that snapshot only.
JIT_CACHE = "JAX_COMPILATION_CACHE_DIR"
session_folder(JIT_CACHE, "jaxstep-test-jit-")
# a command started without JAX's variable keeps to the session's cache too, not the user's
os.environ.setdefault("JAXSTEP_XLA_CACHE", os.environ[JIT_CACHE])
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.3")
# Processes of the session (pytest-xdist's workers, the tests' subprocesses) share that cache:
# with a size limit jax takes a file lock around each read and write of an entry, so that no
# process reads an entry another one is writing.
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(16 * 2**30))


def _fast_compile_flags() -> list[str]:
  """XLA flags under which the CPU backend compiles the tests' many small programs 2-3×
  faster (the programs run slower; no test times them, and none depends on last bits): no
  LLVM optimizations and, on the jaxlib where that was measured (XLA aborts on a flag it
  does not know), the older fusion emitters."""
  from importlib.metadata import version

  flags = ["--xla_backend_optimization_level=0"]
  if version("jaxlib").startswith("0.10."):
    flags.append("--xla_cpu_use_fusion_emitters=false")
  return flags


FAST_COMPILE = _fast_compile_flags()


def xla_flags(*flags: str) -> str:
  """``XLA_FLAGS`` for a test's subprocess: ``flags`` (e.g. a device count) and the session's
  fast-compile ones."""
  return " ".join([*flags, *(f for f in FAST_COMPILE if f not in flags)])


def long_run_env(**extra: str) -> dict:
  """The environment for a subprocess that trains for hundreds of updates: the session's,
  without the fast-compile flags, whose unoptimized code runs such a demo's steps 2-3×
  slower once compiled."""
  own = [f for f in os.environ.get("XLA_FLAGS", "").split() if f not in FAST_COMPILE]
  return {**os.environ, "XLA_FLAGS": " ".join(own), **extra}


os.environ["XLA_FLAGS"] = xla_flags(*os.environ.get("XLA_FLAGS", "").split())

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from jaxstep import config as config_lib  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
# The backend starts now, with one CPU device: a command run in-process later (many tests
# call a command's entry point) then leaves the device count and XLA_FLAGS of this process
# alone and logs no "CPU: N devices" line, whichever test a worker happens to run first.
jax.devices()


def regression_loss(params, batch, rng):
  """Σ mask·(w·x − y)²/2 over the micro-batch: per-sample gradient (w·x − y)·x."""
  del rng
  err = params["w"] * batch["x"] - batch["y"]
  return jnp.sum(batch["loss_mask"] * 0.5 * err**2), {}


def tiny_lm_apply(params, inputs, *, rng=None, train=False):
  """A cheap sequence model: causal running mean of embeddings → linear head. ``[B,S,V]``."""
  del rng, train
  h = params["embed"][inputs]  # [B, S, D]
  h = jnp.cumsum(h, axis=1) / jnp.arange(1, inputs.shape[1] + 1)[None, :, None]
  return jnp.tanh(h) @ params["head"]["kernel"] + params["head"]["bias"]


def tiny_lm_params(vocab=11, dim=6, seed=0):
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
  return {
    "embed": jax.random.normal(k1, (vocab, dim)),
    "head": {
      "kernel": jax.random.normal(k2, (dim, vocab)) * 0.5,
      "bias": jax.random.normal(k3, (vocab,)) * 0.1,
    },
  }


def lm_batch(rng: np.random.Generator, g: int, s: int, vocab: int, mask=None):
  tokens = rng.integers(0, vocab, size=(g, s + 1), dtype=np.int32)
  if mask is None:
    mask = np.ones((g, s), np.int32)
  return {
    "inputs": jnp.asarray(tokens[:, :-1]),
    "targets": jnp.asarray(tokens[:, 1:]),
    "loss_mask": jnp.asarray(mask, jnp.int32),
  }


class LazyModule:
  """A reference library imported at its first use, not at collection: peft's import takes
  seconds, and every pytest-xdist worker collects every test module. Where it is missing, the
  test that uses it is skipped, as ``pytest.importorskip`` at module level would."""

  def __init__(self, name: str):
    self._name = name

  def __getattr__(self, attr):
    if attr.startswith("_"):  # pytest looks for fixture markers on every module attribute
      raise AttributeError(attr)
    return getattr(pytest.importorskip(self._name), attr)


@pytest.fixture
def np_rng():
  return np.random.default_rng(0)


# The tiny random Hugging Face model the parity tests build locally (``from_config``).
TINY_HF_SHAPE = {
  "vocab_size": 96,
  "hidden_size": 32,
  "intermediate_size": 48,
  "num_hidden_layers": 2,
  "num_attention_heads": 4,
  "num_key_value_heads": 2,
  "max_position_embeddings": 64,
}

SMALL_MODEL = [
  "model.d_model=32",
  "model.n_layers=1",
  "model.n_heads=2",
  "model.max_seq_len=16",
  "train.seq_len=16",
  "train.progress=false",
]


def make_cfg(tmp_path, *overrides, docs=200):
  tmp_path.mkdir(parents=True, exist_ok=True)
  corpus = tmp_path / "corpus.txt"
  if not corpus.exists():
    rng = np.random.default_rng(0)
    corpus.write_text(
      "\n\n".join(f"{a} + {b} = {a + b}" for a, b in rng.integers(0, 50, size=(docs, 2)))
    )
  # a schedule of fixed length, so a test may resume a run with a larger max_steps
  fixed = "train.schedule_steps=64"
  return config_lib.load(
    None, [*SMALL_MODEL, fixed, f"data.path={corpus}", f"run_dir={tmp_path / 'run'}", *overrides]
  )


def read_lines(path):
  return [json.loads(line) for line in path.read_text().splitlines()]


def restore_state_arrays(run_dir, step=None):
  """``(step, state tree)`` of a run's checkpoint (the newest by default) onto this process's
  first device, whatever device layout wrote it (the CLI splits a CPU into several devices);
  read and verified as a resume reads it, so a test fails on a checkpoint that does not."""
  from jaxstep.trainer.store.checkpoint_read import read_step, step_dirs

  steps = dict(step_dirs(run_dir / "checkpoints"))
  read = read_step(steps[step or max(steps)])
  assert read.problem is None, read.problem
  return read.step, read.state


def bitwise_same_checkpoints(straight, killed):
  """Asserts that the newest checkpoints of two run dirs hold the same step and bitwise
  the same state; returns ``(step, state)``."""
  (step_a, a), (step_b, b) = restore_state_arrays(straight), restore_state_arrays(killed)
  assert step_a == step_b, (step_a, step_b)
  pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in pairs)
  return step_a, a


def can_mount() -> bool:
  import os
  import shutil

  return os.geteuid() == 0 and shutil.which("mount") is not None


def remount_read_only_when_free(point: pathlib.Path, timeout: float = 30.0) -> None:
  """The kernel refuses ``remount,ro`` ("mount point is busy") while a file there is open
  for writing, which a running save does for a moment: try again until it is free."""
  import subprocess
  import time

  deadline = time.monotonic() + timeout
  while True:
    proc = subprocess.run(["mount", "-o", "remount,ro", str(point)], capture_output=True, text=True)
    if proc.returncode == 0:
      return
    if time.monotonic() > deadline:
      raise AssertionError(f"cannot remount {point} read-only: {proc.stderr}")
    time.sleep(0.02)


@pytest.fixture
def tmpfs(tmp_path):
  """A small tmpfs of its own (root only), unmounted after the test."""
  import subprocess

  mounts = []

  def mount(size: str, read_only: bool = False) -> pathlib.Path:
    point = tmp_path / f"mnt{len(mounts)}"
    point.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)])
    if proc.returncode:
      pytest.skip("cannot mount a tmpfs here")
    mounts.append(point)
    return point

  def remount_read_only(point: pathlib.Path) -> None:
    remount_read_only_when_free(point)

  if not can_mount():
    pytest.skip("mounting a tmpfs needs root")
  mount.read_only = remount_read_only
  yield mount
  for point in mounts:
    subprocess.run(["umount", "-l", str(point)])


@pytest.fixture(autouse=True)
def restore_logging():
  """A command's ``setup_logging`` points the root logger at this test's captured stderr;
  later tests must not log into that closed stream (every test: commands run in-process
  in many files)."""
  import logging

  root = logging.getLogger()
  handlers, level = list(root.handlers), root.level
  yield
  root.handlers[:], root.level = handlers, level


HELPERS = pathlib.Path(__file__).resolve().parent / "helpers"


def devices_env(n: int) -> dict:
  """The session's environment for a subprocess on ``n`` virtual CPU devices."""
  return {
    **os.environ,
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": xla_flags(f"--xla_force_host_platform_device_count={n}"),
  }


def helper_lines(script: str, devices: int, timeout: int) -> list[dict]:
  """The JSON lines that ``tests/helpers/SCRIPT`` prints on ``devices`` virtual CPU devices,
  run once per test session (``once_per_session``): the helpers that check every mesh
  against one device take minutes, and each module that reads them has tests on both
  pytest-xdist workers, whose module fixtures are set up once each."""
  import subprocess

  def run() -> str:
    proc = subprocess.run([sys.executable, str(HELPERS / script)], env=devices_env(devices),
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout

  return [json.loads(line) for line in once_per_session(script, run).splitlines()]


def once_per_session(name: str, compute) -> str:
  """``compute()``'s text, computed by the first process of the test session that asks for
  ``name`` and read back by the others: they wait on a lock file in the session's folder
  while it computes. A ``compute`` that fails leaves nothing, and the next one asking tries
  again (and fails the same way, in its own test)."""
  import fcntl

  folder = pathlib.Path(os.environ["JAXSTEP_TEST_SESSION"])
  done = folder / f"{name}.out"
  with open(folder / f"{name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # released as the file closes
    if not done.exists():
      partial = folder / f"{name}.partial"
      partial.write_text(compute())
      partial.replace(done)
    return done.read_text()


def killable(env: dict) -> dict:
  """``env`` for a process a test may kill: it compiles into a snapshot of the session's
  compilation cache (hard links to the entries there now, so it starts warm), never into the
  session's own, where a kill mid-write would leave a truncated entry for the next process
  to warn about. jax never rewrites an entry that exists, so a linked one stays whole."""
  if not env.get(JIT_CACHE):
    return dict(env)
  snapshot = tempfile.mkdtemp(prefix="jaxstep-test-jit-killable-")
  atexit.register(shutil.rmtree, snapshot, True)
  shutil.copytree(env[JIT_CACHE], snapshot, copy_function=os.link, dirs_exist_ok=True)
  return {**env, JIT_CACHE: snapshot}


def straight_and_killed(tmp_path, args, kill_at: int):
  """Trains ``args`` (``jaxstep.train`` overrides) into ``tmp_path/straight`` to the end, and
  into ``tmp_path/killed`` with a SIGKILL once the checkpoint of update step ``kill_at``
  exists, then the same command again to the end; returns the two run dirs."""
  import os
  import signal
  import subprocess
  import sys
  import time

  env = {**os.environ, "JAX_PLATFORMS": "cpu"}

  def command(name):
    return [sys.executable, "-m", "jaxstep.train", *args, f"run_dir={tmp_path / name}"]

  done = subprocess.run(command("straight"), env=env, capture_output=True, text=True)
  assert done.returncode == 0, done.stderr[-2000:]
  proc = subprocess.Popen(command("killed"), env=killable(env), stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 120
  while not (tmp_path / "killed" / "checkpoints" / str(kill_at)).exists():
    assert time.time() < deadline and proc.poll() is None, "no checkpoint to kill after"
    time.sleep(0.02)
  proc.send_signal(signal.SIGKILL)
  proc.communicate(timeout=60)
  done = subprocess.run(command("killed"), env=env, capture_output=True, text=True)
  assert done.returncode == 0 and "resumed from the checkpoint" in done.stderr, done.stderr
  return tmp_path / "straight", tmp_path / "killed"


# Threads a test may leave behind: process-wide singletons, started once and reused by later
# tests (tqdm's monitor of all progress bars). A run's own threads (TensorBoard's event
# writer, the trackers' sender, data read-ahead) are never here.
LONG_LIVED_THREADS = ("tqdm_monitor",)
GRACE_S = 0.1  # how long they get before garbage holding a thread or a file is collected
LEAK_JOIN_S = 2.0  # and after: a thread still alive then is left behind


def _open_files_under(root: str) -> dict[str, str]:
  """This process's file descriptors open on files under ``root``: ``{fd: path}``."""
  found = {}
  for fd in os.listdir("/proc/self/fd"):
    try:
      path = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # closed meanwhile (the listing's own descriptor)
      continue
    if path.startswith(root):
      found[fd] = path
  return found


# Child processes that serve the whole test process once started: multiprocessing's
# resource tracker (started by the first "spawn" process, e.g. prepare's workers).
LONG_LIVED_CHILDREN = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def _live_children() -> set[int]:
  """Child processes of this one that have not exited (zombies and the long-lived ones
  excluded)."""
  pids = set()
  for task in os.listdir("/proc/self/task"):
    try:
      pids |= {int(p) for p in pathlib.Path(f"/proc/self/task/{task}/children").read_text().split()}
    except OSError:
      continue
  alive = set()
  for pid in pids:
    try:
      state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
      command = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except (OSError, IndexError):
      continue
    if state not in ("Z", "X") and not any(name in command for name in LONG_LIVED_CHILDREN):
      alive.add(pid)
  return alive


@pytest.fixture
def tracker_libraries_ended():
  """Ends, after the test, what the tracker libraries keep for their whole process and
  ``no_leaks`` would otherwise report: MLflow's cached artifact repository of each run, each
  with a thread pool, and W&B's service process and threads shared by all its runs."""
  import sys

  yield
  if "mlflow" in sys.modules:
    from mlflow.tracking._tracking_service import utils

    for repo in utils._artifact_repos_cache.values():
      if getattr(repo, "thread_pool", None) is not None:
        repo.thread_pool.shutdown(wait=True)
    utils._artifact_repos_cache.clear()
  if "wandb" in sys.modules:
    import wandb

    wandb.teardown()


@pytest.fixture(autouse=True)
def no_leaks(request, tmp_path_factory):
  """Fails the test that leaves a thread, a child process or a file of the test session's
  temporary folders open after it ends. Such a leftover outlives the test and acts under a
  later one: a disk-full test's TensorBoard writer thread flushed into the full disk two
  minutes later and failed there, reported as a warning of an unrelated test.

  Threads the test started get ``GRACE_S`` to end; if anything is still there, garbage is
  collected (an unreachable thread pool or memory map ends with it) and threads get
  ``LEAK_JOIN_S`` more. No wait and no collection when nothing is left. ``LONG_LIVED_THREADS``
  names the process-wide ones that may stay."""
  import gc
  import threading
  import time

  root = str(tmp_path_factory.getbasetemp())
  threads, files, children = set(threading.enumerate()), _open_files_under(root), _live_children()

  def left_behind(wait: float) -> list[str]:
    deadline = time.monotonic() + wait
    started = [
      t for t in threading.enumerate() if t not in threads and t.name not in LONG_LIVED_THREADS
    ]
    for thread in started:
      thread.join(max(deadline - time.monotonic(), 0.0))
    leaks = [f"thread {t.name!r} ({type(t).__module__}.{type(t).__qualname__})"
             for t in started if t.is_alive()]  # fmt: skip
    opened = _open_files_under(root).items()
    leaks += [f"open file {path}" for fd, path in opened if files.get(fd) != path]
    return leaks + [f"child process {pid}" for pid in sorted(_live_children() - children)]

  yield
  if left_behind(GRACE_S):
    gc.collect()
    if leaks := left_behind(LEAK_JOIN_S):
      pytest.fail(f"{request.node.nodeid} left behind: {'; '.join(leaks)}", pytrace=False)


# --- test tiers ---------------------------------------------------------------------------
# `pytest` runs the fast tier; the tests marked slow (subprocess runs, kills and resumes,
# meshes of 8 devices, real-size compiles) opt in, as large projects do it: `--slow` (or
# JAXSTEP_SLOW=1) runs everything, `--slow -m slow` the slow tier alone. A slow test named
# on the command line (`pytest tests/test_cli.py::test_…`) or selected with `-m slow` runs anyway.


def pytest_addoption(parser):
  parser.addoption(
    "--slow",
    action="store_true",
    help="also run the tests marked slow (the whole suite); JAXSTEP_SLOW=1 does the same",
  )


def _named(item, config) -> bool:
  """Whether the command line names ``item`` itself (``FILE::test``, maybe parametrized)."""
  for arg in config.args:
    file, sep, name = arg.partition("::")
    if (
      sep
      and item.path == pathlib.Path(file).resolve()
      and item.nodeid.split("::", 1)[1].startswith(name)
    ):
      return True
  return False


def pytest_collection_modifyitems(config, items):
  wanted = config.getoption("--slow") or os.environ.get("JAXSTEP_SLOW") == "1"
  if wanted or "slow" in (config.option.markexpr or ""):
    return
  slow = [item for item in items if item.get_closest_marker("slow") and not _named(item, config)]
  if slow:
    config.hook.pytest_deselected(items=slow)
    items[:] = [item for item in items if item not in slow]
