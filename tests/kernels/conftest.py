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


def _record_launches(path: str) -> None:
    """Record every Triton kernel launch the tests make under the interpreter (the kernel, its
    argument types, constexpr values and launch options), for ``ci/check_triton_compile.py``,
    which compiles each one for a GPU. One JSON file per process: ``path`` (``path.<worker>``
    under pytest-xdist), written when the process ends."""
    import atexit
    import inspect
    import json

    import torch
    from triton.runtime.interpreter import InterpretedFunction

    pointer = {
        torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16",
        torch.int64: "*i64", torch.int32: "*i32", torch.int16: "*i16", torch.int8: "*i8",
        torch.uint8: "*u8", torch.bool: "*i1",
    }  # fmt: skip
    seen: dict[str, dict] = {}
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        params = inspect.signature(self.fn).parameters
        given = dict(zip(params, args), **{k: v for k, v in kwargs.items() if k in params})
        signature, constexprs = {}, {}
        for name, param in params.items():
            value = given.get(name, param.default)
            if "constexpr" in str(param.annotation) or value is None:
                signature[name], constexprs[name] = "constexpr", value
            elif isinstance(value, torch.Tensor):
                signature[name] = pointer[value.dtype]
            elif isinstance(value, bool):
                signature[name] = "i1"
            elif isinstance(value, int):
                signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            elif isinstance(value, float):
                signature[name] = "fp32"
            else:
                raise TypeError(f"record: {self.fn.__name__}.{name} is a {type(value).__name__}")
        spec = {
            "module": self.fn.__module__,
            "kernel": self.fn.__qualname__,
            "signature": signature,
            "constexprs": constexprs,
            "options": {k: v for k, v in kwargs.items() if k not in params},
        }
        seen.setdefault(json.dumps(spec, sort_keys=True), spec)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    out = f"{path}.{worker}" if worker else path

    def write() -> None:
        with open(out, "w") as f:
            json.dump(list(seen.values()), f, indent=0)

    atexit.register(write)


if os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("POLYSPEC_TRITON_RECORD"):
    _record_launches(os.environ["POLYSPEC_TRITON_RECORD"])
