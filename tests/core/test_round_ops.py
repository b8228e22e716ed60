"""Host work of a speculative round: the ops a round dispatches outside its captured
forwards (:class:`polyspec.testing.op_count.RoundOpCounter`), and the draft state the worker
keeps batched between rounds while requests join, leave and sit rounds out."""

from __future__ import annotations

import pytest
import torch

from polyspec import LLM, SamplingParams, SpeculativeConfig
from polyspec.runtime.sampling import RequestSampler
from polyspec.testing.builders import build_bigram_models
from polyspec.testing.op_count import RoundOpCounter

SPEC = SpeculativeConfig(algorithm="eagle", num_steps=3, topk=2, num_draft_tokens=6)


def _prompts(n: int, length: int = 12, seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 64, (n, length), generator=g).tolist()


def _spec_llm(backend, graphs: str, max_batch_size: int = 4) -> LLM:
    # a target close to its bigram: the head's drafts are mostly accepted, so drafting from a
    # wrong request's state would show in the accepted counts
    target, head = build_bigram_models(backend, layer_scale=0.1)
    return LLM.from_modules(
        target, head, SPEC, backend=backend, graphs=graphs, max_batch_size=max_batch_size,
        max_context=128,
    )  # fmt: skip


def _plain_tokens(backend, prompts, max_new: int) -> list[list[int]]:
    target, _ = build_bigram_models(backend, layer_scale=0.1)
    plain = LLM.from_modules(target, backend=backend, max_batch_size=len(prompts), max_context=128)
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    return [o.token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=params)]


def _steady_rounds(llm: LLM, batch_size: int):
    """Counts of the rounds of a second generate (graphs captured by the first) that decode
    the whole batch, but its first round (stacking the prefilled requests' states and growing
    their KV)."""
    prompts = _prompts(batch_size)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts, sampling_params=params)
    with RoundOpCounter(llm) as counter:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    rounds = [r for bs, r in counter.rounds if bs == batch_size][1:]
    assert len(rounds) >= 3
    assert sum(sum(o.stats.accepted_per_round) for o in outs) > sum(
        o.stats.num_rounds for o in outs
    ), "the bigram draft should get drafts accepted (compaction runs)"
    return [{f: sum(getattr(c, f) for c in r.values()) for f in ("ops", "kernels", "syncs",
             "replays")} for r in rounds]  # fmt: skip


def test_greedy_round_is_one_replay_with_few_ops_around_it(reference_backend):
    """Graphs on: a steady all-greedy round replays one graph and dispatches a handful of ops
    outside it (a round of 3 replays dispatched ~120 at batch 1 and ~270 at batch 16), the same
    number at batch 1 and 4 (no device op per request), and reads the device once."""
    per_batch = {}
    for bs in (1, 4):
        rounds = _steady_rounds(_spec_llm(reference_backend, "on", max_batch_size=4), bs)
        for r in rounds:
            assert r["replays"] == 1 and r["syncs"] == 1
            assert r["ops"] <= 30 and r["kernels"] <= 8, r
        per_batch[bs] = {r["ops"] for r in rounds}
    assert per_batch[1] == per_batch[4]


def test_counter_sees_eager_rounds(reference_backend):
    """Graphs off: the same rounds run eagerly, and the counter sees their forwards' ops."""
    rounds = _steady_rounds(_spec_llm(reference_backend, "off"), 2)
    assert all(r["replays"] == 0 and r["ops"] > 300 for r in rounds)


def _start(worker, prompts, rids) -> dict[int, int]:
    """Add and prefill requests ``rids`` (greedy) -> their first tokens."""
    for r in rids:
        sampler = RequestSampler.create(0.0, 0, 1.0, 0, worker.device)
        reserved = worker.kv_need(len(prompts[r]), 48)
        worker.add_request(r, prompts[r], sampler, kv_reserved=reserved)
    return worker.prefill(rids, [len(prompts[r]) for r in rids])


@pytest.mark.parametrize("graphs", ["off", "on"])
def test_draft_state_follows_requests_between_rounds(reference_backend, graphs):
    """Rounds over changing sets of requests (one sits a round out while the same graph bucket
    replays, one joins late, one leaves, the order changes): the draft state kept batched from
    the last round goes to the right requests. Greedy output is lossless whatever the draft
    proposes, so the check is on the drafts: each request's tokens per round (how many were
    accepted) equal those of the same request decoding alone."""
    prompts = _prompts(4, length=9, seed=8)
    worker = _spec_llm(reference_backend, graphs).worker
    rounds: dict[int, list[list[int]]] = {r: [] for r in range(4)}
    first = _start(worker, prompts, [0, 1, 2])
    schedule = [[0, 1, 2], [0, 1, 2], "join 3", [0, 2, 3], [0, 1, 2, 3], [1], [3, 0, 1, 2],
                [3, 0, 1, 2], "leave 1", [0, 2, 3], [0, 2, 3], [2, 0, 3], [2, 0, 3]]  # fmt: skip
    for step in schedule:
        if step == "join 3":
            first.update(_start(worker, prompts, [3]))
        elif step == "leave 1":
            worker.remove_request(1)
        else:
            for r, toks in zip(step, worker.decode(step)):
                rounds[r].append(toks)
    if graphs == "on":
        assert worker.graphs is not None and worker.graphs.num_captured > 0
    assert any(len(t) > 1 for per in rounds.values() for t in per), "no draft was accepted"

    want = _plain_tokens(reference_backend, prompts, max_new=48)
    for r, per_round in rounds.items():
        alone = _spec_llm(reference_backend, graphs).worker
        assert _start(alone, prompts, [r]) == {r: first[r]}
        assert [alone.decode([r])[0] for _ in per_round] == per_round, f"request {r}"
        toks = [first[r]] + [t for step in per_round for t in step]
        assert toks == want[r][: len(toks)], f"request {r}"


@pytest.mark.parametrize("batch_size", [1, 3])
def test_overlapped_rounds_with_long_accepted_paths(reference_backend, batch_size):
    """``overlap_rounds`` where drafts are mostly accepted: each queued round takes its
    prefixes and roots from the last round's accepted lengths and bonus tokens on the device
    (paths of up to S + 1 tokens, compacted for topk > 1), and its draft state from that
    round's draft extend. The tokens equal plain greedy decoding's, with queued rounds used."""
    be = reference_backend
    target, head = build_bigram_models(be, layer_scale=0.1)
    spec = SpeculativeConfig(algorithm="eagle", num_steps=3, topk=4, num_draft_tokens=10)
    llm = LLM.from_modules(
        target, head, spec, backend=be, graphs="on", max_batch_size=batch_size,
        max_context=128, overlap_rounds=True,
    )  # fmt: skip
    prompts = _prompts(batch_size)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in outs] == _plain_tokens(be, prompts, 40)
    assert min(o.stats.mean_acceptance_length for o in outs) > 2.0
    assert llm.worker.queued_rounds["used"] >= 3, llm.worker.queued_rounds


def test_host_time_script_reports_rounds_inside_and_outside_replays(capsys):
    """``benchmarks/host_time_per_round.py``: a captured run whose wall time splits into the replays
    and the rest."""
    import importlib.util
    import re
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "host_time_per_round.py"
    spec = importlib.util.spec_from_file_location("host_time_per_round", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    threads = torch.get_num_threads()
    try:
        assert (
            script.main(["--max-new-tokens", "24", "--topk", "2", "--num-draft-tokens", "6"]) == 0
        )
    finally:
        torch.set_num_threads(threads)
    line = capsys.readouterr().out.strip()
    m = re.fullmatch(
        r"S=3 K=2 N=6 batch 1 on cpu: (\d+) rounds, ([\d.]+) tokens a round, wall ([\d.]+) ms a "
        r"round, in replays ([\d.]+) ms, outside ([\d.]+) ms",
        line,
    )
    assert m, line
    rounds, wall, inside, outside = int(m[1]), float(m[3]), float(m[4]), float(m[5])
    assert 1 <= rounds < 23 and inside > 0 and abs(wall - inside - outside) < 0.01


def test_overlapped_rounds_across_chunked_prefills_and_joins(reference_backend):
    """A queued round survives the prefill chunks of a request that is not decoding yet (the
    batch it was queued for is unchanged); when that request joins, it sits the queued round
    out and is in the next; requests of five lengths come and go through a batch of 3.
    Tokens equal plain greedy decoding's."""
    be = reference_backend
    target, head = build_bigram_models(be, layer_scale=0.1)
    spec = SpeculativeConfig(algorithm="eagle", num_steps=3, topk=2, num_draft_tokens=6)
    llm = LLM.from_modules(
        target, head, spec, backend=be, graphs="on", max_batch_size=3, max_context=160,
        overlap_rounds=True, prefill_chunk_size=8, max_tokens_per_step=8,
    )  # fmt: skip
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (6, 40, 9, 33, 12)]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (30, 24, 40, 20, 28)]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    plain = LLM.from_modules(
        build_bigram_models(be, layer_scale=0.1)[0], backend=be, max_batch_size=3,
        max_context=160,
    )  # fmt: skip
    want = [o.token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert [o.token_ids for o in outs] == want
    queued = llm.worker.queued_rounds
    # a request that joins sits the queued round out and is in the one queued behind it; one
    # that leaves has its row ignored
    # (a round queued for requests that have all left is dropped)
    assert queued["joined_after"] > 0 and queued["used_by_fewer"] > 0, queued


def test_target_size_script_times_both_engines_and_a_linear_tile_override(tmp_path, monkeypatch):
    """``benchmarks/bench_target_size.py`` on the tiny preset with captured graphs: both engines
    generate every token (a failed request is an error, not a timing of nothing), the same
    tokens (greedy), the rounds replay graphs, and ``--linear-configs`` reaches the row-invariant linear's tile choice."""
    import importlib.util
    import json
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_target_size.py"
    spec = importlib.util.spec_from_file_location("bench_target_size", path)
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_target_size", script)  # its dataclasses look it up
    spec.loader.exec_module(script)
    configs = tmp_path / "tiles.json"
    configs.write_text(json.dumps({"256,256": [16, 64, 4, 4]}))
    from polyspec.kernels.triton import linear

    default = linear.tile_config
    threads = torch.get_num_threads()
    try:
        argv = ["--backend", "cpu", "--preset", "tiny", "--graphs", "on", "--batch-sizes", "1"]
        argv += ["--max-new-tokens", "4", "--prompt-len", "16", "--replays", "2"]
        argv += ["--linear-configs", str(configs), "--out", str(tmp_path)]
        assert script.main(argv) == 0
        assert linear.tile_config(256, 256) == (16, 64, 4, 4)
        assert linear.tile_config(512, 256) == default(512, 256)
    finally:
        linear.tile_config = default
        torch.set_num_threads(threads)
    report = json.loads((tmp_path / "target_size.json").read_text())
    (row,) = report["results"]
    for kind in ("plain", "spec"):
        assert row[kind]["tokens"] == 4, row[kind]
        assert row[kind]["forward"]["method"] == "graph_replay", row[kind]["forward"]
    assert row["spec_equals_plain"] is True  # fp32 cpu: greedy speculative = plain
    assert "| yes |" in (tmp_path / "target_size.md").read_text()


def test_gc_pause_script_reports_and_leaves_the_heap_unfrozen(tmp_path):
    """``benchmarks/gc_pause.py`` on a tiny speculative engine: it reports the tracked objects
    and a time per collection, and undoes its ``gc.freeze()`` (the objects it froze would
    otherwise never be collected in the calling process)."""
    import gc
    import importlib.util
    from pathlib import Path

    from polyspec.testing import builders

    target = builders.build_tiny_target(tmp_path / "target", seed=0)
    head = builders.build_tiny_eagle3(tmp_path / "eagle3", target, seed=2)
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gc_pause.py"
    spec = importlib.util.spec_from_file_location("gc_pause", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    frozen_before = gc.get_freeze_count()
    out = script.main(["--target", str(target), "--draft", str(head), "--repeats", "2"])
    assert gc.get_freeze_count() == frozen_before
    assert out["tracked"] > 0 and len(out["collect_ms"]) == 2 and out["frozen_ms"] >= 0


@pytest.mark.parametrize("algorithm", ["eagle", "eagle3"])
def test_ops_in_replays_script_charges_torch_launches_to_their_sites(algorithm):
    """``benchmarks/count_ops_in_replays.py --sites``: with the Triton kernels in place, the
    torch launches of a round replay by call site: the core's (the embedding lookup of every
    forward, but an EAGLE-3 head's, whose lookup, norms and concatenation are one
    ``draft_layer_input`` launch), never a backend's or a dtype query; the forwards' extend
    lengths all come from one launch a round; the head's top-K ids reach the target's
    vocabulary inside ``softmax_topk``. Its own process: the interpreter must be on before
    Triton is imported."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "count_ops_in_replays.py"
    run = subprocess.run(
        [sys.executable, str(path), "--batch-size", "1", "--tree", "2-2-4", "--sites", "100",
         "--algorithm", algorithm],
        capture_output=True, text=True, timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"},
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    _, _, listing = run.stdout.partition("round_greedy: ")
    total = int(listing.split(" torch launches")[0])
    rows = [line.split(None, 1) for line in listing.splitlines()[1:] if line.strip()]
    counts = {site: int(n) for n, site in rows}
    assert total == sum(counts.values()) > 0
    # a round of S=2 runs three forwards: the verify, one draft level, the draft extend
    (embed,) = [site for site in counts if site.endswith("embed: embedding")]
    assert embed.startswith("core/model/llama.py")
    assert counts[embed] == (3 if algorithm == "eagle" else 1), counts
    assert not any("model/eagle.py" in s and algorithm == "eagle3" for s in counts), counts
    assert not any("backends/" in s or "promote_types" in s for s in counts), counts
    lens = {site: n for site, n in counts.items() if "round.py" in site and site.endswith("mul")}
    assert list(lens.values()) == [1] and "_extend_lens" in next(iter(lens)), lens


def test_no_round_is_queued_behind_one_that_takes_every_request_to_its_limit(reference_backend):
    """``overlap_rounds`` at batch 1, requests one after another: a round commits at least one
    token per request, so behind a round that starts one token short of every request's limit
    nothing is queued (it would be all padding, run before the next request's prefill); behind
    the others a round is queued and used. Tokens equal plain greedy decoding's."""
    be = reference_backend
    target, head = build_bigram_models(be, layer_scale=0.1)
    llm = LLM.from_modules(
        target, head, SPEC, backend=be, graphs="on", max_batch_size=1, max_context=128,
        overlap_rounds=True,
    )  # fmt: skip
    worker, calls = llm.worker, []
    queue_next = worker._queue_next

    def recording(tree, launched, rids, sts, rows, joined=0):
        last = all(s.seq_len + 1 >= worker._end_len(s) for s in sts)
        queued = queue_next(tree, launched, rids, sts, rows, joined)
        calls.append((last, queued is not None))
        return queued

    worker._queue_next = recording
    prompts = _prompts(4)
    # 2 = one prefill token + one round that starts a token short of the limit
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (2, 23, 30, 17)]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    for out, p, want in zip(outs, params, [_plain_tokens(be, [q], 30)[0] for q in prompts]):
        assert out.token_ids == want[: p.max_new_tokens]
    assert any(last for last, _ in calls), calls
    assert not any(queued for last, queued in calls if last), calls
    assert any(queued for last, queued in calls if not last), calls
    assert worker.queued_rounds["used"] >= 3, worker.queued_rounds
