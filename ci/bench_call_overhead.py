"""What the cpu backend's direct C++ calls save per target forward (docs/benchmarks.md,
"Sixteenth session").

    python ci/bench_call_overhead.py [--threads 2] [--reps 12]

SmolLM2-135M in bf16, one request with a 192-token prefix; one forward of width 1 (a plain
decode step) and 3 (a chain verify), lm_head included. Interleaved A/B in one process: the
kernels called as the fifteenth session's code called them (a Python closure per weight around
``rowinv.linear``, ``rowinv``'s wrappers behind a per-call dispatch for the layer ops, the
store as two ``index_copy_`` then ``rowinv.attention``) against the bound kernels the backend
hands out now. Both run the same C++ arithmetic, so only the call overhead differs.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from polyspec.backends.cpu import rowinv
from polyspec.engine.llm import LLM

PREFIX = 192


def old_linear(w: torch.Tensor):
    def row_invariant_linear(x, bias):
        return rowinv.linear(x, w, bias)

    return row_invariant_linear


def old_layer_ops(kernels, backend):
    """The layer ops behind the fifteenth session's per-call dispatch and rowinv wrappers."""
    bf = torch.bfloat16

    def pick(name, is_bf16):
        native = getattr(rowinv, name)

        def kernel(*args):
            if is_bf16(*args) and backend.row_invariant_kernels() is not None:
                return native(*args)
            raise AssertionError("bf16 only")

        return kernel

    return dataclasses.replace(
        kernels,
        rms_norm=pick("rms_norm", lambda x, w, *_: x.dtype == bf and w.dtype == bf),
        fused_add_rms_norm=pick(
            "fused_add_rms_norm",
            lambda x, r, w, *_: x.dtype == bf and r.dtype == bf and w.dtype == bf,
        ),
        silu_and_mul=pick("silu_and_mul", lambda x, *_: x.dtype == bf),
        rotary_embedding=pick("rotary_embedding", lambda pos, q, k, c, *_: q.dtype == bf),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=12)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(backend="cpu", dtype="bfloat16", max_batch_size=1, max_context=512)
    worker, model = llm.worker, llm.worker.target
    attn = worker.target_runner.attn
    ids = [(17 * i + 3) % model.config.vocab_size for i in range(PREFIX + 8)]
    row = worker.kv.add_request(PREFIX + 16)
    worker.kv.ensure([row], [PREFIX + 8])

    weights = [p for p in model.parameters() if hasattr(p, "polyspec_linear")]
    weights.append(model.lm_head)
    lin = {
        False: {id(w): w.polyspec_linear for w in weights},
        True: {id(w): old_linear(w.data.contiguous()) for w in weights},
    }
    kernels = {False: model.kernels, True: old_layer_ops(model.kernels, llm.backend)}
    store_and_attend = {False: attn.exact_store_and_attend, True: None}

    def use(old: bool) -> None:
        for w in weights:
            w.polyspec_linear = lin[old][id(w)]
        model.kernels = kernels[old]
        for layer in model.layers:
            layer.kernels = kernels[old]
        attn.exact_store_and_attend = store_and_attend[old]

    with torch.inference_mode():
        worker._extend(worker.target_runner, [row], [0], [PREFIX], ids[:PREFIX])
        for width in (1, 3):

            def forward(width: int = width) -> None:
                h, _ = worker._extend(worker.target_runner, [row], [PREFIX], [width], ids[:width])
                model.compute_logits(h)

            ms: dict[bool, list[float]] = {True: [], False: []}
            for rep in range(args.reps):
                for old in (True, False) if rep % 2 else (False, True):
                    use(old)
                    forward()
                    start = time.perf_counter()
                    forward()
                    forward()
                    ms[old].append((time.perf_counter() - start) / 2 * 1e3)
            use(False)
            print(
                f"width {width}: old wrappers {statistics.median(ms[True]):.2f} ms "
                f"(min {min(ms[True]):.2f}), direct calls {statistics.median(ms[False]):.2f} ms "
                f"(min {min(ms[False]):.2f})",
                flush=True,
            )


if __name__ == "__main__":
    main()
