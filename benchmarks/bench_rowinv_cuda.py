"""The row-invariant Triton linear against cuBLAS (``F.linear``) on a model's weight shapes,
timed inside CUDA graphs (as the engine runs them), for several tile configurations; and, for
each configuration, whether a row computed alone equals that row in a larger batch bitwise.

    python benchmarks/bench_rowinv_cuda.py OUT.json      # on a CUDA machine (ci/device_cuda.sh rowinv)
    python benchmarks/bench_rowinv_cuda.py OUT.json --attention-only
    python benchmarks/bench_rowinv_cuda.py OUT.json --shapes llama3-8b --rows 1,4,16,64 --grid \
        --best BEST.json

``--grid`` times every (BLOCK_N, BLOCK_K, num_warps, num_stages) of :data:`GRID` (those that do
not compile, too large for shared memory, are left out); ``--best`` writes, per weight shape,
the configuration with the least time summed over the rows timed (``{"N,K": [BN, BK, warps,
stages]}``, what ``bench_target_size.py --linear-configs`` reads).

The attention part (SmolLM2 shapes only) times ``list_attention`` per ``block_n`` (and, at 256,
per warp count) at 1, 6, 8, 96 and 128 query tokens (a batch-1 decode, small and SmolLM2-tree
verifies, a batch-16 S=3 K=3 N=8 verify of 128 tokens) over lists of 128 to 1,000 keys.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from polyspec.kernels.triton.linear import row_invariant_linear, tile_config
from polyspec.kernels.triton.list_attention import list_attention

SHAPES = {  # weight (N, K) by model, qkv and gate/up fused as the model runs them
    "smollm2": {
        "qkv": (960, 576),
        "o": (576, 576),
        "gate_up": (3072, 576),
        "down": (576, 1536),
        "lm_head": (49152, 576),
    },
    "llama3-8b": {
        "qkv": (6144, 4096),
        "o": (4096, 4096),
        "gate_up": (28672, 4096),
        "down": (4096, 14336),
        "lm_head": (128256, 4096),
    },
}
ROWS = (1, 6, 16, 96)
CONFIGS = [
    (32, 64, 4, 3),
    (64, 64, 4, 3),
    (64, 128, 4, 3),
    (32, 128, 4, 3),
    (128, 64, 4, 3),
    (64, 64, 2, 3),
]
GRID = list(itertools.product((16, 32, 64), (64, 128, 256), (4, 8), (3, 4, 5)))


def graph_time_us(fn, reps: int = 50) -> float:
    """Mean microseconds per call of ``fn`` over replays of a graph of ``reps`` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        for _ in range(4):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / (4 * reps))
    return best


def time_attention(dev) -> list[dict]:
    """``list_attention`` per block size at SmolLM2's heads (module doc)."""
    attention = []
    hq, hkv, d = 9, 3, 64  # SmolLM2's heads
    k_cache = torch.randn(8192, hkv, d, device=dev).bfloat16()
    v_cache = torch.randn(8192, hkv, d, device=dev).bfloat16()
    for t in (1, 6, 8, 96, 128):
        for length in (128, 260, 400, 1000):
            q = torch.randn(t, hq, d, device=dev).bfloat16()
            lists = torch.stack([torch.randperm(8192, device=dev)[:length] for _ in range(t)])
            lens = torch.full((t,), length, dtype=torch.int32, device=dev)
            kv = k_cache.index_select(0, lists[0]).unsqueeze(0)  # SDPA on one gathered row
            row = {"T": t, "L": length}
            for block_n, warps in ((32, 4), (64, 4), (128, 4), (128, 8), (256, 4), (256, 8)):
                key = f"list{block_n}" + ("" if warps == 4 else f"w{warps}")
                row[f"{key}_us"] = graph_time_us(
                    lambda q=q, lists=lists, lens=lens, b=block_n, w=warps: list_attention(
                        q, k_cache, v_cache, lists, lens, 0.125, block_n=b, num_warps=w
                    )
                )
            qs = q[:1].transpose(0, 1).unsqueeze(0)  # [1, Hq, 1, D]
            ks = kv.repeat_interleave(hq // hkv, 2).transpose(1, 2)  # [1, Hq, L, D]
            row["sdpa_1query_us"] = graph_time_us(
                lambda qs=qs, ks=ks: F.scaled_dot_product_attention(qs, ks, ks)
            )
            attention.append(row)
            print(json.dumps(row), flush=True)
    return attention


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", default="bench_rowinv.json")
    ap.add_argument("--attention-only", action="store_true")
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="smollm2")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts, e.g. 1,16")
    ap.add_argument("--grid", action="store_true", help="time every configuration of GRID")
    ap.add_argument("--best", default=None, help="write the best configuration per shape here")
    return ap.parse_args()


def cycled_us(fn, ws: list[torch.Tensor]) -> float:
    """Microseconds per call of ``fn(w)``, the calls cycling through the copies ``ws``."""
    calls = [lambda w=w: fn(w) for w in ws]
    reps = max(len(ws), 50 // len(ws) * len(ws))

    def run() -> None:
        for i in range(reps):
            calls[i % len(calls)]()

    return graph_time_us(run, reps=1) / reps


def time_linear(x, ws, cfg) -> float | None:
    """Microseconds per call of the row-invariant linear with ``cfg``; None: it does not compile
    (a tile too large for shared memory)."""
    try:
        row_invariant_linear(x, ws[0], config=cfg)
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 (triton's OutOfResources and compile errors alike)
        return None
    return cycled_us(lambda w: row_invariant_linear(x, w, config=cfg), ws)


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    results = []
    shapes = {} if args.attention_only else SHAPES[args.shapes]
    rows = [int(r) for r in args.rows.split(",")]
    configs = GRID if args.grid else CONFIGS
    best = {}
    for name, (n, k) in shapes.items():
        # A model reads each layer's weight once per forward, from memory: a weight of 8 MB or
        # more is timed cycling through copies that together overflow the 50 MB L2, so no call
        # finds its weight still cached by the call before.
        copies = 1 if n * k * 2 < 8 << 20 else max(2, -(-(160 << 20) // (n * k * 2)))
        ws = [(torch.randn(n, k, device=dev) / k**0.5).bfloat16() for _ in range(copies)]
        w = ws[0]
        total = dict.fromkeys(configs, 0.0)
        for m in rows:
            x = torch.randn(m, k, device=dev).bfloat16()
            row = {"shape": name, "N": n, "K": k, "M": m, "weight_copies": copies}
            row["cublas_us"] = cycled_us(lambda w, x=x: F.linear(x, w), ws)
            row["default"] = "x".join(map(str, tile_config(n, k)))
            row["default_us"] = cycled_us(lambda w, x=x: row_invariant_linear(x, w), ws)
            for cfg in configs:
                key = "x".join(map(str, cfg))
                us = time_linear(x, ws, cfg)
                row[key + "_us"] = us
                total[cfg] = None if us is None or total[cfg] is None else total[cfg] + us
                if m > 1 and us is not None:
                    full = row_invariant_linear(x, w, config=cfg)
                    alone = row_invariant_linear(x[m - 1 :], w, config=cfg)
                    row[key + "_invariant"] = bool(torch.equal(alone[0], full[m - 1]))
                    if not row[key + "_invariant"]:
                        total[cfg] = None
            results.append(row)
            print(json.dumps(row), flush=True)
        ok = {c: t for c, t in total.items() if t is not None}
        if ok:
            cfg = min(ok, key=ok.get)
            best[f"{n},{k}"] = list(cfg)
            print(f"best {name} [{n}, {k}]: {cfg} ({ok[cfg]:.1f} us summed over rows {rows})")
    if args.best:
        with open(args.best, "w") as f:
            json.dump(best, f, indent=1)
    attention = [] if args.shapes != "smollm2" else time_attention(dev)
    # cuBLAS itself: does a row depend on the batch?
    w = (torch.randn(49152, 576, device=dev) / 24).bfloat16()
    x = torch.randn(96, 576, device=dev).bfloat16()
    full = F.linear(x, w)
    cublas_invariant = {m: bool(torch.equal(F.linear(x[:m], w)[0], full[0])) for m in (1, 6, 16)}
    print("cuBLAS row 0 equal to the 96-row call, by row count:", cublas_invariant)
    with open(args.out, "w") as f:
        json.dump(
            {"rows": results, "attention": attention, "cublas_invariant": cublas_invariant},
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
