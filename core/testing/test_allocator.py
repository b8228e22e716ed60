"""Conformance: the KV slot allocator (token slots and whole pages).

Random sequences of alloc / free / backup / restore are checked against a plain Python model:
no slot leaks, no slot is handed out twice, ``available`` is exact, slot 0 never appears, and
with pages every allocation is whole, page-aligned runs of consecutive slots.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polyspec.testing.plugin import NATIVE_PAGE_SIZE, resolve_page_size

NUM_PAGES = 12


def make(backend, page_size: int | str):
    """(an allocator of NUM_PAGES pages, its page size); skips when the backend lacks the page
    size."""
    page_size = resolve_page_size(backend, page_size)
    return backend.make_allocator(NUM_PAGES * page_size, page_size), page_size


def check_slots(backend, slots: torch.Tensor, n: int, page_size: int) -> list[int]:
    """Shape, dtype, device, slot 0 and page structure of one allocation; returns the slots."""
    assert slots.shape == (n,)
    assert slots.dtype == backend.index_dtype
    assert slots.device.type == backend.device().type
    values = slots.cpu().tolist()
    assert len(set(values)) == n, "an allocation repeats a slot"
    assert all(page_size <= s < NUM_PAGES * page_size for s in values), values
    for start in range(0, n, page_size):
        page = values[start : start + page_size]
        assert page[0] % page_size == 0, f"page not aligned: {page}"
        assert page == list(range(page[0], page[0] + page_size)), f"page not consecutive: {page}"
    return values


@pytest.mark.parametrize("page_size", [1, 4, NATIVE_PAGE_SIZE])
def test_fresh_allocator(backend, page_size):
    alloc, page_size = make(backend, page_size)
    usable = (NUM_PAGES - 1) * page_size
    assert alloc.available == usable
    assert alloc.alloc(usable + page_size) is None, "over-allocation must return None"
    assert alloc.available == usable, "a failed alloc must allocate nothing"
    empty = alloc.alloc(0)
    assert empty is not None and empty.numel() == 0
    everything = check_slots(backend, alloc.alloc(usable), usable, page_size)
    assert sorted(everything) == list(range(page_size, NUM_PAGES * page_size))
    assert alloc.available == 0
    assert alloc.alloc(page_size) is None
    alloc.free(torch.tensor(everything, dtype=backend.index_dtype, device=backend.device()))
    assert alloc.available == usable


@pytest.mark.parametrize("page_size", [1, 4, NATIVE_PAGE_SIZE])
def test_host_slots_alloc_and_free_like_device_slots(backend, page_size):
    """``alloc_host``: the same allocation on the host (CPU int64), which ``free`` takes back
    as it is; mixed with ``alloc``, no slot is handed out twice."""
    alloc, page_size = make(backend, page_size)
    usable = (NUM_PAGES - 1) * page_size
    host = alloc.alloc_host(2 * page_size)
    assert (
        host.device.type == "cpu" and host.dtype == torch.int64 and host.shape == (2 * page_size,)
    )
    dev = check_slots(backend, alloc.alloc(3 * page_size), 3 * page_size, page_size)
    assert not set(host.tolist()) & set(dev), "a slot handed out twice"
    assert alloc.available == usable - 5 * page_size
    assert alloc.alloc_host(usable) is None, "over-allocation must return None"
    alloc.free(host)
    assert alloc.available == usable - 3 * page_size
    with pytest.raises(ValueError):
        alloc.free(host)  # a double free from the host is caught too
    alloc.free(torch.tensor(dev, dtype=backend.index_dtype, device=backend.device()))
    assert alloc.available == usable


@pytest.mark.parametrize("page_size", [1, 4, NATIVE_PAGE_SIZE])
def test_bad_frees_raise_and_change_nothing(backend, page_size):
    alloc, page_size = make(backend, page_size)
    idx, dev = backend.index_dtype, backend.device()
    slots = alloc.alloc(2 * page_size)
    before = alloc.available

    def bad(values: list[int]) -> None:
        with pytest.raises(ValueError):
            alloc.free(torch.tensor(values, dtype=idx, device=dev))
        assert alloc.available == before

    taken = set(slots.cpu().tolist())
    first_free = next(p for p in range(1, NUM_PAGES) if p * page_size not in taken)
    free_page = [first_free * page_size + i for i in range(page_size)]  # never handed out
    bad(free_page)
    bad(list(range(page_size)))  # the reserved slot 0 / page 0
    bad([NUM_PAGES * page_size + s for s in range(page_size)])  # out of range
    bad(slots.cpu().tolist()[:page_size] * 2)  # the same page twice in one call
    if page_size > 1:
        bad(slots.cpu().tolist()[:1])  # part of a page
    alloc.free(slots)
    with pytest.raises(ValueError):
        alloc.free(slots)  # double free
    assert alloc.available == before + 2 * page_size


@pytest.mark.parametrize("page_size", [1, 4, NATIVE_PAGE_SIZE])
def test_backup_restore(backend, page_size):
    alloc, page_size = make(backend, page_size)
    kept = alloc.alloc(3 * page_size)
    state = alloc.backup_state()
    avail = alloc.available
    scratch = alloc.alloc(4 * page_size)
    alloc.free(kept)
    alloc.restore_state(state)
    assert alloc.available == avail
    # kept is allocated again (freeing it works once), scratch is free again (double free).
    with pytest.raises(ValueError):
        alloc.free(scratch)
    alloc.free(kept)
    assert alloc.available == (NUM_PAGES - 1) * page_size


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, 5)),
        st.tuples(st.just("free"), st.integers(0, 10**6)),
        st.tuples(st.just("backup"), st.just(0)),
        st.tuples(st.just("restore"), st.just(0)),
    ),
    max_size=40,
)


@pytest.mark.parametrize("page_size", [1, 3, NATIVE_PAGE_SIZE])
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=OPS)
def test_random_sequences_match_model(backend, page_size, ops):
    """alloc n pages / free one earlier allocation / snapshot / restore, against a model."""
    alloc, page_size = make(backend, page_size)
    usable = (NUM_PAGES - 1) * page_size
    owned: list[list[int]] = []  # live allocations, as handed out
    handed_out: list[tuple[torch.Tensor, list[int]]] = []  # returned tensors must not change
    snapshot = None
    for op, arg in ops:
        in_use = {s for a in owned for s in a}
        if op == "alloc":
            n = arg * page_size
            got = alloc.alloc(n)
            if n > usable - len(in_use):
                assert got is None
            else:
                values = check_slots(backend, got, n, page_size)
                assert not in_use & set(values), "a slot was handed out twice"
                if values:
                    owned.append(values)
                    handed_out.append((got, values))
        elif op == "free" and owned:
            values = owned.pop(arg % len(owned))
            alloc.free(torch.tensor(values, dtype=backend.index_dtype, device=backend.device()))
        elif op == "backup":
            snapshot = (alloc.backup_state(), [list(a) for a in owned])
        elif op == "restore" and snapshot is not None:
            alloc.restore_state(snapshot[0])
            owned = [list(a) for a in snapshot[1]]
        assert alloc.available == usable - sum(len(a) for a in owned)
    for tensor, values in handed_out:
        assert tensor.cpu().tolist() == values, "a returned slot tensor aliases allocator state"
    # No leak: freeing everything that is live brings back every slot.
    for values in owned:
        alloc.free(torch.tensor(values, dtype=backend.index_dtype, device=backend.device()))
    assert alloc.available == usable
    assert alloc.alloc(usable) is not None
