"""Plugin discovery, probing and backend selection (polyspec.plugins)."""

from __future__ import annotations

import dataclasses
import textwrap
import uuid
from pathlib import Path

import pytest
from plugin_packages import (
    builtin_entry_points,
    ensure_test_plugins_installed,
    fake_entry_point,
    write_plugin_module,
)

from polyspec.backend import BACKEND_API_VERSION, Backend, KernelSet
from polyspec.config import load_config
from polyspec.errors import PolyspecError
from polyspec.kernels.reference import reference_kernels
from polyspec.plugins import (
    BackendSelectionError,
    PluginError,
    PluginRegistry,
    create_backend,
    discover,
    select_backend,
)

CLEAN_ENV: dict[str, str] = {}
"""No POLYSPEC_* variable: what a user gets with nothing configured."""


@pytest.fixture(scope="module", autouse=True)
def _test_plugins_installed() -> None:
    ensure_test_plugins_installed()


def _by_name(reports):
    return {r.name: r for r in reports}


# -- built-in backends ---------------------------------------------------------------------


def test_builtin_backends_are_discovered_through_entry_points():
    reports = _by_name(discover(env=CLEAN_ENV))
    for name in ("cpu", "cuda", "npu"):
        assert reports[name].distribution == "polyspec"
        assert reports[name].entry_point == f"{name} = polyspec.backends.{name}.plugin"
        assert reports[name].error is None
        assert reports[name].api_version == BACKEND_API_VERSION
    assert reports["cpu"].available and reports["cpu"].reason == ""
    assert reports["cpu"].priority == 0
    assert reports["cpu"].factory == "polyspec.backends.cpu.backend:CPUBackend"


def test_cuda_and_npu_are_unavailable_with_a_reason():
    reports = _by_name(discover(env=CLEAN_ENV))
    for name in ("cuda", "npu"):
        assert not reports[name].available
        assert reports[name].reason
        assert reports[name].priority > reports["cpu"].priority
    assert reports["npu"].reason.startswith("torch_npu is not installed") or (
        "not implemented in this version" in reports["npu"].reason
    )


def test_cpu_plugin_declares_the_capabilities_the_backend_has():
    from polyspec.backends.cpu.backend import CPUBackend
    from polyspec.backends.cpu.plugin import CAPABILITIES

    assert CAPABILITIES == CPUBackend().capabilities


def test_auto_detect_picks_cpu_when_no_accelerator_is_available():
    backend = create_backend(env=CLEAN_ENV)
    assert isinstance(backend, Backend)
    assert backend.name == "cpu"
    assert select_backend(env=CLEAN_ENV).name == "cpu"


def test_requesting_an_unavailable_backend_says_why_and_what_is_available():
    with pytest.raises(BackendSelectionError) as info:
        create_backend("cuda", env=CLEAN_ENV)
    msg = str(info.value)
    assert "backend 'cuda'" in msg and "unavailable" in msg
    available_now = msg.split("Available now:")[1].split(".")[0]
    assert "cpu" in [name.strip() for name in available_now.split(",")]


def test_unknown_backend_is_not_installed_error():
    with pytest.raises(BackendSelectionError, match="'nosuch'.*not installed") as info:
        create_backend("nosuch", env=CLEAN_ENV)
    assert "cpu: available" in str(info.value)


def test_cuda_factory_refuses_without_a_device():
    from polyspec.backends.cuda.plugin import make_backend as make_cuda

    with pytest.raises(NotImplementedError, match="needs a usable CUDA device"):
        make_cuda()


def test_cuda_probe_where_the_hardware_is_present(monkeypatch, tmp_path):
    from polyspec.backends.cuda import plugin as cuda

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\n")
    smi.chmod(0o755)
    monkeypatch.setattr(cuda, "torch_build_info", lambda: ("2.13.0", {"cuda": "12.8"}))
    monkeypatch.setattr(cuda, "has_module", lambda name: name == "triton")
    assert cuda.probe({"PATH": str(tmp_path)}).available
    # without triton: unavailable, and the reason says how to get it
    monkeypatch.setattr(cuda, "has_module", lambda name: False)
    result = cuda.probe({"PATH": str(tmp_path)})
    assert not result.available and "triton is not installed" in result.reason
    # the same machine with a CPU-only torch: the reason names torch, not a missing device
    monkeypatch.setattr(cuda, "has_module", lambda name: name == "triton")
    monkeypatch.setattr(cuda, "torch_build_info", lambda: ("2.13.0+cpu", {"cuda": None}))
    result = cuda.probe({"PATH": str(tmp_path)})
    assert "torch.version.cuda is None" in result.reason
    assert "no CUDA device" not in result.reason


def test_npu_probe_is_available_where_the_hardware_is_present(monkeypatch):
    from polyspec.backends.npu import plugin as npu

    monkeypatch.setattr(npu, "has_module", lambda name: name == "torch_npu")
    monkeypatch.setattr(npu, "device_nodes", lambda pattern: ["/dev/davinci0"])
    monkeypatch.setattr(npu, "torch_build_info", lambda: ("2.10.0", {"cuda": None}))
    monkeypatch.setattr(npu, "_version", lambda dist: "2.10.0.post4")
    result = npu.probe({"ASCEND_HOME_PATH": "/usr/local/Ascend/ascend-toolkit/latest"})
    assert result.available, result.reason
    # a torch_npu older than the graph task-group API is reported, with the install line
    monkeypatch.setattr(npu, "_version", lambda dist: "2.5.1")
    result = npu.probe({"ASCEND_HOME_PATH": "/usr/local/Ascend/ascend-toolkit/latest"})
    assert not result.available and "torch_npu 2.5.1 is older than 2.10.0" in result.reason
    monkeypatch.setattr(npu, "_version", lambda dist: "2.10.0.post4")
    monkeypatch.setattr(npu, "has_module", lambda name: False)
    result = npu.probe({"ASCEND_HOME_PATH": "/x"})
    assert result.reason.startswith("torch_npu is not installed")


# -- the out-of-tree example plugins (pip-installed) -----------------------------------------


def test_example_plugin_is_discovered_from_its_distribution():
    reports = _by_name(discover(env=CLEAN_ENV))
    example = reports["example"]
    assert example.distribution == "polyspec-example-backend"
    assert example.version == "0.1.0"
    assert example.available and example.priority < 0
    cpu = dict(reports["cpu"].capabilities, weight_quantization=[])
    assert example.capabilities == cpu  # the cpu backend's, without quantized draft weights


def test_example_plugin_is_never_auto_detected():
    assert select_backend(env=CLEAN_ENV).name == "cpu"


def test_example_plugin_is_selectable_by_env():
    backend = create_backend(env={"POLYSPEC_BACKEND": "example"})
    assert backend.name == "example"
    # the KernelSet override pattern: one kernel replaced, the rest the reference's
    reference = reference_kernels()
    assert backend.kernels.silu_and_mul is not reference.silu_and_mul
    same = [n for n in KernelSet.names() if n != "silu_and_mul"]
    assert all(getattr(backend.kernels, n) is getattr(reference, n) for n in same)


def test_example_kernel_override_matches_the_reference():
    import torch

    backend = create_backend("example", env=CLEAN_ENV)
    x = torch.randn(5, 8)
    torch.testing.assert_close(backend.kernels.silu_and_mul(x), reference_kernels().silu_and_mul(x))


def test_example_plugin_is_selectable_by_config_file(tmp_path):
    path = tmp_path / "polyspec.toml"
    path.write_text('backend = "example"\n')
    engine, _ = load_config(config_file=path, env={"POLYSPEC_BACKEND": "cpu"})
    assert engine.backend == "example"  # the config file beats POLYSPEC_BACKEND
    assert create_backend(engine.backend, env={"POLYSPEC_BACKEND": "cpu"}).name == "example"


def test_explicit_name_beats_env():
    assert create_backend("cpu", env={"POLYSPEC_BACKEND": "example"}).name == "cpu"


def test_broken_plugin_is_reported_and_skipped():
    reports = _by_name(discover(env=CLEAN_ENV))
    broken = reports["broken"]
    assert broken.status == "error" and not broken.available
    for part in ("polyspec-broken-backend", "0.1.0", "broken = polyspec_broken_backend.plugin"):
        assert part in broken.error
    assert "RuntimeError" in broken.error and "broken on purpose" in broken.error
    assert reports["cpu"].available  # discovery carried on


def test_broken_plugin_is_fatal_when_requested():
    with pytest.raises(PluginError, match="broken on purpose") as info:
        create_backend("broken", env=CLEAN_ENV)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_broken_plugin_is_fatal_when_strict():
    with pytest.raises(PluginError, match="polyspec-broken-backend 0.1.0"):
        discover(env={"POLYSPEC_STRICT_PLUGINS": "1"})


def test_allow_list_skips_unlisted_plugins():
    env = {"POLYSPEC_PLUGINS": "cpu,example"}
    reports = _by_name(discover(env=env))
    assert reports["example"].available
    assert reports["broken"].status == "skipped" and reports["broken"].error is None
    assert "POLYSPEC_PLUGINS" in reports["cuda"].reason
    with pytest.raises(BackendSelectionError, match="POLYSPEC_PLUGINS"):
        create_backend("cuda", env=env)
    # strict mode does not fail on a plugin that was never loaded
    assert discover(env={**env, "POLYSPEC_STRICT_PLUGINS": "1"})


def test_disabling_autoload_keeps_builtins_and_requested_plugins():
    env = {"POLYSPEC_DISABLE_PLUGIN_AUTOLOAD": "1"}
    reports = _by_name(discover(env=env))
    assert reports["cpu"].available and reports["cuda"].status == "unavailable"
    assert reports["example"].status == "skipped"
    assert reports["broken"].status == "skipped"
    assert create_backend("example", env=env).name == "example"
    listed = _by_name(discover(env={**env, "POLYSPEC_PLUGINS": "cpu,example"}))
    assert listed["example"].available


# -- fake plugins from entry points no distribution declares -------------------------------


@pytest.fixture
def plugin_dir(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _fake_plugin(
    folder: Path,
    name: str,
    *,
    priority: int = 50,
    available: bool = True,
    api_version: int = BACKEND_API_VERSION,
    spec_name: str | None = None,
    factory: str | None = None,
    extra: str = "",
):
    """Write a plugin module whose backend is the cpu one renamed; return its entry point."""
    module = f"fake_plugin_{name}_{uuid.uuid4().hex[:8]}"
    factory = factory or f"{module}:FakeBackend"
    write_plugin_module(
        folder,
        module,
        textwrap.dedent(f"""
        from polyspec.backend import BackendCapabilities
        from polyspec.backends.cpu.backend import CPUBackend
        from polyspec.hookspecs import BackendSpec, ProbeResult, hookimpl

        class FakeBackend(CPUBackend):
            name = {name!r}

        @hookimpl
        def polyspec_backend_spec():
            return BackendSpec(name={spec_name or name!r}, factory={factory!r},
                               priority={priority}, capabilities=BackendCapabilities(),
                               api_version={api_version})

        @hookimpl
        def polyspec_backend_probe():
            return ProbeResult(available={available}, reason="" if {available} else "no device")
        """)
        + extra,
    )
    return fake_entry_point(name, module)


def test_highest_priority_available_backend_wins(plugin_dir):
    eps = builtin_entry_points() + [
        _fake_plugin(plugin_dir, "acc1", priority=50),
        _fake_plugin(plugin_dir, "acc2", priority=60, available=False),
        _fake_plugin(plugin_dir, "acc3", priority=40),
    ]
    registry = PluginRegistry(entry_points=eps, env=CLEAN_ENV)
    assert registry.select().name == "acc1"
    assert registry.create_backend().name == "acc1"


def test_two_accelerators_at_the_same_priority_is_an_error_naming_both(plugin_dir):
    eps = builtin_entry_points() + [
        _fake_plugin(plugin_dir, "accA", priority=70),
        _fake_plugin(plugin_dir, "accB", priority=70),
    ]
    registry = PluginRegistry(entry_points=eps, env=CLEAN_ENV)
    with pytest.raises(BackendSelectionError, match="'accA' and 'accB'.*priority 70"):
        registry.select()
    # naming one resolves it
    assert PluginRegistry(eps, env={"POLYSPEC_BACKEND": "accB"}).select().name == "accB"


@pytest.mark.parametrize("name,version", [("future", BACKEND_API_VERSION + 1), ("older", 4)])
def test_other_api_version_is_refused_naming_both_versions(plugin_dir, name, version):
    # version 1 had capabilities and kernels the engine never used; version 2 had no notion
    # of ranks (distributed_backend, graph_collectives, Backend.bind_local_rank / device_count)
    # and no apply_token_bitmask (structured output); version 3 had no argmax kernel (greedy
    # tokens came from torch's reduction, whatever the backend); version 4 had no
    # draft_layer_input or assign_block_cache_locs kernel, and its softmax_topk took no
    # index_map
    assert BACKEND_API_VERSION == 5
    ep = _fake_plugin(plugin_dir, name, api_version=version)
    registry = PluginRegistry(entry_points=builtin_entry_points() + [ep], env=CLEAN_ENV)
    report = _by_name(registry.discover())[name]
    assert report.status == "error"
    assert f"version {version}" in report.error
    assert f"version {BACKEND_API_VERSION}" in report.error
    with pytest.raises(PluginError, match=f"API version {version}"):
        registry.create_backend(name)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"spec_name": "other"}, "declares backend name 'other'"),
        ({"factory": "no_colon_here"}, "is not of the form"),
        (
            {"extra": "@hookimpl\ndef polyspec_backend_probe_typo():\n    pass\n"},
            "unknown hook",
        ),
    ],
)
def test_invalid_plugins_are_reported_not_fatal(plugin_dir, kwargs, expected):
    ep = _fake_plugin(plugin_dir, "odd", **kwargs)
    registry = PluginRegistry(entry_points=builtin_entry_points() + [ep], env=CLEAN_ENV)
    reports = _by_name(registry.discover())
    assert reports["odd"].status == "error"
    assert expected in reports["odd"].error
    assert reports["cpu"].available


def test_probe_that_raises_is_reported(plugin_dir):
    module = f"fake_raising_{uuid.uuid4().hex[:8]}"
    write_plugin_module(
        plugin_dir,
        module,
        """
        from polyspec.backend import BackendCapabilities
        from polyspec.hookspecs import BackendSpec, hookimpl

        @hookimpl
        def polyspec_backend_spec():
            return BackendSpec(name="raiser", factory="x:y", priority=1,
                               capabilities=BackendCapabilities())

        @hookimpl
        def polyspec_backend_probe(env):
            raise OSError("device query failed")
        """,
    )
    ep = fake_entry_point("raiser", module)
    registry = PluginRegistry(entry_points=[ep], env=CLEAN_ENV)
    (report,) = registry.discover()
    assert "raised in polyspec_backend_probe" in report.error and "OSError" in report.error
    with pytest.raises(BackendSelectionError, match="no backend is available"):
        registry.select()


def test_name_conflict_between_plugins_is_reported(plugin_dir):
    eps = [_fake_plugin(plugin_dir, "twin"), _fake_plugin(plugin_dir, "twin")]
    registry = PluginRegistry(entry_points=eps, env=CLEAN_ENV)
    (report,) = registry.discover()
    assert "provided by 2 plugins" in report.error
    with pytest.raises(PluginError, match="uninstall all but one"):
        registry.create_backend("twin")


def test_factory_failures_are_plugin_errors(plugin_dir):
    bad_return = _fake_plugin(plugin_dir, "notabackend", factory="builtins:dict", priority=-1)
    missing = _fake_plugin(plugin_dir, "missing", factory="no_such_module_xyz:F", priority=-1)
    registry = PluginRegistry(entry_points=[bad_return, missing], env=CLEAN_ENV)
    with pytest.raises(PluginError, match="not a polyspec.backend.Backend"):
        registry.create_backend("notabackend")
    with pytest.raises(PluginError, match="cannot import its factory"):
        registry.create_backend("missing")


def test_errors_are_polyspec_errors_and_reports_serialise():
    assert issubclass(BackendSelectionError, PolyspecError)
    assert issubclass(PluginError, PolyspecError)
    report = _by_name(discover(env=CLEAN_ENV))["cpu"]
    data = report.to_dict()
    assert data["status"] == "available"
    assert data == {**dataclasses.asdict(report), "status": "available"}


def test_a_namesake_never_shadows_a_builtin_backend(plugin_dir):
    """A third-party plugin also called 'cpu' is reported as ignored; the built-in cpu backend
    is still selected, by name, by auto-detection and with third-party autoload off."""
    from polyspec.backends.cpu.backend import CPUBackend

    shadow = _fake_plugin(plugin_dir, "cpu", priority=-1)
    for env in (CLEAN_ENV, {"POLYSPEC_DISABLE_PLUGIN_AUTOLOAD": "1"}, {"POLYSPEC_BACKEND": "cpu"}):
        registry = PluginRegistry(entry_points=[shadow, *builtin_entry_points()], env=env)
        for name in ("cpu", None):
            backend = registry.create_backend(name)
            assert type(backend) is CPUBackend
        reports = [r for r in registry.discover() if r.name == "cpu"]
        assert [r.distribution for r in reports] == ["polyspec", "?"]
        assert reports[0].available and reports[0].error is None
        assert "built-in backend 'cpu'" in reports[1].error and "ignored" in reports[1].error


def test_a_misspelled_plugin_allow_list_is_named():
    registry = PluginRegistry(entry_points=builtin_entry_points(), env={"POLYSPEC_PLUGINS": "cpux"})
    with pytest.raises(BackendSelectionError, match=r"POLYSPEC_PLUGINS names 'cpux' \(did you"):
        registry.create_backend()
