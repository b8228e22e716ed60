"""Time one EAGLE-3 training step (6 TTT steps, forward + backward + AdamW) of a SmolLM2-135M
shaped head on random features, in each compute dtype: how much mixed precision buys.

    python ci/bench_train_step.py [--device cuda] [--batch-tokens 16384] [--seq-len 512]
"""

from __future__ import annotations

import argparse
import time
import types

import torch

from polyspec.train.head import Eagle3Trainable
from polyspec.train.trainer import TrainConfig, ttt_loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--draft-vocab", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    dev = torch.device(args.device)
    c = types.SimpleNamespace(hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64,
                              rms_norm_eps=1e-5, intermediate_size=1536, rope_theta=100000.0,
                              rope_scaling=None)  # fmt: skip
    b, t = max(1, args.batch_tokens // args.seq_len), args.seq_len
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(b, t, 3 * 576, generator=g).to(dev)
    emb = torch.randn(b, t, 576, generator=g).to(dev)
    tp = torch.softmax(torch.randn(b, t, args.draft_vocab, generator=g), -1).to(dev)
    greedy = torch.randint(0, args.draft_vocab, (b, t), generator=g).to(dev)
    valid = torch.ones(b, t, dtype=torch.bool, device=dev)
    for name in ("float32", "bfloat16"):
        dtype = getattr(torch, name)
        torch.manual_seed(0)
        head = Eagle3Trainable(c, args.draft_vocab, t + 1).to(dev)
        opt = torch.optim.AdamW(head.parameters(), lr=1e-4)
        times = []
        for _ in range(args.steps + 2):
            t0 = time.perf_counter()
            with torch.autocast(dev.type, dtype=dtype, enabled=dtype != torch.float32):
                logits = head(aux, emb, 6)
            loss, accs = ttt_loss(logits, tp, greedy, valid, TrainConfig())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            torch.cat([loss.detach().reshape(1), accs]).tolist()  # the loop's one sync
            times.append(time.perf_counter() - t0)
        per = sorted(times[2:])[len(times[2:]) // 2]
        print(f"{name}: {per * 1e3:.1f} ms a step of {b} x {t} tokens "
              f"({b * t / per / 1e3:.0f} k tokens/s), loss {loss.item():.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
