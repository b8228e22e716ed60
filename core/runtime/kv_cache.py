"""Which KV slots each request owns: the allocator plus the ``req_to_token`` rows.

A request owns the slots of positions ``[0, owned_len)`` of its row; ``owned_len`` is a whole
number of pages. The engine grows a request before a forward that writes new positions
(:meth:`ensure`, optionally some positions ahead, within what the scheduler reserved for the
request) and may shrink it (:meth:`truncate`), so a slot is owned by exactly one request or
free, and finishing every request returns every slot.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from polyspec.backend import KernelSet, KVAllocator
from polyspec.errors import PolyspecError
from polyspec.runtime.req_pool import ReqToTokenPool


class OutOfKVSlots(PolyspecError):
    """Raised when the allocator cannot satisfy a request; nothing was allocated."""


class KVCacheManager:
    def __init__(
        self,
        allocator: KVAllocator,
        req_pool: ReqToTokenPool,
        kernels: KernelSet,
        host_tensor: Callable[[list[int], torch.dtype], torch.Tensor] | None = None,
    ):
        """``host_tensor(values, dtype)``: how host integers reach the device (a backend's
        :meth:`~polyspec.backend.Backend.host_tensor`, which need not wait for queued device
        work); default ``torch.tensor`` on the request table's device."""
        self.allocator = allocator
        self.req_pool = req_pool
        self.kernels = kernels
        device = req_pool.req_to_token.device
        self._host_tensor = host_tensor or (
            lambda values, dtype: torch.tensor(values, dtype=dtype, device=device)
        )
        self.page_size = allocator.page_size
        self.owned_len: dict[int, int] = {}
        # each row's slots of positions [0, owned_len), on the host (int64 chunks, one per
        # growth): freed from here, never read back from the device table (that read would
        # wait for the queued rounds)
        self._host_slots: dict[int, list[torch.Tensor]] = {}
        # positions a row may come to own by growing ahead of need (its reservation; 0: none)
        self.reserved_len: dict[int, int] = {}

    def _round_up(self, n: int) -> int:
        ps = self.page_size
        return (n + ps - 1) // ps * ps

    def add_request(self, reserved: int | None = None) -> int:
        """A row for a new request. ``reserved``: the slots the scheduler set aside for it (its
        peak need); :meth:`ensure` may allocate ahead up to that many positions. None: only
        what each ensure asks for."""
        row = self.req_pool.alloc()
        self.owned_len[row] = 0
        self._host_slots[row] = []
        width = self.req_pool.req_to_token.shape[1]
        ps = self.page_size
        self.reserved_len[row] = 0 if reserved is None else min(reserved // ps * ps, width)
        return row

    def remove_request(self, row: int) -> None:
        self.truncate([row], [0])
        del self.owned_len[row]
        del self.reserved_len[row]
        del self._host_slots[row]
        self.req_pool.free(row)

    def ensure(self, rows: Sequence[int], lengths: Sequence[int], ahead: int = 0) -> None:
        """Make positions ``[0, lengths[i])`` of each row backed by slots (one allocation).

        ``ahead``: a row that has to grow grows by up to this many positions more, within its
        reservation (:meth:`add_request`), so that the next calls find their positions
        backed: decode rounds then allocate once every several rounds, not every round."""
        grow = []
        for row, length in zip(rows, lengths):
            if length > self.req_pool.max_context:
                raise PolyspecError(
                    f"a request needs {length} positions but max_context is "
                    f"{self.req_pool.max_context}; raise max_context or shorten the request"
                )
            need = self._round_up(length)
            if need <= self.owned_len[row]:
                continue
            target = max(need, min(self._round_up(length + ahead), self.reserved_len[row]))
            grow.append((row, target - self.owned_len[row]))
        if not grow:
            return
        total = sum(w for _, w in grow)
        slots = self.allocator.alloc_host(total)  # [total] host int64
        if slots is None:
            raise OutOfKVSlots(
                f"out of KV slots: needed {total}, {self.allocator.available} free; "
                "raise num_kv_slots or lower max_batch_size"
            )
        # rows, starts, ends and the slots in one upload
        values = [r for r, _ in grow] + [self.owned_len[r] for r, _ in grow]
        values += [self.owned_len[r] + w for r, w in grow]
        table = self.req_pool.req_to_token
        values += slots.tolist()
        uploaded = self._host_tensor(values, table.dtype)
        n = 3 * len(grow)
        rows_t, start, end = uploaded[:n].view(3, len(grow))
        self.kernels.assign_req_to_token(rows_t, table, start, end, uploaded[n:])
        at = 0
        for row, want in grow:
            self.owned_len[row] += want
            self._host_slots[row].append(slots[at : at + want])
            at += want

    def truncate(self, rows: Sequence[int], lengths: Sequence[int]) -> None:
        """Free the slots of positions ``>= lengths[i]`` (page-granular) of each row."""
        freed = []
        table = self.req_pool.req_to_token
        for row, length in zip(rows, lengths):
            keep = self._round_up(length)
            owned = self.owned_len[row]
            if keep < owned:
                held = torch.cat(self._host_slots[row])
                freed.append(held[keep:owned])
                self._host_slots[row] = [held[:keep]] if keep else []
                table[row, keep:owned] = 0
                self.owned_len[row] = keep
        if freed:
            self.allocator.free(torch.cat(freed))
