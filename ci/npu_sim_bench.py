#!/usr/bin/env python3
"""``polyspec bench`` on the npu backend with polyspec's torch_npu simulator, on the CPU.

The figures an Ascend run of the same command should reproduce (``ci/device_npu.sh`` prints
them next to its own): the speculative output equal to plain greedy, and the mean acceptance
length (it depends only on the numerics, which the simulator takes from the reference math,
so an NPU's bfloat16 kernels may move it slightly). Timings here are of the CPU and mean
nothing for an NPU.

    python ci/npu_sim_bench.py -- --num-prompts 3 --json /tmp/sim.json ...(polyspec bench flags)

Everything after ``--`` goes to ``polyspec bench``; ``--backend npu`` is added.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    if "--" in argv:
        cut = argv.index("--")
        bench_args = argv[cut + 1 :]
    else:
        bench_args = argv
    from polyspec.backends.npu.sim import simulated

    with simulated():
        from polyspec.cli import main as cli_main

        return int(cli_main(["bench", "--backend", "npu", *bench_args]) or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
