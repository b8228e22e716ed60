"""Running the app under uvicorn: from the CLI (:func:`run_server`) or in a thread of a Python
process (:class:`BackgroundServer`).

The CLI binds the port first and loads the model in a thread meanwhile, so that ``/health``
answers 503 while the model loads; one line on stderr says when it is ready. SIGTERM stops
admission (new requests get 503, the listening socket closes), lets running requests finish
for ``shutdown_grace_s`` seconds, aborts the rest, and the process exits 0.
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


class _Server(uvicorn.Server):
    """uvicorn's server, which on SIGTERM also closes admission and then exits 0 (uvicorn
    re-raises the signal after its graceful shutdown, which would end the process with it)."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.polyspec_state = state

    def handle_exit(self, sig: int, frame) -> None:
        self.polyspec_state.stopping = True
        super().handle_exit(sig, frame)
        captured = getattr(self, "_captured_signals", None)
        if sig == signal.SIGTERM and captured and captured[-1] == sig:
            captured.pop()

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


def run_server(
    settings: ServeSettings,
    host: str,
    port: int,
    load: Callable[[], tuple[LLM, SamplingParams]],
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> int:
    """Serve until SIGTERM / Ctrl-C; ``load`` builds the engine in a thread once the port is
    bound. Returns 0; a model that fails to load raises its error after the server stopped."""
    state = ServerState(settings)
    server = _Server(_config(state, host, port), state)

    def loader() -> None:
        try:
            llm, sampling = load()
            state.attach(llm, sampling)
        except Exception as exc:  # reported by the main thread once uvicorn stopped
            state.load_error = f"{type(exc).__name__}: {exc}"
            state.load_exception = exc
            server.should_exit = True
            return
        while not server.started and not server.should_exit:
            time.sleep(0.01)
        if server.started:
            log(
                f"polyspec serve: ready on http://{host}:{server.bound_port} (model "
                f"{state.model.name!r}, {describe(llm)})"
            )

    thread = threading.Thread(target=loader, name="polyspec-load", daemon=True)
    thread.start()
    try:
        server.run()
    finally:
        state.shutdown(0.0)
    thread.join(timeout=1.0)
    exc = state.load_exception
    if exc is not None:
        if isinstance(exc, PolyspecError):
            raise exc
        raise PolyspecError(f"the model failed to load: {state.load_error}") from exc
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
        self._server = _Server(_config(self.state, host, port), self.state)
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
