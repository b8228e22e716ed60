"""SDPA attention for the five forward modes, shared by the backends (plain torch, any device).

Layout shared by every mode. Request ``b`` becomes one SDPA batch row with ``Qmax`` query rows
and ``Lmax = Pmax + Bw`` key columns:

* columns ``[0, Pmax)``: the cached prefix ``req_to_token[r_b, c]``, visible where
  ``c < prefix_lens[b]``;
* columns ``[Pmax, Pmax + Bw)``: the mode's block: the new tokens (EXTEND, DRAFT_EXTEND,
  DECODE, TARGET_VERIFY: ``req_to_token[r_b, prefix_lens[b] + j]``) masked causally or by the
  tree mask, or the K lanes side by side (DRAFT_DECODE: column ``l * Wmax + j`` is
  ``lane_locs[b, l, j]``) where query lane ``l`` sees only its own lane.

Padding columns point at slot 0 and are masked out; padded query rows see every column (so no
softmax row is empty) and are dropped. All of this is built once per forward by
:meth:`SDPAAttention.build_metadata`; :meth:`SDPAAttention.forward` does per layer one store,
one K and one V gather, one SDPA call and the reshape back to token order.

GQA never repeats K/V: with one query per row (DECODE) the ``G = Hq // Hkv`` query heads of a
kv head are folded into SDPA's query rows (``[B, Hkv, G, D]`` against ``[B, Hkv, Lmax, D]``);
otherwise SDPA's ``enable_gqa`` maps query head ``h`` to kv head ``h // G``.

The gathered K/V live in two buffers allocated once per forward and reused by every layer:
fresh per-layer allocations of that size cost more in page faults than the gather itself.

Row-invariant mode (``exact_attention`` given, bf16 pools): the same layout and mask are turned
once per forward into one ordered key list per token (CSR: ``kv_indptr``, ``kv_indices``), and
every layer calls that kernel instead of SDPA. A token's list is its visible columns in column
order: the prefix in position order, then the block's visible tokens in token order, which for
a verify row is its ancestors root first (a tree node's parent always precedes it). So a draft
token verified at depth d attends to exactly the keys, in exactly the order, that a plain
decode step at the same position would, and the kernel's fixed-order arithmetic makes the two
results bitwise equal. Padded query rows get no list.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

from polyspec.backend import AttentionBackend, AttentionMetadata, ForwardBatch, ForwardMode

from .kv_pool import TensorKVPool, write_kv


@dataclasses.dataclass
class SDPAMetadata(AttentionMetadata):
    """Per-forward index tensors and mask, shared by every layer."""

    mode: ForwardMode
    num_tokens: int  # T
    batch_rows: int  # B: SDPA batch rows (requests)
    max_queries: int  # Qmax: query rows per batch row
    out_cache_loc: torch.Tensor  # [T] int64 slots receiving the new K/V
    kv_index: torch.Tensor  # [B * Lmax] slots of the key columns (slot 0 = padding)
    kv_len: int  # Lmax
    mask: torch.Tensor | None  # [B, 1, Qmax, Lmax] bool (True = visible); None = all visible
    query_index: torch.Tensor | None  # [B * Qmax] token of each padded query row; None = view
    output_index: torch.Tensor | None  # [T] padded row of each token; None = view
    k_buffer: torch.Tensor  # [B * Lmax, Hkv, D] scratch for the gathered keys (every layer)
    v_buffer: torch.Tensor  # [B * Lmax, Hkv, D] scratch for the gathered values
    kv_indptr: torch.Tensor | None = None  # [T + 1] row-invariant mode: offsets into kv_indices
    kv_indices: torch.Tensor | None = None  # [nnz] slots each token attends to, in order


class SDPAAttention(AttentionBackend):
    """Attention over a :class:`TensorKVPool` with ``torch.nn.functional.scaled_dot_product_attention``."""

    def __init__(
        self,
        kv_pool: TensorKVPool,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        exact_attention: Callable[..., torch.Tensor] | None = None,
        exact_store_and_attend: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        """``num_heads`` must be a multiple of ``num_kv_heads``; the pool must match the KV
        head count and head dim. ``exact_attention(q, k_cache, v_cache, kv_indptr, kv_indices,
        scale)`` (the cpu backend passes its C++ ``rowinv.attention``) replaces SDPA for every
        mode (see the module doc). ``exact_store_and_attend(q, k, v, k_cache, v_cache, loc,
        kv_indptr, kv_indices, scale)``, where given, does a layer's store and that attention
        in one call (the cpu backend's ``store_and_attend``: the same bits, one dispatch
        instead of three)."""
        if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
            raise ValueError(
                f"attention: num_heads ({num_heads}) must be a positive multiple of "
                f"num_kv_heads ({num_kv_heads})"
            )
        if kv_pool.num_kv_heads != num_kv_heads or kv_pool.head_dim != head_dim:
            raise ValueError(
                f"attention: the KV pool holds {kv_pool.num_kv_heads} heads of dim "
                f"{kv_pool.head_dim}, but the attention was asked for {num_kv_heads} KV heads "
                f"of dim {head_dim}; build the pool with the model's KV head count and head dim"
            )
        self.kv_pool = kv_pool
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = float(scale)
        self.group = num_heads // num_kv_heads
        self.exact_attention = exact_attention
        self.exact_store_and_attend = exact_store_and_attend

    write_kv = staticmethod(write_kv)
    """``write_kv(k_cache, v_cache, loc, k, v)``: the store step of :meth:`store_kv` (a
    subclass may put one kernel in place of the two ``index_copy_`` calls)."""

    # ------------------------------------------------------------------ metadata

    def build_metadata(self, batch: ForwardBatch) -> SDPAMetadata:
        """Index tensors and the bool mask of ``batch`` (host-side lengths read once here)."""
        return self._with_key_lists(self._build_metadata(batch))

    def _build_metadata(self, batch: ForwardBatch) -> SDPAMetadata:
        device = self.kv_pool.device
        bs = batch.batch_size
        if bs < 1:
            raise ValueError("attention: a forward batch needs at least one request")
        prefix = _host_list(batch.prefix_lens_cpu, batch.prefix_lens, bs, "prefix_lens")
        extend = _host_list(batch.extend_lens_cpu, batch.extend_lens, bs, "extend_lens")
        num_tokens = batch.num_tokens
        if sum(extend) != num_tokens:
            raise ValueError(
                f"attention: sum(extend_lens) = {sum(extend)} but the batch has {num_tokens} "
                f"tokens (input_ids); extend_lens must count each request's new tokens"
            )
        if batch.out_cache_loc.shape != (num_tokens,):
            raise ValueError(
                f"attention: out_cache_loc must have shape [T] = [{num_tokens}], got "
                f"{list(batch.out_cache_loc.shape)}"
            )
        if num_tokens < 1:
            raise ValueError("attention: a forward batch needs at least one token")
        mode = batch.mode
        out_cache_loc = batch.out_cache_loc.to(device=device, dtype=torch.int64)
        rt = batch.req_to_token.to(device)  # [R, C]
        # Only the req_to_token columns some key reads are copied out.
        if mode is ForwardMode.DRAFT_DECODE:
            width = max(prefix)
        else:
            width = max(p + e for p, e in zip(prefix, extend))
        if width > rt.shape[1]:
            raise ValueError(
                f"attention: a request needs {width} req_to_token columns but the table has "
                f"{rt.shape[1]}; prefix_lens + extend_lens must not exceed max_context"
            )
        rpi = batch.req_pool_indices.to(device=device, dtype=torch.int64)
        rows = rt[:, :width].index_select(0, rpi)  # [bs, width]
        q_max = max(extend)
        uniform_q = min(extend) == q_max

        if bs == 1 and self._row_invariant():
            lists = self._single_request_lists(batch, rows[0], prefix[0], extend[0])
            if lists is not None:
                return lists

        if mode is ForwardMode.DECODE and uniform_q and min(prefix) == max(prefix):
            # Hot path (batch-1 decode above all): every row has the same keys count and sees
            # all of them, so no mask and no padding.
            kv_len = prefix[0] + q_max
            kv_index = rows[:, :kv_len].reshape(-1)
            return SDPAMetadata(
                mode,
                num_tokens,
                bs,
                q_max,
                out_cache_loc,
                kv_index,
                kv_len,
                None,
                None,
                None,
                *self._kv_buffers(kv_index.numel()),
            )

        p_max = max(prefix)
        prefix_lens = torch.tensor(prefix, dtype=torch.int64, device=device)  # [bs]
        extend_lens = torch.tensor(extend, dtype=torch.int64, device=device)  # [bs]
        cols = torch.arange(p_max, device=device)  # [Pmax]
        prefix_visible = cols[None, :] < prefix_lens[:, None]  # [bs, Pmax]
        prefix_index = torch.where(prefix_visible, rows[:, :p_max], 0)  # [bs, Pmax]
        if mode is ForwardMode.DRAFT_DECODE:
            block_index, block_mask = self._draft_decode_block(batch, extend, device)
        else:
            block_index, block_mask = self._new_token_block(
                batch, rows, prefix_lens, extend_lens, q_max, device
            )
        kv_index = torch.cat([prefix_index, block_index.to(prefix_index.dtype)], 1)  # [bs, Lmax]
        mask = torch.cat(
            [prefix_visible[:, None, :].expand(bs, q_max, p_max), block_mask], 2
        )  # [bs, Qmax, Lmax]
        q_rows = torch.arange(q_max, device=device)  # [Qmax]
        q_valid = q_rows[None, :] < extend_lens[:, None]  # [bs, Qmax]
        # Padded query rows see everything so that no softmax row is empty; they are dropped.
        mask = mask | ~q_valid[:, :, None]
        sdpa_mask = None if bool(mask.all()) else mask[:, None]  # [bs, 1, Qmax, Lmax]
        query_index = output_index = None
        if not uniform_q:
            starts = torch.cumsum(extend_lens, 0) - extend_lens  # [bs]
            token_of_row = starts[:, None] + q_rows[None, :]  # [bs, Qmax]
            query_index = torch.where(q_valid, token_of_row, 0).reshape(-1)
            output_index = (torch.arange(bs, device=device)[:, None] * q_max + q_rows[None, :])[
                q_valid
            ]  # [T], request-major like the tokens
        return SDPAMetadata(
            mode,
            num_tokens,
            bs,
            q_max,
            out_cache_loc,
            kv_index.reshape(-1),
            int(kv_index.shape[1]),
            sdpa_mask,
            query_index,
            output_index,
            *self._kv_buffers(kv_index.numel()),
        )

    def build_static_metadata(self, batch: ForwardBatch, max_prefix_len: int) -> SDPAMetadata:
        """Fixed-shape metadata from device tensors only (see the contract): ``max_prefix_len``
        prefix columns per request, always a mask, no padding of queries (the layout is
        uniform), no host sync (except for the key lists of row-invariant mode, which only an
        eager graph runner replays)."""
        return self._with_key_lists(self._build_static_metadata(batch, max_prefix_len))

    def _build_static_metadata(self, batch: ForwardBatch, max_prefix_len: int) -> SDPAMetadata:
        device = self.kv_pool.device
        bs, num_tokens = batch.batch_size, batch.num_tokens
        if bs < 1 or num_tokens % bs:
            raise ValueError(
                f"attention: a captured forward needs T = bs * Q tokens, got T = {num_tokens} "
                f"for bs = {bs}"
            )
        q_max = num_tokens // bs
        rt = batch.req_to_token
        width = min(int(max_prefix_len), rt.shape[1])
        rows = rt.index_select(0, batch.req_pool_indices.to(torch.int64)).to(torch.int64)
        prefix_lens = batch.prefix_lens.to(device=device, dtype=torch.int64)  # [bs]
        extend_lens = batch.extend_lens.to(device=device, dtype=torch.int64)  # [bs]
        cols = torch.arange(width, device=device)
        prefix_visible = cols[None, :] < prefix_lens[:, None]  # [bs, P]
        prefix_index = torch.where(prefix_visible, rows[:, :width], 0)
        j = torch.arange(q_max, device=device)  # [Q]
        if batch.mode is ForwardMode.DRAFT_DECODE:
            if batch.lane_locs is None or batch.lane_lens is None:
                raise ValueError("attention: DRAFT_DECODE needs lane_locs and lane_lens")
            lane_locs = batch.lane_locs.to(torch.int64)  # [bs, K, W]
            w = lane_locs.shape[2]
            slot_valid = torch.arange(w, device=device)[None, :] < batch.lane_lens[:, None]
            block_index = torch.where(slot_valid[:, None, :], lane_locs, 0).reshape(bs, -1)
            own_lane = j[:, None, None] == j[None, :, None]  # [K, K, 1]
            block_mask = (own_lane[None] & slot_valid[:, None, None, :]).reshape(bs, q_max, -1)
        else:
            valid = j[None, :] < extend_lens[:, None]  # [bs, Q]
            pos = (prefix_lens[:, None] + j[None, :]).clamp(max=rows.shape[1] - 1)
            block_index = torch.where(valid, rows.gather(1, pos), 0)  # [bs, Q]
            if batch.mode is ForwardMode.TARGET_VERIFY:
                if batch.tree_mask is None or tuple(batch.tree_mask.shape) != (bs, q_max, q_max):
                    raise ValueError(
                        f"attention: TARGET_VERIFY needs tree_mask bool [bs, N, N] = "
                        f"[{bs}, {q_max}, {q_max}]"
                    )
                block_mask = batch.tree_mask.to(torch.bool) & valid[:, None, :]
            else:
                block_mask = (j[None, :] <= j[:, None])[None] & valid[:, None, :]
        kv_index = torch.cat([prefix_index, block_index], 1)  # [bs, L]
        mask = torch.cat([prefix_visible[:, None, :].expand(bs, q_max, width), block_mask], 2)
        # Padding rows (and padding queries) see every column, so no softmax row is empty.
        mask = mask | ~mask.any(-1, keepdim=True)
        return SDPAMetadata(
            batch.mode,
            num_tokens,
            bs,
            q_max,
            batch.out_cache_loc.to(torch.int64),
            kv_index.reshape(-1),
            int(kv_index.shape[1]),
            mask[:, None],
            None,
            None,
            *self._kv_buffers(kv_index.numel()),
        )

    def _row_invariant(self) -> bool:
        return self.exact_attention is not None and self.kv_pool.dtype == torch.bfloat16

    def _single_request_lists(
        self,
        batch: ForwardBatch,
        row: torch.Tensor,  # [width] the request's req_to_token columns
        prefix: int,
        extend: int,
    ) -> SDPAMetadata | None:
        """Row-invariant key lists of a one-request batch built directly (the batch-1 decode
        round's four forwards), with the lists :meth:`_with_key_lists` gives but a handful of
        ops instead of the general layout and its mask. None: take the general path."""
        mode, dev = batch.mode, row.device
        if mode is ForwardMode.DRAFT_DECODE:
            lanes, lane_lens = batch.lane_locs, batch.lane_lens_cpu
            if lanes is None or lane_lens is None or lanes.dim() != 3:
                return None
            width = lane_lens[0]
            if lanes.shape[:2] != (1, extend) or not 1 <= width <= lanes.shape[2]:
                return None
            block = lanes[0, :, :width].to(
                device=dev, dtype=torch.int64
            )  # [K, W]: query k sees its own lane
            keys = torch.cat([row[:prefix].expand(extend, prefix), block], 1)  # [K, P + W]
            indices = keys.reshape(-1)
            per_token = torch.full((extend,), prefix + width, dtype=torch.int64, device=dev)
        else:
            block = row[prefix : prefix + extend]  # [E] the new tokens' slots, in order
            if mode is ForwardMode.TARGET_VERIFY:
                tree = batch.tree_mask
                if tree is None or tuple(tree.shape) != (1, extend, extend):
                    return None  # the general path raises the clear error
                visible_block = tree[0].to(device=dev, dtype=torch.bool)  # [N, N]: ancestors
            else:  # EXTEND, DRAFT_EXTEND, DECODE: causal
                j = torch.arange(extend, device=dev)
                visible_block = j[None, :] <= j[:, None]
            keys = torch.cat([row[:prefix].expand(extend, prefix), block.expand(extend, extend)], 1)
            visible = torch.cat(
                [torch.ones(extend, prefix, dtype=torch.bool, device=dev), visible_block], 1
            )  # [E, P + E]
            indices = keys[visible]  # row-major: token order, then column order
            per_token = visible_block.sum(1) + prefix
        indptr = torch.zeros(extend + 1, dtype=torch.int64, device=dev)
        torch.cumsum(per_token, 0, out=indptr[1:])
        empty = torch.empty(
            0, self.num_kv_heads, self.head_dim, dtype=self.kv_pool.dtype, device=dev
        )
        return SDPAMetadata(
            mode, extend, 1, extend, batch.out_cache_loc.to(torch.int64), indices,
            int(indices.numel()), None, None, None, empty, empty, indptr, indices,
        )  # fmt: skip

    def _with_key_lists(self, m: SDPAMetadata) -> SDPAMetadata:
        """Fill ``kv_indptr`` / ``kv_indices`` in row-invariant mode (see the module doc)."""
        if not self._row_invariant() or m.kv_indices is not None:
            return m
        kv = m.kv_index.view(m.batch_rows, m.kv_len)  # [B, Lmax]
        # Padded query row of each token, in token order (all rows when nothing is padded).
        if m.output_index is None:
            rows = torch.arange(m.batch_rows * m.max_queries, device=kv.device)  # [T]
        else:
            rows = m.output_index  # [T]
        if m.mask is None:
            visible = torch.ones(rows.numel(), m.kv_len, dtype=torch.bool, device=kv.device)
        else:
            visible = m.mask.reshape(m.batch_rows * m.max_queries, m.kv_len).index_select(0, rows)
        token, col = visible.nonzero(as_tuple=True)  # row-major: token order, then column order
        m.kv_indices = kv[rows.div(m.max_queries, rounding_mode="floor")[token], col]
        m.kv_indptr = torch.zeros(rows.numel() + 1, dtype=torch.int64, device=kv.device)
        torch.cumsum(visible.sum(1), 0, out=m.kv_indptr[1:])
        return m

    def _kv_buffers(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Scratch for one layer's gathered K and V ([rows, Hkv, D] each)."""
        pool = self.kv_pool
        shape = (rows, self.num_kv_heads, self.head_dim)
        return (
            torch.empty(shape, dtype=pool.dtype, device=pool.device),
            torch.empty(shape, dtype=pool.dtype, device=pool.device),
        )

    def _new_token_block(
        self,
        batch: ForwardBatch,
        rows: torch.Tensor,  # [bs, C] req_to_token rows of the batch
        prefix_lens: torch.Tensor,  # [bs]
        extend_lens: torch.Tensor,  # [bs]
        q_max: int,
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # ([bs, Qmax] slots, [bs, Qmax, Qmax] mask)
        """Columns of the new tokens and which query sees which (causal or tree mask)."""
        bs = rows.shape[0]
        j = torch.arange(q_max, device=device)  # [Qmax]
        valid = j[None, :] < extend_lens[:, None]  # [bs, Qmax]
        pos = (prefix_lens[:, None] + j[None, :]).clamp(max=rows.shape[1] - 1)  # [bs, Qmax]
        block_index = torch.where(valid, rows.gather(1, pos), 0)  # [bs, Qmax]
        if batch.mode is ForwardMode.TARGET_VERIFY:
            tree_mask = batch.tree_mask
            if tree_mask is None or tuple(tree_mask.shape) != (bs, q_max, q_max):
                got = None if tree_mask is None else list(tree_mask.shape)
                raise ValueError(
                    f"attention: TARGET_VERIFY needs tree_mask bool [bs, N, N] = "
                    f"[{bs}, {q_max}, {q_max}] (TREE_ONLY layout), got {got}"
                )
            if (extend_lens != q_max).any():
                raise ValueError(
                    "attention: TARGET_VERIFY needs extend_lens == N for every request"
                )
            block_mask = tree_mask.to(device=device, dtype=torch.bool)
        else:
            block_mask = j[None, :] <= j[:, None]  # [Qmax, Qmax] causal
            block_mask = block_mask[None] & valid[:, None, :]  # [bs, Qmax, Qmax]
        return block_index, block_mask

    def _draft_decode_block(
        self, batch: ForwardBatch, extend: list[int], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:  # ([bs, K * Wmax] slots, [bs, K, K * Wmax] mask)
        """The K lanes side by side; query lane l sees its own first ``lane_lens[b]`` slots."""
        bs = len(extend)
        topk = extend[0]
        if batch.lane_locs is None or batch.lane_lens is None:
            raise ValueError(
                "attention: DRAFT_DECODE needs lane_locs [bs, K, W] and lane_lens [bs]"
            )
        lane_locs = batch.lane_locs.to(device)
        if (
            lane_locs.dim() != 3
            or lane_locs.shape[:2] != (bs, topk)
            or any(e != topk for e in extend)
        ):
            raise ValueError(
                f"attention: DRAFT_DECODE needs extend_lens == K for every request and lane_locs "
                f"[bs, K, W] = [{bs}, {topk}, W]; got extend_lens {extend} and lane_locs "
                f"{list(lane_locs.shape)}"
            )
        lane_lens_list = _host_list(batch.lane_lens_cpu, batch.lane_lens, bs, "lane_lens")
        w_max = max(lane_lens_list)
        if min(lane_lens_list) < 1 or w_max > lane_locs.shape[2]:
            raise ValueError(
                f"attention: DRAFT_DECODE lane_lens must be in [1, W={lane_locs.shape[2]}] (the "
                f"lane's own new slot is included), got {lane_lens_list}"
            )
        lane_lens = torch.tensor(lane_lens_list, dtype=torch.int64, device=device)  # [bs]
        j = torch.arange(w_max, device=device)  # [Wmax]
        slot_valid = j[None, :] < lane_lens[:, None]  # [bs, Wmax]
        block_index = torch.where(slot_valid[:, None, :], lane_locs[:, :, :w_max], 0)
        lane = torch.arange(topk, device=device)  # [K]
        own_lane = lane[:, None, None] == lane[None, :, None]  # [K(query), K(column lane), 1]
        block_mask = own_lane[None] & slot_valid[:, None, None, :]  # [bs, K, K, Wmax]
        return block_index.reshape(bs, -1), block_mask.reshape(bs, topk, -1)

    # ------------------------------------------------------------------ forward

    def store_kv(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        layer: int,
        metadata: SDPAMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # ([slots, Hkv, D], [slots, Hkv, D])
        """Check that ``q`` matches the metadata, write ``k``/``v`` at ``out_cache_loc`` of
        ``layer``, and return that layer's K and V caches: the first step of every forward
        built on this layout (this class and the Triton attentions)."""
        k_cache, v_cache = self.kv_caches(q, layer, metadata)
        self.write_kv(k_cache, v_cache, metadata.out_cache_loc, k, v)
        return k_cache, v_cache

    def kv_caches(
        self, q: torch.Tensor, layer: int, metadata: SDPAMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:  # q [T, Hq, D] -> ([slots, Hkv, D], [slots, Hkv, D])
        """Check that ``q`` matches the metadata and return ``layer``'s K and V caches."""
        _check_tokens(q, metadata)
        return self.kv_pool.k_cache(layer), self.kv_pool.v_cache(layer)

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        layer: int,
        metadata: SDPAMetadata,
    ) -> torch.Tensor:  # [T, Hq, D]
        """Store ``k``/``v`` at ``out_cache_loc`` of ``layer``, then attend (see module doc)."""
        m = metadata
        if m.kv_indices is not None and self.exact_store_and_attend is not None:
            _check_tokens(q, m)
            pool = self.kv_pool
            return self.exact_store_and_attend(
                q, k, v, pool.k_cache(layer), pool.v_cache(layer), m.out_cache_loc,
                m.kv_indptr, m.kv_indices, self.scale,
            )  # [T, Hq, D]  # fmt: skip
        k_cache, v_cache = self.store_kv(q, k, v, layer, m)  # [slots, Hkv, D] each
        if m.kv_indices is not None and self.exact_attention is not None:
            return self.exact_attention(
                q.contiguous(), k_cache, v_cache, m.kv_indptr, m.kv_indices, self.scale
            )  # [T, Hq, D]

        bsz, q_max, hkv, d = m.batch_rows, m.max_queries, self.num_kv_heads, self.head_dim
        torch.index_select(k_cache, 0, m.kv_index, out=m.k_buffer)
        torch.index_select(v_cache, 0, m.kv_index, out=m.v_buffer)
        keys = m.k_buffer.view(bsz, m.kv_len, hkv, d).transpose(1, 2).to(q.dtype)
        values = m.v_buffer.view(bsz, m.kv_len, hkv, d).transpose(1, 2).to(q.dtype)
        if q_max == 1 and m.query_index is None:
            # The G query heads of each kv head become G query rows of that head.
            qf = q.reshape(bsz, hkv, self.group, d)
            out = F.scaled_dot_product_attention(
                qf, keys, values, attn_mask=m.mask, scale=self.scale
            )
            return out.reshape(bsz, self.num_heads, d)  # [T, Hq, D] (T == B here)
        if m.query_index is not None:
            q = q.index_select(0, m.query_index)  # [B * Qmax, Hq, D]
        qb = q.reshape(bsz, q_max, self.num_heads, d).transpose(1, 2)  # [B, Hq, Qmax, D]
        out = F.scaled_dot_product_attention(
            qb, keys, values, attn_mask=m.mask, scale=self.scale, enable_gqa=self.group > 1
        )  # [B, Hq, Qmax, D]
        out = out.transpose(1, 2).reshape(bsz * q_max, self.num_heads, d)
        if m.output_index is not None:
            out = out.index_select(0, m.output_index)
        return out  # [T, Hq, D]


def _check_tokens(q: torch.Tensor, metadata: SDPAMetadata) -> None:  # q [T, Hq, D]
    if q.shape[0] != metadata.num_tokens:
        raise ValueError(
            f"attention: q has {q.shape[0]} tokens but the metadata was built for "
            f"{metadata.num_tokens}; build_metadata must be called for this batch"
        )


def _host_list(host: list[int] | None, dev: torch.Tensor, bs: int, name: str) -> list[int]:
    """Host copy of a per-request length tensor (the ``*_cpu`` field when filled)."""
    values = list(host) if host is not None else [int(x) for x in dev.tolist()]
    if len(values) != bs:
        raise ValueError(f"attention: {name} has {len(values)} entries for {bs} requests")
    if min(values) < 0:
        raise ValueError(f"attention: {name} must be >= 0, got {values}")
    return values
