"""pluggy hook specifications of a polyspec backend plugin (the only place hooks are declared).

A backend plugin is a module (or any object) registered under the entry-point group
``polyspec.backends``::

    [project.entry-points."polyspec.backends"]
    mybackend = "my_package.polyspec_plugin"

and implements the hooks below with :data:`hookimpl`. pluggy is used for discovery only: once a
backend is created the engine holds the :class:`~polyspec.backend.Backend` object and calls it
directly, never through a hook.

Hooks are always called with keyword arguments only (pluggy enforces this). An implementation
may accept fewer arguments than the specification lists (pluggy passes only the ones it names),
which keeps old plugins working when a hook gains an argument.

Rule for the two discovery hooks (spec and probe): they must be cheap and import no vendor
runtime (no ``torch_npu``, ``triton``, no CUDA initialisation). Listing backends calls them for
every installed plugin; the vendor imports belong in the factory's module, which is imported only
when the backend is activated. The optional ``polyspec_build_kernels`` is called only by
``polyspec build-kernels`` and may do real work.
"""

from __future__ import annotations

import dataclasses

import pluggy

from polyspec.backend import BACKEND_API_VERSION, BackendCapabilities

PROJECT_NAME = "polyspec"
"""pluggy project name; hook implementations must be marked with this project's marker."""

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
"""Marker for the specifications in this file."""

hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
"""Marker plugins put on their hook implementations: ``@hookimpl``."""


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    """Static description of one backend, known without importing its vendor runtime."""

    name: str
    """Backend name users select it by (``backend = "cuda"``); must equal the entry-point name."""
    factory: str
    """Dotted ``"package.module:attribute"`` of a callable taking no required arguments and
    returning a :class:`~polyspec.backend.Backend`; imported only when the backend is created."""
    priority: int
    """Auto-detection order: the available backend with the highest priority wins. The cpu
    reference uses 0 so that every accelerator (positive priority) is preferred to it; a negative
    priority means the backend is never auto-detected, only selected by name."""
    capabilities: BackendCapabilities
    """What the backend can do, declared statically so listing needs no vendor import. The
    created backend's ``capabilities`` may be narrower (e.g. a device without graph support)."""
    api_version: int = BACKEND_API_VERSION
    """The :data:`~polyspec.backend.BACKEND_API_VERSION` the plugin was built against; a plugin
    built for another version is refused."""
    device_type: str = "cpu"
    """torch device type of the backend ("cpu", "cuda", "npu", ...)."""
    description: str = ""
    """One line shown by ``polyspec backends``."""


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """Whether this machine can run a backend right now, and if not, why."""

    available: bool
    """True when the factory is expected to succeed on this machine."""
    reason: str = ""
    """Empty when available; otherwise what is missing and, where possible, how to fix it."""

    def __post_init__(self) -> None:
        if not self.available and not self.reason:
            raise ValueError("ProbeResult(available=False) needs a reason saying what is missing")


@hookspec(firstresult=True)
def polyspec_backend_spec() -> BackendSpec:
    """Describe the backend this plugin provides.

    Called once per discovery, with no arguments. Must not import vendor runtimes; the returned
    :class:`BackendSpec` names the factory by dotted path instead of holding it.
    """


@hookspec(firstresult=True)
def polyspec_backend_probe(env: dict[str, str]) -> ProbeResult:
    """Report whether the backend can run on this machine, without initialising any device.

    :param env: the environment variables discovery runs under (a copy of ``os.environ`` unless a
        test injects one); read it instead of ``os.environ`` so that probes are testable.

    Allowed: :func:`importlib.util.find_spec`, reading ``torch.version``, checking device nodes
    (``/dev/nvidia*``, ``/dev/davinci*``), environment variables and executables on ``PATH``.
    Not allowed: importing vendor packages or calling anything that initialises a device.
    An exception raised here is reported as a broken plugin and the plugin is skipped.
    """


@dataclasses.dataclass(frozen=True)
class KernelBuild:
    """What :func:`polyspec_build_kernels` did."""

    built: bool
    """True when the kernels are built for this machine (by this call or an earlier one)."""
    location: str = ""
    """Where the built kernels live (a file or directory), when built."""
    detail: str = ""
    """When built, how ("compiled in 52 s", "already built"); otherwise why not and what to do."""

    def __post_init__(self) -> None:
        if not self.built and not self.detail:
            raise ValueError("KernelBuild(built=False) needs a detail saying why")


@hookspec(firstresult=True)
def polyspec_build_kernels(env: dict[str, str]) -> KernelBuild | None:
    """Build the backend's just-in-time compiled kernels for this machine now, so that a first
    run does not (``polyspec build-kernels``: an image or a CI job pays the compile once).

    Optional: a backend with nothing to build ahead of time does not implement it. Called only by
    that command, for an available backend; it may import the vendor runtime and run a compiler.
    A build that fails is a ``KernelBuild(built=False, detail=...)``, not an exception.

    :param env: the environment variables the command runs under.
    """
