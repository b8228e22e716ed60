"""``polyspec bench``: plain vs speculative decoding vs Hugging Face transformers, same prompts.

Runs each system in this process, one after the other, each warmed up untimed on the first
prompt (the first batch when --batch-size > 1): (a) polyspec plain decoding, (b) polyspec
speculative decoding (when a draft is configured), (c) ``transformers`` ``generate`` on the
same model, dtype and prompt token ids.
Prints a table; ``--json``, ``--markdown`` and ``--plot`` write the report. ``--batch-sizes``
times plain and speculative decoding at each of several batch sizes instead, one engine per
system for the whole sweep, and reports one row per batch size.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from polyspec.commands.generate import _ENGINE_KEYS, add_engine_arguments, tune_shipped_head
from polyspec.commands.paths import check_output_file
from polyspec.config import MAX_BATCH_SIZE
from polyspec.engine.tree_choice import tree_note
from polyspec.errors import ConfigError

_BENCH_FLAGS = (
    ("dataset", "--dataset"), ("num_prompts", "--num-prompts"), ("batch_size", "--batch-size"),
    ("threads", "--threads"), ("temperatures", "--temperatures"), ("json", "--json"),
    ("markdown", "--markdown"), ("plot", "--plot"), ("batch_sizes", "--batch-sizes"),
)  # fmt: skip
_SWITCHES = (
    ("no_transformers", "--no-transformers"), ("no_phase_times", "--no-phase-times"),
    ("no_chat_template", "--no-chat-template"), ("no_progress", "--no-progress"),
)  # fmt: skip


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "bench",
        help="benchmark plain vs speculative decoding vs transformers on a prompt set",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    p.add_argument(
        "--dataset",
        default="mt_bench",
        help="'mt_bench' (shipped with polyspec; $POLYSPEC_DATA_DIR/eval/mt_bench.jsonl first) or "
        'a JSONL file with one {"prompt": ...} or {"turns": [...]} per line',
    )
    p.add_argument(
        "--num-prompts", type=int, dest="num_prompts", help="use the first N prompts (default: all)"
    )
    p.add_argument(
        "--batch-size",
        type=int,
        dest="batch_size",
        help="requests in flight at once, for every system (default: --max-batch-size "
        "if given, else 1); transformers gets left-padded batches of this size",
    )
    p.add_argument(
        "--batch-sizes",
        dest="batch_sizes",
        metavar="B1,B2,...",
        help="sweep: time plain and speculative decoding at each batch size (e.g. "
        "1,4,16,64,256) on one engine per system, the two taking turns run by run, with "
        "max(--num-prompts, B) prompts at batch B (the set repeated as needed); prints one "
        "row per batch size (tokens/s, speedup, acceptance, tree); --plot draws tokens/s "
        "against batch size. No transformers run",
    )
    p.add_argument(
        "--threads",
        type=int,
        help="torch.set_num_threads for all systems (default: torch's default)",
    )
    p.add_argument(
        "--temperatures",
        help="comma-separated temperatures, e.g. 0,0.7,1.0: also run the speculative "
        "system at each and report its mean acceptance length",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="time each polyspec system this many times and report the median (a shared host "
        "makes single runs noisy; transformers runs once)",
    )
    p.add_argument(
        "--json-schema",
        dest="json_schema",
        metavar="SCHEMA.json",
        help="constrain every request of the plain and speculative systems to this JSON Schema "
        "(structured output); the report adds the grammar's mask time per round. Run without it "
        "for the unconstrained figures (transformers is skipped: it has no constraint)",
    )
    p.add_argument("--json", metavar="OUT.json", help="write the full report as JSON")
    p.add_argument(
        "--markdown",
        metavar="OUT.md",
        help="append a markdown section (command, machine, table) for docs/benchmarks.md",
    )
    p.add_argument(
        "--plot",
        metavar="OUT.png",
        help="write a PNG: acceptance-length histogram and speedup bars (matplotlib)",
    )
    p.add_argument(
        "--no-transformers",
        action="store_true",
        dest="no_transformers",
        help="skip the Hugging Face transformers baseline",
    )
    p.add_argument(
        "--no-phase-times",
        action="store_true",
        dest="no_phase_times",
        help="do not time phases (the phase timer syncs the device once per phase)",
    )
    p.add_argument(
        "--no-chat-template",
        action="store_true",
        dest="no_chat_template",
        help="send prompts as raw text instead of a chat turn",
    )
    p.add_argument(
        "--no-progress", action="store_true", dest="no_progress", help="no progress bars"
    )
    add_engine_arguments(p)


def parse_temperatures(text: str | None) -> list[float]:
    """``"0,0.7,1.0"`` -> [0.0, 0.7, 1.0]; a ConfigError naming the bad entry otherwise."""
    if not text:
        return []
    out = []
    for part in text.split(","):
        try:
            t = float(part)
        except ValueError:
            raise ConfigError(
                f"--temperatures: {part.strip()!r} is not a number; give comma-separated "
                "numbers >= 0, e.g. 0,0.7,1.0"
            ) from None
        if not t >= 0 or t == float("inf"):
            raise ConfigError(f"--temperatures: {part.strip()!r} must be a finite number >= 0")
        out.append(t)
    return out


def parse_batch_sizes(text: str | None) -> list[int]:
    """``"1,4,16"`` -> [1, 4, 16] (sorted, without repeats); a ConfigError naming the bad
    entry otherwise."""
    if not text:
        return []
    sizes = set()
    for part in text.split(","):
        try:
            b = int(part)
        except ValueError:
            b = 0
        if not 1 <= b <= MAX_BATCH_SIZE:
            raise ConfigError(
                f"--batch-sizes: {part.strip()!r} is not a batch size; give comma-separated "
                f"integers from 1 to {MAX_BATCH_SIZE}, e.g. 1,4,16,64"
            )
        sizes.add(b)
    return sorted(sizes)


def command_line(args: argparse.Namespace) -> str:
    """The command as typed when the CLI stored it (``args._argv``), else rebuilt from the
    parsed flags (every flag that was set, in a fixed order)."""
    argv = getattr(args, "_argv", None)
    if argv is not None:
        return shlex.join(["polyspec", *argv])
    parts = ["polyspec", "bench"]
    engine_flags = [(k, "--" + k.replace("_", "-")) for k in _ENGINE_KEYS] + [
        ("config_file", "--config")
    ]
    for key, flag in list(_BENCH_FLAGS) + engine_flags:
        value = getattr(args, key, None)
        if value is not None:
            parts += [flag, str(value)]
    parts += [flag for key, flag in _SWITCHES if getattr(args, key, False)]
    return shlex.join(parts)


def bench_configs(args: argparse.Namespace):
    """(plain EngineConfig, speculative EngineConfig or None, SamplingParams, why spec is
    skipped or None) from the flags > env > config file > defaults, as ``generate`` reads them."""
    from polyspec.config import load_config, speculation_off
    from polyspec.defaults import shipped_head_path

    cli = {k: getattr(args, k, None) for k in _ENGINE_KEYS}
    if args.batch_size is not None and args.batch_size < 1:
        raise ConfigError(f"--batch-size = {args.batch_size} is invalid: must be >= 1")
    cli["max_batch_size"] = args.batch_size or args.max_batch_size or 1
    plain_only = speculation_off(cli, args.config_file)  # from any layer
    if not plain_only:
        tune_shipped_head(cli)
    if plain_only:
        cli["algorithm"] = None
        cli["draft"] = None
    cfg, sampling = load_config(cli=cli, config_file=args.config_file)
    skip = None
    if plain_only:
        cfg = dataclasses.replace(cfg, speculative=None, draft=None)
        skip = "algorithm none"
    elif cfg.speculative is None:
        head = shipped_head_path() if cfg.target is None and cfg.draft is None else None
        if head is not None:
            cfg = dataclasses.replace(cfg, draft=str(head), speculative={"algorithm": "eagle3"})
        else:
            skip = "no draft configured (pass --algorithm eagle|eagle3|standalone and --draft PATH)"
    plain = dataclasses.replace(cfg, speculative=None, draft=None)
    return plain, (None if skip else cfg), sampling, skip


def _read_schema(path: str) -> str:
    """The JSON Schema file's text; a ConfigError naming the file when it is not JSON."""
    try:
        text = Path(path).read_text(encoding="utf-8")
        json.loads(text)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--json-schema {path}: {exc}") from None
    return text


def _mask_ms(worker) -> float:
    """Host milliseconds the worker spent building grammar masks per constrained round
    (warm-up and every repeat included)."""
    return 1e3 * worker.mask_seconds / max(1, worker.constrained_rounds)


def _prompt_ids(tokenizer, prompts: list[str], chat: bool) -> list[list[int]]:
    if chat:
        return [
            list(tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=True))
            for p in prompts
        ]
    return [tokenizer.encode(p) for p in prompts]


def _settings(args, dataset_file: Path, n: int, plain_cfg, spec_cfg, sampling, target) -> dict:
    spec = spec_cfg.speculative if spec_cfg is not None else None
    return {
        "dataset": args.dataset,
        "dataset_file": str(dataset_file),
        "num_prompts": n,
        "max_new_tokens": sampling.max_new_tokens,
        "batch_size": plain_cfg.max_batch_size,
        "temperature": sampling.temperature,
        "top_k": sampling.top_k,
        "top_p": sampling.top_p,
        "seed": sampling.seed,
        "threads": args.threads,
        "chat_template": not args.no_chat_template,
        "target": str(target),
        "draft": spec_cfg.draft if spec_cfg is not None else None,
        "algorithm": spec.algorithm if spec else None,
        "num_steps": spec.num_steps if spec else None,
        "topk": spec.topk if spec else None,
        "num_draft_tokens": spec.num_draft_tokens if spec else None,
        "draft_quantization": None,  # the scheme applied, filled in once the head is loaded
        "dynamic_depth": spec.dynamic_depth if spec else None,
        "batch_trees": [t.text for t in spec.batch_trees] if spec else None,
        "rounds_by_levels_drafted": None,  # dynamic depth's effect, filled in after the runs
        "rounds_by_tree": None,  # with batch trees: engine rounds per tree, after the runs
        "backend": None,  # filled in once the engine has picked it
        "dtype": plain_cfg.dtype,
        "resolved_dtype": None,
        "page_size": plain_cfg.page_size,
        "graphs": plain_cfg.graphs,
        "overlap_rounds": plain_cfg.overlap_rounds,
        "tensor_parallel_size": plain_cfg.tensor_parallel_size,  # as configured: auto, on or off
        "queued_rounds": None,  # where overlap_rounds applies: per system, rounds queued and used
        "graph_memory": None,  # where rounds replay graphs: per system, what they hold
        "phase_timer": None,  # filled in once the backend is known
    }


def run(args: argparse.Namespace) -> int:
    import torch

    from polyspec.bench.plot import require_matplotlib

    temperatures = parse_temperatures(args.temperatures)
    batch_sizes = parse_batch_sizes(getattr(args, "batch_sizes", None))
    if batch_sizes:
        for flag, value in (("--batch-size", args.batch_size), ("--temperatures", temperatures),
                            ("--markdown", args.markdown)):  # fmt: skip
            if value:
                raise ConfigError(f"--batch-sizes sweeps the batch size: drop {flag}")
    if args.plot:
        require_matplotlib()
    for flag in ("json", "markdown", "plot"):  # before the benchmark, not after it
        if getattr(args, flag, None):
            check_output_file(f"--{flag}", getattr(args, flag))
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"--threads = {args.threads} is invalid: must be >= 1")
    if args.repeats < 1:
        raise ConfigError(f"--repeats = {args.repeats} is invalid: must be >= 1")
    threads_before = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        if batch_sizes:
            return _run_sweep(args, batch_sizes)
        return _run(args, temperatures)
    finally:
        # run() may be called in-process (tests, notebooks): leave torch as we found it
        torch.set_num_threads(threads_before)


def _run(args: argparse.Namespace, temperatures: list[float]) -> int:
    """The benchmark proper, once the flags are checked and the threads set."""
    from polyspec.bench import hf_baseline, report, runner
    from polyspec.bench.datasets import load_dataset, read_categories
    from polyspec.bench.plot import write_plot
    from polyspec.engine.llm import LLM

    dataset_file, prompts = load_dataset(args.dataset, args.num_prompts)
    plain_cfg, spec_cfg, sampling, spec_skip = bench_configs(args)
    schema = getattr(args, "json_schema", None)
    if schema is not None:
        sampling = dataclasses.replace(sampling, json_schema=_read_schema(schema))
    progress = not args.no_progress
    phase_times = not args.no_phase_times
    skipped: dict[str, str] = {}
    results: dict[str, runner.SystemResult] = {}

    llm = LLM(config=plain_cfg)
    if not llm.is_leader:  # a rank torchrun started: follow rank 0 through both systems
        llm.follow()
        del llm
        if spec_cfg is not None:
            LLM(config=spec_cfg).follow()
        return 0
    ids = _prompt_ids(llm.tokenizer, prompts, chat=not args.no_chat_template)
    eos, dtype = llm.eos_token_ids, llm.dtype
    backend, target = llm.backend, llm.target_path
    settings = _settings(args, dataset_file, len(ids), plain_cfg, spec_cfg, sampling, target)
    settings.update(backend=backend.name, resolved_dtype=str(dtype).removeprefix("torch."))
    settings["phase_timer"] = runner.phase_run(backend, phase_times)
    print(f"polyspec bench: {len(ids)} prompts from {dataset_file}, target {target}, "
          f"backend {backend.name}, {settings['resolved_dtype']}", file=sys.stderr)  # fmt: skip
    warm = min(plain_cfg.max_batch_size, len(ids))  # one prompt at batch 1, else one batch
    results["plain"] = runner.run_polyspec(
        llm, "plain", ids, sampling, progress, phase_times, warmup_prompts=warm,
        repeats=args.repeats,
    )  # fmt: skip
    if schema is not None:
        settings["json_schema"] = schema
        settings["mask_ms_per_round"] = {"plain": _mask_ms(llm.worker)}
    if llm.scheduler.overlap:  # overlap_rounds resolved for the backend; warm-up included
        settings["queued_rounds"] = {"plain": dict(llm.worker.queued_rounds)}
    _record_graph_memory(settings, "plain", llm)
    llm.stop_ranks()
    del llm  # free the target before the next system loads its own copy
    gc.collect()

    sweep: dict[float, runner.SystemResult] = {}
    num_steps = None
    if spec_cfg is None:
        skipped["spec"] = spec_skip or "no draft"
        if temperatures:
            skipped["temperature_sweep"] = "needs the speculative system"
    else:
        llm = LLM(config=spec_cfg)
        spec = llm.config.speculative  # the tree chosen for this machine, where it chose
        num_steps = max(t[1] for t in spec.trees)  # the deepest tree's, for the positions
        settings.update(
            num_steps=spec.num_steps, topk=spec.topk, num_draft_tokens=spec.num_draft_tokens,
            batch_trees=[t.text for t in spec.batch_trees],
        )  # fmt: skip
        settings["draft_quantization"] = llm.draft_quantization
        if llm.tree_choice is not None:
            settings["tree_choice"] = llm.tree_choice
            print(f"note: {tree_note(llm.tree_choice)}", file=sys.stderr)
        results["spec"] = runner.run_polyspec(
            llm, "spec", ids, sampling, progress, phase_times, warmup_prompts=warm,
            repeats=args.repeats,
        )  # fmt: skip
        if schema is not None:
            settings["mask_ms_per_round"]["spec"] = _mask_ms(llm.worker)
            rounds = max(1, llm.worker.constrained_rounds)
            settings["masks_per_round"] = llm.worker.masks_computed / rounds
            settings["constrained_draft"] = "levels" if llm.worker.mask_lanes else "root"
            choice = llm.scheduler.constrained  # warm-up and every repeat included
            settings["constrained_speculation"] = {
                "mode": choice.mode,
                "tokens_per_s": {
                    str(b): {"spec": spec_rate, "plain": plain_rate}
                    for b, (spec_rate, plain_rate) in choice.rates().items()
                },
            }
        if spec_cfg.speculative.dynamic_depth:  # warm-up and every repeat included
            settings["rounds_by_levels_drafted"] = llm.worker.drafted_levels[1:]
        if spec.batch_trees:  # engine rounds per tree, warm-up and every repeat included
            settings["rounds_by_tree"] = dict(llm.worker.rounds_by_tree)
        if llm.scheduler.overlap:  # likewise
            settings["queued_rounds"] = {
                **(settings["queued_rounds"] or {}),
                "spec": dict(llm.worker.queued_rounds),
            }
        _record_graph_memory(settings, "spec", llm)
        for t in temperatures:
            params = dataclasses.replace(sampling, temperature=t)
            sweep[t] = runner.run_polyspec(
                llm, f"spec T={t:g}", ids, params, progress, phase_times=False, warmup_prompts=0
            )
        llm.stop_ranks()
        del llm
        gc.collect()

    reason = (
        "--no-transformers" if args.no_transformers else hf_baseline.transformers_missing_reason()
    )
    if reason is None and plain_cfg.tensor_parallel_size > 1:
        reason = "tensor parallel: the transformers baseline runs on one device"
    if reason is None and schema is not None:
        reason = "--json-schema (the transformers baseline is unconstrained)"
    if reason is not None:
        skipped["transformers"] = reason
        print(f"note: transformers baseline skipped: {reason}", file=sys.stderr)
    else:
        model = hf_baseline.load_hf_model(target, dtype, backend.device())
        pad = eos[0] if eos else 0  # left padding is masked out, any id will do
        results["transformers"] = hf_baseline.run_transformers(
            model, ids, sampling, eos, pad, plain_cfg.max_batch_size, backend.synchronize,
            progress,
        )  # fmt: skip
        del model
        gc.collect()

    rep = report.build_report(
        command=command_line(args),
        settings=settings,
        machine=report.machine_info(backend.name, str(backend.device())),
        results=results,
        num_steps=num_steps,
        temperature=sampling.temperature,
        skipped=skipped,
        sweep=sweep or None,
        categories=read_categories(dataset_file)[: len(ids)],
    )
    print(report.format_text(rep))
    if schema is not None:
        ms = ", ".join(f"{k} {v:.3f}" for k, v in settings["mask_ms_per_round"].items())
        print(f"grammar mask time per constrained round (ms, host): {ms}")
        if "masks_per_round" in settings:
            print("masks computed per constrained speculative round (the roots' not "
                  f"counted): {settings['masks_per_round']:.2f}; draft masked at: "
                  f"{settings['constrained_draft']}")  # fmt: skip
        chosen = settings.get("constrained_speculation")
        if chosen and chosen["tokens_per_s"]:
            rates = "; ".join(
                f"from batch {b}: spec {r['spec']:.1f}, plain {r['plain']:.1f}"
                for b, r in chosen["tokens_per_s"].items()
            )
            print(f"constrained rounds measured ({chosen['mode']}), tokens/s: {rates}")
    if args.json:
        report.write_json(rep, args.json)
    if args.markdown:
        report.append_markdown(rep, args.markdown)
    if args.plot:
        write_plot(rep, args.plot)
    return 0


def _record_graph_memory(settings: dict, system: str, llm) -> None:
    """``settings["graph_memory"][system]``: the graphs ``llm`` captured and the device
    memory they took (:meth:`CapturedForwards.memory_report`), where its rounds replay graphs."""
    graphs = llm.worker.graphs
    if graphs is not None:
        settings["graph_memory"] = {
            **(settings["graph_memory"] or {}),
            system: graphs.memory_report(),
        }


def _run_sweep(args: argparse.Namespace, sizes: list[int]) -> int:
    """``--batch-sizes``: each system's engine (max_batch_size the largest size) timed at
    every batch size in turn, the engines taking turns (:func:`_sweep`); one table row per
    size."""
    from polyspec.bench import report, runner
    from polyspec.bench.datasets import load_dataset
    from polyspec.bench.plot import write_sweep_plot
    from polyspec.engine.llm import LLM

    dataset_file, prompts = load_dataset(args.dataset, args.num_prompts)
    top = argparse.Namespace(**{**vars(args), "batch_size": sizes[-1]})
    plain_cfg, spec_cfg, sampling, spec_skip = bench_configs(top)
    schema = getattr(args, "json_schema", None)
    if schema is not None:
        sampling = dataclasses.replace(sampling, json_schema=_read_schema(schema))
    progress = not args.no_progress
    skipped = {"transformers": "--batch-sizes (the sweep times polyspec's systems only)"}
    if spec_cfg is None:
        skipped["spec"] = spec_skip or "no draft"
    results: dict[str, dict[int, runner.SystemResult]] = {}
    trees: dict[int, dict] = {}
    engine: dict[str, dict[int, dict]] = {}  # system -> batch size -> rounds and queued rounds
    settings = ids = backend = None
    engines: dict[str, Any] = {}
    # Both engines stay loaded and take turns at each size and repeat, so that a drift of the
    # machine (clocks, the host's other load) falls on both alike. Ranks of a tensor-parallel
    # engine follow one engine at a time: there each system runs its whole sweep in turn.
    interleave = plain_cfg.tensor_parallel_size == 1
    for system, cfg in (("plain", plain_cfg), ("spec", spec_cfg)):
        if cfg is None:
            continue
        llm = LLM(config=cfg)
        if not llm.is_leader:  # a rank torchrun started: follow rank 0 through the sweep
            llm.follow()
            del llm
            continue
        if settings is None:
            ids = _prompt_ids(llm.tokenizer, prompts, chat=not args.no_chat_template)
            backend = llm.backend
            settings = _settings(args, dataset_file, len(ids), plain_cfg, spec_cfg, sampling,
                                 llm.target_path)  # fmt: skip
            settings.update(backend=backend.name, batch_size=None, batch_sizes=sizes,
                            resolved_dtype=str(llm.dtype).removeprefix("torch."),
                            phase_timer="off", interleaved=interleave)  # fmt: skip
            print(f"polyspec bench: batch sizes {','.join(map(str, sizes))}, {len(ids)} prompts "
                  f"from {dataset_file}, target {llm.target_path}, backend {backend.name}, "
                  f"{settings['resolved_dtype']}", file=sys.stderr)  # fmt: skip
        if system == "spec":
            spec = llm.config.speculative
            settings.update(num_steps=spec.num_steps, topk=spec.topk,
                            num_draft_tokens=spec.num_draft_tokens,
                            batch_trees=[t.text for t in spec.batch_trees],
                            draft_quantization=llm.draft_quantization)  # fmt: skip
            if llm.tree_choice is not None:
                settings["tree_choice"] = llm.tree_choice
                print(f"note: {tree_note(llm.tree_choice)}", file=sys.stderr)
        results[system], engine[system] = {}, {}
        engines[system] = llm
        if not interleave:
            _sweep({system: llm}, sizes, ids, sampling, args.repeats, progress,
                   results, engine, trees)  # fmt: skip
            _release(engines.pop(system), settings, system)
        del llm
    if interleave:
        _sweep(engines, sizes, ids, sampling, args.repeats, progress, results, engine, trees)
        for system in list(engines):
            _release(engines.pop(system), settings, system)
    if settings is None:  # not rank 0
        return 0
    rep = report.build_sweep_report(
        command=command_line(args),
        settings=settings,
        machine=report.machine_info(backend.name, str(backend.device())),
        results=results,
        trees=trees,
        engine=engine,
        temperature=sampling.temperature,
        skipped=skipped,
    )
    print(report.format_sweep_text(rep))
    if args.json:
        report.write_json(rep, args.json)
    if args.plot:
        write_sweep_plot(rep, args.plot)
    return 0


def _sweep(engines: dict, sizes, ids, sampling, repeats: int, progress: bool,
           results: dict, engine: dict, trees: dict) -> None:  # fmt: skip
    """Time each of ``engines`` (system -> LLM) at every batch size: per size, one untimed
    full batch and then ``repeats`` timed runs, the systems taking turns run by run."""
    from polyspec.bench import runner

    for b in sizes:
        batch_ids = [ids[i % len(ids)] for i in range(max(len(ids), b))]
        before = {s: dict(llm.worker.rounds_by_tree) for s, llm in engines.items()}
        rounds0 = {s: llm.scheduler.rounds for s, llm in engines.items()}
        queued0 = {s: dict(llm.worker.queued_rounds) for s, llm in engines.items()}
        forwards0 = {s: dict(llm.worker.queued_forwards) for s, llm in engines.items()}
        runs: dict[str, list[runner.SystemResult]] = {s: [] for s in engines}
        for i in range(repeats):
            for system, llm in engines.items():
                name = f"{system} @{b}" + (f" ({i + 1}/{repeats})" if repeats > 1 else "")
                runs[system].append(runner.run_polyspec(
                    llm, name, batch_ids, sampling, progress, phase_times=False,
                    warmup_prompts=b if i == 0 else 0, batch_size=b,
                ))  # fmt: skip
        for system, llm in engines.items():
            results[system][b] = dataclasses.replace(
                runner.median_of(runs[system], sampling.temperature == 0), name=f"{system} @{b}"
            )
            queued, forwards = llm.worker.queued_rounds, llm.worker.queued_forwards
            engine[system][b] = {  # the warm-up's and every timed run's rounds
                "rounds": llm.scheduler.rounds - rounds0[system],
                "queued_rounds": queued["queued"] - queued0[system]["queued"],
                "queued_rounds_used": queued["used"] - queued0[system]["used"],
            }
            if forwards["queued"] > forwards0[system]["queued"]:  # constrained plain forwards
                engine[system][b]["queued_forwards"] = (
                    forwards["queued"] - forwards0[system]["queued"]
                )
                engine[system][b]["queued_forwards_used"] = (
                    forwards["used"] - forwards0[system]["used"]
                )
            if system == "spec":
                after, start = llm.worker.rounds_by_tree, before[system]
                rounds = {t: n - start.get(t, 0) for t, n in after.items() if n > start.get(t, 0)}
                trees[b] = {"tree": llm.worker.tree_for(b).label, "rounds_by_tree": rounds}


def _release(llm, settings: dict, system: str) -> None:
    """Record ``llm``'s graph memory and stop its ranks; the collection frees it once the
    caller's last reference is gone (it passes the one it held)."""
    _record_graph_memory(settings, system, llm)
    llm.stop_ranks()
    del llm
    gc.collect()
