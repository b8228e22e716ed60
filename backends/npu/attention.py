"""Attention of the npu backend for the five forward modes, on one fused operator.

Every mode runs ``torch_npu.npu_fused_infer_attention_score`` over the paged KV cache (block
size P = 128), draft and target alike. Eager forwards:

| mode | layout | queries per row | what a query sees |
|---|---|---|---|
| EXTEND, DRAFT_EXTEND | TND | the request's new tokens | the prefix and earlier new tokens: ``sparse_mode=3`` (causal aligned to the end of the row's keys) with the 2048 x 2048 mask |
| DECODE | TND | 1 | its request's ``prefix + 1`` keys |
| DRAFT_DECODE | TND | 1 per (request, lane) row | a block table of the request's page-aligned prefix followed by the lane's own pages |
| TARGET_VERIFY, chain (topk 1) | TND | N | causal, as EXTEND (a chain's tree mask is causal) |
| TARGET_VERIFY, tree (topk > 1) | BSND | N | the prefix plus its tree ancestors: ``sparse_mode=0`` and an explicit ``[bs, 1, N, KV]`` mask (True = masked) |

The new K/V are stored first with ``torch_npu.npu_scatter_pa_kv_cache`` (the A2 / A3 cache
write, ND caches: ``cache_mode="Norm"``) at the int32 ``out_cache_loc``. Sequence lengths
reach the operator as host lists (``actual_seq_lengths``: cumulative query ends in TND,
``actual_seq_lengths_kv``: per row), taken from ``ForwardBatch.*_cpu``: no device-to-host
sync per layer. A verify forward is a chain when its tree mask is the causal one; that is
checked once per forward on the host (``ForwardBatch`` carries no topk for TARGET_VERIFY).

Graph capture (:meth:`NPUAttention.build_static_metadata`): the same operator and modes, on
the captured batch's fixed layout of Q queries per row (padding requests last, with prefix 0):
TND with ``sparse_mode=3`` for every mode but tree verification (a row sees ``prefix + Q``
keys, the causal diagonal aligned to its end, so a row's real queries see what they see
eagerly; the queries past a row's real tokens are padding whose outputs are discarded), BSND
with ``sparse_mode=0`` and the explicit device-built mask where the verify tree's topk > 1
(``ForwardBatch.topk``). The block tables are device tensors gathered from ``req_to_token``
inside the graph (``ceil((max_prefix_len + Q) / P)`` columns: the prefix bucket plus headroom
for the block's own tokens), so every replay reads the current ones. The host lengths are
graph task parameters: under capture each layer's operator runs as its ``.out`` overload in
a task group of its own behind an ``ExternalEvent`` (vllm-ascend's pattern), and
:meth:`~polyspec.backends.npu.graph.NPUGraphRunner.prepare` re-issues every such task with the
``actual_seq_lengths`` / ``actual_seq_lengths_kv`` computed from the engine's host parameters
through ``ForwardBatch.host_lengths`` (and the same block table, mask and buffers), then
records the event.

float32 models: the fused operator takes float16 / bfloat16 only, so a float32 pool uses the
portable gather + SDPA attention of ``polyspec.backends.common`` on the NPU (exact, slower); it
is what the conformance suite's float32 lossless tests run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from polyspec.backend import (
    AttentionBackend,
    AttentionMetadata,
    ForwardBatch,
    ForwardMode,
    HostLengths,
)
from polyspec.backends.common import SDPAAttention

from . import graph as graph_tasks
from .kv_pool import NPUKVPool, store_paged
from .runtime import import_torch_npu

CAUSAL_MASK_SIZE = 2048
"""Side of the compressed causal mask ``sparse_mode=3`` requires (fixed by the operator)."""

FIA_DTYPES = (torch.float16, torch.bfloat16)
"""KV dtypes Ascend's fused attention operators take."""

CAUSAL, TREE = 3, 0
"""``sparse_mode`` values: right-down causal with the 2048 mask; explicit mask."""


@dataclasses.dataclass
class OperatorLengths:
    """The operator's host-side length arguments of one forward, per operator row."""

    query_lens: list[int]  # per row: queries
    kv_lens: list[int]  # per row: keys visible


def host_lengths(
    mode: ForwardMode,
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    lane_lens: Sequence[int] | None,
    topk: int,
) -> OperatorLengths:
    """Lengths the operator needs, from the batch's host lists."""
    if mode is ForwardMode.DRAFT_DECODE:
        if lane_lens is None:
            raise ValueError("npu attention: DRAFT_DECODE needs lane_lens_cpu")
        kv = [p + w for p, w in zip(prefix_lens, lane_lens) for _ in range(topk)]
        return OperatorLengths([1] * len(kv), kv)
    if mode is ForwardMode.DECODE:
        return OperatorLengths([1] * len(prefix_lens), [p + 1 for p in prefix_lens])
    return OperatorLengths(list(extend_lens), [p + e for p, e in zip(prefix_lens, extend_lens)])


def cumulative(lens: Sequence[int]) -> list[int]:
    """TND ``actual_seq_lengths``: the cumulative query ends of the rows."""
    out, total = [], 0
    for n in lens:
        total += n
        out.append(total)
    return out


@dataclasses.dataclass
class NPUMetadata(AttentionMetadata):
    """Per-forward tensors and host lists shared by every layer."""

    mode: ForwardMode
    out_cache_loc: torch.Tensor  # [T] int32 slots receiving the new K/V
    lengths: OperatorLengths
    block_table: torch.Tensor | None  # [rows, max_blocks] int32
    sparse_mode: int  # CAUSAL (TND) or TREE (BSND, explicit mask)
    atten_mask: torch.Tensor | None  # bool, True = masked
    rows: int  # operator batch rows: requests, or requests * K for DRAFT_DECODE
    queries_per_row: int  # BSND query length (N, tree verification)
    portable: AttentionMetadata | None = None  # float32: the SDPA path's metadata
    # captured forwards: the operator's host lengths for GraphRunner.prepare's host parameters
    replay_lengths: Callable[[Mapping[str, Any]], OperatorLengths] | None = None


class NPUAttention(AttentionBackend):
    """Paged fused attention over an :class:`NPUKVPool` (module docstring)."""

    def __init__(
        self,
        kv_pool: NPUKVPool,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        page_size: int,
    ) -> None:
        """``page_size`` is the block size of the block tables (the allocator's page size)."""
        self.portable = SDPAAttention(kv_pool, num_heads, num_kv_heads, head_dim, scale)
        self.kv_pool = kv_pool
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = float(scale)
        self.page_size = page_size
        self.use_fused = kv_pool.dtype in FIA_DTYPES
        self._causal: torch.Tensor | None = None  # [2048, 2048] bool, built on first use

    # ------------------------------------------------------------------ metadata

    def build_metadata(self, batch: ForwardBatch) -> NPUMetadata:
        """Block tables, host lengths and (tree verification) the explicit mask of ``batch``."""
        bs = batch.batch_size
        prefix = _host(batch.prefix_lens_cpu, "prefix_lens", bs)
        extend = _host(batch.extend_lens_cpu, "extend_lens", bs)
        lane = None
        if batch.mode is ForwardMode.DRAFT_DECODE:
            lane = _host(batch.lane_lens_cpu, "lane_lens", bs)
        lengths = host_lengths(batch.mode, prefix, extend, lane, batch.topk)
        out_cache_loc = batch.out_cache_loc.to(torch.int32)
        if not self.use_fused:
            return NPUMetadata(
                batch.mode, out_cache_loc, lengths, None, CAUSAL, None, bs, 1,
                portable=self.portable.build_metadata(batch),
            )  # fmt: skip
        mode = batch.mode
        if mode is ForwardMode.DRAFT_DECODE:
            table = self._lane_block_table(batch, prefix, lane)
            return NPUMetadata(
                mode, out_cache_loc, lengths, table, CAUSAL,
                self._causal_mask(out_cache_loc.device), bs * batch.topk, 1,
            )  # fmt: skip
        table = self._block_table(batch, max(lengths.kv_lens))
        if mode is ForwardMode.TARGET_VERIFY and not self._is_chain(batch, extend):
            n = extend[0]
            mask = self._tree_mask(batch, prefix, n, table.shape[1] * self.page_size)
            return NPUMetadata(mode, out_cache_loc, lengths, table, TREE, mask, bs, n)
        return NPUMetadata(
            mode, out_cache_loc, lengths, table, CAUSAL,
            self._causal_mask(out_cache_loc.device), bs, 1,
        )  # fmt: skip

    def build_static_metadata(self, batch: ForwardBatch, max_prefix_len: int) -> NPUMetadata:
        """Metadata of a captured forward (module docstring, "Graph capture"): device tensors
        for the block table and the tree mask, host lengths from ``batch.host_lengths``
        (``{}``: the batch as captured; the graph runner's ``prepare`` re-issues them for
        each replay)."""
        bs, t = batch.batch_size, batch.num_tokens
        if bs < 1 or t % bs:
            raise ValueError(
                f"npu attention: a captured forward needs T = bs * Q tokens, got T = {t} for "
                f"bs = {bs}"
            )
        out_cache_loc = batch.out_cache_loc.to(torch.int32)
        if not self.use_fused:
            return NPUMetadata(
                batch.mode, out_cache_loc, OperatorLengths([], []), None, TREE, None, bs, 1,
                portable=self.portable.build_static_metadata(batch, max_prefix_len),
            )  # fmt: skip
        if batch.host_lengths is None:
            raise ValueError(
                "npu attention: a captured forward needs ForwardBatch.host_lengths (the "
                "operator's sequence lengths are host task parameters, re-issued by "
                "GraphRunner.prepare before each replay: capabilities.graph_needs_prepare)"
            )
        if batch.mode is ForwardMode.DRAFT_DECODE:
            return self._static_lanes(batch, max_prefix_len, out_cache_loc)
        ps, q = self.page_size, t // bs
        kv_max = -(-(int(max_prefix_len) + q) // ps) * ps  # keys any row of the bucket may see
        table = _table_columns(batch, kv_max // ps, ps)  # [bs, kv_max / P]
        replay_lengths = _captured_rows(batch.host_lengths, bs, q, lanes=None)
        lengths = replay_lengths({})
        if batch.mode is not ForwardMode.TARGET_VERIFY or batch.topk == 1:
            return NPUMetadata(
                batch.mode, out_cache_loc, lengths, table, CAUSAL,
                self._causal_mask(out_cache_loc.device), bs, q, replay_lengths=replay_lengths,
            )  # fmt: skip
        tree = batch.tree_mask
        if tree is None or tuple(tree.shape) != (bs, q, q):
            raise ValueError(
                f"npu attention: TARGET_VERIFY needs tree_mask bool [bs, N, N] = [{bs}, {q}, {q}]"
            )
        dev = out_cache_loc.device
        prefix = batch.prefix_lens.to(torch.int64)[:, None, None]  # [bs, 1, 1]
        extend = batch.extend_lens.to(torch.int64)[:, None, None]
        col = torch.arange(kv_max, device=dev)[None, None, :]  # [1, 1, KV]
        row = torch.arange(q, device=dev)[None, :, None]  # [1, Q, 1]
        rel = col - prefix  # [bs, 1, KV]: tree node of a key column
        in_tree = (rel >= 0) & (rel < q)
        node = rel.clamp(0, q - 1).expand(bs, q, kv_max)
        visible = (col < prefix) | (in_tree & tree.bool().gather(2, node))
        padding = row >= extend  # [bs, Q, 1]: a padding query sees key 0 only (finite output)
        visible = torch.where(padding, col == 0, visible)  # [bs, Q, KV]
        return NPUMetadata(
            batch.mode, out_cache_loc, lengths, table, TREE, (~visible).unsqueeze(1).contiguous(),
            bs, q, replay_lengths=replay_lengths,
        )  # fmt: skip

    def _static_lanes(
        self, batch: ForwardBatch, max_prefix_len: int, out_cache_loc: torch.Tensor
    ) -> NPUMetadata:
        """DRAFT_DECODE under capture: row (b, l) reads the request's prefix blocks, then lane
        l's blocks (page-aligned prefixes), and sees ``prefix + lane_lens`` keys (TND,
        ``sparse_mode=3``, one query per row)."""
        ps, k = self.page_size, batch.topk
        if batch.lane_locs is None or batch.lane_lens is None:
            raise ValueError("npu attention: DRAFT_DECODE needs lane_locs and lane_lens")
        bs = batch.batch_size
        prefix_blocks = _table_columns(batch, max(-(-int(max_prefix_len) // ps), 1), ps)
        n_prefix = batch.prefix_lens.to(torch.int64) // ps  # [bs] (page-aligned prefixes)
        table = _lane_table(prefix_blocks, n_prefix, batch.lane_locs, ps, k)  # [bs*K, C]
        replay_lengths = _captured_rows(batch.host_lengths, bs, 1, lanes=k)
        return NPUMetadata(
            batch.mode, out_cache_loc, replay_lengths({}), table, CAUSAL,
            self._causal_mask(out_cache_loc.device), bs * k, 1, replay_lengths=replay_lengths,
        )  # fmt: skip

    def _is_chain(self, batch: ForwardBatch, extend: list[int]) -> bool:
        """Whether a verify forward's tree mask is causal (topk 1): one host check per forward."""
        tree = batch.tree_mask
        n, bs = extend[0], batch.batch_size
        if min(extend) != max(extend) or tree is None or tuple(tree.shape) != (bs, n, n):
            raise ValueError(
                f"npu attention: TARGET_VERIFY needs the same N for every request and tree_mask "
                f"bool [bs, N, N] = [{bs}, {n}, {n}]"
            )
        causal = torch.ones(n, n, dtype=torch.bool, device=tree.device).tril()
        return bool(torch.equal(tree.bool(), causal.expand(bs, n, n)))

    def _block_table(self, batch: ForwardBatch, max_kv: int) -> torch.Tensor:  # [bs, blocks]
        ps = self.page_size
        blocks = -(-max_kv // ps)
        rows = batch.req_to_token.index_select(0, batch.req_pool_indices.long())
        return (rows[:, : blocks * ps : ps] // ps).to(torch.int32).contiguous()

    def _lane_block_table(
        self, batch: ForwardBatch, prefix: list[int], lane_lens: list[int]
    ) -> torch.Tensor:  # [bs * K, prefix blocks + lane blocks]
        """Row (b, l): request b's prefix blocks (its prefix ends on a page boundary), then the
        blocks of lane l."""
        ps = self.page_size
        if any(p % ps for p in prefix):
            raise ValueError(
                f"npu attention: DRAFT_DECODE needs page-aligned lane prefixes (page size {ps}), "
                f"got {prefix}; the engine must copy the partial last page into each lane"
            )
        prefix_blocks = self._block_table(batch, max(max(prefix), 1))  # [bs, Pb]
        n_prefix = batch.prefix_lens.to(torch.int64) // ps  # [bs]
        return _lane_table(prefix_blocks, n_prefix, batch.lane_locs, ps, batch.topk)

    def _tree_mask(
        self, batch: ForwardBatch, prefix: list[int], n: int, kv_width: int
    ) -> torch.Tensor:  # [bs, 1, N, kv_width] bool, True = masked
        """Node i of request b sees the prefix and the tree nodes ``tree_mask[b, i]`` marks."""
        tree = batch.tree_mask
        bs = batch.batch_size
        if tree is None or tuple(tree.shape) != (bs, n, n):
            raise ValueError(
                f"npu attention: TARGET_VERIFY needs tree_mask bool [bs, N, N] = [{bs}, {n}, {n}]"
            )
        dev = tree.device
        p = torch.tensor(prefix, device=dev)  # [bs]
        cols = torch.arange(kv_width, device=dev)  # [KV]
        visible = (cols[None, None, :] < p[:, None, None]).expand(bs, n, kv_width).clone()
        tree_cols = (p[:, None] + torch.arange(n, device=dev))[:, None, :].expand(bs, n, n)
        visible.scatter_(2, tree_cols, tree.bool())
        return (~visible).unsqueeze(1).contiguous()

    def _causal_mask(self, device: torch.device) -> torch.Tensor:  # [2048, 2048] bool
        if self._causal is None:
            ones = torch.ones(CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE, dtype=torch.bool, device=device)
            self._causal = torch.triu(ones, diagonal=1)
        return self._causal

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        layer: int,
        metadata: NPUMetadata,
    ) -> torch.Tensor:  # [T, Hq, D]
        """Store ``k``/``v`` at ``out_cache_loc``, then attend (module docstring)."""
        m = metadata
        if m.portable is not None:
            return self.portable.forward(q, k, v, layer, m.portable)
        torch_npu = import_torch_npu()
        key_cache = self.kv_pool.paged_k(layer, self.page_size)  # [blocks, P, Hkv, D]
        value_cache = self.kv_pool.paged_v(layer, self.page_size)
        store_paged(key_cache, value_cache, m.out_cache_loc, k, v)
        blocks = key_cache.shape[0]
        key = key_cache.view(blocks, self.page_size, -1)  # [blocks, P, Hkv * D]
        value = value_cache.view(blocks, self.page_size, -1)
        if m.sparse_mode == TREE:
            query = q.reshape(m.rows, m.queries_per_row, self.num_heads, self.head_dim)
        else:
            query = q.contiguous()  # TND
        if graph_tasks.capturing():
            return self._captured_call(torch_npu, query, key, value, m).reshape(q.shape)
        out, _ = torch_npu.npu_fused_infer_attention_score(
            query, key, value, **self.fia_kwargs(m, m.lengths)
        )
        return out.reshape(q.shape)

    def _captured_call(self, torch_npu, query, key, value, m: NPUMetadata) -> torch.Tensor:
        """The operator inside an NPU graph capture, as an updatable task: an
        ``ExternalEvent`` the replay waits on, then ``.out`` with a preallocated workspace in a
        task group of its own (vllm-ascend's ``compilation/acl_graph.py`` pattern; torch_npu's
        ``test_ifa_update``). The graph runner's ``prepare`` re-issues it with new lengths."""
        if m.replay_lengths is None:
            raise RuntimeError(
                "npu attention: eager metadata inside an NPU graph capture (its host lengths "
                "would be baked into the graph); build it with build_static_metadata"
            )
        npu = torch.npu
        stream = npu.current_stream()
        event = npu.ExternalEvent()
        event.wait(stream)
        event.reset(stream)
        kwargs = self.fia_kwargs(m, m.lengths)
        workspace = torch_npu._npu_fused_infer_attention_score_get_max_workspace(
            query, key, value, **kwargs
        )
        out = torch.empty_like(query)
        lse = torch.empty(1, dtype=torch.float32, device=query.device)
        npu.graph_task_group_begin(stream)
        torch_npu.npu_fused_infer_attention_score.out(
            query, key, value, workspace=workspace, out=[out, lse], **kwargs
        )
        handle = npu.graph_task_group_end(stream)

        def reissue(host_params: Mapping[str, Any]) -> None:
            lengths = m.replay_lengths(host_params)
            torch_npu.npu_fused_infer_attention_score.out(
                query, key, value, workspace=workspace, out=[out, lse],
                **self.fia_kwargs(m, lengths),
            )  # fmt: skip

        graph_tasks.record(graph_tasks.AttentionTask(handle, event, reissue))
        return out

    def fia_kwargs(self, m: NPUMetadata, lengths: OperatorLengths) -> dict[str, Any]:
        """Keyword arguments of the fused operator for ``m`` with host ``lengths``."""
        kwargs: dict[str, Any] = dict(
            block_table=m.block_table,
            block_size=self.page_size,
            num_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            scale=self.scale,
            actual_seq_lengths_kv=list(lengths.kv_lens),
            atten_mask=m.atten_mask,
            sparse_mode=m.sparse_mode,
        )
        if m.sparse_mode == TREE:
            kwargs.update(input_layout="BSND", actual_seq_lengths=list(lengths.query_lens))
        else:
            kwargs.update(input_layout="TND", actual_seq_lengths=cumulative(lengths.query_lens))
        return kwargs


def _captured_rows(
    host_lengths: Callable[[Mapping[str, Any]], HostLengths],
    bs: int,
    q: int,
    lanes: int | None,
) -> Callable[[Mapping[str, Any]], OperatorLengths]:
    """The operator lengths of a captured forward for the engine's host parameters: Q queries
    in every row and ``prefix + Q`` keys (the causal diagonal at the end of the row's keys, so
    a row's real tokens see what they see eagerly); DRAFT_DECODE (``lanes`` = K): one query
    per (request, lane) row and ``prefix + lane_lens`` keys (at least 1)."""

    def replay_lengths(host_params: Mapping[str, Any]) -> OperatorLengths:
        given = host_lengths(host_params)
        prefix = [int(x) for x in given.prefix_lens]
        if len(prefix) != bs:
            raise ValueError(
                f"npu attention: host_lengths gave {len(prefix)} prefix lengths for the "
                f"captured batch's {bs} rows"
            )
        if lanes is None:
            return OperatorLengths([q] * bs, [p + q for p in prefix])
        if given.lane_lens is None or len(given.lane_lens) != bs:
            raise ValueError("npu attention: a captured DRAFT_DECODE needs lane_lens per row")
        # a padding request's lanes (no lane slot) see one key, so their output stays finite
        kv = [max(p + int(w), 1) for p, w in zip(prefix, given.lane_lens) for _ in range(lanes)]
        return OperatorLengths([1] * len(kv), kv)

    return replay_lengths


def _table_columns(batch: ForwardBatch, blocks: int, ps: int) -> torch.Tensor:  # [bs, blocks]
    """The first ``blocks`` block ids of each request (block 0, the padding page, past the
    request table's width), from device tensors only."""
    rows = batch.req_to_token.index_select(0, batch.req_pool_indices.to(torch.int64))
    table = (rows[:, : blocks * ps : ps] // ps).to(torch.int32)
    if table.shape[1] < blocks:
        table = torch.nn.functional.pad(table, (0, blocks - table.shape[1]))
    return table.contiguous()


def _lane_table(
    prefix_blocks: torch.Tensor,  # [bs, Pb] int32
    n_prefix: torch.Tensor,  # [bs] prefix blocks of each request
    lane_locs: torch.Tensor,  # [bs, K, W] slots of each lane
    ps: int,
    k: int,
) -> torch.Tensor:  # [bs * K, Pb + W / P] int32
    """Block table of the draft lanes: request b's first ``n_prefix[b]`` blocks, then lane l's."""
    lane_blocks = (lane_locs[:, :, ::ps] // ps).to(torch.int32)  # [bs, K, Wb]
    bs, pb, wb = prefix_blocks.shape[0], prefix_blocks.shape[1], lane_blocks.shape[2]
    col = torch.arange(pb + wb, device=lane_locs.device)  # [C]
    in_prefix = col[None, :] < n_prefix[:, None]  # [bs, C]
    from_prefix = prefix_blocks.gather(1, col.clamp(max=pb - 1).expand(bs, -1))  # [bs, C]
    lane_col = (col[None, :] - n_prefix[:, None]).clamp(0, wb - 1)  # [bs, C]
    from_lane = lane_blocks.gather(2, lane_col[:, None, :].expand(bs, k, -1))  # [bs, K, C]
    table = torch.where(in_prefix[:, None, :], from_prefix[:, None, :], from_lane)
    return table.reshape(bs * k, pb + wb).contiguous()


def _host(values: list[int] | None, name: str, bs: int) -> list[int]:
    """The batch's host list ``name``_cpu, which this backend requires."""
    if values is None:
        raise ValueError(
            f"npu attention: ForwardBatch.{name}_cpu is missing; Ascend's attention operators "
            f"take host-side sequence lengths, which every eager forward carries"
        )
    if len(values) != bs:
        raise ValueError(f"npu attention: {name}_cpu has {len(values)} entries for {bs} requests")
    return [int(x) for x in values]
