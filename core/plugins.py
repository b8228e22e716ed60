"""Backend plugins: discovery, probing, selection, load reports and their error messages.

Every backend, the built-in cpu / cuda / npu ones included, is found through the entry-point
group ``polyspec.backends`` and described by the hooks of :mod:`polyspec.hookspecs`.

Selection order (first match wins):

1. an explicit name: :func:`create_backend` ``(name)``, which is where ``backend = ...`` from a
   config file or ``--backend`` arrives;
2. the environment variable ``POLYSPEC_BACKEND``;
3. auto-detection: the available backend with the highest priority (accelerators are positive,
   cpu is 0 and therefore last, negative means "only by name"). Two backends available at the
   same highest priority is an error naming both.

Environment variables read here:

- ``POLYSPEC_BACKEND``: backend name used when none is given explicitly.
- ``POLYSPEC_PLUGINS``: comma-separated allow-list of entry-point names; others are skipped.
- ``POLYSPEC_DISABLE_PLUGIN_AUTOLOAD=1``: load only polyspec's own backends plus the ones named in
  ``POLYSPEC_PLUGINS`` or requested by name.

A third-party plugin that uses the name of a built-in backend (cpu, cuda, npu) never replaces
or disables it: the built-in one is loaded and the other is reported as ignored.
- ``POLYSPEC_STRICT_PLUGINS=1``: a plugin that fails to load or probe is fatal instead of being
  reported and skipped (it is always fatal when it is the requested backend).

Nothing here is cached in module globals: each call discovers afresh (cheap: probes import no
vendor runtime), so changes to the environment or installed packages are always seen.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.metadata
import os
from collections.abc import Iterable, Mapping
from typing import Any

import pluggy

from polyspec import hookspecs
from polyspec.backend import BACKEND_API_VERSION, Backend, BackendCapabilities
from polyspec.errors import BackendSelectionError, PluginError
from polyspec.hookspecs import BackendSpec, ProbeResult

__all__ = [
    "ENTRY_POINT_GROUP",
    "BackendReport",
    "BackendSelectionError",
    "PluginError",
    "PluginRegistry",
    "create_backend",
    "discover",
    "select_backend",
]

ENTRY_POINT_GROUP = "polyspec.backends"
"""Entry-point group every backend plugin registers in."""

BUILTIN_DISTRIBUTION = "polyspec"
"""Distribution whose backends stay loaded when third-party autoload is disabled."""

_TRUE = frozenset({"1", "true", "yes", "on"})


def _env_flag(env: Mapping[str, str], key: str) -> bool:
    return env.get(key, "").strip().lower() in _TRUE


def _env_list(env: Mapping[str, str], key: str) -> list[str] | None:
    raw = env.get(key)
    if raw is None or not raw.strip():
        return None
    return [part for part in raw.replace(",", " ").split() if part]


@dataclasses.dataclass(frozen=True)
class BackendReport:
    """What discovery learned about one entry point, including broken and skipped ones."""

    name: str
    """Entry-point name (= backend name)."""
    entry_point: str
    """``"name = module"`` as declared by the distribution."""
    distribution: str
    """Distribution that declares the entry point ("?" when unknown)."""
    version: str
    """Version of that distribution ("?" when unknown)."""
    available: bool
    """True when the backend can be created on this machine."""
    reason: str
    """Empty when available; otherwise why not (probe result, skip policy or plugin error)."""
    priority: int | None = None
    """Auto-detection priority from the plugin's spec (None when the spec is unknown)."""
    capabilities: dict[str, Any] = dataclasses.field(default_factory=dict)
    """``BackendCapabilities.to_dict()`` of the static spec (empty when unknown)."""
    error: str | None = None
    """Full message when the plugin is broken (import, hooks, API version, name conflict)."""
    api_version: int | None = None
    """Backend API version the plugin declares."""
    factory: str | None = None
    """Dotted factory path from the spec."""
    device_type: str | None = None
    """torch device type from the spec."""
    description: str = ""
    """One line from the spec."""
    skipped: bool = False
    """True when the plugin was not loaded because of POLYSPEC_PLUGINS / autoload settings."""

    @property
    def status(self) -> str:
        """ "available", "unavailable", "skipped" or "error"."""
        if self.error is not None:
            return "error"
        if self.skipped:
            return "skipped"
        return "available" if self.available else "unavailable"

    def summary(self) -> str:
        """One line, e.g. ``cuda: unavailable: no CUDA device (...)``."""
        if self.available:
            return f"{self.name}: available"
        return f"{self.name}: {self.status}: {self.error or self.reason}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly view (``polyspec backends --json``)."""
        out = dataclasses.asdict(self)
        out["status"] = self.status
        return out


@dataclasses.dataclass
class _Loaded:
    """A successfully loaded plugin: its report plus the spec needed to create the backend."""

    report: BackendReport
    spec: BackendSpec


def _ep_identity(ep: importlib.metadata.EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "?", "?"
    return str(dist.name or "?"), str(dist.version or "?")


def _normalize_dist(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _is_builtin(ep: importlib.metadata.EntryPoint) -> bool:
    dist, _ = _ep_identity(ep)
    if dist == "?":
        return ep.value.startswith("polyspec.backends.")
    return _normalize_dist(dist) == BUILTIN_DISTRIBUTION


def resolve_factory(path: str) -> Any:
    """Import ``"package.module:attribute"`` and return the attribute."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"factory {path!r} is not of the form 'package.module:attribute'")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


class PluginRegistry:
    """Discovers backend plugins and selects / creates backends.

    :param entry_points: entry points to consider; default: every entry point installed in the
        group ``polyspec.backends``. Tests pass their own.
    :param env: environment variables to obey; default: ``os.environ``.
    """

    def __init__(
        self,
        entry_points: Iterable[importlib.metadata.EntryPoint] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        if entry_points is None:
            entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        self._entry_points = list(entry_points)
        self._env: dict[str, str] = dict(os.environ if env is None else env)

    # -- discovery ------------------------------------------------------------------------

    def discover(self, requested: str | None = None) -> list[BackendReport]:
        """A report for every entry point in the group, sorted by name.

        :param requested: a backend the caller is about to use: its failures are raised as
            :class:`PluginError` instead of being reported, and POLYSPEC_DISABLE_PLUGIN_AUTOLOAD
            does not skip it (POLYSPEC_PLUGINS still does).
        """
        return [entry.report for entry in self._discover(requested)]

    def _discover(self, requested: str | None) -> list[_Loaded | _Skipped]:
        strict = _env_flag(self._env, "POLYSPEC_STRICT_PLUGINS")
        pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)  # fresh: a discovery registers anew
        pm.add_hookspecs(hookspecs)
        out: list[_Loaded | _Skipped] = []
        for group in self._grouped():
            shadows = []
            if len(group) > 1 and any(_is_builtin(e) for e in group):
                # polyspec's own backend wins over a namesake (reported after it)
                shadows = [_Skipped(self._shadowing(e)) for e in group if not _is_builtin(e)]
                group = [e for e in group if _is_builtin(e)]
            ep = group[0]
            fatal = strict or ep.name == requested
            if len(group) > 1:
                out.append(self._conflict(group, fatal))
            elif (skip_reason := self._skip_reason(ep, requested)) is not None:
                out.append(_Skipped(self._bare_report(ep, skip_reason, skipped=True)))
            else:
                out.append(self._load(pm, ep, fatal))
            out += shadows
        return out

    def _grouped(self) -> list[list[importlib.metadata.EntryPoint]]:
        """Entry points grouped by name; the same (distribution, value) seen twice counts once."""
        by_name: dict[str, list[importlib.metadata.EntryPoint]] = {}
        seen: set[tuple[str, str, str]] = set()
        for ep in self._entry_points:
            key = (ep.name, _normalize_dist(_ep_identity(ep)[0]), ep.value)
            if key in seen:
                continue
            seen.add(key)
            by_name.setdefault(ep.name, []).append(ep)
        return [by_name[name] for name in sorted(by_name)]

    def _skip_reason(self, ep: importlib.metadata.EntryPoint, requested: str | None) -> str | None:
        allow = _env_list(self._env, "POLYSPEC_PLUGINS")
        if allow is not None and ep.name not in allow:
            return f"not listed in POLYSPEC_PLUGINS={','.join(allow)}"
        autoload_off = _env_flag(self._env, "POLYSPEC_DISABLE_PLUGIN_AUTOLOAD")
        if autoload_off and not _is_builtin(ep) and allow is None and ep.name != requested:
            return (
                "not loaded: POLYSPEC_DISABLE_PLUGIN_AUTOLOAD=1 (name it in POLYSPEC_PLUGINS or "
                "select it by name to load it)"
            )
        return None

    def _bare_report(
        self,
        ep: importlib.metadata.EntryPoint,
        reason: str,
        *,
        skipped: bool = False,
        error: str | None = None,
    ) -> BackendReport:
        dist, version = _ep_identity(ep)
        return BackendReport(
            name=ep.name,
            entry_point=f"{ep.name} = {ep.value}",
            distribution=dist,
            version=version,
            available=False,
            reason=reason,
            skipped=skipped,
            error=error,
        )

    def _where(self, ep: importlib.metadata.EntryPoint) -> str:
        dist, version = _ep_identity(ep)
        return f"entry point '{ep.name} = {ep.value}' from distribution {dist} {version}"

    def _conflict(self, group: list[importlib.metadata.EntryPoint], fatal: bool) -> _Skipped:
        ep = group[0]
        where = "; ".join(self._where(e) for e in group)
        msg = (
            f"backend name '{ep.name}' is provided by {len(group)} plugins ({where}); "
            f"uninstall all but one of them"
        )
        if fatal:
            raise PluginError(msg)
        return _Skipped(self._bare_report(ep, "plugin error: name conflict", error=msg))

    def _shadowing(self, ep: importlib.metadata.EntryPoint) -> BackendReport:
        msg = (
            f"{self._where(ep)} uses the name of polyspec's built-in backend '{ep.name}', which "
            "takes precedence: this plugin is ignored; rename its entry point and backend"
        )
        return self._bare_report(ep, "ignored: shadows a built-in backend", error=msg)

    def _unknown_allowed(self) -> str:
        """A sentence about names in POLYSPEC_PLUGINS no installed plugin has ("" if none)."""
        allow = _env_list(self._env, "POLYSPEC_PLUGINS")
        names = sorted({ep.name for ep in self._entry_points})
        unknown = [a for a in allow or () if a not in names]
        if not unknown:
            return ""
        parts = []
        for a in unknown:
            close = difflib.get_close_matches(a, names, n=1)
            parts.append(f"'{a}'" + (f" (did you mean '{close[0]}'?)" if close else ""))
        return (
            f"\nPOLYSPEC_PLUGINS names {', '.join(parts)}, which no installed plugin provides "
            f"(installed: {', '.join(names) or 'none'})."
        )

    def _broken(
        self, ep: importlib.metadata.EntryPoint, what: str, exc: BaseException | None, fatal: bool
    ) -> _Skipped:
        detail = f": {type(exc).__name__}: {exc}" if exc is not None else ""
        msg = f"backend plugin '{ep.name}' ({self._where(ep)}) {what}{detail}"
        if fatal:
            raise PluginError(msg) from exc
        short = what if exc is None else f"{what}: {type(exc).__name__}: {exc}"
        return _Skipped(self._bare_report(ep, f"plugin error: {short}", error=msg))

    def _load(
        self, pm: pluggy.PluginManager, ep: importlib.metadata.EntryPoint, fatal: bool
    ) -> _Loaded | _Skipped:
        try:
            plugin = ep.load()
        except Exception as exc:  # a broken third-party plugin must not break discovery
            return self._broken(ep, "failed to import", exc, fatal)
        try:
            pm.register(plugin, name=ep.name)
        except Exception as exc:
            return self._broken(ep, "could not be registered with pluggy", exc, fatal)
        unknown = [hc.name for hc in pm.get_hookcallers(plugin) or [] if not hc.has_spec()]
        if unknown:
            return self._broken(
                ep,
                f"implements unknown hook(s) {', '.join(unknown)} (known: "
                f"polyspec_backend_spec, polyspec_backend_probe)",
                None,
                fatal,
            )
        others = [p for p in pm.get_plugins() if p is not plugin]
        try:
            spec = pm.subset_hook_caller("polyspec_backend_spec", others)()
        except Exception as exc:
            return self._broken(ep, "raised in polyspec_backend_spec", exc, fatal)
        problem = self._check_spec(ep, spec)
        if problem is not None:
            return self._broken(ep, problem, None, fatal)
        try:
            probe = pm.subset_hook_caller("polyspec_backend_probe", others)(env=dict(self._env))
        except Exception as exc:
            return self._broken(ep, "raised in polyspec_backend_probe", exc, fatal)
        if not isinstance(probe, ProbeResult):
            return self._broken(
                ep,
                f"polyspec_backend_probe returned {type(probe).__name__}, expected ProbeResult",
                None,
                fatal,
            )
        dist, version = _ep_identity(ep)
        report = BackendReport(
            name=ep.name,
            entry_point=f"{ep.name} = {ep.value}",
            distribution=dist,
            version=version,
            available=probe.available,
            reason="" if probe.available else probe.reason,
            priority=spec.priority,
            capabilities=spec.capabilities.to_dict(),
            api_version=spec.api_version,
            factory=spec.factory,
            device_type=spec.device_type,
            description=spec.description,
        )
        return _Loaded(report, spec)

    def _check_spec(self, ep: importlib.metadata.EntryPoint, spec: Any) -> str | None:
        """What is wrong with a plugin's spec, or None."""
        if spec is None:
            return "does not implement the hook polyspec_backend_spec"
        if not isinstance(spec, BackendSpec):
            return f"polyspec_backend_spec returned {type(spec).__name__}, expected BackendSpec"
        if spec.api_version != BACKEND_API_VERSION:
            return (
                f"was built for backend API version {spec.api_version}, but this polyspec "
                f"implements backend API version {BACKEND_API_VERSION}; install a release of the "
                f"plugin built for version {BACKEND_API_VERSION}"
            )
        if spec.name != ep.name:
            return f"declares backend name '{spec.name}' but its entry point is named '{ep.name}'"
        if not isinstance(spec.capabilities, BackendCapabilities):
            return "BackendSpec.capabilities is not a BackendCapabilities"
        if ":" not in spec.factory:
            return f"factory {spec.factory!r} is not of the form 'package.module:attribute'"
        if not isinstance(spec.priority, int) or isinstance(spec.priority, bool):
            return f"priority {spec.priority!r} is not an int"
        return None

    # -- selection ------------------------------------------------------------------------

    def select(self, name: str | None = None) -> BackendReport:
        """The report of the backend :meth:`create_backend` would create (see module docs)."""
        return self._select(name)[0].report

    def _select(self, name: str | None) -> tuple[_Loaded, str]:
        source = "requested explicitly"
        if not name:
            name = self._env.get("POLYSPEC_BACKEND", "").strip() or None
            source = f"requested by POLYSPEC_BACKEND={name}"
        entries = self._discover(requested=name)
        if name is not None:
            return self._select_named(name, source, entries), source
        return self._auto_detect(entries)

    def _select_named(self, name: str, source: str, entries: list[_Loaded | _Skipped]) -> _Loaded:
        for entry in entries:
            if entry.report.name != name:
                continue
            if isinstance(entry, _Loaded) and entry.report.available:
                return entry
            report = entry.report
            raise BackendSelectionError(
                f"backend '{name}' ({source}) is {report.status}: {report.error or report.reason}."
                f"{_fix_hint(entries, source)}{self._unknown_allowed()}"
            )
        raise BackendSelectionError(
            f"backend '{name}' ({source}) is not installed: no plugin declares it in the "
            f"entry-point group '{ENTRY_POINT_GROUP}'. Install the package that provides it."
            f"{_fix_hint(entries, source)}{self._unknown_allowed()}"
        )

    def _auto_detect(self, entries: list[_Loaded | _Skipped]) -> tuple[_Loaded, str]:
        candidates = [
            e
            for e in entries
            if isinstance(e, _Loaded) and e.report.available and e.spec.priority >= 0
        ]
        if not candidates:
            raise BackendSelectionError(
                "no backend is available on this machine (auto-detect):\n"
                + _listing(entries)
                + "\nInstall a backend plugin whose probe succeeds here, or fix the reasons above."
                + self._unknown_allowed()
            )
        best = max(e.spec.priority for e in candidates)
        top = [e for e in candidates if e.spec.priority == best]
        if len(top) > 1:
            names = " and ".join(f"'{e.report.name}'" for e in top)
            raise BackendSelectionError(
                f"auto-detect is ambiguous: backends {names} are both available at priority "
                f'{best}. Choose one with POLYSPEC_BACKEND=NAME, `backend = "NAME"` in '
                f"polyspec.toml or --backend NAME."
            )
        return top[0], f"auto-detected (highest priority available, {best})"

    # -- creation -------------------------------------------------------------------------

    def create_backend(self, name: str | None = None) -> Backend:
        """Select a backend (see module docs), import its factory and call it with no arguments."""
        entry, source = self._select(name)
        spec = entry.spec
        label = f"backend '{spec.name}' ({source}, from {entry.report.distribution})"
        try:
            factory = resolve_factory(spec.factory)
        except Exception as exc:
            raise PluginError(
                f"{label}: cannot import its factory {spec.factory!r}: {type(exc).__name__}: {exc}"
            ) from exc
        try:
            backend = factory()
        except (PluginError, BackendSelectionError):
            raise
        except NotImplementedError as exc:
            raise BackendSelectionError(f"{label} cannot be created: {exc}") from exc
        except Exception as exc:
            raise PluginError(
                f"{label}: its factory {spec.factory!r} failed: {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(backend, Backend):
            raise PluginError(
                f"{label}: its factory {spec.factory!r} returned {type(backend).__name__}, "
                f"which is not a polyspec.backend.Backend"
            )
        if backend.api_version != BACKEND_API_VERSION:
            raise PluginError(
                f"{label}: the backend object implements backend API version "
                f"{backend.api_version}, but this polyspec implements version {BACKEND_API_VERSION}"
            )
        if backend.name != spec.name:
            raise PluginError(
                f"{label}: its factory returned a backend named '{backend.name}'; the name must "
                f"match the entry point '{spec.name}'"
            )
        return backend


@dataclasses.dataclass
class _Skipped:
    """A plugin that is skipped by policy, broken, or in a name conflict."""

    report: BackendReport


def _listing(entries: list[_Loaded | _Skipped]) -> str:
    if not entries:
        return f"  (no plugin is installed in the entry-point group '{ENTRY_POINT_GROUP}')"
    return "\n".join(f"  {e.report.summary()}" for e in entries)


def _fix_hint(entries: list[_Loaded | _Skipped], source: str) -> str:
    usable = [e.report.name for e in entries if isinstance(e, _Loaded) and e.report.available]
    lines = ["", "Installed backends:", _listing(entries)]
    if usable:
        lines.append(f"Available now: {', '.join(usable)}.")
    if "POLYSPEC_BACKEND" in source:
        lines.append("Unset POLYSPEC_BACKEND to auto-detect, or set it to an available backend.")
    else:
        lines.append("Choose an available backend, or omit the backend to auto-detect.")
    return "\n".join(lines)


def discover(*, env: Mapping[str, str] | None = None) -> list[BackendReport]:
    """A :class:`BackendReport` for every installed backend plugin, broken ones included."""
    return PluginRegistry(env=env).discover()


def select_backend(
    name: str | None = None, *, env: Mapping[str, str] | None = None
) -> BackendReport:
    """The report of the backend :func:`create_backend` would create, without creating it."""
    return PluginRegistry(env=env).select(name)


def create_backend(name: str | None = None, *, env: Mapping[str, str] | None = None) -> Backend:
    """Create a backend by name, or by the selection rules when ``name`` is None.

    Raises :class:`BackendSelectionError` (unknown, unavailable or ambiguous backend) or
    :class:`PluginError` (the requested plugin is broken or its factory failed), with a message
    listing the installed backends and how to fix the problem.
    """
    return PluginRegistry(env=env).create_backend(name)
