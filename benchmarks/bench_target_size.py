#!/usr/bin/env python3
"""polyspec's speculative engine at target-model size, with RANDOM weights.

  python benchmarks/bench_target_size.py --backend cuda --preset llama3-8b --out DIR
  python benchmarks/bench_target_size.py --backend cpu --preset tiny --graphs on --batch-sizes 1,4 --out DIR

What it measures. A Llama-3-8B-shaped target (and an EAGLE-3 head of the same width) is built
directly on the device with random weights, in memory (no checkpoint: 16 GB of bf16 would take
longer to write and read than the benchmark takes to run), and wrapped by ``LLM.from_modules``.
For each batch size, a plain engine and a speculative engine each generate ``--max-new-tokens``
tokens for every prompt (random token ids, ``ignore_eos``), after an untimed warm-up generate and
the capture of every graph bucket the timed run can reach. Each engine runs twice:

* run A, the PhaseTimer off: tokens/s, the number of decode rounds, the wall time of a round
  (``step_ms``: the whole engine, scheduler included, prefill excluded; ``round_ms``: the worker's
  ``decode`` call alone);
* run B, the PhaseTimer on (it synchronises the device at every phase boundary, so its total is a
  little above run A's): milliseconds per round in each phase (draft, verify, accept,
  draft_extend, other for EAGLE; target, other for plain). A captured all-greedy EAGLE round is
  one graph (draft forwards, tree, verify, acceptance, KV compaction and draft extend): its
  replay is timed as verify, its draft phase is the host's preparation of the round, and it has
  no draft_extend phase.

The model-forward time of a round is the time of the target verify forward + the draft forwards
+ the draft extend forward (plain: the target decode forward). With captured graphs it is
measured by replaying each captured graph the timed run used (``runner.replay(key, {})`` replays
with the buffers of the last round; ``--replays`` times, the device synchronised around them),
weighted by how many times the run used each key. A graph holds the forward plus the few small
kernels captured with it (draft top-k and tree assembly, lm_head and logits, greedy acceptance,
the accepted path's KV moves, the extend's top-k): device work that belongs to the forward pass.
Without graphs (``--graphs off``, or a backend without capture) the forward time is the sum of
the PhaseTimer's draft + verify + draft_extend phases: an upper bound (those phases also hold
host-side batch building and the tree kernels), so the overhead fraction is then a lower bound;
the report says which method was used.

``overhead_fraction = 1 - forward_ms_per_round / step_ms``: the share of a round spent outside
model forwards (host work, scheduling, launches, synchronisation, small kernels).

Why acceptance is meaningless here: the draft head has not been trained to predict this random
target, so its guesses almost never match and nearly every round emits one token. Speculative
tokens/s is therefore far below what a trained head gives (and usually below plain decoding);
read the per-round times and the overhead fraction, not the speed-up. Per-round cost does not
depend on what the weights are: the shapes (batch, tree, context) are the same.

Writes ``DIR/target_size.json`` and ``DIR/target_size.md`` (the exact command, torch version,
device name, settings, one row per batch size) and prints the markdown.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import json
import platform
import shlex
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from polyspec.config import SamplingParams, SpeculativeConfig
from polyspec.engine.llm import LLM
from polyspec.errors import PolyspecError
from polyspec.model.config import ModelConfig
from polyspec.model.eagle import DraftHead
from polyspec.model.llama import CausalLM
from polyspec.model.loader import default_aux_layers


@dataclasses.dataclass(frozen=True)
class Preset:
    """The shape of a target model and of its EAGLE-3 head."""

    target: ModelConfig
    draft_vocab_size: int  # the head's lm_head rows (a d2t map sends them into the target vocab)


PRESETS: dict[str, Preset] = {
    "llama3-8b": Preset(
        ModelConfig(
            architecture="llama",
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_layers=32,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            max_position_embeddings=8192,
            eos_token_ids=(128001, 128009),
        ).validate(),
        draft_vocab_size=32000,
    ),
    # SmolLM2-135M's shape and the shipped head's draft vocabulary: the overhead fraction of
    # the default model's rounds, which the end-to-end bench cannot split off the forwards.
    "smollm2-135m": Preset(
        ModelConfig(
            architecture="llama",
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_layers=30,
            num_heads=9,
            num_kv_heads=3,
            head_dim=64,
            rms_norm_eps=1e-5,
            rope_theta=100000.0,
            max_position_embeddings=8192,
            eos_token_ids=(2,),
            tie_word_embeddings=True,
        ).validate(),
        draft_vocab_size=8192,
    ),
    # The same structure at a few MB (about 4.7M parameters), for checking the script on a CPU.
    "tiny": Preset(
        ModelConfig(
            architecture="llama",
            vocab_size=4096,
            hidden_size=256,
            intermediate_size=512,
            num_layers=6,
            num_heads=4,
            num_kv_heads=2,
            head_dim=64,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            max_position_embeddings=4096,
            eos_token_ids=(2,),
        ).validate(),
        draft_vocab_size=1024,
    ),
}

DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
}


# -- random models ---------------------------------------------------------------------------


@torch.no_grad()
def randomize_(module: torch.nn.Module, seed: int) -> None:
    """Fill every parameter in place with Gaussian values that keep activations O(1): norms
    around 1, matrices with std ``fan_in ** -0.5`` (halved for the residual-branch outputs
    o_proj / down_proj), embeddings std 0.4, lm_head std ``3 / sqrt(H)`` (logit std about 3)."""
    params = list(module.named_parameters())
    if not params:
        return
    g = torch.Generator(device=params[0][1].device).manual_seed(seed)
    for name, p in params:
        leaf = name.rsplit(".", 1)[-1]
        if "bias" in leaf:
            p.normal_(0.0, 0.1, generator=g)
        elif p.dim() == 1:
            p.normal_(1.0, 0.1, generator=g)
        elif leaf == "embed_tokens":
            p.normal_(0.0, 0.4, generator=g)
        elif leaf == "lm_head":
            p.normal_(0.0, 3.0 * p.shape[1] ** -0.5, generator=g)
        else:
            scale = 0.5 if leaf in ("o_proj", "down_proj") else 1.0
            p.normal_(0.0, scale * p.shape[1] ** -0.5, generator=g)


def build_models(
    preset: Preset, backend: Any, dtype: torch.dtype, seed: int = 0
) -> tuple[CausalLM, DraftHead]:
    """A random target and a random EAGLE-3 head for it, built directly on ``backend``'s
    device (one decoder layer of the target's width, SGLang's default aux layers, a draft
    vocabulary of ``preset.draft_vocab_size`` ids mapped onto random target ids)."""
    tc = preset.target
    dev = backend.device()
    target = CausalLM(tc, backend.kernels, dev, dtype)
    randomize_(target, seed)
    head_cfg = dataclasses.replace(tc, num_layers=1)
    head = DraftHead(
        "eagle3",
        head_cfg,
        target,
        backend.kernels,
        dev,
        dtype,
        draft_vocab_size=preset.draft_vocab_size,
        aux_layer_ids=default_aux_layers(tc.num_layers),
        max_positions=target.cos_sin_cache.shape[0],
    )
    randomize_(head, seed + 1)
    g = torch.Generator().manual_seed(seed + 2)
    d2t = torch.randperm(tc.vocab_size, generator=g)[: preset.draft_vocab_size].sort().values
    head.set_token_map(d2t)
    return target.eval(), head.eval()


def num_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# -- timing ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Probe:
    """Counts and times what an engine does during one generate: prefill / decode calls (the
    device synchronised around each) and the graph keys each captured computation replays."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    rounds: int = 0
    graph_calls: Counter = dataclasses.field(default_factory=Counter)  # (name, b, p) -> calls
    eager_calls: Counter = dataclasses.field(default_factory=Counter)  # name -> graph refused
    in_decode: bool = False  # inside the worker's decode (graph calls of a round are counted)


def instrument(llm: LLM) -> Probe:
    """Wrap ``llm``'s worker (prefill, decode) and captured forwards (run) with counters; the
    returned Probe is reset by the caller before each timed run. With ``overlap_rounds`` the
    decode calls are not synchronised (that would undo the overlap): their time is then the
    host's only, and ``round_ms`` means nothing; ``step_ms`` (wall time) still holds."""
    probe = Probe()
    worker, sync = llm.worker, llm.backend.synchronize
    overlap = llm.scheduler.overlap

    def timed(fn: Callable, attr: str, count: bool) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not (overlap and count):
                sync()
            t0 = time.perf_counter()
            probe.in_decode = count
            try:
                out = fn(*args, **kwargs)
            finally:
                probe.in_decode = False
            if not (overlap and count):
                sync()
            setattr(probe, attr, getattr(probe, attr) + time.perf_counter() - t0)
            if count:
                probe.rounds += 1
            return out

        return wrapper

    worker.prefill = timed(worker.prefill, "prefill_s", False)
    worker.decode = timed(worker.decode, "decode_s", True)
    graphs = worker.graphs
    if graphs is not None:
        run = graphs.run

        def counted_run(name: str, bs: int, max_prefix: int, *args: Any) -> Any:
            out = run(name, bs, max_prefix, *args)
            if not probe.in_decode:  # a captured prefill: not part of a round
                return out
            if out is None:
                probe.eager_calls[name] += 1
            else:
                b = graphs.buckets.batch_bucket(bs)
                p = graphs.buckets.prefix_bucket(max_prefix)
                probe.graph_calls[(name, b, p)] += 1
            return out

        graphs.run = counted_run
    return probe


def _ready(llm: LLM, key: tuple) -> None:
    """Prepare graph ``key`` (where the runner needs it) and replay it once, untimed."""
    graphs = llm.worker.graphs
    name, b, p = key
    if graphs.needs_prepare:
        graphs.runner.prepare(key, {"batch_size": b, "max_prefix_len": p})
    graphs.runner.replay(key, {})
    llm.backend.synchronize()


def time_replays(llm: LLM, keys: Sequence[tuple], replays: int) -> dict[tuple, float]:
    """Seconds per replay of each captured graph key, with the buffers the last round left
    (one untimed replay first, then ``replays`` back to back, the device synchronised around
    them)."""
    graphs, sync = llm.worker.graphs, llm.backend.synchronize
    runner = graphs.runner
    out = {}
    with torch.inference_mode():
        for key in keys:
            _ready(llm, key)
            t0 = time.perf_counter()
            for _ in range(replays):
                runner.replay(key, {})
            sync()
            out[key] = (time.perf_counter() - t0) / replays
    return out


def profile_replays(llm: LLM, keys: Sequence[tuple], replays: int) -> dict[str, Any]:
    """What runs inside each captured graph: ``replays`` replays of every key in ``keys`` under
    torch.profiler, one row per kernel name with its launches and device microseconds per
    replay, and the replay's wall time (so ``1 - kernel_us / wall_us`` is the time the device
    spent between kernels: launch latency inside the graph, not host work)."""
    from torch.profiler import ProfilerActivity, profile

    graphs, sync = llm.worker.graphs, llm.backend.synchronize
    runner = graphs.runner
    on_device = llm.backend.device().type == "cuda"
    activity = ProfilerActivity.CUDA if on_device else ProfilerActivity.CPU
    out: dict[str, Any] = {}
    with torch.inference_mode():
        for key in keys:
            _ready(llm, key)
            name, b, p = key
            with profile(activities=[activity]) as prof:
                t0 = time.perf_counter()
                for _ in range(replays):
                    runner.replay(key, {})
                sync()
                wall_us = 1e6 * (time.perf_counter() - t0) / replays
            rows = []
            for avg in prof.key_averages():
                us = avg.self_device_time_total if on_device else avg.self_cpu_time_total
                if us <= 0 or (on_device and avg.device_type.name != "CUDA"):
                    continue
                rows.append(
                    {
                        "kernel": avg.key,
                        "per_replay": avg.count / replays,
                        "us_per_replay": us / replays,
                    }
                )
            rows.sort(key=lambda r: -r["us_per_replay"])
            kernel_us = sum(r["us_per_replay"] for r in rows)
            out[f"{name}/b{b}/p{p}"] = {
                "wall_us": wall_us,
                "kernel_us": kernel_us,
                "launches": sum(r["per_replay"] for r in rows),
                "kernels": rows,
            }
    return out


FORWARD_PHASES = {"spec": ("draft", "verify", "draft_extend"), "plain": ("target",)}


def expected_graphs(llm: LLM, kind: str, batch_size: int) -> tuple[str, ...]:  # noqa: ARG001
    """The captured computations one greedy round of ``batch_size`` requests runs (the worker
    says: an EAGLE head's all-greedy round is a single graph, draft forwards, verify and draft
    extend together, named for the batch size's tree)."""
    return llm.worker.round_graphs(greedy=True, batch_size=batch_size)


def measure(
    llm: LLM,
    probe: Probe,
    kind: str,
    prompts: list[list[int]],
    sampling: SamplingParams,
    replays: int,
    profile: bool = False,
) -> dict[str, Any]:
    """Warm up, then run A (timer off) and run B (timer on) over ``prompts``; one result dict.
    ``probe``: :func:`instrument`'s for ``llm``; ``profile``: add :func:`profile_replays` of
    the graphs the run used."""
    sync = llm.backend.synchronize
    # Warm-up: every computation runs (and its buckets for this batch get captured lazily) ...
    llm.generate(prompt_token_ids=prompts, sampling_params=sampling)
    graphs = llm.worker.graphs
    if graphs is not None:  # ... then every bucket the timed run can reach, untimed
        longest = max(len(p) for p in prompts) + sampling.max_new_tokens
        graphs.capture_all(len(prompts), longest + 16)

    def timed_run(phases: bool) -> tuple[float, list]:
        probe.prefill_s = probe.decode_s = 0.0
        probe.rounds = 0
        probe.graph_calls.clear()
        probe.eager_calls.clear()
        timer = llm.worker.timer
        timer.seconds.clear()
        timer.enabled = phases
        try:
            sync()
            t0 = time.perf_counter()
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=sampling)
            sync()
            return time.perf_counter() - t0, outs
        finally:
            timer.enabled = False

    wall, outs = timed_run(False)
    failed = [o.error for o in outs if o.finish_reason == "error"]
    if failed:  # a timing of nothing would read as a result
        raise RuntimeError(f"{kind}: {len(failed)} of {len(outs)} requests failed: {failed[0]}")
    rounds, decode_s, prefill_s = probe.rounds, probe.decode_s, probe.prefill_s
    graph_calls, eager_calls = Counter(probe.graph_calls), Counter(probe.eager_calls)
    tokens = sum(len(o.token_ids) for o in outs)
    # The run's tokens, request by request, as one digest: equal digests, equal outputs.
    digest = hashlib.sha256(json.dumps([list(o.token_ids) for o in outs]).encode()).hexdigest()
    request_rounds = sum(o.stats.num_rounds for o in outs)
    decode_tokens = sum(sum(o.stats.accepted_per_round) for o in outs)

    wall_b, _ = timed_run(True)
    phase_s = dict(llm.worker.timer.seconds)
    phase_s.pop("prefill", None)  # per-round phases only (prefill_s is reported apart)
    rounds_b = max(probe.rounds, 1)
    phase_ms = {k: 1e3 * v / rounds_b for k, v in phase_s.items()}

    step_ms = 1e3 * (wall - prefill_s) / max(rounds, 1)
    round_ms = 1e3 * decode_s / max(rounds, 1)
    forward: dict[str, Any]
    if graph_calls:
        keys = sorted(graph_calls)
        per_replay = time_replays(llm, keys, replays)
        fwd_s = sum(graph_calls[k] * per_replay[k] for k in keys)
        # With overlap_rounds a round queued behind the last one and then dropped (the batch
        # changed) replays too: its device time counts as forward time.
        overlap = llm.scheduler.overlap
        complete = not eager_calls and all(
            (n >= rounds if overlap else n == rounds)
            for g in expected_graphs(llm, kind, len(prompts))
            for n in [sum(c for (name, _, _), c in graph_calls.items() if name == g)]
        )
        forward = {
            "method": "graph_replay" if complete else "graph_replay_partial",
            "ms_per_round": 1e3 * fwd_s / max(rounds, 1),
            "graphs": [
                {
                    "name": k[0],
                    "batch_bucket": k[1],
                    "prefix_bucket": k[2],
                    "calls": graph_calls[k],
                    "replay_ms": 1e3 * per_replay[k],
                }
                for k in keys
            ],
            "eager_calls": dict(eager_calls),
        }
        if profile:
            forward["profile"] = profile_replays(llm, keys, replays)
        notes = []
        if not complete:
            notes.append(
                "some rounds ran eagerly (outside every graph bucket or over the graph budget): "
                "their forwards are missing from ms_per_round, which is then a lower bound"
            )
        if not llm.backend.capabilities.graph_capture:
            notes.append(
                f"backend {llm.backend.name!r} replays its graphs eagerly (no device graphs): a "
                "replay's time includes the host work of running the forward, so ms_per_round "
                "is an upper bound and the overhead fraction a lower bound"
            )
        if notes:
            forward["note"] = "; ".join(notes)
    else:
        fwd = sum(phase_ms.get(p, 0.0) for p in FORWARD_PHASES[kind])
        forward = {
            "method": "phase_timer",
            "ms_per_round": fwd,
            "note": "no captured graphs: the forward time is the sum of the PhaseTimer's "
            f"{' + '.join(FORWARD_PHASES[kind])} phase(s) (eager forwards plus the host work in "
            "those phases), an upper bound; the overhead fraction is a lower bound",
        }
    fwd_ms = forward["ms_per_round"]
    return {
        "tokens": tokens,
        "tokens_sha256": digest,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "prefill_s": prefill_s,
        "decode_tokens_per_s": decode_tokens / decode_s if decode_s > 0 else 0.0,
        "rounds": rounds,
        "num_kv_slots": llm.worker.num_kv_slots,
        "mean_tokens_per_request_round": decode_tokens / max(request_rounds, 1),
        "step_ms": step_ms,
        "round_ms": round_ms,
        "phase_ms_per_round": phase_ms,
        "phase_total_ms": sum(phase_ms.values()),
        "timed_with_phases_wall_s": wall_b,
        "forward": forward,
        "overhead_fraction": 1.0 - fwd_ms / step_ms if step_ms > 0 else None,
        "overhead_fraction_worker": 1.0 - fwd_ms / round_ms if round_ms > 0 else None,
    }


# -- report ----------------------------------------------------------------------------------


def device_name(backend: Any) -> str:
    dev = backend.device()
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"{dev.type}: {platform.processor() or platform.machine()} ({platform.platform()})"


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def _yes_no(x: bool | None) -> str:
    return "-" if x is None else ("yes" if x else "**NO**")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = [
        f"# polyspec at target size: {s['preset']} (random weights)",
        "",
        f"- command: `{report['command']}`",
        f"- device: {report['device']}; backend {s['backend']}; torch {report['torch']}; "
        f"dtype {s['dtype']}; graphs {s['graphs']} (captured: {report['graphs_captured']})",
        f"- target {report['target_params'] / 1e9:.3f} B params; EAGLE-3 head "
        f"{report['draft_params'] / 1e6:.1f} M params (aux layers {report['aux_layers']}, "
        f"draft vocab {report['draft_vocab_size']})",
        f"- EAGLE-3 num_steps {s['num_steps']}, topk {s['topk']}, num_draft_tokens "
        f"{s['num_draft_tokens']}; prompt {s['prompt_len']} random ids, "
        f"{s['max_new_tokens']} new tokens (ignore_eos), greedy",
    ]
    if report.get("peak_memory_gib") is not None:
        lines.append(f"- peak device memory: {report['peak_memory_gib']:.1f} GiB")
    lines += [
        "- random weights: the head's guesses almost never match, so spec tokens/s is NOT a "
        "speed-up measurement; read the per-round times and the overhead fraction",
        "",
        "## Speculative (EAGLE-3) round",
        "",
        "| batch | plain tok/s | spec tok/s | rounds | tok/req-round | step ms | draft | verify "
        "| accept | draft_extend | other | forward ms | forward method | overhead | spec = plain |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for r in report["results"]:
        p, sp = r["plain"], r["spec"]
        ph = sp["phase_ms_per_round"]
        lines.append(
            f"| {r['batch_size']} | {_f(p['tokens_per_s'], '.1f')} | "
            f"{_f(sp['tokens_per_s'], '.1f')} | {sp['rounds']} | "
            f"{_f(sp['mean_tokens_per_request_round'])} | {_f(sp['step_ms'], '.3f')} | "
            + " | ".join(
                _f(ph.get(k), ".3f") for k in ("draft", "verify", "accept", "draft_extend", "other")
            )
            + f" | {_f(sp['forward']['ms_per_round'], '.3f')} | {sp['forward']['method']} | "
            f"{_pct(sp['overhead_fraction'])} | {_yes_no(r['spec_equals_plain'])} |"
        )
    plain = [r for r in report["results"] if r["plain"]["forward"]["method"] != "skipped"]
    if plain:
        lines += [
            "",
            "## Plain decode round",
            "",
            "| batch | tok/s | rounds | step ms | target | other | forward ms | forward method "
            "| overhead |",
            "|---:|---:|---:|---:|---:|---:|---:|---|---:|",
        ]
    for r in plain:
        p = r["plain"]
        ph = p["phase_ms_per_round"]
        lines.append(
            f"| {r['batch_size']} | {_f(p['tokens_per_s'], '.1f')} | {p['rounds']} | "
            f"{_f(p['step_ms'], '.3f')} | {_f(ph.get('target'), '.3f')} | "
            f"{_f(ph.get('other'), '.3f')} | {_f(p['forward']['ms_per_round'], '.3f')} | "
            f"{p['forward']['method']} | {_pct(p['overhead_fraction'])} |"
        )
    graphs = [
        (r["batch_size"], g)
        for r in report["results"]
        for g in r["spec"]["forward"].get("graphs", [])
    ]
    if graphs:
        lines += [
            "",
            "## Graph replays of the speculative round (ms per replay)",
            "",
            "| batch | graph | batch bucket | prefix bucket | calls | replay ms |",
            "|---:|---|---:|---:|---:|---:|",
        ]
        for bs, g in graphs:
            lines.append(
                f"| {bs} | {g['name']} | {g['batch_bucket']} | {g['prefix_bucket']} | "
                f"{g['calls']} | {g['replay_ms']:.3f} |"
            )
    profiled = [
        (r["batch_size"], kind, key, prof)
        for r in report["results"]
        for kind in ("plain", "spec")
        for key, prof in r[kind]["forward"].get("profile", {}).items()
    ]
    for bs, kind, key, prof in profiled:
        lines += [
            "",
            f"## Kernels in one replay: batch {bs}, {kind}, {key}",
            "",
            f"{prof['launches']:.0f} launches, {prof['kernel_us']:.1f} us of kernels in a "
            f"{prof['wall_us']:.1f} us replay",
            "",
            "| kernel | launches | us |",
            "|---|---:|---:|",
        ]
        for row in prof["kernels"][:40]:
            lines.append(
                f"| `{row['kernel'][:90]}` | {row['per_replay']:.1f} | {row['us_per_replay']:.2f} |"
            )
    notes = sorted(
        {
            r[k]["forward"]["note"]
            for r in report["results"]
            for k in ("plain", "spec")
            if "note" in r[k]["forward"]
        }
    )
    lines += [
        "",
        "step ms: engine wall time per decode round (run without the phase timer, prefill "
        "excluded). Phase columns: ms per round with the phase timer on (it synchronises at "
        "each phase boundary). forward ms: model forwards per round (target verify + draft "
        "forwards + draft extend; plain: the decode forward). overhead = 1 - forward / step.",
        *[f"Note: {n}" for n in notes],
        "",
    ]
    return "\n".join(lines)


# -- command line ----------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _batch_sizes(text: str) -> list[int]:
    parts = [t.strip() for t in text.split(",") if t.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("expected comma-separated batch sizes, e.g. 1,16")
    sizes = [_positive_int(t) for t in parts]
    if len(set(sizes)) != len(sizes):
        raise argparse.ArgumentTypeError(f"batch sizes repeat: {text!r}")
    return sizes


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="Per-phase times and the overhead fraction of polyspec's speculative round "
        "at target size, with random weights (see the module docstring).",
    )
    ap.add_argument("--backend", default=None, help="backend name (cuda, cpu, ...); default auto")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--batch-sizes", type=_batch_sizes, default=[1, 16], metavar="B1,B2,...")
    ap.add_argument("--prompt-len", type=_positive_int, default=128)
    ap.add_argument("--max-new-tokens", type=_positive_int, default=64)
    ap.add_argument("--num-steps", type=_positive_int, default=3)
    ap.add_argument("--topk", type=_positive_int, default=1)
    ap.add_argument(
        "--num-draft-tokens",
        type=_positive_int,
        default=None,
        help="tree nodes verified per request (default: num_steps + 1 for a chain, i.e. 4)",
    )
    ap.add_argument("--graphs", choices=("auto", "on", "off"), default="auto")
    ap.add_argument(
        "--max-context",
        type=_positive_int,
        default=1024,
        help="request table width (context limit); KV slots are sized from it (default 1024)",
    )
    ap.add_argument(
        "--num-kv-slots",
        type=_positive_int,
        default=None,
        help="KV pool size in tokens (default: polyspec's sizing for the largest batch)",
    )
    ap.add_argument("--replays", type=_positive_int, default=20, help="graph replays timed per key")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also list the kernels inside each captured graph (torch.profiler over the replays)",
    )
    ap.add_argument("--skip-plain", action="store_true", help="only the speculative engine")
    ap.add_argument("--skip-spec", action="store_true", help="only the plain engine")
    ap.add_argument(
        "--linear-configs",
        type=Path,
        default=None,
        help='JSON {"N,K": [BLOCK_N, BLOCK_K, num_warps, num_stages]}: the row-invariant '
        "linear's tile for those weight shapes instead of tile_config's (what "
        "bench_rowinv_cuda.py --best writes), to time a choice before making it the default",
    )
    ap.add_argument(
        "--overlap-rounds",
        action="store_true",
        help="EngineConfig.overlap_rounds: queue each round before the last one's tokens are "
        "read (decode calls are then timed unsynchronised; step ms stays the wall time)",
    )
    ap.add_argument("--out", type=Path, required=True, help="directory for the JSON and markdown")
    args = ap.parse_args(argv)
    try:
        args.spec = SpeculativeConfig(
            algorithm="eagle3",
            num_steps=args.num_steps,
            topk=args.topk,
            num_draft_tokens=args.num_draft_tokens,
        )
    except PolyspecError as e:
        ap.error(str(e))
    if args.max_new_tokens < 2:
        ap.error("--max-new-tokens must be at least 2 (the first token comes from the prefill)")
    need = args.prompt_len + args.max_new_tokens + args.spec.num_draft_tokens
    if need > args.max_context:
        ap.error(
            f"--prompt-len {args.prompt_len} + --max-new-tokens {args.max_new_tokens} + "
            f"num_draft_tokens {args.spec.num_draft_tokens} = {need} exceeds --max-context "
            f"{args.max_context}; raise --max-context"
        )
    vocab = PRESETS[args.preset].target.vocab_size
    if args.prompt_len >= PRESETS[args.preset].target.max_position_embeddings:
        ap.error(f"--prompt-len {args.prompt_len} is past the preset's positions")
    args.vocab = vocab
    if args.skip_plain and args.skip_spec:
        ap.error("--skip-plain and --skip-spec leave nothing to run")
    if args.out.exists() and not args.out.is_dir():
        ap.error(f"--out {args.out} exists and is not a directory")
    return args


def use_linear_configs(configs: dict[str, Sequence[int]]) -> None:
    """Make the row-invariant linear take ``configs`` ("N,K" -> tile) for those weight shapes
    (each weight keeps one tile, so spec and plain still sum alike)."""
    from polyspec.kernels.triton import linear

    default = linear.tile_config

    def tile_config(n: int, k: int) -> tuple[int, int, int, int]:
        return tuple(configs.get(f"{n},{k}", default(n, k)))

    linear.tile_config = tile_config


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.linear_configs is not None:
        use_linear_configs(json.loads(args.linear_configs.read_text()))
    if argv is None:
        command = shlex.join(["python", *sys.argv])
    else:
        command = shlex.join(["python", "benchmarks/bench_target_size.py", *argv])
    from polyspec.plugins import create_backend

    try:
        backend = create_backend(args.backend)
    except PolyspecError as e:
        print(f"bench_target_size: error: {e}", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype]
    dtype_name = str(dtype).removeprefix("torch.")
    supported = getattr(backend.capabilities, "dtypes", None)
    if supported and dtype_name not in supported:
        print(
            f"bench_target_size: error: backend {backend.name!r} does not support {dtype_name} "
            f"(it supports {', '.join(supported)}); pick --dtype",
            file=sys.stderr,
        )
        return 2
    is_cuda = backend.device().type == "cuda"
    preset = PRESETS[args.preset]
    torch.manual_seed(args.seed)

    t0 = time.perf_counter()
    target, head = build_models(preset, backend, dtype, args.seed)
    backend.synchronize()
    print(
        f"built {args.preset} target ({num_params(target) / 1e9:.3f} B params) and EAGLE-3 head "
        f"({num_params(head) / 1e6:.1f} M) on {backend.device()} in {time.perf_counter() - t0:.1f} s",
        file=sys.stderr,
    )
    top = max(args.batch_sizes)
    engine_kw: dict[str, Any] = dict(
        backend=backend,
        max_batch_size=top,
        max_context=args.max_context,
        num_kv_slots=args.num_kv_slots,
        graphs=args.graphs,
        max_graph_batch_size=max(top, 1),
        max_tokens_per_step=max(2048, top * args.prompt_len),
        prefill_chunk_size=max(512, args.prompt_len),
        overlap_rounds="on" if args.overlap_rounds else "off",  # off: phases timed synced
    )
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    g = torch.Generator().manual_seed(args.seed + 100)
    prompts = {
        bs: torch.randint(0, args.vocab, (bs, args.prompt_len), generator=g).tolist()
        for bs in args.batch_sizes
    }

    results: dict[int, dict[str, Any]] = {bs: {"batch_size": bs} for bs in args.batch_sizes}
    captured = False
    try:
        systems = [k for k in ("plain", "spec") if not getattr(args, f"skip_{k}")]
        for kind in systems:
            if kind == "plain":
                llm = LLM.from_modules(target, **engine_kw)
            else:
                llm = LLM.from_modules(target, head, args.spec, **engine_kw)
            captured = captured or llm.worker.graphs is not None
            probe = instrument(llm)
            for bs in args.batch_sizes:
                t0 = time.perf_counter()
                results[bs][kind] = measure(
                    llm, probe, kind, prompts[bs], sampling, args.replays, args.profile
                )
                r = results[bs][kind]
                print(
                    f"{kind:5s} bs={bs:3d}: {r['tokens_per_s']:9.1f} tok/s, {r['rounds']} rounds, "
                    f"step {r['step_ms']:.3f} ms, forward {r['forward']['ms_per_round']:.3f} ms "
                    f"({r['forward']['method']}), overhead {_pct(r['overhead_fraction'])} "
                    f"[{time.perf_counter() - t0:.1f} s]",
                    file=sys.stderr,
                )
            del llm
            gc.collect()
            if is_cuda:
                torch.cuda.empty_cache()
    except PolyspecError as e:
        print(f"bench_target_size: error: {e}", file=sys.stderr)
        return 2
    for kind in ("plain", "spec"):
        if getattr(args, f"skip_{kind}"):
            for r in results.values():
                r[kind] = {
                    "tokens_per_s": None,
                    "rounds": 0,
                    "step_ms": None,
                    "mean_tokens_per_request_round": None,
                    "phase_ms_per_round": {},
                    "forward": {"ms_per_round": None, "method": "skipped"},
                    "overhead_fraction": None,
                }

    for r in results.values():  # greedy speculative output must equal plain output
        digests = {r[k].get("tokens_sha256") for k in ("plain", "spec")}
        r["spec_equals_plain"] = len(digests) == 1 if None not in digests else None
    report = {
        "command": command,
        "torch": torch.__version__,
        "device": device_name(backend),
        "python": platform.python_version(),
        "graphs_captured": captured,
        "settings": {
            "preset": args.preset,
            "backend": backend.name,
            "dtype": dtype_name,
            "graphs": args.graphs,
            "batch_sizes": args.batch_sizes,
            "prompt_len": args.prompt_len,
            "max_new_tokens": args.max_new_tokens,
            "num_steps": args.spec.num_steps,
            "topk": args.spec.topk,
            "num_draft_tokens": args.spec.num_draft_tokens,
            "max_context": args.max_context,
            "num_kv_slots": args.num_kv_slots,
            "replays": args.replays,
            "seed": args.seed,
            "overlap_rounds": args.overlap_rounds,
        },
        "model": dataclasses.asdict(preset.target),
        "target_params": num_params(target),
        "draft_params": num_params(head),
        "aux_layers": list(head.aux_layer_ids),
        "draft_vocab_size": head.draft_vocab_size,
        "peak_memory_gib": torch.cuda.max_memory_allocated(backend.device()) / 2**30
        if is_cuda
        else None,
        "results": [results[bs] for bs in args.batch_sizes],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "target_size.json").write_text(json.dumps(report, indent=2) + "\n")
    md = markdown(report)
    (args.out / "target_size.md").write_text(md)
    print(json.dumps(report, indent=2))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
