"""``polyspec serve``: an OpenAI-compatible HTTP server (docs/serving.md)."""

from __future__ import annotations

import argparse
import functools
import gc
import os
import sys

from polyspec.commands.generate import add_engine_arguments
from polyspec.errors import BackendSelectionError, ConfigError, PluginError

SERVE_MAX_BATCH_SIZE = 128
"""``max_batch_size`` of ``polyspec serve`` where no flag, environment variable or config file
sets one and the backend really captures graphs (``BackendCapabilities.graph_capture``): a
server's load is many requests at once, and its graphs cover every batch up to it. Elsewhere
(the CPU) the engine's default stays, since the KV pool is sized from ``max_batch_size``."""


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve the model over HTTP (OpenAI-compatible API, streaming, /metrics)",
        description="Serve the target (with its draft) over an OpenAI-compatible HTTP API: "
        "/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics. Requests join "
        "the running batch at the next round; streamed requests get each round's accepted "
        "text. Engine and sampling flags are generate's; the sampling flags set the defaults of "
        "the fields a request leaves out. Needs the serve extra: pip install 'polyspec[serve]'.",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument(
        "--port", type=int, default=8000, help="port to bind (default 8000; 0: any free port)"
    )
    p.add_argument(
        "--served-model-name",
        dest="served_model_name",
        help="the model name clients send (default: the target's file or directory name)",
    )
    p.add_argument(
        "--api-key",
        dest="api_key",
        default=os.environ.get("POLYSPEC_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 requests (default: $POLYSPEC_API_KEY; "
        "unset: no key)",
    )
    p.add_argument(
        "--max-queued-requests",
        type=int,
        dest="max_queued_requests",
        help="requests that may wait for admission; past it the server answers 429 with "
        "Retry-After (default: no limit)",
    )
    p.add_argument(
        "--shutdown-grace",
        type=float,
        default=30.0,
        dest="shutdown_grace",
        metavar="SECONDS",
        help="on SIGTERM, how long running requests may finish before they are aborted "
        "(default 30)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=16 * 1024 * 1024,
        dest="max_request_bytes",
        help="larger request bodies get a 413 (default 16 MiB)",
    )
    p.add_argument(
        "--phase-times",
        choices=["auto", "on", "off"],
        default="auto",
        dest="phase_times",
        help="time the draft / verify phases of each round for /metrics; auto = where the "
        "backend runs kernels synchronously (the timer syncs the device per phase)",
    )
    add_engine_arguments(p)


def settings_from_args(args: argparse.Namespace):
    """The :class:`~polyspec.serve.app.ServeSettings` of the flags (checked)."""
    from polyspec.serve.app import ServeSettings

    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port = {args.port} is invalid: must be in 0..65535")
    if args.max_queued_requests is not None and args.max_queued_requests < 1:
        raise ConfigError(
            f"--max-queued-requests = {args.max_queued_requests} is invalid: must be >= 1 "
            "(leave it out for no limit)"
        )
    if not args.shutdown_grace >= 0:
        raise ConfigError(f"--shutdown-grace = {args.shutdown_grace} is invalid: must be >= 0")
    if args.max_request_bytes < 1024:
        raise ConfigError(
            f"--max-request-bytes = {args.max_request_bytes} is invalid: must be >= 1024"
        )
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise ConfigError("--served-model-name is empty: give a name or leave it out")
    if args.api_key is not None and not args.api_key:
        raise ConfigError("--api-key is empty: give a key or leave it out")
    return ServeSettings(
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        max_queued_requests=args.max_queued_requests,
        max_request_bytes=args.max_request_bytes,
        shutdown_grace_s=args.shutdown_grace,
        phase_times=args.phase_times,
    )


def serve_batch_default(args: argparse.Namespace) -> str | None:
    """Set ``args.max_batch_size`` to :data:`SERVE_MAX_BATCH_SIZE` where no layer sets
    ``max_batch_size`` and the backend that will run captures graphs; returns a note saying
    so, or None (the setting left as it was)."""
    from polyspec.config import given_engine_keys
    from polyspec.plugins import select_backend

    if args.max_batch_size is not None:
        return None
    given = given_engine_keys({"backend": args.backend}, args.config_file)
    if "max_batch_size" in given:
        return None
    try:
        report = select_backend(given.get("backend"))
    except (BackendSelectionError, PluginError):  # the engine reports it when it starts
        return None
    if not report.capabilities.get("graph_capture"):
        return None
    args.max_batch_size = SERVE_MAX_BATCH_SIZE
    return (
        f"max_batch_size = {SERVE_MAX_BATCH_SIZE} (serve's default where the backend captures "
        "graphs; --max-batch-size changes it)"
    )


def run(args: argparse.Namespace) -> int:
    try:
        from polyspec.serve.server import run_server
    except ImportError as exc:
        raise ConfigError(
            f"polyspec serve needs the serve extra ({exc.name} is missing): "
            "pip install 'polyspec[serve]'"
        ) from None
    from polyspec.commands.generate import engine_from_args

    settings = settings_from_args(args)
    batch_note = serve_batch_default(args)
    from polyspec.parallel.launch import under_torchrun

    if under_torchrun() and int(os.environ["RANK"]) != 0:  # rank 0 serves; this rank follows
        llm, _, _ = engine_from_args(args)
        _freeze_heap()
        llm.follow()
        return 0

    def load():
        llm, sampling, notes = engine_from_args(args)
        if batch_note is not None:
            notes = [batch_note, *notes]
        for n in notes:
            print(f"note: {n}", file=sys.stderr)
        if llm.worker.graphs is not None:  # capture now, not inside the first requests' time
            say = functools.partial(print, file=sys.stderr, flush=True)
            say("polyspec serve: capturing graphs...")
            shown = [0]

            def progress(done: int, total: int) -> None:
                if done * 10 // total > shown[0]:  # a line every tenth
                    shown[0] = done * 10 // total
                    say(f"polyspec serve: captured {done} / {total} graphs")

            warm = llm.warm_up(progress)
            say(f"polyspec serve: {warm['graphs']} graphs captured in {warm['seconds']:.1f} s")
        _freeze_heap()
        return llm, sampling

    print(
        f"polyspec serve: binding {args.host}:{args.port} and loading the model...",
        file=sys.stderr,
        flush=True,
    )
    return run_server(settings, args.host, args.port, load)


def _freeze_heap() -> None:
    """Move everything alive at start-up (the engine lives as long as the server) out of the
    garbage collector's generations: with SmolLM2 and the shipped head loaded (~183k tracked
    objects) a full collection took 50-70 ms on a 2-core CPU (``benchmarks/gc_pause.py``), a
    stall of every request in flight whenever the oldest generation was collected; frozen, it
    takes microseconds."""
    gc.collect()
    gc.freeze()
