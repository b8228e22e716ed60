"""``polyspec bench`` end to end on tiny checkpoints, plus its dataset and metric helpers."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from polyspec.bench import datasets, metrics
from polyspec.cli import main
from polyspec.commands.bench import parse_temperatures
from polyspec.errors import ConfigError
from polyspec.testing import builders

PROMPTS = ["Hello there", "The cat sat on the", "Tell me a story about the sea"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """A tiny target (a HF directory transformers loads), an EAGLE-3 head and a prompt file."""
    root = tmp_path_factory.mktemp("bench")
    target = builders.build_tiny_target(root / "target", seed=0)
    data = root / "prompts.jsonl"
    lines = [json.dumps({"turns": [PROMPTS[0], "second turn"], "category": "writing"})]
    lines += [json.dumps({"prompt": PROMPTS[1], "category": "math"})]
    lines += [json.dumps({"prompt": p}) for p in PROMPTS[2:]]
    data.write_text("\n".join(lines) + "\n")
    return {
        "target": target,
        "eagle3": builders.build_tiny_eagle3(root / "eagle3", target, seed=2),
        "data": data,
    }


def _bench(tmp_path: Path, *flags: str) -> dict:
    out = tmp_path / "out.json"
    argv = ["bench", "--max-new-tokens", "8", "--no-progress", "--json", str(out), *flags]
    assert main(argv) == 0
    return json.loads(out.read_text())


def test_bench_end_to_end_eagle3(tiny, tmp_path, capsys):
    md = tmp_path / "bench.md"
    rep = _bench(
        tmp_path, "--dataset", str(tiny["data"]), "--target", str(tiny["target"]),
        "--draft", str(tiny["eagle3"]), "--algorithm", "eagle3", "--num-steps", "3",
        "--markdown", str(md), "--threads", "1", "--temperatures", "0,0.7",
    )  # fmt: skip
    systems = rep["systems"]
    assert set(systems) == {"plain", "spec", "transformers"}
    for entry in systems.values():
        assert entry["tokens_per_s"] > 0 and entry["num_tokens"] > 0
    spec = systems["spec"]
    assert spec["mean_acceptance_length"] >= 1.0
    assert len(spec["acceptance_per_position"]) == 3
    assert sum(spec["acceptance_length_histogram"].values()) == spec["num_rounds"] > 0
    assert set(spec["phase_fractions"]) == {"draft", "verify", "draft_extend", "prefill", "other"}
    assert sum(spec["phase_fractions"].values()) == pytest.approx(1.0)
    # Per category where the dataset names one (the third prompt has none).
    assert set(spec["acceptance_by_category"]) == {"writing", "math"}
    assert all(a >= 1.0 for a in spec["acceptance_by_category"].values())
    assert rep["outputs_identical"] is True and rep["outputs_differing"] == 0
    # Same model, dtype and prompt ids: the fp32 transformers baseline agrees with plain.
    assert rep["transformers_outputs_differing_from_plain"] == 0
    assert rep["speedups"]["spec_over_plain"] == pytest.approx(
        spec["tokens_per_s"] / systems["plain"]["tokens_per_s"]
    )
    assert [row["temperature"] for row in rep["temperature_sweep"]] == [0.0, 0.7]
    s, m = rep["settings"], rep["machine"]
    assert (s["num_prompts"], s["max_new_tokens"], s["algorithm"], s["batch_size"]) == (
        3, 8, "eagle3", 1,
    )  # fmt: skip
    assert m["torch_num_threads"] == 1 and m["backend"] == "cpu" and m["torch_version"]
    assert rep["command"].startswith("polyspec bench") and "--num-steps 3" in rep["command"]
    text = md.read_text()
    assert rep["command"] in text and "| spec |" in text
    printed = capsys.readouterr().out
    assert "spec and plain outputs identical" in printed
    assert "mean acceptance length by category: " in printed


def test_bench_standalone_self_draft_accepts_everything(tiny, tmp_path):
    """The target as its own draft: every draft token is accepted, in batches of 2."""
    rep = _bench(
        tmp_path, "--dataset", str(tiny["data"]), "--target", str(tiny["target"]),
        "--draft", str(tiny["target"]), "--algorithm", "standalone", "--num-steps", "2",
        "--batch-size", "2", "--no-transformers",
    )  # fmt: skip
    spec = rep["systems"]["spec"]
    assert rep["outputs_identical"] is True
    assert spec["acceptance_per_position"] == [1.0, 1.0]
    assert spec["mean_acceptance_length"] == 3.0
    assert rep["skipped"] == {"transformers": "--no-transformers"}
    assert rep["settings"]["batch_size"] == 2


def test_bench_json_schema(tiny, tmp_path, capsys):
    """--json-schema constrains both systems (the target as its own draft: drafts are
    accepted under the grammar, and spec equals plain) and reports the mask time per round;
    the unconstrained transformers baseline is skipped, and a file that is not JSON is a
    clear error."""
    pytest.importorskip("llguidance", reason="structured output needs polyspec[grammar]")
    schema = tmp_path / "schema.json"
    schema.write_text(
        json.dumps(
            {
                "type": "object",
                "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
                "required": ["n"],
                "additionalProperties": False,
            }
        )
    )
    rep = _bench(
        tmp_path, "--dataset", str(tiny["data"]), "--target", str(tiny["target"]),
        "--draft", str(tiny["target"]), "--algorithm", "standalone", "--num-steps", "2",
        "--num-prompts", "2", "--max-new-tokens", "12", "--json-schema", str(schema),
    )  # fmt: skip
    assert rep["outputs_identical"] is True
    assert rep["skipped"] == {
        "transformers": "--json-schema (the transformers baseline is unconstrained)"
    }
    settings = rep["settings"]
    assert settings["json_schema"] == str(schema)
    assert set(settings["mask_ms_per_round"]) == {"plain", "spec"}
    assert all(ms > 0 for ms in settings["mask_ms_per_round"].values())
    # a greedy chain's round on the cpu backend computes at most S a request: its S - 1
    # lanes' and, where greedy acceptance walks to it, its leaf's (the tree walk)
    assert 0 < settings["masks_per_round"] <= 2 * settings["num_steps"], settings
    assert rep["systems"]["spec"]["mean_acceptance_length"] > 1.0  # drafts accepted
    chosen = settings["constrained_speculation"]  # auto: both kinds measured
    assert chosen["mode"] == "auto" and chosen["tokens_per_s"], chosen
    assert any(r["spec"] > 0 and r["plain"] > 0 for r in chosen["tokens_per_s"].values()), chosen
    out = capsys.readouterr().out
    assert "grammar mask time per constrained round (ms, host): plain" in out
    assert "masks computed per constrained speculative round" in out
    assert "constrained rounds measured (auto), tokens/s: from batch" in out
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["bench", "--dataset", str(tiny["data"]), "--json-schema", str(bad)]) == 2
    assert f"--json-schema {bad}" in capsys.readouterr().err


def test_bench_plain_only_sampling(tiny, tmp_path):
    rep = _bench(
        tmp_path, "--dataset", str(tiny["data"]), "--target", str(tiny["target"]),
        "--num-prompts", "2", "--temperature", "0.8", "--seed", "3", "--no-transformers",
    )  # fmt: skip
    assert set(rep["systems"]) == {"plain"} and "spec" in rep["skipped"]
    assert rep["outputs_identical"] is None and rep["identity_check"].startswith("n/a")
    assert rep["settings"]["num_prompts"] == 2


def test_read_prompts_formats_and_errors(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"turns": ["a", "b"]}\n\n{"prompt": "c"}\n')
    assert datasets.read_prompts(good) == ["a", "c"]
    bad = tmp_path / "bad.jsonl"
    for line, msg in [
        ("{not json", "line 2 is not valid JSON"),
        ('{"text": "x"}', "line 2 has neither 'turns' nor 'prompt'"),
        ('{"turns": []}', "line 2: 'turns' must be a non-empty list"),
        ('["x"]', "line 2 must be a JSON object"),
    ]:
        bad.write_text('{"prompt": "ok"}\n' + line + "\n")
        with pytest.raises(ConfigError, match=msg):
            datasets.read_prompts(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        datasets.read_prompts(tmp_path / "missing.jsonl")


def test_find_mt_bench(tmp_path):
    shipped = datasets.find_mt_bench(env={})
    assert shipped == datasets.MT_BENCH_PACKAGED
    assert len(datasets.read_prompts(shipped)) == 80
    with pytest.raises(ConfigError, match="question.jsonl"):
        datasets.find_mt_bench(env={}, packaged=tmp_path / "missing.jsonl")
    env_file = tmp_path / "env" / "eval" / "mt_bench.jsonl"
    env_file.parent.mkdir(parents=True)
    env_file.write_text('{"turns": ["q"]}\n')
    assert datasets.find_mt_bench(env={"POLYSPEC_DATA_DIR": str(env_file.parents[1])}) == env_file


def test_metrics():
    rounds = [1, 4, 2, 3]  # tokens committed per round: accepted draft tokens + 1
    assert metrics.mean_acceptance_length(rounds) == 2.5
    assert metrics.position_acceptance(rounds, 3) == [0.75, 0.5, 0.25]
    assert metrics.acceptance_histogram(rounds, 4) == {1: 1, 2: 1, 3: 1, 4: 1}
    frac = metrics.spec_phase_fractions(
        {"draft": 1.0, "verify": 1.5, "accept": 0.5, "draft_extend": 0.25, "other": 0.25,
         "prefill": 0.5}
    )  # fmt: skip
    assert frac == {
        "draft": 0.25, "verify": 0.375, "draft_extend": 0.0625, "prefill": 0.125, "other": 0.1875
    }  # fmt: skip
    assert metrics.speedup(3.0, 2.0) == 1.5 and metrics.speedup(3.0, None) is None


def test_parse_temperatures_and_flag_errors(tmp_path):
    assert parse_temperatures("0, 0.7,1") == [0.0, 0.7, 1.0]
    with pytest.raises(ConfigError, match="'hot' is not a number"):
        parse_temperatures("0,hot")
    with pytest.raises(ConfigError, match="must be a finite number >= 0"):
        parse_temperatures("-1")
    assert main(["bench", "--dataset", str(tmp_path / "none.jsonl")]) == 2


def _report_for_plot(spec: bool) -> dict:
    systems = {"plain": {"tokens_per_s": 10.0}, "transformers": {"tokens_per_s": 5.0}}
    if spec:
        systems["spec"] = {
            "tokens_per_s": 20.0,
            "mean_acceptance_length": 2.5,
            "acceptance_length_histogram": {"1": 3, "2": 1, "3": 0, "4": 4},
        }
    return {"command": "polyspec bench --dataset x.jsonl", "systems": systems}


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    from polyspec.bench.plot import write_plot

    for spec in (True, False):
        out = tmp_path / f"plot_{spec}.png"
        write_plot(_report_for_plot(spec), out)
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_a_clear_error(tmp_path, monkeypatch):
    import sys

    from polyspec.bench.plot import write_plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with pytest.raises(ConfigError, match="pip install matplotlib"):
        write_plot(_report_for_plot(True), tmp_path / "p.png")
    argv = ["bench", "--dataset", "x.jsonl", "--plot", str(tmp_path / "p.png")]
    assert main(argv) == 2  # refused before any model loads


@pytest.mark.parametrize("async_execution", [False, True])
def test_phase_times_run_apart_on_async_backends(tiny, async_execution):
    """Where the phase timer's syncs would slow the device (``async_execution``), the timed
    run goes without them and the phases come from a second run; on the CPU, one run."""
    import dataclasses

    from polyspec.bench.runner import run_polyspec
    from polyspec.config import SamplingParams, SpeculativeConfig
    from polyspec.engine.llm import LLM

    llm = LLM(
        target=str(tiny["target"]), draft=str(tiny["eagle3"]), backend="cpu", dtype="float32",
        speculative=SpeculativeConfig(algorithm="eagle3", num_steps=3), max_context=128,
    )  # fmt: skip
    llm.backend.capabilities = dataclasses.replace(
        llm.backend.capabilities, async_execution=async_execution
    )
    timed_with: list[bool] = []
    generate = llm.generate

    def recording_generate(*args, **kwargs):
        timed_with.append(llm.worker.timer.enabled)
        return generate(*args, **kwargs)

    llm.generate = recording_generate
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    res = run_polyspec(llm, "spec", ids, SamplingParams(max_new_tokens=6), progress=False)
    # warm-up (untimed, timer off), then the timed run, then (async only) the phase run
    assert timed_with == ([False, False, True] if async_execution else [False, True])
    assert set(res.phase_seconds) == {
        "draft", "verify", "accept", "draft_extend", "prefill", "other"
    }  # fmt: skip
    assert all(res.phase_seconds[k] > 0 for k in ("draft", "verify", "draft_extend"))
    assert res.num_tokens == sum(len(o) for o in res.outputs) > 0


def test_repeats_report_the_median_run(tiny, tmp_path, monkeypatch, capsys):
    """--repeats N times each polyspec system N times: wall_s is the median of the runs (all
    listed in the JSON), phases come from the first, a run with other greedy outputs stops the
    bench, and N < 1 is refused before any model loads."""
    from polyspec.bench import runner

    rep = _bench(
        tmp_path, "--dataset", str(tiny["data"]), "--target", str(tiny["target"]),
        "--draft", str(tiny["eagle3"]), "--algorithm", "eagle3", "--repeats", "3",
        "--no-transformers",
    )  # fmt: skip
    for name in ("plain", "spec"):
        entry = rep["systems"][name]
        assert len(entry["wall_s_runs"]) == 3
        assert entry["wall_s"] == sorted(entry["wall_s_runs"])[1]
        assert entry["tokens_per_s"] == pytest.approx(entry["num_tokens"] / entry["wall_s"])
    assert rep["outputs_identical"] is True and "phase_fractions" in rep["systems"]["spec"]
    assert "tokens/s from the median of 3 timed runs" in capsys.readouterr().out
    assert "wall_s_runs" not in _bench(
        tmp_path, "--dataset", str(tiny["data"]), "--target", str(tiny["target"]),
        "--no-transformers", "--num-prompts", "1",
    )["systems"]["plain"]  # fmt: skip

    timed = runner._timed_generate
    calls = [0]

    def flaky(llm, name, ids, sampling, progress, phase_times):
        wall, outs, phases = timed(llm, name, ids, sampling, progress, phase_times)
        calls[0] += 1
        if calls[0] == 2:  # the warm-up does not come through here: the second timed run
            outs[0].token_ids.append(0)
        return wall, outs, phases

    monkeypatch.setattr(runner, "_timed_generate", flaky)
    argv = ["bench", "--max-new-tokens", "4", "--no-progress", "--dataset", str(tiny["data"]),
            "--target", str(tiny["target"]), "--no-transformers", "--repeats", "2"]  # fmt: skip
    with pytest.raises(RuntimeError, match="other greedy outputs"):
        main(argv)
    assert main(argv[:-1] + ["0"]) == 2


def test_bench_batch_trees_and_overlapped_rounds(tiny, tmp_path, capsys):
    """``--batch-trees`` and ``--overlap-rounds`` reach both systems' engines and the report:
    rounds per tree, and the rounds queued and used per system."""
    rep = _bench(
        tmp_path, "--dataset", str(tiny["data"]), "--target", str(tiny["target"]),
        "--draft", str(tiny["eagle3"]), "--algorithm", "eagle3", "--num-steps", "3",
        "--topk", "2", "--num-draft-tokens", "5", "--batch-trees", "2:2-1-3", "--batch-size",
        "3", "--graphs", "on", "--overlap-rounds", "--max-new-tokens", "16",
        "--no-transformers",
    )  # fmt: skip
    s = rep["settings"]
    assert rep["outputs_identical"] is True
    assert s["batch_trees"] == ["2:2-1-3"] and s["overlap_rounds"] == "on"
    assert set(s["rounds_by_tree"]) == {"S=3 K=2 N=5", "S=2 K=1 N=3"}
    assert s["rounds_by_tree"]["S=2 K=1 N=3"] > 0
    assert set(s["queued_rounds"]) == {"plain", "spec"}
    assert all(q["used"] > 0 for q in s["queued_rounds"].values()), s["queued_rounds"]
    assert "--overlap-rounds" in rep["command"]
    printed = capsys.readouterr().out
    assert "spec engine rounds by draft tree" in printed
    assert "plain rounds queued behind another (overlap_rounds): " in printed


def test_bench_sweep_reports_queued_constrained_forwards(tiny, tmp_path, capsys):
    """A constrained sweep with ``--overlap-rounds``: each system's constrained plain rounds
    queue their next forward (``constrained_speculation`` off: the speculative engine's too),
    and the sweep reports how many were queued and used per batch size."""
    pytest.importorskip("llguidance", reason="structured output needs polyspec[grammar]")
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "array", "items": {"type": "integer"}, "maxItems": 4}))
    rep = _bench(
        tmp_path, "--dataset", str(tiny["data"]), "--target", str(tiny["target"]),
        "--draft", str(tiny["eagle3"]), "--algorithm", "eagle3", "--num-steps", "2",
        "--batch-sizes", "1,2", "--graphs", "on", "--overlap-rounds", "--max-new-tokens", "16",
        "--json-schema", str(schema), "--constrained-speculation", "off",
    )  # fmt: skip
    for r in rep["batch_sweep"]:
        assert r["outputs_identical"] is True
        for e in r["engine"].values():
            assert 0 < e["queued_forwards_used"] <= e["queued_forwards"], e
    printed = capsys.readouterr().out
    for system in ("plain", "spec"):
        assert f"{system} constrained plain rounds' forwards queued, used: 1: " in printed


def test_bench_batch_sizes_sweep(tiny, tmp_path, capsys):
    """``--batch-sizes``: one engine per system timed at each size, one row per size (at
    least that many prompts, the set repeated), a table on stdout, and a tokens/s plot."""
    import importlib.util

    plot = tmp_path / "sweep.png"
    has_plot = importlib.util.find_spec("matplotlib") is not None
    rep = _bench(
        tmp_path, "--dataset", str(tiny["data"]), "--target", str(tiny["target"]),
        "--draft", str(tiny["eagle3"]), "--algorithm", "eagle3", "--num-steps", "2",
        "--batch-sizes", "4,1,2", "--graphs", "on", *(["--plot", str(plot)] if has_plot else []),
    )  # fmt: skip
    rows = rep["batch_sweep"]
    assert [r["batch_size"] for r in rows] == [1, 2, 4]
    assert [r["num_prompts"] for r in rows] == [3, 3, 4]
    for r in rows:
        assert r["plain_tokens_per_s"] > 0 and r["spec_tokens_per_s"] > 0
        assert r["spec_over_plain"] == pytest.approx(
            r["spec_tokens_per_s"] / r["plain_tokens_per_s"]
        )
        assert r["mean_acceptance_length"] >= 1.0 and r["outputs_identical"] is True
        assert r["tree"] == "S=2 K=1 N=3" and sum(r["rounds_by_tree"].values()) > 0
        assert r["engine"]["spec"]["rounds"] == sum(r["rounds_by_tree"].values())
        assert r["engine"]["plain"]["rounds"] >= r["engine"]["spec"]["rounds"] > 0
        for e in r["engine"].values():
            assert 0 <= e["queued_rounds_used"] <= e["queued_rounds"]
    s = rep["settings"]
    assert s["batch_sizes"] == [1, 2, 4] and s["graphs"] == "on"
    assert set(s["graph_memory"]) == {"plain", "spec"}
    assert all(m["graphs"] > 0 for m in s["graph_memory"].values())
    assert "transformers" in rep["skipped"]
    printed = capsys.readouterr().out
    assert "batch  prompts  plain tok/s  spec tok/s  spec/plain  accept len  tree" in printed
    assert plot.is_file() or not has_plot
    for flags in (["--batch-sizes", "0,2"], ["--batch-sizes", "2", "--batch-size", "2"],
                  ["--batch-sizes", "2", "--temperatures", "0.7"]):  # fmt: skip
        assert main(["bench", "--dataset", str(tiny["data"]), *flags]) == 2
    err = capsys.readouterr().err
    assert "--batch-sizes: '0' is not a batch size" in err and "drop --batch-size" in err


def test_bench_sweep_interleaves_the_systems(tiny, tmp_path, monkeypatch):
    """``--batch-sizes`` with ``--repeats``: both engines stay loaded and take turns run by
    run at each size (a drift of the machine falls on both), the first run of each warmed
    up; every run's seconds are in the row and tokens/s is from their median."""
    from polyspec.bench import runner

    calls = []
    real = runner.run_polyspec

    def spy(llm, name, *args, **kwargs):
        calls.append((name, kwargs["warmup_prompts"]))
        return real(llm, name, *args, **kwargs)

    monkeypatch.setattr(runner, "run_polyspec", spy)
    rep = _bench(
        tmp_path, "--dataset", str(tiny["data"]), "--target", str(tiny["target"]),
        "--draft", str(tiny["eagle3"]), "--algorithm", "eagle3", "--num-steps", "2",
        "--batch-sizes", "1,2", "--repeats", "2", "--num-prompts", "2",
    )  # fmt: skip
    assert calls == [
        ("plain @1 (1/2)", 1), ("spec @1 (1/2)", 1), ("plain @1 (2/2)", 0), ("spec @1 (2/2)", 0),
        ("plain @2 (1/2)", 2), ("spec @2 (1/2)", 2), ("plain @2 (2/2)", 0), ("spec @2 (2/2)", 0),
    ]  # fmt: skip
    assert rep["settings"]["interleaved"] is True
    for r in rep["batch_sweep"]:
        assert r["outputs_identical"] is True
        for system in ("plain", "spec"):
            runs = r["wall_s_runs"][system]
            tokens = r[f"{system}_tokens_per_s"] * statistics.median(runs)  # a whole count
            assert len(runs) == 2 and tokens == pytest.approx(round(tokens), abs=1e-6)
            assert 0 < round(tokens) <= r["num_prompts"] * 8


def test_warm_up_captures_each_tree_for_the_batch_sizes_that_run_it(tiny):
    """The benchmark's capture of every bucket (untimed) records a tree's rounds for the
    buckets whose batch sizes run that tree only, as a server's warm-up does: here the main
    tree at batch 1, plain rounds from 2."""
    from polyspec.bench.runner import run_polyspec
    from polyspec.config import SamplingParams, SpeculativeConfig
    from polyspec.engine.llm import LLM

    spec = SpeculativeConfig(
        "eagle3", num_steps=3, topk=2, num_draft_tokens=4, batch_trees="2:plain"
    )
    llm = LLM(
        target=str(tiny["target"]), draft=str(tiny["eagle3"]), backend="cpu", dtype="float32",
        speculative=spec, max_batch_size=4, max_context=128, graphs="on",
    )  # fmt: skip
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    greedy = SamplingParams(max_new_tokens=6)
    for b in (1, 4):
        run_polyspec(llm, f"spec @{b}", ids, greedy, progress=False, phase_times=False,
                     warmup_prompts=b, batch_size=b)  # fmt: skip
    main_tree, plain = llm.worker.tree_for(1), llm.worker.tree_for(2)
    assert plain.num_steps == 0 and main_tree.num_steps == 3
    buckets = {}
    for name, b, _ in llm.worker.graphs.captured:
        buckets.setdefault(name, set()).add(b)
    assert buckets[llm.worker.round_fn(main_tree, True).__name__] == {1}
    assert buckets[llm.worker.round_fn(plain, True).__name__] == {2, 4}
