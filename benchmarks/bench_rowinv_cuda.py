"""The row-invariant Triton linear against cuBLAS (``F.linear``) on SmolLM2-135M's weight shapes,
timed inside CUDA graphs (as the engine runs them), for several tile configurations; and, for
each configuration, whether a row computed alone equals that row in a larger batch bitwise.

    python benchmarks/bench_rowinv_cuda.py OUT.json      # on a CUDA machine (ci/device_cuda.sh rowinv)
    python benchmarks/bench_rowinv_cuda.py OUT.json --attention-only

The attention part times ``list_attention`` per ``block_n`` (and, at 256, per warp count) at
1, 6, 8, 96 and 128 query tokens (a batch-1 decode, small and SmolLM2-tree verifies, a
batch-16 S=3 K=3 N=8 verify of 128 tokens) over lists of 128 to 1,000 keys.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

from polyspec.kernels.triton.linear import row_invariant_linear, tile_config
from polyspec.kernels.triton.list_attention import list_attention

SHAPES = {  # name: (N, K) of SmolLM2-135M-Instruct, qkv and gate/up fused as the model runs them
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}
ROWS = (1, 6, 16, 96)
CONFIGS = [(32, 64, 4), (64, 64, 4), (64, 128, 4), (32, 128, 4), (128, 64, 4), (64, 64, 2)]


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


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--attention-only"]
    out_path = args[0] if args else "bench_rowinv.json"
    torch.manual_seed(0)
    dev = torch.device("cuda")
    results = []
    shapes = {} if "--attention-only" in sys.argv else SHAPES
    for name, (n, k) in shapes.items():
        w = (torch.randn(n, k, device=dev) / k**0.5).bfloat16()
        for m in ROWS:
            x = torch.randn(m, k, device=dev).bfloat16()
            row = {"shape": name, "N": n, "K": k, "M": m}
            row["cublas_us"] = graph_time_us(lambda x=x, w=w: F.linear(x, w))
            for cfg in CONFIGS:
                key = "x".join(map(str, cfg))
                row[key + "_us"] = graph_time_us(
                    lambda x=x, w=w, cfg=cfg: row_invariant_linear(x, w, config=cfg)
                )
                if m > 1:
                    full = row_invariant_linear(x, w, config=cfg)
                    alone = row_invariant_linear(x[m - 1 :], w, config=cfg)
                    row[key + "_invariant"] = bool(torch.equal(alone[0], full[m - 1]))
            row["default"] = "x".join(map(str, tile_config(n, k)))
            results.append(row)
            print(json.dumps(row), flush=True)
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
    # cuBLAS itself: does a row depend on the batch?
    w = (torch.randn(49152, 576, device=dev) / 24).bfloat16()
    x = torch.randn(96, 576, device=dev).bfloat16()
    full = F.linear(x, w)
    cublas_invariant = {m: bool(torch.equal(F.linear(x[:m], w)[0], full[0])) for m in (1, 6, 16)}
    print("cuBLAS row 0 equal to the 96-row call, by row count:", cublas_invariant)
    with open(out_path, "w") as f:
        json.dump(
            {"rows": results, "attention": attention, "cublas_invariant": cublas_invariant},
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
