"""KV slot allocator shared by the backends: token slots (``page_size == 1``) and whole pages.

Both cases are one allocator over *pages* (a token slot is a page of size 1). The free pages
live in a preallocated tensor used as a stack, so ``alloc`` and ``free`` cost O(n) in the
number of pages they touch, never O(num_slots): they run every decode round.
"""

from __future__ import annotations

import dataclasses

import torch

from polyspec.backend import KVAllocator


@dataclasses.dataclass(frozen=True)
class _AllocatorState:
    """Snapshot taken by :meth:`PagedAllocator.backup_state` (the free pages, in stack order)."""

    free_pages: torch.Tensor  # [num_free_pages] int64


class PagedAllocator(KVAllocator):
    """Hands out slots in whole pages of ``page_size`` consecutive slots; page 0 is reserved.

    ``page_size == 1`` is the token-slot allocator. Allocated pages are tracked in a bool
    tensor so that double frees and frees of slots never handed out raise ``ValueError``
    before any state changes.
    """

    def __init__(
        self,
        num_slots: int,
        page_size: int = 1,
        device: torch.device | str = "cpu",
        index_dtype: torch.dtype = torch.int64,
    ) -> None:
        """``num_slots`` must be a multiple of ``page_size`` and leave at least one page
        besides the reserved page 0."""
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_slots % page_size != 0:
            raise ValueError(
                f"num_slots ({num_slots}) must be a multiple of page_size ({page_size}); "
                f"round it down to {num_slots - num_slots % page_size}"
            )
        if num_slots // page_size < 2:
            raise ValueError(
                f"num_slots ({num_slots}) leaves no usable page: page 0 is reserved, so at "
                f"least 2 * page_size = {2 * page_size} slots are needed"
            )
        self.num_slots = num_slots
        self.page_size = page_size
        self.device = torch.device(device)
        self.index_dtype = index_dtype
        self.num_pages = num_slots // page_size
        # Stack of free pages: entries [0, _top) are free; the top of the stack is handed out
        # first. Stored in descending order so that a fresh allocator hands out 1, 2, 3, ...
        self._stack = torch.arange(self.num_pages - 1, 0, -1, dtype=torch.int64)  # [num_pages-1]
        self._top = self.num_pages - 1
        self._allocated = torch.zeros(self.num_pages, dtype=torch.bool)  # [num_pages]
        self._page_offsets = torch.arange(page_size, dtype=torch.int64)  # [page_size]

    @property
    def available(self) -> int:
        """Exact number of free slots (``page_size`` times free pages)."""
        return self._top * self.page_size

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """``num_tokens`` slots [num_tokens] (whole pages, each page's slots consecutive and
        page-aligned), or None when not enough are free (nothing is allocated then)."""
        slots = self.alloc_host(num_tokens)
        return None if slots is None else slots.to(device=self.device, dtype=self.index_dtype)

    def alloc_host(self, num_tokens: int) -> torch.Tensor | None:
        """:meth:`alloc`'s slots on the host (int64): the free lists live there."""
        if num_tokens < 0:
            raise ValueError(f"alloc: num_tokens must be >= 0, got {num_tokens}")
        if num_tokens % self.page_size != 0:
            raise ValueError(
                f"alloc: num_tokens ({num_tokens}) must be a multiple of page_size "
                f"({self.page_size}); round it up to whole pages"
            )
        n = num_tokens // self.page_size
        if n > self._top:
            return None
        pages = self._stack[self._top - n : self._top].flip(0)  # [n] (flip copies)
        self._top -= n
        self._allocated[pages] = True
        return self._pages_to_slots(pages)

    def free(self, slots: torch.Tensor) -> None:
        """Return ``slots`` [n] (host or device); with pages, every page touched must be passed
        whole. Raises ``ValueError`` (and frees nothing) for reserved, out-of-range, duplicate,
        partial-page or not-allocated slots."""
        if slots.dim() != 1:
            raise ValueError(f"free: slots must be 1-D, got shape {tuple(slots.shape)}")
        if slots.dtype.is_floating_point or slots.dtype == torch.bool:
            raise ValueError(f"free: slots must be an integer tensor, got {slots.dtype}")
        if slots.numel() == 0:
            return
        s = slots.to(device="cpu", dtype=torch.int64)  # [n]
        lo, hi = int(s.min()), int(s.max())
        if lo < 0 or hi >= self.num_slots:
            raise ValueError(
                f"free: slot index out of range [0, {self.num_slots}): got min {lo}, max {hi}"
            )
        pages = self._slots_to_pages(s)  # [n / page_size]
        if bool((pages == 0).any()):
            raise ValueError(
                "free: slot 0 / page 0 is reserved (the padding target) and never handed out; "
                "do not free padding entries"
            )
        not_allocated = ~self._allocated[pages]
        if bool(not_allocated.any()):
            bad = (pages[not_allocated][:8] * self.page_size).tolist()
            raise ValueError(
                f"free: slots not currently allocated (double free, or never handed out); "
                f"first offending page starts: {bad}"
            )
        self._allocated[pages] = False
        n = pages.numel()
        # Pushed reversed so that the next alloc hands these pages back in the given order.
        self._stack[self._top : self._top + n] = pages.flip(0)
        self._top += n

    def _slots_to_pages(self, s: torch.Tensor) -> torch.Tensor:  # s [n] -> [n / page_size]
        """Distinct pages of ``s``, checking that no slot repeats and every page is whole."""
        sorted_s = torch.sort(s).values  # [n]
        if sorted_s.numel() > 1 and bool((sorted_s[1:] == sorted_s[:-1]).any()):
            raise ValueError("free: the same slot appears more than once in one call")
        if self.page_size == 1:
            return sorted_s
        pages = torch.unique_consecutive(sorted_s // self.page_size)
        # n distinct slots inside len(pages) pages of page_size slots: all pages are whole
        # exactly when the counts match.
        if pages.numel() * self.page_size != s.numel():
            raise ValueError(
                f"free: page_size is {self.page_size} and only whole pages can be freed, but "
                f"{s.numel()} slots touch {pages.numel()} pages; pass every slot of each page"
            )
        return pages

    def _pages_to_slots(self, pages: torch.Tensor) -> torch.Tensor:  # pages [n] -> [n*ps]
        if self.page_size == 1:
            return pages.clone()
        return (pages[:, None] * self.page_size + self._page_offsets).reshape(-1)

    def backup_state(self) -> _AllocatorState:
        """An opaque snapshot of the free list (costs one copy of the free pages)."""
        return _AllocatorState(free_pages=self._stack[: self._top].clone())

    def restore_state(self, state: _AllocatorState) -> None:
        """Return to ``state``: pages allocated since the snapshot are free again, pages freed
        since then are allocated again."""
        if not isinstance(state, _AllocatorState):
            raise ValueError(
                f"restore_state: expected a state returned by backup_state of this allocator, "
                f"got {type(state).__name__}"
            )
        n = state.free_pages.numel()
        if n > self.num_pages - 1:
            raise ValueError("restore_state: the snapshot comes from a larger allocator")
        self._stack[:n] = state.free_pages
        self._top = n
        self._allocated.fill_(True)
        self._allocated[state.free_pages] = False
        self._allocated[0] = False

    def clear(self) -> None:
        """Free everything (back to the freshly constructed state)."""
        self._stack = torch.arange(self.num_pages - 1, 0, -1, dtype=torch.int64)
        self._top = self.num_pages - 1
        self._allocated.zero_()


class TokenSlotAllocator(PagedAllocator):
    """The ``page_size == 1`` allocator: single token slots, slot 0 reserved."""

    def __init__(
        self,
        num_slots: int,
        device: torch.device | str = "cpu",
        index_dtype: torch.dtype = torch.int64,
    ) -> None:
        """An allocator over slots ``1 .. num_slots - 1``."""
        super().__init__(num_slots, 1, device, index_dtype)
