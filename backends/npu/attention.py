"""Attention of the npu backend for the five forward modes, on Ascend's fused operators.

KV layout: the pool's ``[num_slots, Hkv, D]`` cache of a layer viewed as ``[blocks, P, Hkv, D]``
(P = page size, 128); a request's keys are read through a block table, ``req_to_token[r, ::P] //
P``, which is why the engine allocates whole pages and copies a prefix's partial last page into
each draft lane.

| mode | operator | queries | what a query sees |
|---|---|---|---|
| DECODE | ``_npu_paged_attention`` | 1 per request | its request's ``prefix + 1`` keys |
| DRAFT_DECODE | ``_npu_paged_attention`` | one row per (request, lane) | a block table of the request's page-aligned prefix followed by the lane's own pages |
| EXTEND, DRAFT_EXTEND | ``npu_fused_infer_attention_score`` TND | the new tokens | causal with the prefix: ``sparse_mode=3`` (bottom-right aligned causal) with the 2048 x 2048 compressed mask |
| TARGET_VERIFY | ``npu_fused_infer_attention_score`` BSND | N per request | the prefix plus its tree ancestors: an explicit ``[bs, 1, N, KV]`` mask (``sparse_mode=0``, True = masked) built from the tree mask, so any tree (topk > 1) verifies, not only chains |

Sequence lengths reach the operators as host lists (``actual_seq_lengths`` /
``actual_seq_lengths_kv`` / ``context_lens``), taken from ``ForwardBatch.*_cpu`` (filled in every
eager forward): no device-to-host sync per layer or per forward.

float32 models: Ascend's fused attention takes float16 / bfloat16 only, so a float32 pool uses
the portable gather + SDPA attention of ``polyspec.backends.common`` on the NPU (exact, slower). It is what
the conformance suite's float32 lossless tests run.

Graph capture: while a graph is being captured (``torch.npu.is_current_stream_capturing()``),
every attention call goes through ``npu_fused_infer_attention_score.out`` inside a task group
and is recorded in the backend's :class:`GraphTaskRecorder`; ``NPUGraphRunner.prepare`` re-issues
each recorded task with the new host lengths before a replay (vllm-ascend's scheme).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from polyspec.backend import AttentionBackend, AttentionMetadata, ForwardBatch, ForwardMode
from polyspec.backends.common import SDPAAttention

from .kv_pool import NPUKVPool
from .runtime import import_torch_npu

CAUSAL_MASK_SIZE = 2048
"""Side of the compressed causal mask ``sparse_mode=3`` requires (fixed by the operator)."""

FIA_DTYPES = (torch.float16, torch.bfloat16)
"""KV dtypes Ascend's fused attention operators take."""


@dataclasses.dataclass
class HostLengths:
    """The host-side length arguments of one forward, per operator row."""

    query_lens: list[int]  # per row: queries (TND: cumulative ends, see ``fia_actual_q``)
    kv_lens: list[int]  # per row: keys visible


def host_lengths(
    mode: ForwardMode,
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    lane_lens: Sequence[int] | None,
    topk: int,
) -> HostLengths:
    """Lengths the operators need, from the batch's host lists (also used by graph updates,
    so a captured call and its update compute them the same way)."""
    if mode is ForwardMode.DRAFT_DECODE:
        if lane_lens is None:
            raise ValueError("npu attention: DRAFT_DECODE needs lane_lens_cpu")
        kv = [p + w for p, w in zip(prefix_lens, lane_lens) for _ in range(topk)]
        return HostLengths([1] * len(kv), kv)
    if mode is ForwardMode.DECODE:
        return HostLengths([1] * len(prefix_lens), [p + 1 for p in prefix_lens])
    return HostLengths(list(extend_lens), [p + e for p, e in zip(prefix_lens, extend_lens)])


def fia_actual_q(mode: ForwardMode, lengths: HostLengths) -> list[int]:
    """``actual_seq_lengths`` of the fused operator: cumulative ends in TND (EXTEND,
    DRAFT_EXTEND), per-row lengths in BSND (TARGET_VERIFY, and decode rows under capture)."""
    if mode in (ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND):
        out, total = [], 0
        for n in lengths.query_lens:
            total += n
            out.append(total)
        return out
    return list(lengths.query_lens)


@dataclasses.dataclass
class NPUMetadata(AttentionMetadata):
    """Per-forward tensors and host lists shared by every layer."""

    mode: ForwardMode
    num_tokens: int  # T
    out_cache_loc: torch.Tensor  # [T] int32 slots receiving the new K/V
    lengths: HostLengths
    block_table: torch.Tensor | None  # [rows, max_blocks] int32
    context_lens: torch.Tensor | None  # [rows] int32 on the host (paged decode)
    atten_mask: torch.Tensor | None  # bool, True = masked (FIA)
    rows: int  # operator batch rows: requests, or requests * K for DRAFT_DECODE
    queries_per_row: int  # BSND query length (N for TARGET_VERIFY, 1 for decode rows)
    topk: int = 1  # lanes per request (DRAFT_DECODE)
    portable: AttentionMetadata | None = None  # float32: the SDPA path's metadata


@dataclasses.dataclass
class GraphTask:
    """One captured attention call: its task-group handle and what re-issuing it needs."""

    handle: Any
    event: Any
    mode: ForwardMode
    topk: int
    kwargs: dict[str, Any]  # tensor arguments of the .out call (kept alive with the graph)


class GraphTaskRecorder:
    """Shared by the backend's attentions and its graph runner: while ``tasks`` is a list, a
    capture is running and attention calls append their :class:`GraphTask` to it."""

    def __init__(self) -> None:
        """Not recording."""
        self.tasks: list[GraphTask] | None = None
        self.workspace: dict[Any, torch.Tensor] = {}  # FIA workspace per (shape, mode) key


class NPUAttention(AttentionBackend):
    """Paged attention over an :class:`NPUKVPool` (module docstring)."""

    def __init__(
        self,
        kv_pool: NPUKVPool,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        page_size: int,
        recorder: GraphTaskRecorder,
    ) -> None:
        """``page_size`` is the block size of the block tables (the allocator's page size)."""
        self.portable = SDPAAttention(kv_pool, num_heads, num_kv_heads, head_dim, scale)
        self.kv_pool = kv_pool
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = float(scale)
        self.page_size = page_size
        self.recorder = recorder
        self.use_fused = kv_pool.dtype in FIA_DTYPES
        self._causal: torch.Tensor | None = None  # [2048, 2048] bool, built on first use

    # ------------------------------------------------------------------ metadata

    def build_metadata(self, batch: ForwardBatch) -> NPUMetadata:
        """Block tables, host lengths and (TARGET_VERIFY) the tree mask of ``batch``."""
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
                batch.mode, batch.num_tokens, out_cache_loc, lengths, None, None, None, bs, 1,
                portable=self.portable.build_metadata(batch),
            )  # fmt: skip
        mode, ps = batch.mode, self.page_size
        if mode is ForwardMode.DRAFT_DECODE:
            table = self._lane_block_table(batch, prefix, lane)
            rows, q_per_row = bs * batch.topk, 1
        else:
            table = self._block_table(batch, max(lengths.kv_lens))
            rows, q_per_row = bs, (max(extend) if mode is ForwardMode.TARGET_VERIFY else 1)
        context_lens = None
        mask = None
        if mode in (ForwardMode.DECODE, ForwardMode.DRAFT_DECODE):
            context_lens = torch.tensor(lengths.kv_lens, dtype=torch.int32)  # host tensor
        elif mode is ForwardMode.TARGET_VERIFY:
            if min(extend) != max(extend):
                raise ValueError("npu attention: TARGET_VERIFY needs the same N for every request")
            mask = self._tree_mask(batch, prefix, extend[0], table.shape[1] * ps)
        else:
            mask = self._causal_mask(batch.out_cache_loc.device)
        return NPUMetadata(
            mode, batch.num_tokens, out_cache_loc, lengths, table, context_lens, mask, rows,
            q_per_row, batch.topk,
        )  # fmt: skip

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
        ps, k = self.page_size, batch.topk
        if any(p % ps for p in prefix):
            raise ValueError(
                f"npu attention: DRAFT_DECODE needs page-aligned lane prefixes (page size {ps}), "
                f"got {prefix}; the engine must copy the partial last page into each lane"
            )
        prefix_blocks = self._block_table(batch, max(max(prefix), 1))  # [bs, Pb]
        lanes = batch.lane_locs  # [bs, K, W]
        lane_blocks = (lanes[:, :, ::ps] // ps).to(torch.int32)  # [bs, K, Wb]
        bs, pb, wb = prefix_blocks.shape[0], prefix_blocks.shape[1], lane_blocks.shape[2]
        n_prefix = torch.tensor([p // ps for p in prefix], device=lanes.device)  # [bs]
        col = torch.arange(pb + wb, device=lanes.device)  # [C]
        in_prefix = col[None, :] < n_prefix[:, None]  # [bs, C]
        from_prefix = prefix_blocks.gather(1, col.clamp(max=pb - 1).expand(bs, -1))  # [bs, C]
        lane_col = (col[None, :] - n_prefix[:, None]).clamp(0, wb - 1)  # [bs, C]
        from_lane = lane_blocks.gather(2, lane_col[:, None, :].expand(bs, k, -1))  # [bs, K, C]
        table = torch.where(in_prefix[:, None, :], from_prefix[:, None, :], from_lane)
        return table.reshape(bs * k, pb + wb).contiguous()

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
        ps = self.page_size
        key_cache = self.kv_pool.paged_k(layer, ps)  # [blocks, P, Hkv, D]
        value_cache = self.kv_pool.paged_v(layer, ps)
        torch_npu._npu_reshape_and_cache(
            key=k.contiguous(), value=v.contiguous(), key_cache=key_cache,
            value_cache=value_cache, slot_indices=m.out_cache_loc,
        )  # fmt: skip
        if self.recorder.tasks is not None:
            return self._captured(q, key_cache, value_cache, m)
        if m.mode in (ForwardMode.DECODE, ForwardMode.DRAFT_DECODE):
            out = torch.empty_like(q)
            torch_npu._npu_paged_attention(
                query=q.contiguous(), key_cache=key_cache, value_cache=value_cache,
                num_kv_heads=self.num_kv_heads, num_heads=self.num_heads, scale_value=self.scale,
                block_table=m.block_table, context_lens=m.context_lens, out=out,
            )  # fmt: skip
            return out
        out, _ = torch_npu.npu_fused_infer_attention_score(
            *self._fia_inputs(q, key_cache, value_cache, m), **self._fia_kwargs(m)
        )
        return out.reshape(q.shape)

    def _fia_inputs(
        self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, m: NPUMetadata
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(query, key, value) as the fused operator reads them: TND / BSND queries, caches as
        ``[blocks, P, Hkv * D]``."""
        blocks = key_cache.shape[0]
        key = key_cache.view(blocks, self.page_size, -1)
        value = value_cache.view(blocks, self.page_size, -1)
        if m.mode in (ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND):
            return q.contiguous(), key, value  # TND: [T, Hq, D]
        return q.reshape(m.rows, m.queries_per_row, self.num_heads, self.head_dim), key, value

    def _fia_kwargs(self, m: NPUMetadata) -> dict[str, Any]:
        """Keyword arguments of the fused operator for ``m`` (host lengths included)."""
        kwargs: dict[str, Any] = dict(
            block_table=m.block_table,
            block_size=self.page_size,
            num_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            scale=self.scale,
            actual_seq_lengths=fia_actual_q(m.mode, m.lengths),
            actual_seq_lengths_kv=list(m.lengths.kv_lens),
        )
        if m.mode in (ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND):
            kwargs.update(input_layout="TND", atten_mask=m.atten_mask, sparse_mode=3)
        elif m.mode is ForwardMode.TARGET_VERIFY:
            kwargs.update(input_layout="BSND", atten_mask=m.atten_mask, sparse_mode=0)
        else:
            kwargs.update(input_layout="BSND", sparse_mode=0)
        return kwargs

    def _captured(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        m: NPUMetadata,
    ) -> torch.Tensor:  # [T, Hq, D]
        """Under graph capture: the fused operator's ``.out`` overload inside a task group,
        recorded so that :meth:`update_task` can give it new host lengths before a replay."""
        torch_npu = import_torch_npu()
        npu = torch.npu
        query, key, value = self._fia_inputs(q, key_cache, value_cache, m)
        kwargs = self._fia_kwargs(m)
        ws_key = (m.mode, tuple(query.shape), tuple(key.shape))
        workspace = self.recorder.workspace.get(ws_key)
        if workspace is None:
            workspace = torch_npu._npu_fused_infer_attention_score_get_max_workspace(
                query, key, value, **kwargs
            )
            self.recorder.workspace[ws_key] = workspace
        out = torch.empty_like(query)
        lse = torch.empty(1, dtype=query.dtype, device=query.device)
        stream = npu.current_stream()
        event = npu.ExternalEvent()
        event.wait(stream)
        event.reset(stream)
        npu.graph_task_group_begin(stream)
        torch_npu.npu_fused_infer_attention_score.out(
            query, key, value, workspace=workspace, out=[out, lse], **kwargs
        )
        handle = npu.graph_task_group_end(stream)
        tensors = dict(query=query, key=key, value=value, workspace=workspace, out=[out, lse])
        self.recorder.tasks.append(GraphTask(handle, event, m.mode, m.topk, {**kwargs, **tensors}))
        return out.reshape(q.shape)


def update_task(task: GraphTask, stream: Any, lengths: HostLengths) -> None:
    """Re-issue a captured attention task with new host lengths on ``stream`` (the update
    stream), then record its event so that the replayed graph waits for the update."""
    torch_npu = import_torch_npu()
    npu = torch.npu
    kwargs = dict(task.kwargs)
    query, key, value = kwargs.pop("query"), kwargs.pop("key"), kwargs.pop("value")
    kwargs["actual_seq_lengths"] = fia_actual_q(task.mode, lengths)
    kwargs["actual_seq_lengths_kv"] = list(lengths.kv_lens)
    with npu.stream(stream):
        npu.graph_task_update_begin(stream, task.handle)
        torch_npu.npu_fused_infer_attention_score.out(query, key, value, **kwargs)
        npu.graph_task_update_end(stream)
        task.event.record(stream)


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
