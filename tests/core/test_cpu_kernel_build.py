"""The cpu kernels' build (polyspec.backends.cpu.jit_build, ``polyspec build-kernels``): a build
killed midway never hangs a later run, a live build is waited for within a bound, and every step
says what it does.

The kill tests compile a tiny C++ extension through the very function that builds rowinv.cpp
(torch's loader, ninja and the real compiler), each in its own temporary TORCH_EXTENSIONS_DIR.
The compiler is wrapped by a script that holds the compile step until the test opens a gate, so
"killed mid-build" is a fact rather than a race.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from plugin_packages import fake_entry_point, write_plugin_module

from polyspec import cli
from polyspec.backends.cpu import jit_build
from polyspec.errors import BackendSelectionError, ConfigError, PluginError
from polyspec.hookspecs import KernelBuild
from polyspec.plugins import PluginRegistry

needs_toolchain = pytest.mark.skipif(
    sys.platform != "linux" or shutil.which(os.environ.get("CXX", "c++")) is None
    or shutil.which("ninja") is None,
    reason="needs Linux, a C++ compiler and ninja",
)  # fmt: skip

TINY_SOURCE = r"""
#include <Python.h>
#define POLYSPEC_CAT_(a, b) a##b
#define POLYSPEC_CAT(a, b) POLYSPEC_CAT_(a, b)
static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, nullptr}, {nullptr, nullptr, 0, nullptr}};
static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "tiny", nullptr, -1, methods};
PyMODINIT_FUNC POLYSPEC_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module_def); }
"""

DRIVER = """
import sys
from polyspec.backends.cpu import jit_build
result = jit_build.build_extension(
    sys.argv[1], [sys.argv[2]], label="the test kernels", duration="a moment"
)
print("ANSWER", result.module.answer()) if result.module else print("FELL BACK:", result.reason)
"""

NAME = "polyspec_test_tiny"
STARTING = "compiling the test kernels for this machine (first run only, a moment) ..."
WAITING = "waiting for another process compiling the test kernels (pid "
RUN_BOUND_S = 90  # a second run finishes well within this (a few seconds here)


class Workspace:
    """A temporary extension directory, the tiny source, and a gated compiler wrapper."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ext_dir = root / "extensions"
        self.source = root / "tiny.cpp"
        self.source.write_text(TINY_SOURCE)
        self.gate = root / "gate"
        self.gated_cxx = root / "gated-c++"
        real = shutil.which(os.environ.get("CXX", "c++"))
        # holds the compile step (-c) until the gate opens, at most 60 s; other calls pass through
        self.gated_cxx.write_text(
            "#!/bin/sh\n"
            'case " $* " in *" -c "*)\n'
            f'  touch "{self.gate}.reached"; i=0\n'
            f'  while [ ! -e "{self.gate}.open" ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done;;\n'
            "esac\n"
            f'exec "{real}" "$@"\n'
        )
        self.gated_cxx.chmod(0o755)
        self.started: list[subprocess.Popen] = []

    @property
    def build_dir(self) -> Path:
        return self.ext_dir / NAME

    def env(self, gated: bool, **extra: str) -> dict[str, str]:
        env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(self.ext_dir))
        env.update({jit_build.WAIT_ENV: "60", **extra})  # a stuck wait ends within RUN_BOUND_S
        env["CXX"] = str(self.gated_cxx) if gated else shutil.which(env.get("CXX", "c++"))
        return env

    def start(self, gated: bool, **extra: str) -> subprocess.Popen:
        """A run in its own session (so that a test can signal its whole process group)."""
        proc = subprocess.Popen(
            [sys.executable, "-c", DRIVER, NAME, str(self.source)],
            env=self.env(gated, **extra),
            stdout=subprocess.PIPE,
            stderr=(self.root / f"stderr{len(self.started)}").open("w"),
            text=True,
            start_new_session=True,
        )
        self.started.append(proc)
        return proc

    def stderr(self, proc: subprocess.Popen) -> str:
        return (self.root / f"stderr{self.started.index(proc)}").read_text()

    def wait_for(self, what, timeout: float = 60.0, proc: subprocess.Popen | None = None):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if what():
                return
            if proc is not None and proc.poll() is not None:
                break
            time.sleep(0.05)
        detail = f"\nstderr:\n{self.stderr(proc)}" if proc is not None else ""
        pytest.fail(f"timed out waiting ({timeout} s){detail}")

    def mid_build(self, proc: subprocess.Popen) -> None:
        """Wait until ``proc``'s compiler is running (torch's lock file exists by then)."""
        self.wait_for(lambda: Path(f"{self.gate}.reached").exists(), proc=proc)
        assert (self.build_dir / jit_build.TORCH_LOCK_NAME).exists()

    def finish(self, proc: subprocess.Popen) -> tuple[str, str, float]:
        """(stdout, stderr, seconds) of a run, which must end within RUN_BOUND_S."""
        start = time.monotonic()
        out, _ = proc.communicate(timeout=RUN_BOUND_S)
        return out, self.stderr(proc), time.monotonic() - start

    def cleanup(self) -> None:
        Path(f"{self.gate}.open").touch()  # lets a held compiler of a killed run exit
        for proc in self.started:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


@pytest.fixture
def ws(tmp_path):
    workspace = Workspace(tmp_path)
    yield workspace
    workspace.cleanup()


@needs_toolchain
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "sig, whole_group",
    [(signal.SIGTERM, True), (signal.SIGKILL, False)],
    ids=["SIGTERM-to-its-group", "SIGKILL-to-python-alone"],
)
def test_build_killed_midway_then_next_run_builds(ws, sig, whole_group):
    """The issue's case: a run killed mid-build leaves torch's lock file, which made every later
    run wait forever. SIGTERM to its process group (`kill %1`, a CI cancel): ninja stops its
    compiler. SIGKILL to the python process alone (the OOM killer): its compiler keeps running
    in the build directory. The next run waits for such a compiler (saying so, with its pid),
    then removes the lock file, says so, builds and loads, within a bounded time."""
    first = ws.start(gated=True)
    ws.mid_build(first)
    if whole_group:
        os.killpg(first.pid, sig)
    else:
        os.kill(first.pid, sig)
    first.wait(timeout=30)
    assert (ws.build_dir / jit_build.TORCH_LOCK_NAME).exists()  # what used to hang every run

    second = ws.start(gated=False)
    ws.wait_for(lambda: second.poll() is not None or WAITING in ws.stderr(second))
    if sig == signal.SIGKILL:
        assert WAITING in ws.stderr(second)
    if WAITING in ws.stderr(second):  # the killed run's compiler, held at the gate
        pids = ws.stderr(second).split(WAITING, 1)[1].split(", left running")[0]
        sids = set()
        for pid in pids.split(", "):
            try:
                sids.add(os.getsid(int(pid)))
            except ProcessLookupError:  # a short-lived step of that build (ninja's shell) ended
                pass
        assert sids == {first.pid}  # the gated compiler is still there, and nothing else
        assert "left running by a killed build" in ws.stderr(second)
        Path(f"{ws.gate}.open").touch()
    out, err, seconds = ws.finish(second)
    assert "ANSWER 42" in out, err
    assert "left by a build of the test kernels that was killed" in err
    assert STARTING in err and "compiled the test kernels in " in err
    assert not (ws.build_dir / jit_build.TORCH_LOCK_NAME).exists()
    assert seconds < RUN_BOUND_S


@needs_toolchain
@pytest.mark.timeout(240)
def test_waiting_for_a_live_builder_is_bounded(ws):
    """A run that finds another process compiling says so with its pid, gives up after
    POLYSPEC_CPU_BUILD_WAIT seconds and falls back; the builder is not disturbed."""
    builder = ws.start(gated=True)
    ws.mid_build(builder)

    out, err, seconds = ws.finish(ws.start(gated=False, POLYSPEC_CPU_BUILD_WAIT="1"))
    assert f"{WAITING}{builder.pid}) ..." in err
    assert f"gave up waiting for pid {builder.pid} after 1 s" in err
    assert "FELL BACK: another process" in out and jit_build.WAIT_ENV in out
    assert seconds < 30

    Path(f"{ws.gate}.open").touch()
    out, err, _ = ws.finish(builder)
    assert "ANSWER 42" in out, err
    assert STARTING in err and "compiled the test kernels in " in err


@needs_toolchain
def test_compile_error_names_the_first_error_lines(tmp_path, monkeypatch, capfd):
    """A failing compile says so with the compiler's own error line; no module, a reason."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    source = tmp_path / "broken.cpp"
    source.write_text("#include <Python.h>\nint f() { return undeclared_name; }\n")
    result = jit_build.build_extension(
        "polyspec_test_broken", [str(source)], label="the test kernels", wait_s=5
    )
    err = capfd.readouterr().err
    assert result.module is None and "undeclared_name" in result.reason
    assert "compiling the test kernels failed after" in err
    assert "broken.cpp:2" in err and "error:" in err and "undeclared_name" in err


def test_first_error_lines_skips_command_echo():
    text = (
        "Error building extension 'x': [1/2] c++ -MMD -Werror -c /src/x.cpp -o x.o\n"
        "FAILED: x.o\n"
        "c++ -MMD -c /src/x.cpp -o x.o\n"
        "/src/x.cpp:3:5: error: expected ';' before '}' token\n"
        "/src/x.cpp:9:1: error: 'y' was not declared\n"
        "ninja: build stopped: subcommand failed.\n"
    )
    assert jit_build.first_error_lines(text, count=1) == [
        "/src/x.cpp:3:5: error: expected ';' before '}' token"
    ]
    assert jit_build.first_error_lines("just one line") == ["just one line"]


def test_wait_limit_env():
    assert jit_build.wait_limit({}) == jit_build.DEFAULT_WAIT_S
    assert jit_build.wait_limit({jit_build.WAIT_ENV: " 2.5 "}) == 2.5
    assert jit_build.wait_limit({jit_build.WAIT_ENV: "0"}) == 0.0
    for bad in ("soon", "-1", "inf", "nan"):
        with pytest.raises(ConfigError, match=f"{jit_build.WAIT_ENV}='{bad}'.*>= 0"):
            jit_build.wait_limit({jit_build.WAIT_ENV: bad})


def test_build_kernels_command_reports_why_it_cannot_build(tmp_path, monkeypatch, capsys):
    """``polyspec build-kernels`` through the cpu plugin's hook: no compiler, exit 1, the
    reason and the fallback on stderr; an unknown backend is a user error."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    assert cli.main(["build-kernels", "--backend", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "polyspec: error: cpu: cannot build its kernels: no C++ compiler found" in err
    assert "stock PyTorch" in err
    assert cli.main(["build-kernels", "--backend", "no-such-backend"]) == 2
    assert "no-such-backend" in capsys.readouterr().err
    monkeypatch.setenv(jit_build.WAIT_ENV, "later")
    assert cli.main(["build-kernels", "--backend", "cpu"]) == 2
    assert f"{jit_build.WAIT_ENV}='later'" in capsys.readouterr().err


def _kernel_plugin(folder: Path, name: str, available: bool, hook: str) -> object:
    """A fake backend plugin (cpu's factory) whose polyspec_build_kernels body is ``hook``."""
    module = f"fake_kernels_{name}"
    write_plugin_module(
        folder,
        module,
        f"""
from polyspec.backend import BackendCapabilities
from polyspec.hookspecs import BackendSpec, KernelBuild, ProbeResult, hookimpl

@hookimpl
def polyspec_backend_spec():
    return BackendSpec(name={name!r}, factory="polyspec.backends.cpu.backend:CPUBackend",
                       priority=-1, capabilities=BackendCapabilities())

@hookimpl
def polyspec_backend_probe():
    return ProbeResult(available={available}, reason="" if {available} else "no device")
"""
        + (f"\n@hookimpl\ndef polyspec_build_kernels(env):\n    {hook}\n" if hook else ""),
    )
    return fake_entry_point(name, module)


def test_registry_build_kernels_calls_the_hook_of_available_backends(tmp_path, monkeypatch):
    """PluginRegistry.build_kernels: every available backend implementing the hook, or the one
    named; a backend without it is left out; a wrong return type is a plugin error."""
    monkeypatch.syspath_prepend(str(tmp_path))
    eps = [
        _kernel_plugin(tmp_path, "built", True, "return KernelBuild(True, '/k.so', env['WHO'])"),
        _kernel_plugin(tmp_path, "failing", True, "return KernelBuild(False, detail='no cc')"),
        _kernel_plugin(tmp_path, "nothing", True, ""),
        _kernel_plugin(tmp_path, "absent", False, "raise AssertionError('not available')"),
        _kernel_plugin(tmp_path, "wrong", False, "return 'built'"),
    ]
    registry = PluginRegistry(entry_points=eps, env={"WHO": "me"})
    assert registry.build_kernels() == [
        ("built", KernelBuild(True, "/k.so", "me")),
        ("failing", KernelBuild(False, detail="no cc")),
    ]
    assert registry.build_kernels("nothing") == []
    with pytest.raises(BackendSelectionError, match="'absent'.*no device"):
        registry.build_kernels("absent")
    eps[-1] = _kernel_plugin(tmp_path, "wrong2", True, "return 'built'")
    with pytest.raises(PluginError, match="'wrong2'.*returned str, expected KernelBuild"):
        PluginRegistry(entry_points=eps, env={"WHO": "me"}).build_kernels("wrong2")
    with pytest.raises(ValueError, match="needs a detail"):
        KernelBuild(False)
