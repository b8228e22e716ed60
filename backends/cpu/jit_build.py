"""Build and import a torch C++ extension once per machine, without ever hanging a later run.

``torch.utils.cpp_extension.load`` guards its build with a lock *file* (``<build dir>/lock``) whose
existence is the lock: a process killed mid-build (SIGTERM from ``timeout``, a CI cancel, a closed
terminal, the OOM killer) leaves it behind, and every later load of that extension waits on it
forever, silently. :func:`build_extension` wraps that load:

* it holds an OS lock (``fcntl.flock`` on ``<build dir>/polyspec.lock``, the holder's pid written
  inside) around the whole build and import; the kernel drops it when its holder dies, however it
  dies, so a dead builder never blocks anyone;
* holding it, it treats a torch ``lock`` file as left by a killed build (every build of the
  extension goes through here): it waits for that build's compiler processes that still run in
  the directory (they would write the same object files), then removes the file;
* a process that finds a live builder says so on stderr, with the builder's pid, and waits at
  most :data:`WAIT_ENV` seconds (default :data:`DEFAULT_WAIT_S`); then it gives up and returns
  no module, so that its caller falls back;
* a compile says when it starts and when it ends (with the time); a failed one shows the
  compiler's first error lines.

The code knows nothing of what it builds (tests build a tiny extension through it). Linux and
other POSIX systems only; where ``fcntl`` is missing it calls torch's loader unguarded.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from types import ModuleType

from polyspec.errors import ConfigError

WAIT_ENV = "POLYSPEC_CPU_BUILD_WAIT"
"""Seconds a run waits for another process compiling the same kernels before it gives up."""

DEFAULT_WAIT_S = 300.0
"""A compile of the cpu kernels takes about a minute; five allow for a loaded machine."""

LOCK_NAME = "polyspec.lock"
"""The flock file in the extension's build directory (its content: the holder's pid)."""

TORCH_LOCK_NAME = "lock"
"""The lock file ``torch.utils.cpp_extension`` creates for a build and removes when it ends."""

_POLL_S = 0.25


@dataclasses.dataclass(frozen=True)
class BuildResult:
    """What :func:`build_extension` did."""

    module: ModuleType | None
    """The imported extension, or None when it could not be built or loaded here."""
    reason: str
    """Empty with a module; otherwise why not, in one line."""
    directory: str
    """The build directory (``$TORCH_EXTENSIONS_DIR/<name>`` or torch's default)."""
    compiled: bool = False
    """True when this call ran the compiler (False: it found the extension built)."""
    seconds: float = 0.0
    """Time spent in the build and import, waiting excluded."""

    @property
    def location(self) -> str:
        """The loaded library's path ("" without a module)."""
        return getattr(self.module, "__file__", "") or ""


def wait_limit(env: Mapping[str, str] | None = None) -> float:
    """:data:`WAIT_ENV` in seconds (default :data:`DEFAULT_WAIT_S`); a bad value is a
    ConfigError."""
    raw = (os.environ if env is None else env).get(WAIT_ENV, "").strip()
    if not raw:
        return DEFAULT_WAIT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise ConfigError(
            f"{WAIT_ENV}={raw!r}: give the seconds a run waits for another process compiling "
            f"the cpu kernels before it falls back, a number >= 0 (default {DEFAULT_WAIT_S:g})"
        )
    return value


def extension_directory(name: str) -> str:
    """Where torch builds the extension ``name``: ``$TORCH_EXTENSIONS_DIR/<name>``, else under
    torch's default root (``~/.cache/torch_extensions/<python>_<accelerator>/<name>``)."""
    from torch.utils import cpp_extension

    get = getattr(cpp_extension, "_get_build_directory", None)
    if get is not None:  # torch's own rule, so a build made by a plain load() is found
        return get(name, False)
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    directory = os.path.join(root, name)
    os.makedirs(directory, exist_ok=True)
    return directory


def _say(message: str) -> None:
    print(f"polyspec: {message}", file=sys.stderr, flush=True)


def build_extension(
    name: str,
    sources: Sequence[str],
    *,
    extra_cflags: Sequence[str] = (),
    extra_ldflags: Sequence[str] = (),
    label: str = "the extension",
    duration: str = "a moment",
    wait_s: float | None = None,
) -> BuildResult:
    """Build (or find built) and import the extension ``name`` from ``sources`` (module doc).

    :param label: what the messages call it ("the cpu kernels").
    :param duration: how long a compile takes, for the start message ("about a minute").
    :param wait_s: the most seconds to wait for another process building it; default
        :func:`wait_limit`.
    Never raises for a build that fails or times out (only :func:`wait_limit`'s ConfigError
    for a bad :data:`WAIT_ENV`): the result says why.
    """
    if wait_s is None:
        wait_s = wait_limit()
    try:
        directory = extension_directory(name)
    except OSError as exc:
        return BuildResult(None, f"cannot create the extension directory: {exc}", "")
    try:
        import fcntl
    except ImportError:  # no POSIX file locks: torch's loader alone
        return _build_and_load(
            name, sources, extra_cflags, extra_ldflags, directory, label, duration
        )
    deadline = time.monotonic() + wait_s
    lock_path = os.path.join(directory, LOCK_NAME)
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by the compiler
    except OSError as exc:  # torch's loader could not write there either
        return BuildResult(None, f"cannot open {lock_path}: {exc.strerror}", directory)
    try:
        holder = _acquire(fcntl, fd, lock_path, label, wait_s, deadline)
        if holder is not None:
            return BuildResult(
                None,
                f"another process (pid {holder}) was still compiling {label} after {wait_s:g} s "
                f"of waiting ({WAIT_ENV} sets the limit)",
                directory,
            )
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        reason = _clear_killed_build(directory, label, wait_s, deadline)
        if reason:
            return BuildResult(None, reason, directory)
        return _build_and_load(
            name, sources, extra_cflags, extra_ldflags, directory, label, duration
        )
    finally:
        os.close(fd)  # drops the flock


def _acquire(fcntl, fd: int, lock_path: str, label: str, wait_s: float, deadline: float):
    """Take the flock on ``fd``; None once held, else the holder's pid (or "?") at the deadline."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        pass
    holder = _read_pid(lock_path)
    _say(
        f"waiting for another process compiling {label} (pid {holder}) ... (at most "
        f"{wait_s:g} s; {WAIT_ENV} sets the limit)"
    )
    while time.monotonic() < deadline:
        time.sleep(min(_POLL_S, max(0.0, deadline - time.monotonic())))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return None
        except BlockingIOError:
            continue
    _say(f"gave up waiting for pid {holder} after {wait_s:g} s")
    return holder


def _read_pid(lock_path: str) -> str:
    """The pid a flock holder wrote, or "?" (it writes right after taking the lock)."""
    for _ in range(10):
        try:
            with open(lock_path) as f:
                text = f.read().strip()
        except OSError:
            text = ""
        if text.isdigit():
            return text
        time.sleep(0.02)
    return "?"


def _clear_killed_build(directory: str, label: str, wait_s: float, deadline: float) -> str:
    """With the flock held: remove torch's lock file left by a killed build, once the compiler
    processes that build left running in ``directory`` have ended. "" or why not."""
    torch_lock = os.path.join(directory, TORCH_LOCK_NAME)
    try:
        since = os.stat(torch_lock).st_mtime
    except FileNotFoundError:
        return ""
    left = _processes_in(directory, since)
    if left:
        pids = ", ".join(str(p) for p in left)
        _say(
            f"waiting for another process compiling {label} (pid {pids}, left running by a "
            f"killed build) ... (at most {wait_s:g} s; {WAIT_ENV} sets the limit)"
        )
        while left and time.monotonic() < deadline:
            time.sleep(_POLL_S)
            left = _processes_in(directory, since)
        if left:
            _say(f"gave up waiting for pid {pids} after {wait_s:g} s")
            return (
                f"compiler processes of a killed build (pid {pids}) were still running in "
                f"{directory} after {wait_s:g} s ({WAIT_ENV} sets the limit)"
            )
    try:
        os.remove(torch_lock)
        _say(f"removed {torch_lock}, left by a build of {label} that was killed")
    except FileNotFoundError:
        pass
    return ""


def _processes_in(directory: str, since: float) -> list[int]:
    """Pids of the processes started at or after ``since`` (epoch seconds, 1 s of slack) whose
    working directory is ``directory``: what a killed build left running there (ninja runs its
    compiler commands in the build directory). [] where /proc does not say."""
    target = os.path.realpath(directory)
    try:
        with open("/proc/stat") as f:
            boot = next(float(line.split()[1]) for line in f if line.startswith("btime "))
        ticks = os.sysconf("SC_CLK_TCK")
        entries = os.listdir("/proc")
    except (OSError, StopIteration, ValueError):
        return []
    found = []
    for entry in entries:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if os.readlink(f"/proc/{entry}/cwd") != target:
                continue
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            started = boot + int(fields[19]) / ticks  # field 22: start time in clock ticks
            if fields[0] != "Z" and started >= since - 1.0:
                found.append(int(entry))
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile, or not ours to read
    return sorted(found)


def _build_and_load(
    name: str,
    sources: Sequence[str],
    extra_cflags: Sequence[str],
    extra_ldflags: Sequence[str],
    directory: str,
    label: str,
    duration: str,
) -> BuildResult:
    from torch.utils import cpp_extension

    library = os.path.join(directory, name + _library_suffix())
    before = _mtime(library)
    will_compile = _needs_compile(directory, library, sources, extra_cflags, extra_ldflags)
    if will_compile:
        _say(f"compiling {label} for this machine (first run only, {duration}) ...")
    start = time.monotonic()
    try:
        module = cpp_extension.load(
            name=name,
            sources=list(sources),
            extra_cflags=list(extra_cflags),
            extra_ldflags=list(extra_ldflags),
            build_directory=directory,
            verbose=False,
        )
    except Exception as exc:  # the caller falls back; the reason says why
        seconds = time.monotonic() - start
        lines = first_error_lines(str(exc))
        if will_compile or _mtime(library) != before:
            detail = "".join(f"\n    {line}" for line in lines)
            _say(f"compiling {label} failed after {seconds:.0f} s:{detail}")
        return BuildResult(
            None,
            f"build or load failed: {type(exc).__name__}: {lines[0]}",
            directory,
            compiled=will_compile,
            seconds=seconds,
        )
    seconds = time.monotonic() - start
    compiled = will_compile or _mtime(library) != before
    if compiled:
        _say(f"compiled {label} in {seconds:.0f} s ({library})")
    return BuildResult(module, "", directory, compiled=compiled, seconds=seconds)


def _library_suffix() -> str:
    return ".pyd" if sys.platform == "win32" else ".so"


def _mtime(path: str) -> float | None:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None


def _needs_compile(
    directory: str,
    library: str,
    sources: Sequence[str],
    extra_cflags: Sequence[str],
    extra_ldflags: Sequence[str],
) -> bool:
    """Whether torch's load is about to run the compiler (for the start message; the end
    message also notices a compile this missed)."""
    built = _mtime(library)
    if built is None or any((_mtime(s) or 0.0) > built for s in sources):
        return True
    try:
        with open(os.path.join(directory, "build.ninja")) as f:
            rules = f.read()
    except OSError:
        return True
    # load() rewrites build.ninja when a source path, a flag or the compiler changed: a rebuild
    from torch.utils import cpp_extension

    wanted = [os.path.abspath(s) for s in sources]
    wanted += [" ".join(extra_cflags), " ".join(extra_ldflags)]
    wanted.append(f"cxx = {cpp_extension.get_cxx_compiler()}\n")
    if any(text not in rules for text in wanted):
        return True
    try:  # headers (a torch upgrade) and interrupted builds: ninja's own dry run knows
        dry = subprocess.run(
            ["ninja", "-n", "-C", directory], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.SubprocessError):
        return True
    return dry.returncode != 0 or "no work to do" not in dry.stdout


_ERROR_LINE = re.compile(r"(^|[\s:])((fatal )?error|undefined reference)\b", re.IGNORECASE)


def first_error_lines(text: str, count: int = 3, width: int = 200) -> list[str]:
    """The first ``count`` compiler / linker error lines of a failed build's output (torch puts
    the output in its exception), else its first lines; each cut to ``width`` characters."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [
        line
        for line in lines
        if _ERROR_LINE.search(line)
        and not line.startswith(("Error building extension", "FAILED:", "ninja:"))
        and not re.match(r"^\[\d+/\d+\]", line)  # ninja's echo of a compiler command
    ]
    picked = (errors or lines or ["(no output)"])[:count]
    return [line if len(line) <= width else line[: width - 3] + "..." for line in picked]
