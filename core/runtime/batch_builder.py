"""Builds :class:`ForwardBatch` objects for each mode from host-side request bookkeeping.

Host lists (``rows``, ``prefix_lens``, ``extend_lens``) are the engine's own counters; the
tensors built here are what the backend sees. Slots of new tokens are read from
``req_to_token``, so :meth:`KVCacheManager.ensure` must have run first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from polyspec.backend import Backend, ForwardBatch, ForwardMode
from polyspec.runtime.req_pool import ReqToTokenPool


class BatchBuilder:
    def __init__(self, backend: Backend, req_pool: ReqToTokenPool):
        self.backend = backend
        self.req_pool = req_pool
        self.device = backend.device()
        self.index_dtype = backend.index_dtype

    def index(self, values: Sequence[int]) -> torch.Tensor:
        """Host ints -> device tensor in the backend's index dtype (no stream sync)."""
        return self.backend.host_tensor(list(values), self.index_dtype)

    def long(self, values: Sequence[int]) -> torch.Tensor:
        """Host ints -> int64 device tensor (no stream sync)."""
        return self.backend.host_tensor(list(values), torch.int64)

    def slots(self, rows: Sequence[int], start: Sequence[int], end: Sequence[int]) -> torch.Tensor:
        """Slots of positions ``[start[i], end[i])`` of each row, concatenated."""
        if len(rows) == 1:  # the common batch-1 case: a view, no kernel launch
            return self.req_pool.req_to_token[rows[0], start[0] : end[0]]
        total = sum(e - s for s, e in zip(start, end))
        out = torch.empty(total, dtype=self.index_dtype, device=self.device)
        self.backend.kernels.assign_extend_cache_locs(
            self.index(rows), self.req_pool.req_to_token, self.index(start), self.index(end), out
        )
        return out

    def extend_positions(
        self, prefix_lens: Sequence[int], extend_lens: Sequence[int]
    ) -> torch.Tensor:
        if len(prefix_lens) == 1:
            p = prefix_lens[0]
            return torch.arange(p, p + extend_lens[0], dtype=torch.int64, device=self.device)
        return torch.cat(
            [
                torch.arange(p, p + n, dtype=torch.int64, device=self.device)
                for p, n in zip(prefix_lens, extend_lens)
            ]
        )

    def build(
        self,
        mode: ForwardMode,
        rows: Sequence[int],
        prefix_lens: Sequence[int],
        extend_lens: Sequence[int],
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor | None = None,  # [T]; default prefix + arange(extend)
        out_cache_loc: torch.Tensor | None = None,  # [T]; default req_to_token segments
        **extra,
    ) -> ForwardBatch:
        """A batch whose new tokens of request i occupy positions
        ``[prefix_lens[i], prefix_lens[i] + extend_lens[i])`` of its row."""
        if positions is None:
            positions = self.extend_positions(prefix_lens, extend_lens)
        if out_cache_loc is None:
            out_cache_loc = self.slots(
                rows, prefix_lens, [p + n for p, n in zip(prefix_lens, extend_lens)]
            )
        batch = ForwardBatch(
            mode=mode,
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=out_cache_loc,
            req_pool_indices=self.index(rows),
            req_to_token=self.req_pool.req_to_token,
            prefix_lens=self.index(prefix_lens),
            extend_lens=self.index(extend_lens),
            **extra,
        )
        # The engine knows the lengths on the host anyway: always passing them spares every
        # backend a device-to-host sync (and host_seq_lens backends require them).
        batch.prefix_lens_cpu = list(prefix_lens)
        batch.extend_lens_cpu = list(extend_lens)
        return batch
