"""The cuda backend's attentions: the SDPA layout of ``polyspec.backends.common``, attended by
the Triton kernels of ``polyspec.kernels.triton``.

- :class:`RowInvariantAttention` (``POLYSPEC_CUDA_KERNELS=rowinv``, the default): one ordered
  key list per token (:mod:`polyspec.kernels.triton.list_attention`), so a verify row computes
  bitwise what a decode step at its position computes. Eager forwards turn SDPA's layout into
  the lists with device ops (:func:`key_lists_from`); captured forwards write them with one
  kernel (``static_key_lists``).
- :class:`TritonAttention` (``POLYSPEC_CUDA_TRITON_ATTENTION=1`` in ``torch`` mode): SDPA's
  layout read by one paged kernel (:mod:`polyspec.kernels.triton.attention`) that stops at each
  request's own prefix length and reads K/V straight from the pool.

:class:`RowInvariantAttention` stores a forward's K/V with the Triton ``store_kv`` (K and V in
one launch); :class:`TritonAttention` with SDPA's two ``index_copy_``.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from polyspec.backend import ForwardBatch, ForwardMode, Rotary
from polyspec.backends.common import SDPAAttention, SDPAMetadata
from polyspec.kernels.triton.attention import paged_attention
from polyspec.kernels.triton.cache import store_kv
from polyspec.kernels.triton.list_attention import list_attention, static_key_lists
from polyspec.kernels.triton.rope import rotary_store_kv


@dataclasses.dataclass
class ListMetadata(SDPAMetadata):
    """SDPA's layout plus the per-token key lists the kernel reads."""

    key_lists: torch.Tensor | None = None  # [T, L] slots in attention order
    key_lens: torch.Tensor | None = None  # [T] int32


class RowInvariantAttention(SDPAAttention):
    """SDPA's metadata (every mode, eager and captured), attended by :func:`list_attention`.
    The base class's ``build_metadata`` and ``build_static_metadata`` both end in
    ``_with_key_lists``, which here adds the per-token key lists."""

    write_kv = staticmethod(store_kv)  # K and V in one launch

    def __init__(self, *args: object, pdl: bool = False, rotary_in_forward: bool = False) -> None:
        """SDPAAttention's arguments; ``pdl``: launch the kernels with programmatic dependent
        launch (``polyspec.kernels.triton.pdl``); ``rotary_in_forward``: take q and k before
        rotary embedding and rotate them in the K/V store's launch (``rotary_store_kv``, the
        Triton ``rotary_embedding``'s arithmetic: only where that is the backend's)."""
        super().__init__(*args)
        self.pdl = pdl
        self.rotary_in_forward = rotary_in_forward
        if pdl:
            self.write_kv = functools.partial(store_kv, pdl=True)

    def build_static_metadata(self, batch: ForwardBatch, max_prefix_len: int) -> ListMetadata:
        """A captured forward's metadata: the key lists from :func:`static_key_lists` (one
        launch) instead of SDPA's layout, which this attention does not read."""
        lists, lens = static_key_lists(batch, max_prefix_len, pdl=self.pdl)
        empty = torch.empty(0, dtype=torch.int64, device=lists.device)
        return ListMetadata(
            batch.mode, batch.num_tokens, batch.batch_size, batch.num_tokens // batch.batch_size,
            batch.out_cache_loc.to(torch.int64), empty, 0, None, None, None,
            *self._kv_buffers(0), key_lists=lists, key_lens=lens,
        )  # fmt: skip

    def _with_key_lists(self, m: SDPAMetadata) -> ListMetadata:
        lists, lens = key_lists_from(m)
        fields = {f.name: getattr(m, f.name) for f in dataclasses.fields(SDPAMetadata)}
        return ListMetadata(**fields, key_lists=lists, key_lens=lens)

    def _kv_buffers(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        # The kernel reads the pool directly: no gathered copies.
        empty = torch.empty(0, self.num_kv_heads, self.head_dim, device=self.kv_pool.device)
        return empty, empty

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        layer: int,
        metadata: ListMetadata,
        rotary: Rotary | None = None,
    ) -> torch.Tensor:  # [T, Hq, D]
        """Store ``k``/``v`` at ``out_cache_loc`` of ``layer`` (``rotary`` given: q and k
        rotated on the way, by one launch), then :func:`list_attention`."""
        m = metadata
        if rotary is None:
            k_cache, v_cache = self.store_kv(q, k, v, layer, m)
        else:
            k_cache, v_cache = self.kv_caches(q, layer, m)
            q = rotary_store_kv(
                rotary.positions, q, k, v, rotary.cos_sin_cache, rotary.is_neox, k_cache,
                v_cache, m.out_cache_loc, pdl=self.pdl,
            )  # fmt: skip
        return list_attention(
            q, k_cache, v_cache, m.key_lists, m.key_lens, self.scale, pdl=self.pdl
        )


def key_lists_from(m: SDPAMetadata) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, L], [T])
    """Each token's visible key slots in column order, and their count, from the SDPA layout
    (device ops only: no host sync, so this runs inside graph capture)."""
    kv = m.kv_index.view(m.batch_rows, m.kv_len)  # [B, L]
    if m.mask is None and m.output_index is None:  # every token sees every column of its row
        token_rows = torch.arange(m.num_tokens, device=kv.device) // m.max_queries
        lens = torch.full((m.num_tokens,), m.kv_len, dtype=torch.int32, device=kv.device)
        return kv.index_select(0, token_rows), lens
    if m.output_index is None:
        rows = torch.arange(m.batch_rows * m.max_queries, device=kv.device)  # [T]
    else:
        rows = m.output_index.to(torch.int64)  # [T] padded query row of each token
    slots = kv.index_select(0, rows // m.max_queries)  # [T, L]
    if m.mask is None:
        return slots, torch.full_like(rows, m.kv_len, dtype=torch.int32)
    visible = m.mask.reshape(m.batch_rows * m.max_queries, m.kv_len).index_select(0, rows)
    rank = torch.cumsum(visible, 1, dtype=torch.int64) - 1  # [T, L] place in the list
    dest = torch.where(visible, rank, m.kv_len)  # hidden columns go to a spare last column
    lists = torch.zeros((rows.numel(), m.kv_len + 1), dtype=slots.dtype, device=kv.device)
    lists.scatter_(1, dest, slots)
    return lists[:, : m.kv_len], visible.sum(1, dtype=torch.int32)


@dataclasses.dataclass
class TritonMetadata:
    """SDPA's metadata plus what the kernel reads per token and per request."""

    sdpa: SDPAMetadata
    prefix_lens: torch.Tensor  # [B] int64 prefix columns to read (all L when unmasked)
    token_row: torch.Tensor  # [T] int64 padded query row of each token
    mask: torch.Tensor  # [B * Qmax, L] int8
    prefix_width: int  # P


class TritonAttention(SDPAAttention):
    """SDPA's metadata, the Triton kernel above for the attention itself."""

    def build_metadata(self, batch: ForwardBatch) -> TritonMetadata:
        """SDPA's eager metadata, extended for the kernel."""
        return self._extend(batch, super().build_metadata(batch), static=False)

    def build_static_metadata(self, batch: ForwardBatch, max_prefix_len: int) -> TritonMetadata:
        """SDPA's captured-forward metadata, extended for the kernel (device ops only)."""
        return self._extend(batch, super().build_static_metadata(batch, max_prefix_len), True)

    def _kv_buffers(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        # The kernel reads the pool directly: no gathered copies.
        empty = torch.empty(0, self.num_kv_heads, self.head_dim, device=self.kv_pool.device)
        return empty, empty

    def _extend(self, batch: ForwardBatch, m: SDPAMetadata, static: bool) -> TritonMetadata:
        device = self.kv_pool.device
        rows = m.batch_rows * m.max_queries
        if m.mask is None:  # every column visible to every query (the decode hot path)
            prefix_width = m.kv_len
            prefix_lens = torch.full((m.batch_rows,), m.kv_len, dtype=torch.int64, device=device)
            mask = torch.zeros(1, dtype=torch.int8, device=device)  # no block: never read
        else:
            mask = m.mask.reshape(rows, m.kv_len).to(torch.int8)
            if static:
                prefix_width = m.kv_len - _block_width(batch, m)
            elif batch.prefix_lens_cpu is not None:
                prefix_width = max(batch.prefix_lens_cpu)
            else:
                prefix_width = int(batch.prefix_lens.max())
            prefix_lens = batch.prefix_lens.to(device=device, dtype=torch.int64)
        if m.output_index is not None:
            token_row = m.output_index.to(torch.int64)
        else:
            token_row = torch.arange(m.num_tokens, device=device, dtype=torch.int64)
        return TritonMetadata(m, prefix_lens, token_row, mask, prefix_width)

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        layer: int,
        metadata: TritonMetadata,
    ) -> torch.Tensor:  # [T, Hq, D]
        """Store ``k``/``v`` at ``out_cache_loc``, then the kernel over the pool."""
        m = metadata.sdpa
        k_cache, v_cache = self.store_kv(q, k, v, layer, m)
        return paged_attention(
            q, k_cache, v_cache, m.kv_index, metadata.prefix_lens, metadata.token_row,
            metadata.mask, m.max_queries, m.kv_len, metadata.prefix_width, self.scale,
        )  # fmt: skip


def _block_width(batch: ForwardBatch, m: SDPAMetadata) -> int:
    """Columns of the mode's block in a captured forward's metadata (shape-derived)."""
    if batch.mode is ForwardMode.DRAFT_DECODE and batch.lane_locs is not None:
        return int(batch.lane_locs.shape[1] * batch.lane_locs.shape[2])
    return m.max_queries
