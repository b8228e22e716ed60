"""pytest plugin (entry point ``pytest11``): the ``--polyspec-backend`` option and fixtures."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("polyspec")
    group.addoption(
        "--polyspec-backend",
        action="store",
        default=None,
        help="backend the polyspec conformance suite runs against (default: cpu, or "
        "$POLYSPEC_BACKEND)",
    )
    group.addoption(
        "--polyspec-world-size",
        action="store",
        type=int,
        default=1,
        help="ranks the distributed conformance tests (test_distributed.py) run on, as real "
        "torch.distributed processes over the backend's declared distributed_backend; 1 (the "
        "default) skips them",
    )
    group.addoption(
        "--polyspec-npu-sim",
        action="store_true",
        default=False,
        help="install polyspec's torch_npu simulator (polyspec.backends.npu.sim) as torch_npu / "
        "torch.npu for the session, so that --polyspec-backend npu runs on the CPU",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--polyspec-npu-sim", default=False):
        from polyspec.backends.npu.sim import simulated

        context = simulated()
        context.__enter__()
        config._polyspec_npu_sim = context  # type: ignore[attr-defined]


def pytest_unconfigure(config: pytest.Config) -> None:
    context = getattr(config, "_polyspec_npu_sim", None)
    if context is not None:
        context.__exit__(None, None, None)


@pytest.fixture(scope="session")
def backend_name(request: pytest.FixtureRequest) -> str:
    import os

    return request.config.getoption("--polyspec-backend") or os.environ.get(
        "POLYSPEC_BACKEND", "cpu"
    )


@pytest.fixture(scope="session")
def backend(backend_name: str):
    """The backend under test, created through plugin discovery."""
    from polyspec.plugins import create_backend

    return create_backend(backend_name)


@pytest.fixture(scope="session")
def reference_backend():
    """The cpu reference backend: the oracle every backend is compared against."""
    from polyspec.backends.cpu.backend import CPUBackend

    return CPUBackend()


def require(condition: bool, capability: str) -> None:
    """Skip the calling test unless ``condition``; the reason names the missing capability."""
    if not condition:
        pytest.skip(f"backend lacks capability: {capability}")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory):
    """A tiny random Llama target and drafts for it, written in the real formats:
    ``target``, ``eagle`` (EAGLE-1, pytorch_model.bin), ``eagle3`` (SpecForge safetensors),
    ``standalone`` (a smaller random LM of the same vocabulary). No downloads."""
    from polyspec.testing import builders

    root = tmp_path_factory.mktemp("tiny")
    target = builders.build_tiny_target(root / "target", seed=0)
    return {
        "target": target,
        "eagle": builders.build_tiny_eagle(root / "eagle", target, seed=1),
        "eagle3": builders.build_tiny_eagle3(root / "eagle3", target, seed=2),
        "standalone": builders.build_tiny_standalone(root / "standalone", target, seed=3),
    }


NATIVE_PAGE_SIZE = "native"
"""Page-size grid entry: the backend's own page size when it supports neither 1 nor 16."""

_GRID_PAGE_SIZES = (1, 16)


def default_page_size(backend) -> int:
    """The page size for tests that do not test paging: 1 where supported, else the backend's
    smallest supported page size (128 on Ascend-shaped backends)."""
    sizes = backend.capabilities.page_sizes
    return 1 if sizes is None or 1 in sizes else min(sizes)


def resolve_page_size(backend, page_size: int | str) -> int:
    """A page-size grid entry for ``backend``: an int is used as is (skipped by capability when
    unsupported); :data:`NATIVE_PAGE_SIZE` is the backend's smallest supported page size outside
    the 1 / 16 grid, skipped when the backend supports every size (the grid already covers it)."""
    if page_size != NATIVE_PAGE_SIZE:
        require(backend.capabilities.supports_page_size(int(page_size)), f"page_size {page_size}")
        return int(page_size)
    sizes = backend.capabilities.page_sizes
    others = sorted(s for s in sizes or () if s not in _GRID_PAGE_SIZES)
    if not others:
        pytest.skip(
            f"page_size native: the backend's page sizes ({'any' if sizes is None else list(sizes)}) "
            f"are covered by the page_size 1 / 16 cases"
        )
    return others[0]
