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
