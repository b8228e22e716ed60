"""Which KV slots each request owns: the allocator plus the ``req_to_token`` rows.

A request owns the slots of positions ``[0, owned_len)`` of its row; ``owned_len`` is a whole
number of pages. The engine grows a request before a forward that writes new positions
(:meth:`ensure`) and shrinks it after rejected draft tokens (:meth:`truncate`), so a slot is
owned by exactly one request or free, and finishing every request returns every slot.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from polyspec.backend import KernelSet, KVAllocator
from polyspec.errors import PolyspecError
from polyspec.runtime.req_pool import ReqToTokenPool


class OutOfKVSlots(PolyspecError):
    """Raised when the allocator cannot satisfy a request; nothing was allocated."""


class KVCacheManager:
    def __init__(self, allocator: KVAllocator, req_pool: ReqToTokenPool, kernels: KernelSet):
        self.allocator = allocator
        self.req_pool = req_pool
        self.kernels = kernels
        self.page_size = allocator.page_size
        self.owned_len: dict[int, int] = {}

    def _round_up(self, n: int) -> int:
        ps = self.page_size
        return (n + ps - 1) // ps * ps

    def add_request(self) -> int:
        row = self.req_pool.alloc()
        self.owned_len[row] = 0
        return row

    def remove_request(self, row: int) -> None:
        self.truncate([row], [0])
        del self.owned_len[row]
        self.req_pool.free(row)

    def ensure(self, rows: Sequence[int], lengths: Sequence[int]) -> None:
        """Make positions ``[0, lengths[i])`` of each row backed by slots (one allocation)."""
        grow = []
        for row, length in zip(rows, lengths):
            if length > self.req_pool.max_context:
                raise PolyspecError(
                    f"a request needs {length} positions but max_context is "
                    f"{self.req_pool.max_context}; raise max_context or shorten the request"
                )
            want = self._round_up(length) - self.owned_len[row]
            if want > 0:
                grow.append((row, want))
        if not grow:
            return
        total = sum(w for _, w in grow)
        slots = self.allocator.alloc(total)
        if slots is None:
            raise OutOfKVSlots(
                f"out of KV slots: needed {total}, {self.allocator.available} free; "
                "raise num_kv_slots or lower max_batch_size"
            )
        device = self.req_pool.req_to_token.device
        idx = self.req_pool.req_to_token.dtype
        rows_t = torch.tensor([r for r, _ in grow], dtype=idx, device=device)
        start = torch.tensor([self.owned_len[r] for r, _ in grow], dtype=idx, device=device)
        end = torch.tensor([self.owned_len[r] + w for r, w in grow], dtype=idx, device=device)
        self.kernels.assign_req_to_token(rows_t, self.req_pool.req_to_token, start, end, slots)
        for row, want in grow:
            self.owned_len[row] += want

    def truncate(self, rows: Sequence[int], lengths: Sequence[int]) -> None:
        """Free the slots of positions ``>= lengths[i]`` (page-granular) of each row."""
        freed = []
        table = self.req_pool.req_to_token
        for row, length in zip(rows, lengths):
            keep = self._round_up(length)
            owned = self.owned_len[row]
            if keep < owned:
                freed.append(table[row, keep:owned].clone())
                table[row, keep:owned] = 0
                self.owned_len[row] = keep
        if freed:
            self.allocator.free(torch.cat(freed))
