"""The cuda backend plugin on a machine without a GPU: cheap probe, honest factory, and the
pieces of the backend that can be checked without CUDA."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from polyspec.backend import Backend, GraphRunner


def _fake_smi(tmp_path) -> str:
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\n")
    smi.chmod(0o755)
    return str(tmp_path)


def test_probe_is_available_with_hardware_cuda_torch_and_triton(monkeypatch, tmp_path):
    from polyspec.backends.cuda import plugin

    path = _fake_smi(tmp_path)
    monkeypatch.setattr(plugin, "torch_build_info", lambda: ("2.11.0", {"cuda": "13.0"}))
    monkeypatch.setattr(plugin, "has_module", lambda name: True)
    assert plugin.probe({"PATH": path}).available
    monkeypatch.setattr(plugin, "has_module", lambda name: name != "triton")
    result = plugin.probe({"PATH": path})
    assert not result.available and "triton is not installed" in result.reason


def test_probe_and_plugin_import_initialise_nothing():
    code = (
        "import sys, torch; from polyspec.backends.cuda import plugin; "
        "plugin.probe({'PATH': ''}); "
        "assert 'triton' not in sys.modules, 'triton imported'; "
        "assert not torch.cuda.is_initialized(), 'CUDA initialised'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA"
)
def test_factory_refuses_without_a_cuda_device():
    from polyspec.backends.cuda.plugin import make_backend

    with pytest.raises(NotImplementedError, match="needs a usable CUDA device"):
        make_backend()


def test_declared_capabilities_are_the_backends():
    from polyspec.backends.cuda.backend import CUDA_CAPABILITIES, CUDABackend
    from polyspec.backends.cuda.graph import CUDAGraphRunner
    from polyspec.backends.cuda.plugin import CAPABILITIES

    assert CUDA_CAPABILITIES is CAPABILITIES
    assert CAPABILITIES.graph_capture and CAPABILITIES.tree_attention
    assert CAPABILITIES.page_sizes is None and CAPABILITIES.async_host_reads
    assert issubclass(CUDABackend, Backend) and CUDABackend.name == "cuda"
    assert issubclass(CUDAGraphRunner, GraphRunner)
    with pytest.raises(ValueError, match="warmup_iters"):
        CUDAGraphRunner(torch.device("cuda"), warmup_iters=0)


def test_rotary_in_store_is_on_unless_0_and_rejects_other_values(monkeypatch):
    """``POLYSPEC_CUDA_ROTARY_IN_STORE``: on unless "0"; any other value names the choices."""
    from polyspec.backends.cuda.backend import _rotary_in_store

    monkeypatch.delenv("POLYSPEC_CUDA_ROTARY_IN_STORE", raising=False)
    assert _rotary_in_store() is True
    for value, on in (("0", False), (" 0 ", False), ("1", True), ("", True)):
        monkeypatch.setenv("POLYSPEC_CUDA_ROTARY_IN_STORE", value)
        assert _rotary_in_store() is on, value
    monkeypatch.setenv("POLYSPEC_CUDA_ROTARY_IN_STORE", "yes")
    with pytest.raises(ValueError, match="POLYSPEC_CUDA_ROTARY_IN_STORE='yes'.*'1'.*'0'"):
        _rotary_in_store()
