"""The EAGLE-3 training loop: batches of cached target features -> TTT loss -> AdamW.

Loss of TTT step j: cross-entropy between the head's distribution and the target's (both over
the draft vocabulary), weighted ``step_decay ** j``; positions whose target token is outside
the draft vocabulary, prompt positions and positions before step j's first valid one are
masked. The acceptance estimate is 1 + sum_j prod_{i<=j} acc_i, where acc_i is the top-1
agreement of step i with the target (chain acceptance if steps were independent).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from polyspec.train.features import SequenceFeatures
from polyspec.train.head import Eagle3Trainable


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 1500
    lr: float = 1e-3
    seed: int = 0
    ttt_steps: int = 5
    step_decay: float = 0.8
    batch_tokens: int = 4096
    max_len: int = 640
    noise: float = 0.05
    warmup: int = 50
    grad_clip: float = 0.5
    log_every: int = 25
    ckpt_every: int = 250
    # Matmul dtype of the forward and backward passes (autocast; weights, AdamW state and the
    # loss's softmax stay fp32). bf16 runs on tensor cores / AMX; float32 is exact but several
    # times slower on an accelerator.
    compute_dtype: str = "bfloat16"


class Batches:
    """Random batches of whole sequences, padded to the longest, within ``batch_tokens``."""

    def __init__(self, feats: list[SequenceFeatures], cfg: TrainConfig, seed: int):
        self.feats = feats
        self.cfg = cfg
        self.rng = random.Random(seed)

    def next(self) -> list[SequenceFeatures]:
        out, longest = [], 0
        while True:
            f = self.feats[self.rng.randrange(len(self.feats))]
            n = min(len(f.ids), self.cfg.max_len)
            if out and max(longest, n) * (len(out) + 1) > self.cfg.batch_tokens:
                return out
            out.append(f)
            longest = max(longest, n)


def make_tensors(batch, target, t2d_index, draft_ids, cfg: TrainConfig, device, gen):
    """Padded inputs and targets of a batch on ``device``."""
    t = min(max(len(f.ids) for f in batch), cfg.max_len)
    b = len(batch)
    h = target.config.hidden_size
    aux = torch.zeros(b, t, 3 * h, device=device)
    hid = torch.zeros(b, t, h, device=device)
    nxt = torch.zeros(b, t, dtype=torch.int64, device=device)
    greedy = torch.full((b, t), -1, dtype=torch.int64, device=device)
    valid = torch.zeros(b, t, dtype=torch.bool, device=device)
    for i, f in enumerate(batch):
        n = min(len(f.ids), t)
        aux[i, :n] = f.aux[:n].float()
        hid[i, :n] = f.hidden[:n].float()
        nxt[i, : n - 1] = f.ids[1:n]
        greedy[i, : n - 1] = f.greedy[1:n]  # the target's token after position p + 1
        # position p predicts token p + 2: train where that token is part of the answer
        lo = max(f.prompt_len - 2, 0)
        valid[i, lo : n - 1] = True
    if cfg.noise > 0:
        scale = aux.pow(2).mean(-1, keepdim=True).sqrt() * cfg.noise
        aux = aux + (torch.rand(aux.shape, generator=gen, device=device) * 2 - 1) * scale
    with torch.no_grad():
        embeds = target.embed(nxt).float()
        lm_rows = target.lm_head_weight[draft_ids].float()
        # target distribution at position p + 1, over the draft vocabulary
        tp = torch.softmax(F.linear(_shift_left(hid), lm_rows), dim=-1)
        greedy_d = t2d_index[greedy.clamp(min=0)]  # draft id of the target's token, -1 if none
        valid &= greedy_d >= 0
    return aux, embeds, tp, greedy_d, valid


def _shift_left(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], dim=1)


def ttt_loss(
    logits: list[torch.Tensor],  # ttt_steps x [B, T, V_draft]
    tp: torch.Tensor,  # [B, T, V_draft] target distribution
    greedy_d: torch.Tensor,  # [B, T] draft id of the target's greedy token, -1 if none
    valid: torch.Tensor,  # [B, T] bool
    cfg: TrainConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted loss, per-step top-1 accuracies [ttt_steps]); both stay on the device, so a
    step waits on the accelerator once (when the caller reads them), not once per TTT step."""
    total = torch.zeros((), device=tp.device)
    accs = []
    for j, lg in enumerate(logits):
        mask = valid.clone()
        mask[:, :j] = False
        n = mask.sum().clamp(min=1)
        logp = torch.log_softmax(lg.float(), dim=-1)
        ce = -(tp * logp).sum(-1)
        total = total + (cfg.step_decay**j) * (ce * mask).sum() / n
        accs.append(((lg.argmax(-1) == greedy_d) & mask).sum().float() / n)
    return total, torch.stack(accs)


def acceptance_estimate(accs: list[float]) -> float:
    est, run = 1.0, 1.0
    for a in accs:
        run *= a
        est += run
    return est


def train_head(
    head: Eagle3Trainable,
    target,
    feats: list[SequenceFeatures],
    draft_ids: torch.Tensor,
    cfg: TrainConfig,
    out_dir: Path,
    device: torch.device,
    resume: bool = False,
    progress=None,
    time_budget_s: float | None = None,
) -> list[dict]:
    """Train ``head`` in place; logs to ``out_dir/train_log.jsonl``; checkpoints to
    ``out_dir/checkpoint.pt`` (resumed with ``resume=True``).

    ``time_budget_s`` caps the run's length in steps, not by cutting it off: the time of the
    first ``_TIMED_STEPS`` steps (still in warm-up) sets the total, ``min(cfg.steps, budget /
    step time)``, so the learning-rate schedule still decays to its floor. The total is logged
    and checkpointed (pass it as ``steps`` to repeat the run)."""
    torch.manual_seed(cfg.seed)
    amp_dtype = _COMPUTE_DTYPES.get(cfg.compute_dtype)
    if amp_dtype is None:
        raise ValueError(
            f"compute_dtype must be one of {sorted(_COMPUTE_DTYPES)}, got {cfg.compute_dtype!r}"
        )
    head.to(device)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    total = [cfg.steps]  # a cell: the time budget may lower it during warm-up
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            min(1.0, (s + 1) / cfg.warmup)
            * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, total[0]) / total[0])))
        ),
    )
    vocab = target.config.vocab_size
    t2d_index = torch.full((vocab,), -1, dtype=torch.int64)
    t2d_index[draft_ids] = torch.arange(draft_ids.numel())
    t2d_index, draft_ids_d = t2d_index.to(device), draft_ids.to(device)
    start = 0
    ckpt = out_dir / "checkpoint.pt"
    log_file = out_dir / "train_log.jsonl"
    if resume and ckpt.is_file():
        state = torch.load(ckpt, map_location=device, weights_only=True)
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start = int(state["step"])
        total[0] = int(state.get("total_steps", cfg.steps))
        time_budget_s = None  # the total was fixed by the run that wrote the checkpoint
    elif log_file.exists():
        log_file.unlink()
    batches = Batches(feats, cfg, cfg.seed + start)
    gen = torch.Generator(device=device).manual_seed(cfg.seed + start)
    logs = []
    t0 = time.perf_counter()
    run_loss, run_acc, n_run = 0.0, None, 0
    step = start
    while step < total[0]:
        if time_budget_s is not None and step == start + _TIMED_STEPS:
            per_step = (time.perf_counter() - t0) / _TIMED_STEPS
            total[0] = max(step + 1, min(cfg.steps, int(time_budget_s / per_step)))
            print(f"time budget {time_budget_s:.0f} s at {per_step:.3f} s/step: {total[0]} steps")
        batch = batches.next()
        aux, embeds, tp, greedy_d, valid = make_tensors(
            batch, target, t2d_index, draft_ids_d, cfg, device, gen
        )
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype != torch.float32):
            logits = head(aux, embeds, cfg.ttt_steps)
        loss, accs = ttt_loss(logits, tp, greedy_d, valid, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        sched.step()
        loss_f, *accs = torch.cat([loss.detach().reshape(1), accs]).tolist()  # one sync
        run_loss += loss_f
        run_acc = accs if run_acc is None else [a + b for a, b in zip(run_acc, accs)]
        n_run += 1
        if progress is not None:
            progress(step + 1, loss_f, acceptance_estimate(accs))
        if (step + 1) % cfg.log_every == 0 or step + 1 == total[0]:
            rec = {
                "step": step + 1,
                "total_steps": total[0],
                "loss": run_loss / n_run,
                "acc_per_step": [a / n_run for a in run_acc],
                "acceptance_estimate": acceptance_estimate([a / n_run for a in run_acc]),
                "lr": sched.get_last_lr()[0],
                "elapsed_s": time.perf_counter() - t0,
            }
            logs.append(rec)
            with log_file.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            run_loss, run_acc, n_run = 0.0, None, 0
        if (step + 1) % cfg.ckpt_every == 0 and step + 1 < total[0]:
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"head": head.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "step": step + 1,
                        "total_steps": total[0]}, tmp)  # fmt: skip
            tmp.replace(ckpt)  # atomic: an interruption never leaves a half-written checkpoint
        step += 1
    return logs


_TIMED_STEPS = 20
_COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
