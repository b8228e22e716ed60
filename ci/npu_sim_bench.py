#!/usr/bin/env python3
"""``polyspec bench`` on the npu backend with polyspec's torch_npu simulator, on the CPU.

The figures an Ascend run of the same command should reproduce (``ci/device_npu.sh`` prints
them next to its own): the speculative output against plain greedy, and the mean acceptance
length (it depends only on the numerics, which the simulator takes from the reference math,
so an NPU's bfloat16 kernels may move it slightly). Timings here are of the CPU and mean
nothing for an NPU.

    python ci/npu_sim_bench.py [--rowwise-linear] -- --num-prompts 3 --json /tmp/sim.json ...

Everything after ``--`` goes to ``polyspec bench``; ``--backend npu`` is added.
``--rowwise-linear`` (a diagnosis, slow): every ``F.linear`` of the models computes its rows
one at a time, so a token's logits no longer depend on how many rows share its forward (a
verify forward multiplies N rows, a decode step 1); where speculative and plain greedy
outputs differ without it and agree with it, the difference came from the batch-shape
dependence of torch's bfloat16 GEMM (docs/backends/npu.md).
"""

from __future__ import annotations

import sys


def rowwise_linear() -> None:
    """Replace ``torch.nn.functional.linear`` (the models' one linear call) by a row-by-row
    loop of the same function."""
    import torch
    import torch.nn.functional as F

    batched = F.linear

    def linear(x, weight, bias=None):
        if x.dim() < 2 or x.shape[:-1].numel() <= 1:
            return batched(x, weight, bias)
        rows = x.reshape(-1, x.shape[-1])
        out = torch.cat([batched(rows[i : i + 1], weight, bias) for i in range(rows.shape[0])])
        return out.reshape(*x.shape[:-1], weight.shape[0])

    F.linear = linear


def main(argv: list[str]) -> int:
    if "--" in argv:
        cut = argv.index("--")
        own, bench_args = argv[:cut], argv[cut + 1 :]
    else:
        own, bench_args = [], argv
    if own and own != ["--rowwise-linear"]:
        print(f"unknown options before '--': {own} (only --rowwise-linear)", file=sys.stderr)
        return 2
    if own:
        rowwise_linear()
    from polyspec.backends.npu.sim import simulated

    with simulated():
        from polyspec.cli import main as cli_main

        return int(cli_main(["bench", "--backend", "npu", *bench_args]) or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
