"""Every ``torch_npu.*`` and ``torch.npu.*`` name the npu backend uses, with where it is documented.

``tests/core/test_npu_static.py`` parses the backend's sources and fails when they use a name
missing here, so a new vendor call needs a documented source before it can be added. Sources:

* [API]  Ascend Extension for PyTorch custom API reference (torch_npu), hiascend.com, e.g.
  https://www.hiascend.com/document/detail/zh/Pytorch/700/apiref/apilist/ptaoplist_001232.html
  (npu_fused_infer_attention_score, torch_npu 7.0.0 / torch 2.5.1 and later).
* [GRAPH] torch_npu's docs and tests of NPUGraph task groups: ``torch_npu.npu.graph_task_group_
  begin/end`` and ``graph_task_update_begin/end`` (docs/zh/native_apis/... in Ascend/pytorch)
  and its test ``test_ifa_update`` (capture FIA between task-group calls, update its
  ``actual_seq_lengths`` on another stream, then replay).
* [VLLM] vllm-ascend ``vllm_ascend/attention/attention_v1.py`` and ``compilation/acl_graph.py``
  (paged decode, cache writes, workspace sizing, graph parameter updates).
* [CUDA-MIRROR] ``torch.npu`` mirrors ``torch.cuda``'s device / stream / graph API (torch_npu
  README, "torch.npu" module); the names below have the same meaning as their CUDA namesakes.
"""

from __future__ import annotations

TORCH_NPU_NAMES: dict[str, str] = {
    "npu_fused_infer_attention_score": "[API] fused prompt/incremental attention, paged via "
    "block_table; atten_mask True = masked; returns (out, softmax_lse)",
    "_npu_fused_infer_attention_score_get_max_workspace": "[VLLM][GRAPH] workspace for the .out "
    "overload, sized for the largest shapes so a graph update never reallocates",
    "_npu_paged_attention": "[VLLM] paged decode: query [n, Hq, D], caches [blocks, block_size, "
    "Hkv, D], block_table int32, context_lens host int32",
    "_npu_reshape_and_cache": "[VLLM] write key/value [T, Hkv, D] at int32 slot_indices of "
    "[blocks, block_size, Hkv, D] caches",
    "npu_scatter_nd_update_": "[API] in-place scatter of rows: cache[indices[i]] = updates[i]",
}
"""``torch_npu.<name>`` -> source and meaning."""

TORCH_NPU_OVERLOADS: dict[str, str] = {
    "out": "[GRAPH] ``npu_fused_infer_attention_score.out(..., workspace=, out=[out, lse])``",
}
"""``torch_npu.<op>.<overload>`` attributes."""

TORCH_DOT_NPU_NAMES: dict[str, str] = {
    "is_available": "[CUDA-MIRROR]",
    "device_count": "[CUDA-MIRROR]",
    "set_device": "[CUDA-MIRROR]",
    "synchronize": "[CUDA-MIRROR]",
    "mem_get_info": "[CUDA-MIRROR] (free, total) bytes",
    "current_stream": "[CUDA-MIRROR]",
    "Stream": "[CUDA-MIRROR]",
    "stream": "[CUDA-MIRROR] stream context manager",
    "NPUGraph": "[GRAPH][CUDA-MIRROR] torch.cuda.CUDAGraph counterpart (capture_begin, replay, "
    "pool)",
    "graph": "[GRAPH][CUDA-MIRROR] capture context manager (graph, pool=, stream=)",
    "is_current_stream_capturing": "[CUDA-MIRROR]",
    "ExternalEvent": "[GRAPH][VLLM] event the captured task waits on; the update stream records it",
    "graph_task_group_begin": "[GRAPH] start recording an updatable task group on a stream",
    "graph_task_group_end": "[GRAPH] end it; returns the handle used by graph_task_update_begin",
    "graph_task_update_begin": "[GRAPH] (stream, handle): re-issue the task with new host params",
    "graph_task_update_end": "[GRAPH] (stream)",
}
"""``torch.npu.<name>`` -> source and meaning."""
