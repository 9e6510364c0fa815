"""Throughput accounting: peak FLOP/s per device and model FLOPs utilization (MFU).

MFU = (model FLOPs per token × tokens per second) ÷ (peak FLOP/s × devices). Model FLOPs
per token come from ``GPTConfig.flops_per_token`` (6·W + 12·L·d·S).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

# Dense bf16 peaks, FLOP/s per device, from vendor data sheets (SXM parts).
GPU_PEAKS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12}


def measured_matmul_flops(n: int = 1024, repeats: int = 5, stat=min) -> float:
  """FLOP/s of an fp32 ``n×n`` matmul on the default device: ``stat`` (best by default)
  of ``repeats`` timings."""
  a = jnp.ones((n, n), jnp.float32)
  dot = jax.jit(jnp.dot)
  dot(a, a).block_until_ready()
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    dot(a, a).block_until_ready()
    times.append(time.perf_counter() - t)
  return 2 * n**3 / stat(times)


def peak_flops_per_device(override_tflops: float = 0.0) -> float:
  """The configured peak, a known GPU's bf16 peak, or (CPU, unknown) a measured matmul."""
  if override_tflops > 0:
    return override_tflops * 1e12
  kind = jax.devices()[0].device_kind
  for name, peak in GPU_PEAKS.items():
    if name in kind:
      return peak
  return measured_matmul_flops()


def mfu(flops_per_token: float, tokens_per_sec: float, peak: float, devices: int) -> float:
  return float(np.float64(flops_per_token) * tokens_per_sec / (peak * devices))
