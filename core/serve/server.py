"""Running the app under uvicorn: from the CLI (:func:`run_server`) or in a thread of a Python
process (:class:`BackgroundServer`).

The CLI binds the port first (uvicorn in a thread) and loads the model in the main thread
meanwhile, so that ``/health`` answers 503 while the model loads; one line on stderr says when
it is ready. SIGTERM stops admission (new requests get 503, the listening socket closes), lets
running requests finish for ``shutdown_grace_s`` seconds, aborts the rest, and the process
exits 0.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import uvicorn

from polyspec.errors import PolyspecError
from polyspec.serve.app import ServerState, ServeSettings, create_app

if TYPE_CHECKING:
    from polyspec.config import SamplingParams
    from polyspec.engine.llm import LLM

SWITCH_INTERVAL_S = 0.0005
"""The interpreter's thread switch interval while serving (Python's default is 5 ms). The
engine's thread waits for the device with the GIL released and wants it back the moment a
round ends; the HTTP thread, busy streaming chunks, keeps it until the interval runs out, so
the default would add up to 5 ms to every round, longer than a whole round on a GPU."""


class _Server(uvicorn.Server):
    """uvicorn's server, which also tells the port it bound."""

    @property
    def bound_port(self) -> int | None:
        """The port listened on (the one the OS chose for port 0), once started."""
        for server in getattr(self, "servers", []):
            for sock in server.sockets:
                return sock.getsockname()[1]
        return None


def _config(state: ServerState, host: str, port: int) -> uvicorn.Config:
    return uvicorn.Config(
        create_app(state),
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=max(1, round(state.settings.shutdown_grace_s)),
    )


def describe(llm: LLM) -> str:
    """The engine settings in one phrase, for the ready line."""
    spec = llm.config.speculative
    dtype = str(llm.dtype).removeprefix("torch.")
    if llm.draft is None or spec is None:
        mode = "plain decoding"
    else:
        mode = (
            f"{spec.algorithm} num_steps {spec.num_steps} topk {spec.topk} num_draft_tokens "
            f"{spec.num_draft_tokens}"
            + "".join(f", from batch {t.min_batch_size}: {t.label}" for t in spec.batch_trees)
            + f", draft {llm.draft_path}"
        )
    return f"backend {llm.backend.name}, {dtype}, {mode}"


class _Stop(Exception):
    """SIGTERM while the model was still loading."""


def run_server(
    settings: ServeSettings,
    host: str,
    port: int,
    load: Callable[[], tuple[LLM, SamplingParams]],
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> int:
    """Serve until SIGTERM / Ctrl-C. uvicorn runs in a thread and binds the port first; the
    model is built here, in the main thread, meanwhile, and this thread then runs the engine's
    steps (see :meth:`EngineLoop.drive` for why). Returns 0 after SIGTERM; Ctrl-C
    raises KeyboardInterrupt once the server stopped; a model that fails to load raises its
    error."""
    state = ServerState(settings)
    server = _Server(_config(state, host, port))
    http = threading.Thread(target=server.run, name="polyspec-http", daemon=True)
    signals: list[int] = []

    def on_signal(sig: int, frame) -> None:
        signals.append(sig)
        state.stopping = True
        server.should_exit = True
        if sig == signal.SIGINT and len(signals) > 1:
            server.force_exit = True  # a second Ctrl-C: do not wait for running requests
        if state.llm is None:  # still loading: stop the load too
            raise KeyboardInterrupt if sig == signal.SIGINT else _Stop()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    interval = sys.getswitchinterval()
    sys.setswitchinterval(min(interval, SWITCH_INTERVAL_S))
    try:
        http.start()
        while not server.started and http.is_alive():
            time.sleep(0.01)
        if not server.started:
            raise PolyspecError(
                f"could not serve on {host}:{port} (see the message above); pick another "
                "--port or --host"
            )
        llm, sampling = load()
        if not server.should_exit:
            state.attach(llm, sampling)
            log(
                f"polyspec serve: ready on http://{host}:{server.bound_port} (model "
                f"{state.model.name!r}, {describe(llm)})"
            )
        # The main thread runs the engine's steps (EngineLoop.drive: torch's CPU kernels are
        # faster on the thread that built the model) until the HTTP thread has stopped.
        llm.engine.drive(lambda: not http.is_alive(), keep_alive=True)
        while http.is_alive():
            http.join(0.2)
    except _Stop:
        pass
    finally:
        server.should_exit = True
        for s, handler in previous.items():
            signal.signal(s, handler)
        sys.setswitchinterval(interval)
        if http.is_alive():
            http.join(timeout=settings.shutdown_grace_s + 5)
        state.shutdown(0.0)
    if signals and signals[-1] == signal.SIGINT:
        raise KeyboardInterrupt
    return 0


class BackgroundServer:
    """Serve an :class:`~polyspec.LLM` from a thread of this process (tests, notebooks);
    ``llm`` None starts the server without a model (503s) until ``server.state.attach(llm)``::

    with BackgroundServer(llm) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    """

    def __init__(
        self,
        llm: LLM | None,
        settings: ServeSettings | None = None,
        default_sampling: SamplingParams | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ):
        self.state = ServerState(settings or ServeSettings())
        if llm is not None:  # else every /v1 request answers 503 until attach()
            self.state.attach(llm, default_sampling)
        self._server = _Server(_config(self.state, host, port))
        self._host = host
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """``http://host:port`` (no trailing slash)."""
        return f"http://{self._host}:{self._server.bound_port}"

    def start(self, timeout_s: float = 30.0) -> BackgroundServer:
        self._thread = threading.Thread(target=self._server.run, name="polyspec-serve", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start (see the log above)")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stop serving (requests still running are aborted as their connections close). The
        LLM stays usable; ``llm.shutdown()`` stops its engine loop."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30.0)
        self.state.stopping = True

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
