"""Triton kernel tests: run on the CPU through Triton's interpreter unless a device is named.

``POLYSPEC_TRITON_DEVICE=cuda`` (ci/device_cuda.sh) runs the same tests compiled on that device;
otherwise ``TRITON_INTERPRET=1`` is set here, before any Triton kernel is defined (``@triton.jit``
picks the interpreter when the decorated module is imported).
"""

from __future__ import annotations

import os

import pytest

if not os.environ.get("POLYSPEC_TRITON_DEVICE"):
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def triton_device() -> str:
    """The torch device the Triton kernels run on ("cpu" under the interpreter)."""
    return os.environ.get("POLYSPEC_TRITON_DEVICE") or "cpu"
