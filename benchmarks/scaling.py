"""What one update step sends between devices, and what each host writes and reads, as a
job grows: the train step of a config compiled (never run) on a data × fsdp mesh of virtual
CPU devices, its collectives counted from the compiled HLO text, and the per-host bytes.

  python -m benchmarks.scaling --config gpt-1.3b --data 8 --fsdp 8 --ks 1,8

Measured (from the compiled HLO, per device): every all-reduce, reduce-scatter, all-gather,
all-to-all and collective-permute of the step, its count, operands, replica group (the mesh
axis it runs over) and operand bytes, and whether it sits in a while loop (it would then run
once per iteration). Computed from those: bytes on the wire per device (ring algorithms),
checkpoint bytes per host (state bytes / hosts) and data bytes read per host per update
(G × (S + 1) × token bytes / hosts), at 8, 64 and 512 devices with fsdp fixed and the data
axis growing. The script sets ``XLA_FLAGS=--xla_force_host_platform_device_count`` itself
(data × fsdp devices); trailing ``key=value`` words are config overrides.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import resource
import sys
import time

OPS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
DTYPE_BYTES = {
  "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
  "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
INSTRUCTION = re.compile(
  r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.+?)\s+"
  rf"(?P<op>{'|'.join(OPS)})(?P<start>-start)?\((?P<rest>.*)$"
)
ARRAY = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([\d,]*)\]")
COMPUTATION = re.compile(r"\n(?:ENTRY )?%?([\w.\-]+) [^\n]*\{\n(.*?)\n\}", re.S)
DEVICES_PER_HOST = 8


def array_bytes(shape: str) -> tuple[int, int]:
  """``(bytes, arrays)`` of an HLO shape: one array or a tuple of them."""
  arrays = ARRAY.findall(shape)
  total = sum(
    DTYPE_BYTES[t] * math.prod(int(d) for d in dims.split(",") if d) for t, dims in arrays
  )
  return total, len(arrays)


def _iota(dims: str, perm: str | None):
  import numpy as np

  shape = [int(d) for d in dims.split(",")]
  ids = np.arange(math.prod(shape)).reshape(shape)
  return ids.transpose([int(p) for p in perm.split(",")]) if perm else ids


def replica_groups(rest: str, devices: int) -> list[list[int]]:
  """The replica groups of a collective in any of the HLO spellings: explicit lists, iota
  (``[G,S]<=[dims]T(perm)``) or mesh axes (``mesh['a'=2,'b'=4], device_ids=(…) {'b'}``);
  ``{}`` or none: one group of every device."""
  import numpy as np

  m = re.search(r"replica_groups=\{(\{[\d,{}]*\})\}", rest)
  if m:
    return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", rest)
  if m:
    return _iota(m.group(3), m.group(4)).reshape(int(m.group(1)), int(m.group(2))).tolist()
  m = re.search(
    r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?"
    r" \{([^}]*)\}",
    rest,
  )
  if m:
    axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))
    names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
    ids = _iota(m.group(2), m.group(3)) if m.group(2) else np.arange(math.prod(sizes))
    ids = ids.reshape(sizes)
    chosen = [names.index(a) for a in re.findall(r"'(\w+)'", m.group(4))]
    others = [i for i in range(len(names)) if i not in chosen]
    size = math.prod(sizes[i] for i in chosen)
    return ids.transpose(others + chosen).reshape(-1, size).tolist()
  return [list(range(devices))]


def mesh_axis(group: list[int], data: int, fsdp: int, tensor: int = 1, expert: int = 1) -> str:
  """Which axes of a row-major (data, fsdp[, expert][, tensor]) mesh a replica group spans."""
  import numpy as np

  members = sorted(group)
  if len(members) == data * fsdp * expert * tensor:
    return "all"
  coords = np.array(np.unravel_index(members, (data, fsdp, expert, tensor))).T
  names = ("data", "fsdp", "expert", "tensor")
  varying = [n for n, col in zip(names, coords.T, strict=True) if len(set(col)) > 1]
  sizes = {"data": data, "fsdp": fsdp, "expert": expert, "tensor": tensor}
  if varying and len(members) == math.prod(sizes[n] for n in varying):
    return "+".join(varying)
  return f"{len(members)} devices"


def loop_computations(hlo: str) -> set[str]:
  """Computations reachable from any while loop's body or condition."""
  comps = dict(COMPUTATION.findall(hlo))
  todo = re.findall(r"(?:body|condition)=%?([\w.\-]+)", hlo)
  seen: set[str] = set()
  while todo:
    name = todo.pop()
    if name in seen or name not in comps:
      continue
    seen.add(name)
    todo += re.findall(r"(?:body|condition|calls|to_apply)=%?([\w.\-]+)", comps[name])
  return seen


def collectives(hlo: str, data: int, fsdp: int, tensor: int = 1, expert: int = 1) -> list[dict]:
  """Every collective of a compiled HLO module: op, mesh axis, operands, operand bytes per
  device, and whether it runs inside a while loop."""
  in_loop = loop_computations(hlo)
  out = []
  for comp, body in COMPUTATION.findall(hlo):
    for line in body.splitlines():
      m = INSTRUCTION.match(line)
      if not m:
        continue
      op, rest = m.group("op"), m.group("rest")
      result, arrays = array_bytes(m.group("shape"))
      if op == "collective-permute":
        size = 2
        axis = "pairs"
      else:
        groups = replica_groups(rest, data * fsdp * expert * tensor)
        size, axis = len(groups[0]), mesh_axis(groups[0], data, fsdp, tensor, expert)
      operand = {"all-gather": result // size, "reduce-scatter": result * size}.get(op, result)
      name = re.search(r'op_name="([^"]*)"', rest)
      out.append(
        {
          "op": op,
          "axis": axis,
          "group_size": size,
          "operands": arrays,
          "operand_bytes": operand,
          "result_bytes": result,
          "dtypes": sorted({t for t, _ in ARRAY.findall(m.group("shape"))}),
          "in_loop": comp in in_loop,
          "source": name.group(1).rsplit("/", 1)[-1] if name else "",
          "async": bool(m.group("start")),
        }
      )
  return out


def wire_bytes(op: str, operand: int, n: int) -> float:
  """Bytes one device sends for a collective of ``operand`` bytes over ``n`` devices with a
  ring algorithm (what NCCL and most transports use for large buffers)."""
  if n <= 1:
    return 0.0
  if op == "all-reduce":
    return 2 * (n - 1) / n * operand
  if op in ("reduce-scatter", "all-to-all"):
    return (n - 1) / n * operand
  if op == "all-gather":
    return (n - 1) * operand
  return float(operand)


def group_rows(found: list[dict]) -> list[dict]:
  """Collectives grouped by (op, axis, source): count, operands, operand bytes per device."""
  rows: dict[tuple, dict] = {}
  for c in found:
    key = (c["op"], c["axis"], c["source"], c["in_loop"])
    r = rows.setdefault(
      key,
      {"op": c["op"], "axis": c["axis"], "source": c["source"], "in_loop": c["in_loop"],
       "group_size": c["group_size"], "count": 0, "operands": 0, "operand_bytes": 0},
    )  # fmt: skip
    r["count"] += 1
    r["operands"] += c["operands"]
    r["operand_bytes"] += c["operand_bytes"]
  return sorted(rows.values(), key=lambda r: (OPS.index(r["op"]), r["axis"], r["source"]))


def measure(
  config: str,
  overrides: list[str],
  data: int,
  fsdp: int,
  ks: list[int],
  tensor: int = 1,
  expert: int = 1,
) -> dict:
  """Compiles the train step of ``config`` for each K on a (data, fsdp[, tensor]) mesh of
  this process's (virtual) devices and counts what it sends, writes and reads, and what each
  device holds (the compiled step's ``memory_analysis``)."""
  import jax
  import numpy as np

  from jaxstep import models, parallel
  from jaxstep.parallel import leaf_spec
  from jaxstep.trainer.config import loading as config_lib
  from jaxstep.trainer.plan import auto_accum, steps, tensor_split

  cfg = config_lib.load(config, overrides)
  cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, tensor=tensor, expert=expert))
  tensor_split.check(cfg.model, cfg.mesh, cfg.train.seq_len)
  if cfg.model.vocab_size == 0:
    raise SystemExit("set model.vocab_size: the tokenizer is not read here")
  t = cfg.train
  mesh = parallel.make_mesh(data, fsdp, tensor=tensor, expert=expert)
  schedule = t.schedule_steps or t.max_steps or 1
  out = {"config": config, "overrides": overrides, "data": data, "fsdp": fsdp, "runs": []}
  out["tensor"], out["expert"] = tensor, expert
  for k in ks:
    cfg_k = dataclasses.replace(cfg, train=dataclasses.replace(t, grad_accum_steps=k))
    start = time.perf_counter()
    apply_fn, state = steps.abstract_state(cfg_k, mesh, schedule)
    compiled = steps.compile_step(cfg_k, apply_fn, mesh, schedule, k, state)
    seconds = time.perf_counter() - start
    found = collectives(compiled.as_text(), data, fsdp, tensor, expert)
    memory = compiled.memory_analysis()
    out["runs"].append(
      {
        "k": k,
        "argument_bytes": memory.argument_size_in_bytes,
        "temp_bytes": memory.temp_size_in_bytes,
        "peak_bytes": auto_accum.compiled_bytes(compiled),
        "compile_s": round(seconds, 1),
        "max_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "collectives": found,
        "rows": group_rows(found),
      }
    )
    print(f"K={k}: compiled in {seconds:.1f} s, {len(found)} collectives", file=sys.stderr)
  leaves = jax.tree.leaves(state.params)
  sharded = [x for x in leaves if leaf_spec(x.shape, fsdp) != jax.sharding.PartitionSpec()]
  state_leaves = jax.tree.leaves(state)
  out.update(
    num_params=models.num_params(state.params),
    param_leaves=len(leaves),
    sharded_param_leaves=len(sharded),
    sharded_param_elements=int(sum(math.prod(x.shape) for x in sharded)),
    replicated_param_elements=int(sum(math.prod(x.shape) for x in leaves) - sum(
      math.prod(x.shape) for x in sharded)),
    state_bytes=int(sum(math.prod(x.shape) * x.dtype.itemsize for x in state_leaves)),
    state_bytes_per_device=int(
      sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in state_leaves)
    ),
    global_batch_size=t.global_batch_size,
    seq_len=t.seq_len,
    token_bytes=2 if cfg.model.vocab_size <= 2**16 else 4,
    vocab_size=cfg.model.vocab_size,
    jax=jax.__version__,
    devices=int(np.prod(mesh.devices.shape)),
  )  # fmt: skip
  return out


def gradient_reductions(run: dict) -> dict:
  """The gradient's reductions in one compiled step: the flat all-device psum (replicated
  leaves + metric sums), the data-axis all-reduce operands and the fsdp reduce-scatters."""
  found = [c for c in run["collectives"] if not c["in_loop"]]
  return {
    "flat_psum": sum(
      1 for c in found if c["op"] == "all-reduce" and c["source"] == "psum" and c["axis"] == "all"
    ),
    "data_all_reduce_operands": sum(
      c["operands"] for c in found if c["op"] == "all-reduce" and c["axis"] == "data"
    ),
    "fsdp_reduce_scatters": sum(1 for c in found if c["op"] == "reduce-scatter"),
    "in_loop": sum(1 for c in run["collectives"] if c["in_loop"]),
  }


def gib(n: float) -> str:
  """Bytes in GiB, MiB or KiB, whichever reads best."""
  for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
    if n >= size:
      return f"{n / size:,.2f} {unit}"
  return f"{n / 2**10:,.1f} KiB"


def report(m: dict, sizes=(8, 64, 512)) -> str:
  """Markdown: the measured collectives per K, then the computed per-host table (a data ×
  fsdp mesh) or each axis's wire bytes (with a tensor axis)."""
  tensor = f" × tensor {m['tensor']}" if m.get("tensor", 1) > 1 else ""
  tensor += f" × expert {m['expert']}" if m.get("expert", 1) > 1 else ""
  lines = [
    f"`{m['config']}` {' '.join(m['overrides'])}: {m['num_params']:,} parameters, "
    f"mesh data {m['data']} × fsdp {m['fsdp']}{tensor} ({m['devices']} virtual CPU devices), "
    f"jax {m['jax']}",
    "",
  ]
  for run in m["runs"]:
    red = gradient_reductions(run)
    lines += [
      f"K = {run['k']} (compiled in {run['compile_s']} s, peak RSS {run['max_rss_gib']} GiB): "
      f"flat psum {red['flat_psum']}, data all-reduce operands "
      f"{red['data_all_reduce_operands']}, fsdp reduce-scatters {red['fsdp_reduce_scatters']}, "
      f"collectives inside loops {red['in_loop']}; per device: arguments "
      f"{gib(run['argument_bytes'])}, temporaries {gib(run['temp_bytes'])}, peak "
      f"{gib(run['peak_bytes'])}",
      "",
      "| collective | axis (group) | source | count | operands | operand bytes / device |",
      "| --- | --- | --- | ---: | ---: | ---: |",
    ]
    for r in run["rows"]:
      where = " (in loop)" if r["in_loop"] else ""
      lines.append(
        f"| {r['op']}{where} | {r['axis']} ({r['group_size']}) | {r['source']} | {r['count']} "
        f"| {r['operands']} | {r['operand_bytes']:,} ({gib(r['operand_bytes'])}) |"
      )
    lines.append("")
  if len(m["runs"]) > 1:
    same = all(r["rows"] == m["runs"][0]["rows"] for r in m["runs"][1:])
    ks = ", ".join(str(r["k"]) for r in m["runs"])
    lines += [f"Collectives identical for K = {ks}: {'yes' if same else 'NO'}", ""]
  rows = m["runs"][0]["rows"]
  if tensor:
    return "\n".join([*lines, *axis_table(m, rows)])
  f = m["fsdp"]
  lines += [
    f"Grown at fsdp {f}, data = devices / {f}, {DEVICES_PER_HOST} devices per host; "
    f"G = {m['global_batch_size']}, S = {m['seq_len']}, {m['token_bytes']}-byte tokens. "
    f"The row of the compiled mesh ({m['data']} × {f}) is measured; the others use its "
    f"per-device operands with the group sizes of their mesh. Wire bytes: ring algorithms.",
    "",
    "| devices | hosts | mesh | operand bytes / device | wire bytes / device | "
    "wire bytes, whole job | checkpoint bytes / host | data bytes / host / update |",
    "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
  ]
  for n in sizes:
    d, hosts = n // f, max(n // DEVICES_PER_HOST, 1)
    group = {"all": n, "data": d, "fsdp": f}
    operand = wire = 0.0
    for r in rows:
      size = group.get(r["axis"], r["group_size"])
      if size > 1:  # a collective over one device is not emitted
        operand += r["operand_bytes"]
        wire += wire_bytes(r["op"], r["operand_bytes"] / max(r["count"], 1), size) * r["count"]
    ckpt = m["state_bytes"] / hosts
    tokens = m["global_batch_size"] * (m["seq_len"] + 1) * m["token_bytes"] / hosts
    mark = " (measured)" if d == m["data"] else ""
    lines.append(
      f"| {n} | {hosts} | {d} × {f}{mark} | {gib(operand)} | {gib(wire)} | {gib(wire * n)} "
      f"| {gib(ckpt)} | {gib(tokens)} |"
    )
  lines += [
    "",
    f"State: {gib(m['state_bytes'])} in all, {gib(m['state_bytes_per_device'])} per device "
    f"(mesh {m['data']} × {f}).",
  ]
  return "\n".join(lines)


def axis_table(m: dict, rows: list[dict]) -> list[str]:
  """Operand and wire bytes per device of one update, by the mesh axes a collective spans."""
  by_axis: dict[str, list[float]] = {}
  for r in rows:
    size = r["group_size"]
    wire = wire_bytes(r["op"], r["operand_bytes"] / max(r["count"], 1), size) * r["count"]
    total = by_axis.setdefault(r["axis"], [0, 0.0, 0])
    total[0] += r["operand_bytes"]
    total[1] += wire
    total[2] += r["count"]
  lines = ["| axes | collectives | operand bytes / device | wire bytes / device |"]
  lines.append("| --- | ---: | ---: | ---: |")
  for axis, (operand, wire, count) in sorted(by_axis.items()):
    lines.append(f"| {axis} | {count} | {gib(operand)} | {gib(wire)} |")
  return [*lines, "", f"State: {gib(m['state_bytes'])} in all, "
          f"{gib(m['state_bytes_per_device'])} per device."]  # fmt: skip


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", default="gpt-1.3b")
  p.add_argument("--data", type=int, default=8)
  p.add_argument("--fsdp", type=int, default=8)
  p.add_argument("--tensor", type=int, default=1)
  p.add_argument("--expert", type=int, default=1, help="expert-parallel size (an MoE model)")
  p.add_argument("--ks", default="1,8", help="comma-separated K values to compile")
  p.add_argument("--json", default=None, help="also write the measurements here")
  p.add_argument("overrides", nargs="*", metavar="key=value")
  args = p.parse_args(argv)
  devices = args.data * args.fsdp * args.tensor * args.expert
  if "jax" in sys.modules:
    raise SystemExit("run benchmarks.scaling in a fresh process (it sets XLA_FLAGS)")
  os.environ["JAX_PLATFORMS"] = "cpu"
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
  os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
  ks = [int(k) for k in args.ks.split(",")]
  m = measure(args.config, args.overrides, args.data, args.fsdp, ks, args.tensor, args.expert)
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(m, f, indent=1)
  print(report(m))
  return 0


if __name__ == "__main__":
  sys.exit(main())
