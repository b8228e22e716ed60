"""Conformance, distributed part: tensor parallelism on the backend under test, with real
``torch.distributed`` processes (``--polyspec-world-size N``; skipped at the default 1).

- the backend's declared collectives (``BackendCapabilities.distributed_backend``) sum, gather
  and broadcast correctly on its devices;
- a sharded target's forward gives the whole model's logits (each rank holding only its part);
- speculative greedy decoding under tensor parallelism gives the unsharded plain engine's
  tokens, with requests joining and leaving a batch.
"""

from __future__ import annotations

import pytest

from polyspec.testing.plugin import default_page_size, require
from polyspec.testing.ranks import run_ranks

CASES = "polyspec.testing.distributed_cases"


@pytest.fixture(scope="module")
def world_size(request: pytest.FixtureRequest, backend) -> int:
    n = int(request.config.getoption("--polyspec-world-size") or 1)
    if n < 2:
        pytest.skip("distributed conformance: pass --polyspec-world-size 2 (or more)")
    require(backend.capabilities.distributed_backend is not None, "distributed_backend")
    devices = backend.device_count()
    if devices is not None and devices < n:
        pytest.skip(f"{n} ranks need {n} devices; backend {backend.name!r} sees {devices}")
    return n


def test_declared_collectives_are_correct(world_size, backend_name):
    run_ranks(f"{CASES}:collectives", world_size, backend_name)


def test_sharded_forward_equals_unsharded(world_size, backend_name, tiny_models):
    run_ranks(f"{CASES}:sharded_forward", world_size, backend_name, (str(tiny_models["target"]),))


def test_spec_equals_plain_under_tensor_parallel(world_size, backend, backend_name, tiny_models):
    topk = 2 if backend.capabilities.tree_attention else 1
    page = 16 if backend.capabilities.supports_page_size(16) else default_page_size(backend)
    args = (str(tiny_models["target"]), str(tiny_models["eagle3"]), "eagle3", topk, page)
    run_ranks(f"{CASES}:spec_equals_plain", world_size, backend_name, args)
