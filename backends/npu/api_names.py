"""Every ``torch_npu.*`` and ``torch.npu.*`` name the npu backend uses, with where it is documented.

``tests/core/test_npu_static.py`` parses the backend's sources and fails when they use a name
missing here, so a new vendor call needs a documented source before it can be added. Sources:

* [API]  Ascend Extension for PyTorch custom API reference (torch_npu); the same text ships in
  torch_npu 2.10.0.post4 as ``torch_npu/_op_plugin_docs.py`` (npu_fused_infer_attention_score,
  npu_scatter_pa_kv_cache).
* [SIM] polyspec's torch_npu simulator (``polyspec.backends.npu.sim``).
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
    "npu_fused_infer_attention_score": "[API] fused attention, paged via block_table (int32), "
    "TND (cumulative actual_seq_lengths) with sparse_mode=3 and the 2048 x 2048 mask, or BSND "
    "with sparse_mode=0 and an explicit mask (True = masked); returns (out, softmax_lse)",
    "npu_scatter_pa_kv_cache": "[API][VLLM] Atlas A2/A3 cache write: key/value [T, N, D] into "
    "[blocks, block_size, N, D] caches at slot_mapping [T]; cache_mode='Norm' for ND caches",
    "_npu_fused_infer_attention_score_get_max_workspace": "[VLLM][GRAPH] the workspace of "
    "npu_fused_infer_attention_score.out for the same arguments, sized at capture (no "
    "allocation inside a graph task; torch_npu/npu/_npugraph_handlers/ifa_handler.py)",
    "SIMULATED_DEVICE_TYPE": "[SIM] set only by polyspec's torch_npu simulator "
    "(polyspec.backends.npu.sim): the device tensors live on; absent from the real torch_npu",
}
"""``torch_npu.<name>`` -> source and meaning."""

TORCH_NPU_OVERLOADS: dict[str, str] = {
    "npu_fused_infer_attention_score.out": "[GRAPH][VLLM] results into out=[attn_out, "
    "softmax_lse] with workspace=: the form a graph task is captured and updated in "
    "(vllm-ascend update_attn_params, torch_npu test_ifa_update)",
}
"""``torch_npu.<op>.<overload>`` attributes."""

TORCH_DOT_NPU_NAMES: dict[str, str] = {
    "is_available": "[CUDA-MIRROR]",
    "device_count": "[CUDA-MIRROR] visible NPUs (tensor parallelism: one rank a device)",
    "set_device": "[CUDA-MIRROR] bind this process to npu:<rank>",
    "synchronize": "[CUDA-MIRROR]",
    "mem_get_info": "[CUDA-MIRROR] (free, total) bytes",
    "current_stream": "[CUDA-MIRROR]",
    "Stream": "[CUDA-MIRROR]",
    "stream": "[CUDA-MIRROR] stream context manager",
    "NPUGraph": "[GRAPH][CUDA-MIRROR] torch.cuda.CUDAGraph counterpart (capture_begin, replay, "
    "pool)",
    "graph": "[GRAPH][CUDA-MIRROR] capture context manager (graph, pool=, stream=)",
    "ExternalEvent": "[GRAPH] torch_npu/npu/streams.py: waitable before it is recorded; a "
    "captured wait blocks each replay until the update stream records it; reset() clears it",
    "graph_task_group_begin": "[GRAPH] start an updatable task group on the capturing stream",
    "graph_task_group_end": "[GRAPH] end it; returns the handle graph_task_update_begin takes",
    "graph_task_update_begin": "[GRAPH] re-issue a task group's operators with new arguments",
    "graph_task_update_end": "[GRAPH] end the update",
}
"""``torch.npu.<name>`` -> source and meaning."""
