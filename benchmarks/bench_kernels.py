#!/usr/bin/env python3
"""Microbenchmarks of the Triton kernels on a CUDA device (run by ci/device_cuda.sh).

  python benchmarks/bench_kernels.py OUT.json [--iters 200]

* build_tree and verify_tree_greedy at batch 1 (target: < 20 us each), timed two ways with CUDA
  events: ``eager`` = back-to-back Python calls (includes launch overhead: what an eager engine
  pays) and ``graph`` = the same call captured in a CUDA graph and replayed (device time only).
* rms_norm, fused_add_rms_norm, rotary_embedding, silu_and_mul at decode shapes (Llama-8B-like,
  bf16), Triton vs the torch reference, both eager.
* softmax_topk at the shipped head's draft shapes (16,384 bf16 logits a row; 1 and 3 rows a
  step at batch 1, 48 at batch 16; k = 3): the kernel's ``loop`` and ``whole`` forms (the
  latter at several warp counts) and torch's softmax + topk.
Prints a table and writes every row to OUT.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable

import torch


def _time_eager(fn: Callable[[], object], iters: int, warmup: int = 20) -> float:
    """Mean microseconds per call of back-to-back calls, measured with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / iters


def _time_graph(fn: Callable[[], object], iters: int, per_graph: int = 20) -> float | None:
    """Mean microseconds per call when ``per_graph`` calls are captured in one CUDA graph."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(per_graph):
                fn()
        replays = max(iters // per_graph, 5)
        return _time_eager(graph.replay, replays, warmup=3) / per_graph
    except Exception as exc:  # noqa: BLE001 -- report, keep benchmarking the rest
        print(f"  graph capture failed: {exc!r}", file=sys.stderr)
        return None


def _tree_inputs(topk: int, num_steps: int, n: int, dev: torch.device):
    """A real draft tree for batch 1 from the reference draft pipeline."""
    from polyspec.kernels import reference as ref

    g = torch.Generator().manual_seed(0)
    scores, levels = None, []
    for step in range(num_steps):
        rows = 1 if step == 0 else topk
        p, i = torch.randn(rows, 1000, generator=g).softmax(-1).topk(topk, dim=-1)
        _, _, scores, level = ref.select_top_k(step, p, i, torch.zeros(rows, 4), scores, topk)
        levels.append(level)
    parent_list, selected, tokens = ref.organize_draft_results(
        *[[lv[k] for lv in levels] for k in range(3)], n
    )
    return parent_list.to(dev), selected.to(dev), tokens.to(dev)


def bench_tree(iters: int, dev: torch.device) -> list[dict]:
    from polyspec.backend import TreeMaskMode
    from polyspec.kernels import reference as ref
    from polyspec.kernels.triton import tree

    rows = []
    for topk, num_steps, n in ((1, 5, 6), (4, 5, 16), (8, 8, 64)):
        parent_list, selected, tokens = _tree_inputs(topk, num_steps, n, dev)
        seq_lens = torch.tensor([517], device=dev)
        outs = {
            "tree_mask": torch.empty(1, n, n, dtype=torch.bool, device=dev),
            "positions": torch.empty(n, dtype=torch.int64, device=dev),
            "retrive_index": torch.empty(1, n, dtype=torch.int64, device=dev),
            "retrive_next_token": torch.empty(1, n, dtype=torch.int64, device=dev),
            "retrive_next_sibling": torch.empty(1, n, dtype=torch.int64, device=dev),
        }
        args = (parent_list, selected, seq_lens, topk, num_steps, n, TreeMaskMode.TREE_ONLY)
        shape = f"bs=1 K={topk} S={num_steps} N={n}"
        for impl, fn in (("triton", tree.build_tree), ("torch", ref.build_tree)):
            call = functools.partial(fn, *args, **outs)
            rows.append(_row("build_tree", shape, impl, call, iters))

        candidates = torch.cat([torch.tensor([[7]], device=dev), tokens], 1)
        # The target follows the first child everywhere: the longest accept path.
        follow = candidates.gather(1, outs["retrive_next_token"].clamp(min=0))
        vouts = {
            "predicts": torch.empty(n, dtype=torch.int64, device=dev),
            "accept_index": torch.empty(1, num_steps + 1, dtype=torch.int64, device=dev),
            "accept_length": torch.empty(1, dtype=torch.int64, device=dev),
        }
        links = (
            outs["retrive_index"],
            outs["retrive_next_token"],
            outs["retrive_next_sibling"],
        )
        for impl, fn in (("triton", tree.verify_tree_greedy), ("torch", ref.verify_tree_greedy)):
            call = functools.partial(fn, candidates, *links, follow, **vouts)
            rows.append(_row("verify_tree_greedy", shape, impl, call, iters))
    return rows


def bench_model(iters: int, dev: torch.device) -> list[dict]:
    from polyspec.kernels import reference as ref
    from polyspec.kernels.triton import activation, norm, rope

    rows = []
    dtype = torch.bfloat16
    hidden, inter, hq, hkv, dim = 4096, 14336, 32, 8, 128
    inv = 1.0 / 500000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32, device=dev) / dim)
    freqs = torch.arange(8192, dtype=torch.float32, device=dev)[:, None] * inv
    cache = torch.cat([freqs.cos(), freqs.sin()], 1)
    w = torch.randn(hidden, device=dev, dtype=dtype)
    for tokens in (1, 8, 64):
        shape = f"T={tokens} H={hidden} bf16"
        x = torch.randn(tokens, hidden, device=dev, dtype=dtype)
        res = torch.randn(tokens, hidden, device=dev, dtype=dtype)
        gate_up = torch.randn(tokens, 2 * inter, device=dev, dtype=dtype)
        qkv = torch.randn(tokens, hq + 2 * hkv, dim, device=dev, dtype=dtype)
        q, k = qkv[:, :hq], qkv[:, hq : hq + hkv]
        pos = torch.randint(0, 8192, (tokens,), device=dev)
        cases = (
            ("rms_norm", norm.rms_norm, ref.rms_norm, (x, w, 1e-6)),
            ("fused_add_rms_norm", norm.fused_add_rms_norm, ref.fused_add_rms_norm, (x, res, w, 1e-6)),
            ("rotary_embedding", rope.rotary_embedding, ref.rotary_embedding, (pos, q, k, cache, True)),
            ("silu_and_mul", activation.silu_and_mul, ref.silu_and_mul, (gate_up,)),
        )  # fmt: skip
        for name, tri, torch_fn, args in cases:
            for impl, fn in (("triton", tri), ("torch", torch_fn)):
                rows.append(_row(name, shape, impl, functools.partial(fn, *args), iters))
            _check_close(name, tri(*args), torch_fn(*args))
    return rows


def bench_topk(iters: int, dev: torch.device) -> list[dict]:
    from polyspec.kernels import reference as ref
    from polyspec.kernels.triton.topk import softmax_topk_form, whole_warps

    rows, vocab, k = [], 16384, 3
    for n in (1, 3, 48):
        shape = f"n={n} V={vocab} k={k} bf16"
        logits = (4 * torch.randn(n, vocab, device=dev)).to(torch.bfloat16)
        want_p, _ = ref.softmax_topk(logits, k)
        forms = [("loop", {"form": "loop"})]
        forms += [(f"whole{w}", {"form": "whole", "num_warps": w}) for w in (4, 8, 16, 32)]
        for impl, kw in forms:
            call = functools.partial(softmax_topk_form, logits, k, **kw)
            p, idx = call()
            _check_close(f"softmax_topk {impl}", p, want_p)
            rows.append(_row("softmax_topk", shape, impl, call, iters))
        rows.append(
            _row(
                "softmax_topk",
                shape,
                "torch",
                functools.partial(ref.softmax_topk, logits, k),
                iters,
            )
        )
        print(f"  (the wrapper's whole form runs {whole_warps(vocab)} warps at V={vocab})")
    return rows


def _check_close(name: str, got: object, expected: object) -> None:
    """Sanity: the benchmarked Triton kernel agrees with torch on the benchmark inputs."""
    pairs = zip(got, expected) if isinstance(got, tuple) else [(got, expected)]
    for a, b in pairs:
        torch.testing.assert_close(a.float(), b.float(), atol=3e-2, rtol=3e-2, msg=name)


def _row(kernel: str, shape: str, impl: str, call: Callable[[], object], iters: int) -> dict:
    eager = _time_eager(call, iters)
    graph = _time_graph(call, iters)
    row = {"kernel": kernel, "shape": shape, "impl": impl, "eager_us": eager, "graph_us": graph}
    g = "-" if graph is None else f"{graph:9.2f}"
    print(f"{kernel:20s} {shape:26s} {impl:7s} eager {eager:9.2f} us   graph {g} us", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="path of the JSON file to write")
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    dev = torch.device("cuda", 0)
    import triton

    meta = {
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "iters": args.iters,
        "target_us": {"build_tree": 20.0, "verify_tree_greedy": 20.0},
    }
    print(f"{meta['device']}  torch {meta['torch']}  triton {meta['triton']}")
    rows = bench_tree(args.iters, dev) + bench_model(args.iters, dev) + bench_topk(args.iters, dev)
    verdicts = {}
    for row in rows:
        if row["impl"] == "triton" and row["kernel"] in meta["target_us"]:
            best = min(t for t in (row["eager_us"], row["graph_us"]) if t is not None)
            verdicts[f"{row['kernel']} {row['shape']}"] = best < meta["target_us"][row["kernel"]]
    meta["meets_target"] = verdicts
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    print("targets (< 20 us, best of eager / graph):", json.dumps(verdicts, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
