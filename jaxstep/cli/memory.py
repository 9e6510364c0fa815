"""``python -m jaxstep.memory [--config FILE] [key=value …]``: the memory ledger of a config.

The textbook mixed-precision Adam table (ZeRO stages), jaxstep's own layout by role, and the
compiled step's ``memory_analysis()``, per device (GiB = 2^30 bytes).
"""

from __future__ import annotations

from jaxstep.cli._common import config_command
from jaxstep.trainer.memory import compiled_memory, jaxstep_layout, textbook_state_bytes

GIB = 2**30


def report(cfg) -> str:
  c = compiled_memory(cfg)
  p, dp = c["num_params"], c["data"] * c["fsdp"]
  gib = lambda b: f"{b / GIB:9.3f} GiB"  # noqa: E731
  lines = [
    f"P = {p:,} parameters; mesh data={c['data']} fsdp={c['fsdp']}; "
    f"precision {cfg.train.precision}; per device:",
    "",
    f"textbook mixed-precision Adam (16 B/param), D = {dp}:",
  ]
  formulas = ["16P", "(4 + 12/D)P", "(2 + 14/D)P", "16P/D"]
  for stage, formula in enumerate(formulas):
    lines.append(
      f"  ZeRO-{stage}  {formula:<12} "
      f"{gib(textbook_state_bytes(p, zero_stage=stage, data_parallel=dp))}"
    )
  lines += ["  + activations (not divided by D)", "", "jaxstep layout:"]
  layout = jaxstep_layout(p, precision=cfg.train.precision, fsdp=c["fsdp"])
  for name, b in layout.items():
    lines.append(f"  {name:<48} {gib(b)}")
  persistent = sum(b for n, b in layout.items() if "during" not in n)
  lines += [
    f"  {'persistent state (params + moments)':<48} {gib(persistent)}",
    "",
    "compiled train step (memory_analysis):",
    f"  {'arguments (state + batch)':<48} {gib(c['argument_bytes'])}",
    f"  {'outputs':<48} {gib(c['output_bytes'])}",
    f"  {'temporaries (accumulator, activations, …)':<48} {gib(c['temp_bytes'])}",
    f"  {'state arrays as placed':<48} {gib(c['state_bytes'])}",
  ]
  return "\n".join(lines)


def main(argv=None) -> int:
  def action(cfg) -> int:
    from jaxstep.parallel.cpu_devices import configure_cpu_defaults

    configure_cpu_defaults(cfg)  # the devices train would use for this config
    print(report(cfg))
    return 0

  return config_command("jaxstep memory", __doc__, action, argv)
