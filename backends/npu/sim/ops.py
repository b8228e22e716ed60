"""The torch_npu operators the npu backend calls, on the CPU with the reference math.

Each operator checks the contract its documentation states and raises ``NPUContractError``
where the real operator would fail or silently compute something else. Sources (cited per rule
below):

* [DOC-FIA] ``torch_npu.npu_fused_infer_attention_score`` in torch_npu 2.10.0.post4's
  ``torch_npu/_op_plugin_docs.py`` (the Ascend Extension for PyTorch API reference text):
  argument list, ``input_layout``, ``sparse_mode`` 0 / 3, the 2048 x 2048 optimised mask,
  ``actual_seq_lengths`` (TND: cumulative ends), ``block_table`` int32, ``block_size``,
  ``num_key_value_heads`` (GQA).
* [DOC-SPA] ``torch_npu.npu_scatter_pa_kv_cache`` in the same file: scenario 2 (``key`` [T, N, D],
  caches [blocks, block_size, N, D], ``slot_mapping`` [T]), ``cache_mode`` ('PA_NZ' default,
  'Norm' for ND caches), contiguous inputs, equal dtypes, slot range.
* [IFA-HANDLER] ``torch_npu/npu/_npugraph_handlers/ifa_handler.py``: under graph capture the
  operator runs as its ``.out`` overload, and ``actual_seq_lengths`` /
  ``actual_seq_lengths_kv`` are the arguments a graph update changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

CAUSAL_MASK_SIZE = 2048
"""[DOC-FIA] sparse_mode 2/3/4: atten_mask shape (2048, 2048), (1, 2048, 2048) or (1, 1, ...)."""

LAYOUTS = ("BSH", "BSND", "BNSD", "TND")
FIA_DTYPES = (torch.float16, torch.bfloat16)
MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)


class NPUContractError(RuntimeError):
    """A call the real torch_npu operator would reject (or compute wrongly)."""


def _fail(op: str, message: str) -> None:
    raise NPUContractError(f"simulated torch_npu.{op}: {message}")


def _host_ints(op: str, name: str, value: Any) -> list[int] | None:
    """[DOC-FIA] ``SymInt[]?``: a host list of ints (a tensor is not accepted by the schema)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor) or not isinstance(value, Sequence):
        _fail(op, f"{name} must be a host list of int (SymInt[]), got {type(value).__name__}")
    out = []
    for x in value:
        if isinstance(x, torch.Tensor) or not isinstance(x, int) or x < 0:
            _fail(op, f"{name} must hold non-negative Python ints, got {x!r}")
        out.append(int(x))
    return out


def _causal_2048(op: str, mask: torch.Tensor) -> None:
    """[DOC-FIA] sparse_mode 3 takes the optimised lower-triangular mask: 2048 x 2048, True /
    1 above the diagonal (masked), the user guaranteeing its content."""
    if tuple(mask.shape[-2:]) != (CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE) or mask.dim() > 4:
        _fail(op, f"sparse_mode=3 needs atten_mask (2048, 2048), got {list(mask.shape)}")
    if any(s != 1 for s in mask.shape[:-2]):
        _fail(op, f"sparse_mode=3 needs atten_mask (1, [1,] 2048, 2048), got {list(mask.shape)}")
    upper = torch.triu(torch.ones(CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE, dtype=torch.bool), 1)
    if not torch.equal(mask.reshape(CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE).bool().cpu(), upper):
        _fail(op, "sparse_mode=3 needs the upper-triangular (diagonal excluded) masked 2048 mask")


def npu_fused_infer_attention_score(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    atten_mask: torch.Tensor | None = None,
    actual_seq_lengths: Sequence[int] | None = None,
    actual_seq_lengths_kv: Sequence[int] | None = None,
    block_table: torch.Tensor | None = None,
    num_heads: int = 1,
    scale: float = 1.0,
    pre_tokens: int = 2147483647,
    next_tokens: int = 2147483647,
    input_layout: str = "BSH",
    num_key_value_heads: int = 0,
    sparse_mode: int = 0,
    inner_precise: int = 0,
    block_size: int = 0,
    softmax_lse_flag: bool = False,
    **unsupported: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged fused attention (the arguments the npu backend uses); returns (out, lse [1])."""
    out = torch.empty_like(query)
    fia_compute(
        query, key, value, out, atten_mask=atten_mask, actual_seq_lengths=actual_seq_lengths,
        actual_seq_lengths_kv=actual_seq_lengths_kv, block_table=block_table,
        num_heads=num_heads, scale=scale, input_layout=input_layout,
        num_key_value_heads=num_key_value_heads, sparse_mode=sparse_mode, block_size=block_size,
        softmax_lse_flag=softmax_lse_flag, unsupported=unsupported,
    )  # fmt: skip
    return out, torch.zeros(1, dtype=torch.float32, device=query.device)


def fia_compute(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    *,
    atten_mask: torch.Tensor | None,
    actual_seq_lengths: Sequence[int] | None,
    actual_seq_lengths_kv: Sequence[int] | None,
    block_table: torch.Tensor | None,
    num_heads: int,
    scale: float,
    input_layout: str,
    num_key_value_heads: int,
    sparse_mode: int,
    block_size: int,
    softmax_lse_flag: bool = False,
    unsupported: dict[str, Any] | None = None,
) -> None:
    """The checks and reference math of the fused attention, writing ``out``."""
    op = "npu_fused_infer_attention_score"
    if unsupported:
        _fail(op, f"the simulator does not model {sorted(unsupported)}")
    if softmax_lse_flag:
        _fail(op, "softmax_lse_flag=True is not modelled (the backend never asks for the lse)")
    if input_layout not in LAYOUTS:
        _fail(op, f"input_layout {input_layout!r} not one of {LAYOUTS}")
    if query.dtype not in FIA_DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        _fail(op, f"query/key/value must be one float16/bfloat16 dtype, got {query.dtype}, "
              f"{key.dtype}, {value.dtype}")  # fmt: skip
    hq = int(num_heads)
    hkv = int(num_key_value_heads) or hq
    if hq % hkv or hq // hkv > 64:  # [DOC-FIA] num_key_value_heads: divides num_heads, ratio <= 64
        _fail(op, f"num_heads {hq} must be a multiple of num_key_value_heads {hkv}, ratio <= 64")
    q_lens = _host_ints(op, "actual_seq_lengths", actual_seq_lengths)
    kv_lens = _host_ints(op, "actual_seq_lengths_kv", actual_seq_lengths_kv)
    # queries as [B][S_b, Hq, D]
    if input_layout == "TND":
        if query.dim() != 3 or query.shape[1] != hq:
            _fail(op, f"TND query must be [T, num_heads={hq}, D], got {list(query.shape)}")
        if q_lens is None:  # [DOC-FIA] TND: actual_seq_lengths required, its length is B
            _fail(op, "TND needs actual_seq_lengths (cumulative query ends, one per batch)")
        if any(b < a for a, b in zip([0, *q_lens], q_lens)) or (
            q_lens and q_lens[-1] > query.shape[0]
        ):
            _fail(op, f"TND actual_seq_lengths must be non-decreasing cumulative ends <= T="
                  f"{query.shape[0]}, got {q_lens}")  # fmt: skip
        starts = [0, *q_lens[:-1]]
        rows = [(s, e - s) for s, e in zip(starts, q_lens)]
        d = query.shape[2]
    else:
        if input_layout == "BSH":
            if query.dim() != 3 or query.shape[2] % hq:
                _fail(op, f"BSH query must be [B, S, num_heads * D], got {list(query.shape)}")
            qv = query.view(query.shape[0], query.shape[1], hq, -1)
        elif input_layout == "BSND":
            qv = query
        else:
            qv = query.transpose(1, 2)
        if qv.dim() != 4 or qv.shape[2] != hq:
            _fail(op, f"{input_layout} query has {list(query.shape)}, not {hq} heads")
        b, s, d = qv.shape[0], qv.shape[1], qv.shape[3]
        if q_lens is None or s == 1:  # [DOC-FIA] "Q_S为1时该参数无效"
            q_lens = [s] * b
        elif len(q_lens) == 1:
            q_lens = q_lens * b
        elif len(q_lens) < b:
            _fail(op, f"actual_seq_lengths has {len(q_lens)} entries for batch {b}")
        if any(n > s for n in q_lens[:b]):
            _fail(op, f"actual_seq_lengths {q_lens} exceed the query's S={s}")
        rows = [(i, q_lens[i]) for i in range(b)]
    if d % 16:  # [DOC-FIA] float16 / bfloat16: D 16-aligned
        _fail(op, f"head dim {d} must be a multiple of 16")
    batch = len(rows)
    # paged key/value: [blocks, block_size, Hkv * D] or [blocks, Hkv, block_size, D]
    if block_table is None:
        _fail(op, "the simulator models the paged form only: pass block_table and block_size")
    if block_table.dtype != torch.int32 or block_table.dim() != 2:  # [DOC-FIA] block_table int32
        _fail(op, f"block_table must be a 2-D int32 tensor, got {block_table.dtype} "
              f"{list(block_table.shape)}")  # fmt: skip
    if block_table.shape[0] != batch:  # [DOC-FIA] page attention: first dim equals B
        _fail(op, f"block_table has {block_table.shape[0]} rows for batch {batch}")
    if block_size % 128 or not 128 <= block_size <= 512:  # [DOC-FIA] 128 <= block_size <= 512
        _fail(op, f"block_size {block_size} must be a multiple of 128 in [128, 512]")
    if kv_lens is None:  # [DOC-FIA] page attention: actual_seq_lengths_kv required
        _fail(op, "page attention needs actual_seq_lengths_kv")
    if len(kv_lens) == 1:
        kv_lens = kv_lens * batch
    if len(kv_lens) < batch:
        _fail(op, f"actual_seq_lengths_kv has {len(kv_lens)} entries for batch {batch}")
    if key.dim() == 3:
        if key.shape[1] != block_size or key.shape[2] != hkv * d:
            _fail(op, f"key cache must be [blocks, block_size={block_size}, Hkv*D={hkv * d}], "
                  f"got {list(key.shape)}")  # fmt: skip
        k_cache = key.view(key.shape[0], block_size, hkv, d)
        v_cache = value.view(value.shape[0], block_size, hkv, d)
    elif key.dim() == 4 and tuple(key.shape[1:]) == (hkv, block_size, d):
        k_cache, v_cache = key.transpose(1, 2), value.transpose(1, 2)
    else:
        _fail(op, f"key cache must be [blocks, {block_size}, {hkv * d}] or "
              f"[blocks, {hkv}, {block_size}, {d}], got {list(key.shape)}")  # fmt: skip
    if tuple(value.shape) != tuple(key.shape):
        _fail(op, "key and value caches must have one shape")
    max_blocks = -(-max(kv_lens[:batch], default=0) // block_size)
    if block_table.shape[1] < max_blocks:  # [DOC-FIA] second dim >= maxBlockNumPerSeq
        _fail(op, f"block_table has {block_table.shape[1]} columns, the longest sequence needs "
              f"{max_blocks}")  # fmt: skip
    if sparse_mode == 3:
        if atten_mask is None:
            _fail(op, "sparse_mode=3 needs the 2048 x 2048 causal atten_mask")
        _causal_2048(op, atten_mask)
    elif sparse_mode == 0:
        if atten_mask is not None:
            if atten_mask.dtype not in MASK_DTYPES:
                _fail(op, f"atten_mask dtype {atten_mask.dtype} not bool/int8/uint8")
            if input_layout == "TND":
                _fail(op, "TND takes sparse_mode=0 only without a mask, or sparse_mode=3")
    else:
        _fail(op, f"sparse_mode {sparse_mode}: the backend uses only 0 and 3")
    group = hq // hkv
    n_blocks = k_cache.shape[0]
    table = block_table.to(torch.int64)
    for bi, (start, n) in enumerate(rows):
        kv = kv_lens[bi]
        if n == 0:
            continue
        if n > kv and sparse_mode == 3:
            _fail(op, f"batch {bi}: {n} queries but {kv} keys (sparse_mode=3 aligns the causal "
                  f"diagonal bottom-right: queries <= keys)")  # fmt: skip
        nb = -(-kv // block_size)
        ids = table[bi, :nb]
        if nb and (int(ids.min()) < 0 or int(ids.max()) >= n_blocks):
            _fail(op, f"batch {bi}: block ids {ids.tolist()} outside [0, {n_blocks})")
        k = k_cache[ids].reshape(-1, hkv, d)[:kv].float()  # [kv, Hkv, D]
        v = v_cache[ids].reshape(-1, hkv, d)[:kv].float()
        if input_layout == "TND":
            q = query[start : start + n].float()  # [n, Hq, D]
        else:
            q = qv[start, :n].float()
        k = k.repeat_interleave(group, dim=1)  # query head h reads kv head h // group
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [Hq, n, kv]
        masked = torch.zeros(n, kv, dtype=torch.bool, device=q.device)
        if sparse_mode == 3:  # right-down causal: query i sees keys <= kv - n + i
            masked = torch.arange(kv, device=q.device)[None, :] > (
                kv - n + torch.arange(n, device=q.device)[:, None]
            )
        elif atten_mask is not None:
            masked = _explicit_mask(op, atten_mask, bi, batch, n, kv, q_rows_total=qv.shape[1])
        scores = scores.masked_fill(masked[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        o = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)  # [n, Hq, D]
        if input_layout == "TND":
            out[start : start + n] = o
        elif input_layout == "BSND":
            out[start, :n] = o
        elif input_layout == "BNSD":
            out[start, :, :n] = o.transpose(0, 1)
        else:
            out[start, :n] = o.reshape(n, -1)


def _explicit_mask(
    op: str, mask: torch.Tensor, b: int, batch: int, n: int, kv: int, q_rows_total: int
) -> torch.Tensor:  # [n, kv] bool, True = masked
    """[DOC-FIA] sparse_mode 0: (B, 1, Q_S, KV_S), (1, Q_S, KV_S) or (1, 1, Q_S, KV_S) with
    Q_S / KV_S possibly rounded up; True (1) = not computed."""
    if mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[0] in (1, batch):
        m = mask[b if mask.shape[0] == batch else 0, 0]
    elif mask.dim() == 3 and mask.shape[0] == 1:
        m = mask[0]
    else:
        _fail(op, f"sparse_mode=0 atten_mask must be (B, 1, Q_S, KV_S) / (1, [1,] Q_S, KV_S), "
              f"got {list(mask.shape)}")  # fmt: skip
    if m.shape[0] < q_rows_total or m.shape[1] < kv:
        _fail(op, f"atten_mask {list(mask.shape)} is smaller than Q_S={q_rows_total} x KV_S={kv}")
    return m[:n, :kv].bool()


def npu_scatter_pa_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    compress_lens: torch.Tensor | None = None,
    compress_seq_offsets: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    cache_mode: str | None = "PA_NZ",
) -> None:
    """[DOC-SPA] scenario 2: ``key``/``value`` [T, N, D] into ND caches [blocks, block_size, N,
    D] at ``slot_mapping`` [T] (``cache[s // block_size, s % block_size] = key[t]``)."""
    op = "npu_scatter_pa_kv_cache"
    if compress_lens is not None or compress_seq_offsets is not None or seq_lens is not None:
        _fail(op, "compression arguments (scenario 3) are not modelled")
    if cache_mode not in (None, "Norm"):
        _fail(op, f"cache_mode {cache_mode!r} expects NZ-format caches (npu_format_cast(..., 29)); "
              f"pass cache_mode='Norm' for ND [blocks, block_size, N, D] caches")  # fmt: skip
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache),
                    ("value_cache", value_cache), ("slot_mapping", slot_mapping)):  # fmt: skip
        if not t.is_contiguous():  # [DOC-SPA] "输入参数不支持非连续"
            _fail(op, f"{name} must be contiguous")
    if len({key.dtype, value.dtype, key_cache.dtype, value_cache.dtype}) != 1:
        _fail(op, f"key, value and caches must share a dtype, got {key.dtype}, {value.dtype}, "
              f"{key_cache.dtype}, {value_cache.dtype}")  # fmt: skip
    if slot_mapping.dtype not in (torch.int32, torch.int64) or slot_mapping.dim() != 1:
        _fail(op, f"slot_mapping must be 1-D int32/int64, got {slot_mapping.dtype} "
              f"{list(slot_mapping.shape)}")  # fmt: skip
    if key.dim() != 3 or key_cache.dim() != 4 or key.shape[0] != slot_mapping.shape[0]:
        _fail(
            op,
            f"scenario 2 needs key [T, N, D], cache [blocks, block_size, N, D], slots [T]; "
            f"got {list(key.shape)}, {list(key_cache.shape)}, {list(slot_mapping.shape)}",
        )
    if tuple(key.shape[1:]) != tuple(key_cache.shape[2:]) or tuple(value.shape[1:]) != tuple(
        value_cache.shape[2:]
    ):
        _fail(op, f"key {list(key.shape)} / value {list(value.shape)} do not match caches "
              f"{list(key_cache.shape)} / {list(value_cache.shape)}")  # fmt: skip
    capacity = key_cache.shape[0] * key_cache.shape[1]
    if slot_mapping.numel() == 0:
        return
    slots = slot_mapping.to(torch.int64)
    if int(slots.min()) < 0 or int(slots.max()) >= capacity:  # [DOC-SPA] [0, blocks*bs - 1]
        _fail(op, f"slot_mapping outside [0, {capacity - 1}]")
    key_cache.view(capacity, *key_cache.shape[2:]).index_copy_(0, slots, key)
    value_cache.view(capacity, *value_cache.shape[2:]).index_copy_(0, slots, value)


def get_max_workspace(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs):
    """``_npu_fused_infer_attention_score_get_max_workspace``: a workspace tensor for the
    ``.out`` overload (its content is unused by the simulator)."""
    return torch.empty(1024, dtype=torch.uint8, device=query.device)
