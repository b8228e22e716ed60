"""Rows of the ``req_to_token`` table: one per running request."""

from __future__ import annotations

import torch

from polyspec.errors import PolyspecError


class ReqToTokenPool:
    """``req_to_token[row, pos]`` is the KV slot of position ``pos`` of the request in ``row``.

    Shared by the target and the draft: both models index their own KV pools with the same slots.
    Unused entries hold 0, the reserved padding slot, so a padded read never leaves the pool.
    """

    def __init__(
        self,
        max_requests: int,
        max_context: int,
        device: torch.device,
        dtype: torch.dtype,
        page_size: int = 1,
    ):
        self.max_requests = max_requests
        self.max_context = max_context
        # Requests own whole pages, so the last page of a max_context request may reach past
        # max_context: the table is as wide as max_context rounded up to whole pages.
        width = -(-max_context // page_size) * page_size
        self.req_to_token = torch.zeros(max_requests, width, dtype=dtype, device=device)
        self._free_rows = list(range(max_requests - 1, -1, -1))

    def alloc(self) -> int:
        if not self._free_rows:
            raise PolyspecError(
                f"all {self.max_requests} request rows are in use; raise max_batch_size"
            )
        return self._free_rows.pop()

    def free(self, row: int) -> None:
        if row in self._free_rows or not 0 <= row < self.max_requests:
            raise ValueError(f"request row {row} is not allocated")
        self.req_to_token[row].zero_()
        self._free_rows.append(row)

    @property
    def available(self) -> int:
        return len(self._free_rows)
