"""The CUDA backend: the shared allocator, KV pool and SDPA attention layout
(``polyspec.backends.common``) on a CUDA device, the portable Triton kernels in the KernelSet,
and real CUDA graphs.

Kernels (``POLYSPEC_CUDA_KERNELS``):

* ``rowinv`` (default): every linear layer runs :mod:`polyspec.kernels.triton.linear` and
  every attention :class:`.attention.RowInvariantAttention`
  (:mod:`polyspec.kernels.triton.list_attention`), both row-invariant: a token's
  result does not depend on how many tokens share the forward, so a verify forward computes
  bitwise what a decode step would, and greedy speculative output equals plain greedy output
  in bf16 too.
* ``torch``: cuBLAS through ``F.linear`` and the SDPA attention below (the kernels before
  row-invariance; bf16 outputs may then part after a near-tie, docs/benchmarks.md).

On compute capability 9.0 and later every Triton kernel (the KernelSet's, the linear, the
attention's K/V store, key lists and attention) launches with programmatic dependent launch
(:mod:`polyspec.kernels.triton.pdl`): each may start while the one before it ends, which hides
the launch gap between a round's few hundred small kernels. ``POLYSPEC_CUDA_PDL=0`` turns it
off (same results, a switch for timing it and for bisecting).

In ``torch`` mode attention is :class:`polyspec.backends.common.SDPAAttention`, which is plain
torch and device-agnostic: on CUDA, ``scaled_dot_product_attention`` dispatches to the flash / memory
efficient kernels, and every mode (tree masks included) works over the paged KV cache. It reads
host-side lengths while building metadata, so the attention metadata is built outside captured
graphs (the engine builds it once per forward anyway).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch

from polyspec.backend import Backend, HostRead, KernelSet
from polyspec.backends.common import PagedAllocator, SDPAAttention, TensorKVPool
from polyspec.kernels.reference import reference_kernels
from polyspec.kernels.triton import triton_kernel_overrides

from .graph import CUDAGraphRunner
from .plugin import CAPABILITIES as CUDA_CAPABILITIES

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _chosen_overrides() -> dict:
    """The Triton kernels, minus those ``POLYSPEC_CUDA_REFERENCE_KERNELS`` names ("all", or a
    comma-separated list of KernelSet names): a switch for bisecting a kernel problem."""
    import os

    keep_reference = os.environ.get("POLYSPEC_CUDA_REFERENCE_KERNELS", "").strip()
    if keep_reference == "all":
        return {}
    names = {n.strip() for n in keep_reference.split(",") if n.strip()}
    unknown = names - set(KernelSet.names())
    if unknown:
        raise ValueError(
            f"POLYSPEC_CUDA_REFERENCE_KERNELS names unknown kernels {sorted(unknown)}; "
            f"known: {', '.join(KernelSet.names())} (or 'all')"
        )
    return {k: v for k, v in triton_kernel_overrides().items() if k not in names}


def _pdl_enabled(device_index: int) -> bool:
    """``POLYSPEC_CUDA_PDL``: unset or "1", programmatic dependent launch where the device has
    it (compute capability 9.0 and later); "0", never (module doc)."""
    value = os.environ.get("POLYSPEC_CUDA_PDL", "1").strip() or "1"
    if value not in ("0", "1"):
        raise ValueError(
            f"POLYSPEC_CUDA_PDL={value!r}: use '1' (programmatic dependent launch where the "
            f"device supports it, the default) or '0' (off)"
        )
    return value == "1" and torch.cuda.get_device_capability(device_index) >= (9, 0)


def _rotary_in_store() -> bool:
    """``POLYSPEC_CUDA_ROTARY_IN_STORE``: unset or "1" (the default), the row-invariant
    attention rotates q and k in the launch that stores K/V (``rotary_store_kv``, bitwise the
    values of the two kernels: checked under Triton's interpreter in CI and compiled on an
    H100, where the cuda conformance suite's ``test_lossless`` passed with it); "0", the
    KernelSet's ``rotary_embedding`` then ``store_kv``, one launch a layer more."""
    value = os.environ.get("POLYSPEC_CUDA_ROTARY_IN_STORE", "1").strip() or "1"
    if value not in ("0", "1"):
        raise ValueError(
            f"POLYSPEC_CUDA_ROTARY_IN_STORE={value!r}: use '1' (rotary embedding in the K/V "
            f"store's launch, the default) or '0' (two launches)"
        )
    return value == "1"


def _kernel_mode() -> str:
    """``POLYSPEC_CUDA_KERNELS``: "rowinv" (default) or "torch" (module doc)."""
    mode = os.environ.get("POLYSPEC_CUDA_KERNELS", "rowinv").strip() or "rowinv"
    if mode not in ("rowinv", "torch"):
        raise ValueError(
            f"POLYSPEC_CUDA_KERNELS={mode!r} is not a kernel mode; use 'rowinv' (row-invariant "
            f"Triton linear and attention, the default) or 'torch' (cuBLAS and SDPA)"
        )
    return mode


class CUDABackend(Backend):
    """NVIDIA GPUs through torch.cuda, with the Triton kernels of ``polyspec.kernels.triton``."""

    name = "cuda"
    device_type = "cuda"

    def __init__(self, device_index: int | None = None) -> None:
        """Use CUDA device ``device_index`` (default: the current device). Raises
        ``NotImplementedError`` when no CUDA device is usable and ``ImportError`` when Triton is
        missing."""
        if not torch.cuda.is_available():
            raise NotImplementedError(
                "the cuda backend needs a usable CUDA device, but torch.cuda.is_available() is "
                f"False (torch {torch.__version__}, CUDA {torch.version.cuda}); check the driver "
                "and CUDA_VISIBLE_DEVICES, or select the cpu backend"
            )
        self._index = torch.cuda.current_device() if device_index is None else device_index
        if not 0 <= self._index < torch.cuda.device_count():
            raise ValueError(
                f"cuda backend: device {self._index} does not exist; "
                f"{torch.cuda.device_count()} CUDA device(s) are visible"
            )
        self.capabilities = CUDA_CAPABILITIES
        self.pdl = _pdl_enabled(self._index)
        overrides = _chosen_overrides()
        self._triton_kernels = frozenset(overrides)
        if self.pdl:  # every Triton KernelSet entry takes ``pdl``
            overrides = {k: functools.partial(fn, pdl=True) for k, fn in overrides.items()}
        self.kernels = dataclasses.replace(reference_kernels(), **overrides)
        self.kernel_mode = _kernel_mode()
        self._read_buffers: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}

    def device(self, rank: int | None = None) -> torch.device:
        """CUDA device of local rank ``rank`` (None: this process's), offset from the device
        this backend was created on."""
        return torch.device("cuda", self._index + (self.local_rank if rank is None else rank))

    def device_count(self) -> int:
        """The CUDA devices this process sees from the backend's own on."""
        return torch.cuda.device_count() - self._index

    def bind_local_rank(self, rank: int) -> None:
        """Local rank ``rank`` runs on ``device(rank)``, made current for NCCL."""
        self.local_rank = rank
        torch.cuda.set_device(self.device())

    def synchronize(self) -> None:
        """Wait for all queued work on this backend's device."""
        torch.cuda.synchronize(self.device())

    def host_tensor(self, values: list[int] | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Pinned host tensor, copied with ``non_blocking=True``: the copy is queued behind the
        running graphs instead of waiting for them (PyTorch's pinned-memory cache keeps the
        host buffer alive until the copy has run)."""
        if isinstance(values, torch.Tensor):  # a pinned copy: the caller may reuse its buffer
            host = torch.empty(values.shape, dtype=dtype, pin_memory=True).copy_(values)
        else:
            host = torch.tensor(values, dtype=dtype, pin_memory=True)
        return host.to(self.device(), non_blocking=True)

    def read_async(self, tensor: torch.Tensor) -> HostRead:  # [n] device -> [n] host
        """A non-blocking copy into pinned memory, waited on through a CUDA event. The
        pinned buffers are reused in a ring of three per (size, dtype): the engine has at most
        two reads outstanding (a round's, and the round queued behind it)."""
        ring = self._read_buffers.setdefault((tensor.numel(), tensor.dtype), [])
        if len(ring) < 3:  # a new buffer until the ring is full: never one still in flight
            host = torch.empty(tensor.numel(), dtype=tensor.dtype, pin_memory=True)
        else:  # the oldest, whose read the engine has waited for (or dropped) by now
            host = ring.pop(0)
        ring.append(host)
        host.copy_(tensor.reshape(-1), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return HostRead(host, event.synchronize)

    def memory_info(self) -> tuple[int, int]:
        """(free bytes, total bytes) of the device, from ``cudaMemGetInfo``."""
        free, total = torch.cuda.mem_get_info(self.device())
        return int(free), int(total)

    def row_invariant(self, dtype: torch.dtype) -> bool:
        """Every float dtype in ``rowinv`` mode (module doc); no claim in ``torch`` mode."""
        return self.kernel_mode == "rowinv" and dtype in _DTYPES.values()

    def linear_fn(self, weight: torch.Tensor):  # weight [out, in]
        """The row-invariant Triton linear for float weights in ``rowinv`` mode (module doc);
        None (``F.linear``, cuBLAS) in ``torch`` mode."""
        if self.kernel_mode != "rowinv" or weight.dim() != 2:
            return None
        if weight.dtype not in _DTYPES.values():
            return None
        from polyspec.kernels.triton.linear import row_invariant_linear

        w = weight.contiguous()
        pdl = self.pdl

        def linear(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            return row_invariant_linear(x, w, bias, pdl=pdl)

        return linear

    def make_allocator(self, num_slots: int, page_size: int) -> PagedAllocator:
        """A token-slot (``page_size == 1``) or paged allocator; free lists stay on the host,
        slots are handed out on the device."""
        return PagedAllocator(num_slots, page_size, self.device(), self.index_dtype)

    def make_kv_pool(
        self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> TensorKVPool:
        """Zero-initialised ``[num_layers, num_slots, Hkv, D]`` K and V tensors on the device."""
        if dtype not in _DTYPES.values():
            raise ValueError(
                f"cuda backend: unsupported KV dtype {dtype}; use one of {self.capabilities.dtypes}"
            )
        return TensorKVPool(num_slots, num_layers, num_kv_heads, head_dim, dtype, self.device())

    def make_attention(
        self, kv_pool: TensorKVPool, num_heads: int, num_kv_heads: int, head_dim: int, scale: float
    ) -> SDPAAttention:
        """Attention over ``kv_pool`` (a pool made by :meth:`make_kv_pool`): the row-invariant
        list attention in ``rowinv`` mode, SDPA in ``torch`` mode (module doc)."""
        if not isinstance(kv_pool, TensorKVPool) or kv_pool.device.type != "cuda":
            raise TypeError(
                f"cuda backend: make_attention needs a pool from make_kv_pool, got "
                f"{type(kv_pool).__name__}"
            )
        if self.kernel_mode == "rowinv":
            from .attention import RowInvariantAttention

            # the Triton rotary_embedding's arithmetic, so only where it is this KernelSet's
            fused = _rotary_in_store() and "rotary_embedding" in self._triton_kernels
            return RowInvariantAttention(
                kv_pool, num_heads, num_kv_heads, head_dim, scale, pdl=self.pdl,
                rotary_in_forward=fused,
            )  # fmt: skip
        if os.environ.get("POLYSPEC_CUDA_TRITON_ATTENTION", "") == "1":
            # Checked against the oracle under the Triton interpreter, not yet measured on a
            # GPU: opt-in until a benchmark says it beats SDPA (docs/backends/cuda.md).
            from .attention import TritonAttention

            return TritonAttention(kv_pool, num_heads, num_kv_heads, head_dim, scale)
        return SDPAAttention(kv_pool, num_heads, num_kv_heads, head_dim, scale)

    def make_graph_runner(self) -> CUDAGraphRunner:
        """A runner that captures CUDA graphs on this backend's device."""
        return CUDAGraphRunner(self.device())
