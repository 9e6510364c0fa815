"""CPU defaults, applied by the CLI before JAX starts its backend.

On a CPU-only host XLA runs one device's program on a shared thread pool; splitting the
global batch over one virtual device per core, each single-threaded, and reducing once per
update is faster than one device using every core. XLA's YNNPACK fusions are kept on for
several devices but turned off for a single multi-threaded device, where they are slower.
XLA aborts on unknown flags, so the YNN flag is only set on the jaxlib it was measured on.
The measurements behind each choice, and how to repeat them: docs/performance.md.
"""

from __future__ import annotations

import importlib.util
import logging
import os

import jax
import jaxlib
from jax._src import xla_bridge

from jaxstep.core import geometry

log = logging.getLogger("jaxstep")
YNN_OFF = "--xla_cpu_experimental_ynn_fusion_type="
# One thread per virtual device: the devices already use every core.
ONE_THREAD = "--xla_cpu_multi_thread_eigen=false"
ACCELERATOR_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm7_plugin", "libtpu")


def _cpu_only() -> bool:
  """True when JAX will run on the CPU: forced by JAX_PLATFORMS, or no accelerator plugin."""
  platforms = os.environ.get("JAX_PLATFORMS", "")
  if platforms:
    return platforms.split(",")[0].strip() == "cpu"
  return not any(importlib.util.find_spec(p) for p in ACCELERATOR_PLUGINS)


def cpu_device_count(
  global_batch_size: int,
  grad_accum_steps: int,
  cores: int,
  *,
  data: int = 0,
  fsdp: int = 0,
  cpu_devices: int = 0,
  tensor: int = 1,
) -> int:
  """Devices to split one CPU into: ``cpu_devices`` if set, else ``data × fsdp × tensor``
  if data and fsdp are set, else the most (≤ ``cores``, at least ``tensor``, a multiple of
  ``tensor`` × the one mesh size set) whose batch shards (devices ÷ tensor) divide G into
  equal micro-batch shards (G % (shards × K) == 0)."""
  if cpu_devices:
    return cpu_devices
  if data > 0 and fsdp > 0:
    return data * fsdp * tensor
  fixed = max(data, fsdp, 1) * tensor
  fits = [
    d
    for d in range(1, max(cores, tensor, 1) + 1)
    if d % fixed == 0 and geometry.divides(global_batch_size, grad_accum_steps, d // tensor)
  ]
  return max(fits) if fits else tensor


def extra_xla_flags(devices: int, flags: str, jaxlib_version: str) -> str:
  """The XLA flags the CLI adds for ``devices`` virtual CPU devices: one eigen thread per
  device when there are several; YNNPACK fusion off for a single device (jaxlib 0.10 only,
  where it was measured, and only if ``flags`` does not set it already)."""
  if devices > 1:
    return ONE_THREAD
  if jaxlib_version.startswith("0.10.") and "ynn_fusion_type" not in flags:
    return YNN_OFF
  return ""


def configure_cpu_defaults(
  global_batch_size: int,
  grad_accum_steps: int,
  *,
  data: int = 0,
  fsdp: int = 0,
  cpu_devices: int = 0,
  tensor: int = 1,
) -> None:
  """Sets the CPU device count (``cpu_device_count``) and XLA flags; a no-op on
  accelerators, when the user already chose (``XLA_FLAGS`` device count), or once the
  backend has started."""
  if not _cpu_only() or xla_bridge.backends_are_initialized():
    return
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" in flags:
    return
  n = cpu_device_count(
    global_batch_size,
    grad_accum_steps,
    os.cpu_count() or 1,
    data=data,
    fsdp=fsdp,
    cpu_devices=cpu_devices,
    tensor=tensor,
  )
  extra = extra_xla_flags(n, flags, jaxlib.__version__)
  if extra:
    os.environ["XLA_FLAGS"] = f"{flags} {extra}".strip()
  jax.config.update("jax_num_cpu_devices", n)
  log.info(
    "CPU: %d device%s; XLA_FLAGS %r",
    n,
    "" if n == 1 else "s",
    os.environ.get("XLA_FLAGS", ""),
  )


def fresh_compiles_for_expert_meshes(mesh) -> None:
  """Turns JAX's persistent compilation cache off for this process when ``mesh`` has an
  expert axis on CPU devices.

  XLA:CPU runs an expert-parallel train step that it loaded from the cache with its
  collectives out of order across devices: one device waits in the MoE layer's all-gather
  while another waits in the all-reduce of the token count, until XLA's rendezvous
  terminates the process after 40 s. The same program compiled in the process runs (tested
  over dozens of runs; jaxlib 0.10), so such a run compiles its programs every start. Other
  meshes keep the cache: their resumed runs load the same programs and run them."""
  if mesh.shape.get("expert", 1) == 1 or mesh.devices.flat[0].platform != "cpu":
    return
  if not jax.config.jax_enable_compilation_cache:
    return
  from jax.experimental.compilation_cache import compilation_cache

  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()
  log.info(
    "compilation cache: off for this run (XLA:CPU runs an expert-parallel step loaded from "
    "it with its collectives out of order)"
  )
