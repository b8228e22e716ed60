"""``polyspec bench-serve``: the serving benchmark (docs/serving.md, "Benchmark").

Unless ``--base-url`` is given, starts ``polyspec serve`` itself twice with the same engine
flags, speculative then plain (``--algorithm none``), each on a free port, and drives each with
the ``openai`` client at every ``--concurrency``: every prompt of the dataset is sent once per
concurrency as a streamed chat request. Reports per system and concurrency the request
throughput, output tokens/s, TTFT / inter-token / end-to-end latency (p50 / p90 / p99) and the
mean acceptance length, and the spec / plain ratio of each; ``--json`` and ``--plot`` write them.
``--offline-baseline`` also times ``LLM.generate`` on the same prompts one at a time, in this
process, alternating prompt by prompt with single streamed requests to the server, and reports
the server's output tokens/s over ``LLM.generate``'s.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import json
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

from polyspec.commands.generate import _ENGINE_KEYS, _SPEC_KEYS, add_engine_arguments
from polyspec.errors import ConfigError

READY = "polyspec serve: ready on "
DEFAULT_MAX_TOKENS = 128


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "bench-serve",
        help="benchmark the server: speculative vs plain serving at several concurrencies",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    p.add_argument(
        "--dataset",
        default="mt_bench",
        help="'mt_bench' (shared/data/eval or $POLYSPEC_DATA_DIR/eval) or a JSONL file with "
        'one {"prompt": ...} or {"turns": [...]} per line',
    )
    p.add_argument("--num-prompts", type=int, dest="num_prompts",
                   help="use the first N prompts (default: all)")  # fmt: skip
    p.add_argument(
        "--concurrency",
        default="1,4,16,64",
        help="comma-separated numbers of requests in flight (default 1,4,16,64)",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        dest="request_rate",
        help="send requests as a Poisson process of this many per second, still at most "
        "--concurrency in flight (default: all at once)",
    )
    p.add_argument(
        "--base-url",
        dest="base_url",
        help="benchmark this running server (e.g. http://host:8000/v1) instead of starting "
        "polyspec serve; no spec / plain comparison then",
    )
    p.add_argument("--model", help="with --base-url: the model name (default: the first listed)")
    p.add_argument("--api-key", dest="api_key", default="none", help="with --base-url: its key")
    p.add_argument(
        "--systems",
        default="spec,plain",
        help="which servers to start, in order: spec, plain or both (default spec,plain)",
    )
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        dest="ignore_eos",
        help="every request generates --max-new-tokens tokens (ignore_eos)",
    )
    p.add_argument(
        "--no-chat-template",
        action="store_true",
        dest="no_chat_template",
        help="send raw text to /v1/completions instead of chat turns",
    )
    p.add_argument(
        "--offline-baseline",
        action="store_true",
        dest="offline_baseline",
        help="also time LLM.generate on the same prompts one at a time in this process, "
        "alternating prompt by prompt with single streamed requests to the server; report the "
        "server's output tokens/s over LLM.generate's",
    )
    p.add_argument("--json", metavar="OUT.json", help="write the report as JSON")
    p.add_argument(
        "--plot", metavar="OUT.png", help="write latency vs throughput curves (matplotlib)"
    )
    p.add_argument("--no-progress", action="store_true", dest="no_progress",
                   help="no progress bars")  # fmt: skip
    add_engine_arguments(p)


def parse_concurrency(text: str) -> list[int]:
    """``"1,4,16"`` -> [1, 4, 16]; a ConfigError naming the bad entry otherwise."""
    out = []
    for part in text.split(","):
        try:
            c = int(part)
        except ValueError:
            c = 0
        if c < 1:
            raise ConfigError(
                f"--concurrency: {part.strip()!r} is not a positive integer; give e.g. 1,4,16,64"
            )
        out.append(c)
    return out


def parse_systems(text: str) -> list[tuple[str, bool]]:
    """``"spec,plain"`` -> [("spec", False), ("plain", True)] (name, plain decoding)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in ("spec", "plain")]
    if bad or not names or len(set(names)) != len(names):
        raise ConfigError(
            f"--systems {text!r} is invalid: give spec, plain or spec,plain (each at most once)"
        )
    return [(n, n == "plain") for n in names]


def engine_argv(args: argparse.Namespace, plain: bool) -> list[str]:
    """The engine flags of ``args`` for ``polyspec serve``; ``plain``: without the draft's
    flags and with ``--algorithm none``."""
    argv: list[str] = []
    skip = {"algorithm", "draft", *_SPEC_KEYS} if plain else set()
    for key in (*_ENGINE_KEYS, "config_file"):
        value = getattr(args, key, None)
        if value is None or key in skip:
            continue
        flag = "--config" if key == "config_file" else "--" + key.replace("_", "-")
        argv += [flag, str(value)]
    if plain:
        argv += ["--algorithm", "none"]
    return argv


_BENCH_FLAGS = (
    ("dataset", "--dataset"), ("num_prompts", "--num-prompts"), ("concurrency", "--concurrency"),
    ("request_rate", "--request-rate"), ("base_url", "--base-url"), ("model", "--model"),
    ("systems", "--systems"), ("json", "--json"), ("plot", "--plot"),
)  # fmt: skip
_SWITCHES = (
    ("ignore_eos", "--ignore-eos"), ("no_chat_template", "--no-chat-template"),
    ("offline_baseline", "--offline-baseline"),
)  # fmt: skip


def command_line(args: argparse.Namespace) -> str:
    """The command rebuilt from the parsed flags (every flag that was set, in a fixed order;
    the API key left out)."""
    parts = ["polyspec", "bench-serve"]
    for key, flag in _BENCH_FLAGS:
        value = getattr(args, key, None)
        if value is not None:
            parts += [flag, str(value)]
    parts += [flag for key, flag in _SWITCHES if getattr(args, key, False)]
    return shlex.join(parts + engine_argv(args, plain=False))


class ServerProcess:
    """``polyspec serve --port 0`` in a subprocess; its URL from the ready line."""

    def __init__(self, argv: list[str], timeout_s: float = 1800.0):
        self.cmd = [sys.executable, "-m", "polyspec", "serve", "--host", "127.0.0.1",
                    "--port", "0", *argv]  # fmt: skip
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self.proc = subprocess.Popen(
            self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        self.url = self._wait_ready(timeout_s)
        self._drain = threading.Thread(target=self._read_rest, daemon=True)
        self._drain.start()

    def _wait_ready(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        for line in self.proc.stderr:
            self.tail.append(line.rstrip())
            if line.startswith(READY):
                self.ready_line = line.strip()
                return line[len(READY) :].split()[0]
            if time.monotonic() > deadline:
                break
        self.stop()
        raise ConfigError(
            f"the server did not start: {shlex.join(self.cmd)}\n" + "\n".join(self.tail)
        )

    def _read_rest(self) -> None:
        for line in self.proc.stderr:
            self.tail.append(line.rstrip())

    def stop(self) -> None:
        """SIGTERM, then kill if it is still there after 60 s."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _first_model(base_url: str, api_key: str) -> str:
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    models = client.models.list().data
    if not models:
        raise ConfigError(f"{base_url}/models lists no model: pass --model")
    return models[0].id


def _bar(name: str, total: int, enabled: bool):
    from polyspec.bench.runner import progress_bar

    return progress_bar(name, total, enabled)


def _run_system(name, base_url, api_key, model, prompts, concurrencies, args, max_tokens):
    from polyspec.serve import bench

    temperature = args.temperature if args.temperature is not None else 0.0
    chat = not args.no_chat_template
    warm = bench.Load(model, prompts[:1], min(max_tokens, 16), temperature, args.ignore_eos, chat)
    bench.run_load(base_url, warm, 1, api_key=api_key)
    if max(concurrencies) > 1:  # every batch size's path built before timing
        warm = dataclasses.replace(warm, prompts=prompts[: max(concurrencies)])
        bench.run_load(base_url, warm, max(concurrencies), api_key=api_key)
    load = bench.Load(model, prompts, max_tokens, temperature, args.ignore_eos, chat)
    runs = {}
    for c in concurrencies:
        bar = _bar(f"{name} c={c}", len(prompts), not args.no_progress)
        runs[c] = bench.run_load(base_url, load, c, args.request_rate, api_key, on_done=bar.update)
        bar.close()
    return runs


class OfflineBaseline:
    """``LLM.generate`` in this process with the same flags, to time against the server at
    concurrency 1 (``--offline-baseline``). Built before the server so that the server can be
    pinned to the draft tree this engine settled on (:attr:`pin`): where the head lets the
    engine time candidate trees at start-up, two engines may pick differently."""

    def __init__(self, args: argparse.Namespace, plain: bool, max_tokens: int):
        from polyspec.commands.generate import engine_from_args
        from polyspec.config import SamplingParams

        ns = argparse.Namespace(**vars(args))
        if plain:
            for key in ("draft", *_SPEC_KEYS):
                setattr(ns, key, None)
            ns.algorithm = "none"
        self.llm, sampling, _ = engine_from_args(ns)
        self.params = SamplingParams(
            max_new_tokens=max_tokens,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            ignore_eos=args.ignore_eos,
            seed=sampling.seed,
        )
        self.chat = not args.no_chat_template
        spec = self.llm.config.speculative if self.llm.draft is not None else None
        self.pin: list[str] = []
        if spec is not None:
            self.pin = ["--num-steps", str(spec.num_steps), "--topk", str(spec.topk),
                        "--num-draft-tokens", str(spec.num_draft_tokens),
                        "--batch-trees", ",".join(t.text for t in spec.batch_trees) or "none",
                        "--dynamic-depth", str(spec.dynamic_depth or 0)]  # fmt: skip

    def time_one(self, prompt: str) -> tuple[int, float]:
        """(output tokens, seconds) of one prompt alone."""
        llm, params = self.llm, self.params
        t0 = time.perf_counter()
        out = (llm.chat(prompt, params) if self.chat else llm.generate([prompt], params))[0]
        return len(out.token_ids), time.perf_counter() - t0

    def close(self) -> None:
        self.llm.shutdown()
        self.llm = None
        gc.collect()


def interleaved(offline: OfflineBaseline, base_url: str, model: str, prompts, args, max_tokens,
                progress: bool) -> dict:  # fmt: skip
    """Each prompt alone through ``LLM.generate``, then alone through the server (streamed),
    alternating prompt by prompt, so that a shared machine's changing load hits both alike;
    -> tokens/s of each over all prompts and their ratio."""
    from polyspec.serve import bench

    temperature = args.temperature if args.temperature is not None else 0.0
    chat = not args.no_chat_template
    offline.time_one(prompts[0])  # warm-up, untimed (the server was warmed up already)
    gen_tokens = gen_s = srv_tokens = srv_s = 0.0
    bar = _bar("generate | server", len(prompts), progress)
    for prompt in prompts:
        n, sec = offline.time_one(prompt)
        gen_tokens, gen_s = gen_tokens + n, gen_s + sec
        load = bench.Load(model, [prompt], max_tokens, temperature, args.ignore_eos, chat)
        run = bench.run_load(base_url, load, 1)
        srv_tokens, srv_s = srv_tokens + run["output_tokens"], srv_s + run["wall_s"]
        bar.update()
    bar.close()
    gen_tps = gen_tokens / gen_s if gen_s else 0.0
    srv_tps = srv_tokens / srv_s if srv_s else 0.0
    return {
        "generate_tokens_per_s": gen_tps,
        "server_tokens_per_s": srv_tps,
        "generate_tokens": int(gen_tokens),
        "server_tokens": int(srv_tokens),
        "ratio": srv_tps / gen_tps if gen_tps else None,
    }


def run(args: argparse.Namespace) -> int:
    from polyspec.bench.datasets import load_dataset
    from polyspec.bench.plot import require_matplotlib
    from polyspec.bench.report import machine_info
    from polyspec.serve import bench

    concurrencies = parse_concurrency(args.concurrency)
    if args.request_rate is not None and not args.request_rate > 0:
        raise ConfigError(f"--request-rate = {args.request_rate} is invalid: must be > 0")
    if args.plot:
        require_matplotlib()
    if args.offline_baseline and args.base_url:
        raise ConfigError("--offline-baseline starts the servers itself: leave out --base-url")
    dataset_file, prompts = load_dataset(args.dataset, args.num_prompts)
    max_tokens = args.max_new_tokens or DEFAULT_MAX_TOKENS
    if args.max_batch_size is None and not args.base_url:
        args.max_batch_size = max(concurrencies)  # every request in flight joins the batch
    command = command_line(args)
    report: dict = {
        "command": command,
        "settings": {
            "dataset": args.dataset,
            "dataset_file": str(dataset_file),
            "num_prompts": len(prompts),
            "concurrency": concurrencies,
            "request_rate": args.request_rate,
            "max_tokens": max_tokens,
            "temperature": args.temperature or 0.0,
            "ignore_eos": args.ignore_eos,
            "chat_template": not args.no_chat_template,
            "max_batch_size": args.max_batch_size,
        },
        "machine": machine_info("server", "see servers"),
        "servers": {},
        "systems": {},
    }
    print(f"polyspec bench-serve: {len(prompts)} prompts from {dataset_file}, concurrency "
          f"{concurrencies}, max_tokens {max_tokens}", file=sys.stderr)  # fmt: skip
    if args.base_url:
        model = args.model or _first_model(args.base_url, args.api_key)
        report["servers"]["server"] = {"base_url": args.base_url, "model": model}
        report["systems"]["server"] = _run_system(
            "server", args.base_url, args.api_key, model, prompts, concurrencies, args, max_tokens
        )
    else:
        systems = parse_systems(args.systems)
        if args.algorithm == "none" or (args.target and not args.draft):
            why = "--algorithm none" if args.algorithm == "none" else "--target without --draft"
            print(f"note: plain serving only ({why})", file=sys.stderr)
            systems = [("plain", True)]
        for name, plain in systems:
            argv = engine_argv(args, plain)
            offline = None
            if args.offline_baseline:  # first, so that the server gets the same tree
                offline = OfflineBaseline(args, plain, max_tokens)
                argv += offline.pin
            server = ServerProcess(argv)
            print(server.ready_line, file=sys.stderr)
            try:
                base_url = server.url + "/v1"
                model = _first_model(base_url, "none")
                report["servers"][name] = {"command": shlex.join(server.cmd),
                                           "ready": server.ready_line}  # fmt: skip
                report["systems"][name] = _run_system(
                    name, base_url, "none", model, prompts, concurrencies, args, max_tokens
                )
                if offline is not None:
                    report.setdefault("offline", {})[name] = interleaved(
                        offline, base_url, model, prompts, args, max_tokens, not args.no_progress
                    )
            finally:
                server.stop()
                if offline is not None:
                    offline.close()
        if {"spec", "plain"} <= set(report["systems"]):
            spec, plain_runs = report["systems"]["spec"], report["systems"]["plain"]
            report["ratios"] = {c: bench.ratios(spec[c], plain_runs[c]) for c in concurrencies}
    print(bench.format_table(report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        bench.write_plot(report, args.plot)
    return 0
