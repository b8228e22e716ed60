"""The cpu reference backend: the whole contract in plain PyTorch, eager, any page size.

It is the oracle the conformance suite compares every other backend with, and also the
backend that runs real models on CPU, so its attention precomputes all indices once per forward.

bf16 models run on two small C++ kernels (``rowinv.cpp``: linear and attention, AVX2 + FMA,
built on first use) whose result for a token does not depend on the tokens computed with it, so
a verify forward over N tokens gives bitwise the logits of N one-token decode steps and bf16
speculative decoding emits exactly plain decoding's tokens. Where they cannot be built (no
AVX2, no compiler) or with ``POLYSPEC_CPU_KERNELS=torch``, bf16 runs on stock PyTorch
(``F.linear``, oneDNN, SDPA), where a near-tie can resolve differently in the two paths.
"""

from __future__ import annotations

import dataclasses
import os
import warnings

import torch
import torch.nn.functional as F

from polyspec.backend import Backend, BackendCapabilities, KernelSet
from polyspec.backends.common import EagerGraphRunner, PagedAllocator, SDPAAttention, TensorKVPool
from polyspec.errors import ConfigError
from polyspec.kernels.reference import check_draft_layer_input_args, reference_kernels

from . import bitmask, rowinv

CPU_CAPABILITIES = BackendCapabilities(
    graph_capture=False,
    graph_needs_prepare=False,
    max_graph_shapes=None,
    tree_attention=True,
    page_sizes=None,
    index_dtype="int64",
    dtypes=("float32", "bfloat16", "float16"),
    static_metadata=True,
    weight_quantization=("int8",),
)
"""What the cpu backend supports: everything, but its graph runner is eager."""


class CPUBackend(Backend):
    """Plain-PyTorch backend on ``torch.device("cpu")`` with the reference kernels (and
    ``apply_token_bitmask`` in numpy)."""

    name = "cpu"
    device_type = "cpu"

    def __init__(self) -> None:
        """The reference kernel set, with the C++ layer ops for bf16 unless
        ``POLYSPEC_CPU_KERNELS=torch``."""
        self.capabilities = CPU_CAPABILITIES
        # structured output's masks in single-threaded numpy (bitmask.py says why)
        reference = dataclasses.replace(
            reference_kernels(), apply_token_bitmask=bitmask.apply_token_bitmask
        )
        self.kernels = reference
        self.kernel_choice = os.environ.get("POLYSPEC_CPU_KERNELS", "auto").strip() or "auto"
        if self.kernel_choice not in ("auto", "torch"):
            raise ConfigError(
                f"POLYSPEC_CPU_KERNELS={self.kernel_choice!r}: use 'auto' (the row-invariant "
                "C++ kernels for bf16 where they build, the default) or 'torch' (stock PyTorch "
                "only)"
            )
        if self.kernel_choice == "auto":
            self.kernels = dataclasses.replace(reference, **_bf16_layer_ops(self, reference))

    def share_host(self, local_ranks: int) -> None:
        """Each rank takes its share of the cores for torch's threads (at least one), unless
        ``OMP_NUM_THREADS`` sets them or they are fewer already. At the default every rank's
        OpenMP team is as wide as the machine, and a team whose threads wait for cores the
        other ranks hold spins through each forward: two ranks on 2 cores decoded 3x slower
        than with one thread each (docs/benchmarks.md, "CPU: tensor parallel")."""
        if "OMP_NUM_THREADS" in os.environ:
            return
        share = max(1, len(os.sched_getaffinity(0)) // local_ranks)
        if torch.get_num_threads() > share:
            torch.set_num_threads(share)

    def row_invariant_kernels(self):
        """The built ``rowinv`` extension for bf16 models, or None (``POLYSPEC_CPU_KERNELS=torch``,
        or it cannot be built here: :func:`rowinv.unavailable_reason` says why)."""
        if self.kernel_choice == "torch":
            return None
        # Resolved once per backend: the layer ops ask on every call, and a missing extension
        # must warn once, not once per op.
        if not hasattr(self, "_rowinv_module"):
            self._rowinv_module = rowinv.load()
            if self._rowinv_module is None:
                warnings.warn(
                    f"cpu backend: row-invariant bf16 kernels unavailable "
                    f"({rowinv.unavailable_reason()}); bf16 runs on stock PyTorch, slower at "
                    "several rows, and its speculative output can part from plain output after "
                    "a near-tie (dtype 'auto' loads a GGUF target in float32 here instead)",
                    stacklevel=2,
                )
        return self._rowinv_module

    def memory_info(self) -> tuple[int, int]:
        """(available, total) bytes of host memory, or (0, 0) where the OS does not say."""
        try:
            page = os.sysconf("SC_PAGE_SIZE")
            return (os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page)
        except (ValueError, OSError, AttributeError):
            return (0, 0)

    def row_invariant(self, dtype: torch.dtype) -> bool:
        """bf16 where the row-invariant kernels are built (module doc). fp32 runs oneDNN and
        SDPA, whose results are close across row counts but not claimed bitwise."""
        return dtype == torch.bfloat16 and self.row_invariant_kernels() is not None

    def prepare_linear_weight(self, weight: torch.Tensor) -> torch.Tensor:  # [out, in]
        """fp32 weights column-major: oneDNN/MKL run ``x @ W.T`` with a contiguous ``W.T`` up to
        2x faster for the 1-16 row inputs of decode and verify (measured at a79670e)."""
        if weight.dtype != torch.float32 or weight.dim() != 2:
            return weight
        return weight.t().contiguous().t()

    def quantized_linear_fn(self, weight: torch.Tensor, scheme: str):  # weight [out, in]
        """``"int8"`` for bf16 weights where the C++ kernels are built (``rowinv.linear_w8``:
        int8 weights, fp32 math, row-invariant); None otherwise (fp32 runs never wait for the
        compiler, and a dequantizing fallback would read more bytes than it saves)."""
        if scheme != "int8" or weight.dim() != 2 or weight.dtype != torch.bfloat16:
            return None
        if self.row_invariant_kernels() is None:
            return None
        from polyspec.kernels.quant import quantize_int8

        q, scale = quantize_int8(weight)
        # fn(x, bias) straight into the kernel (no Python frame per call)
        return self.row_invariant_kernels().BoundLinearW8(q, scale)

    def auto_weight_quantization(self, dtype: torch.dtype) -> str | None:
        """int8 where the C++ kernels run on AVX-512 or AMX. On an AVX2-only CPU the int8
        kernel's unpacking (two instructions per 8 weights, against two per 16 for bf16) costs
        more than the bytes it saves: the draft lm_head at 1 row took 1.07 ms in int8 against
        0.85 ms in bf16 (``benchmarks/bench_draft_kernels.py``, 2-core AMD EPYC Zen 1;
        docs/benchmarks.md, "Draft weights, int8 or bf16"), so the head stays in bf16 there."""
        module = self.row_invariant_kernels() if dtype == torch.bfloat16 else None
        if module is None or module.isa() == "avx2":
            return None
        return "int8"

    def linear_fn(self, weight: torch.Tensor):  # weight [out, in]
        """bf16: the row-invariant kernel (module doc) where it is built. Otherwise weights
        prepacked for oneDNN (``torch.ops.mkldnn._reorder_linear_weight``).

        bf16 on a CPU with native oneDNN bf16 (AVX-512-BF16 / AMX): a packed bf16 copy,
        bit-identical to ``F.linear`` and about 1.5x faster at streaming a decode step's
        weights. fp32: a packed fp32 copy for every row count (one kernel, so a row's result
        does not depend on how many rows came with it, which keeps speculative and plain fp32
        greedy decoding token-identical). bf16 elsewhere (AVX2): ``F.linear`` in bf16 costs a
        pass over the weight per input row, so a 6-row verify cost 5.5x a 1-row decode; such
        inputs go to a packed fp32 copy (computed in fp32, rounded to bf16: 1.2x the 1-row
        cost at 6 rows), and single rows stay on ``F.linear``, 1.3-1.6x faster there
        (measured at b7fe0ca). None where oneDNN is missing, or for other dtypes."""
        if weight.dim() != 2 or weight.dtype not in (torch.bfloat16, torch.float32):
            return None
        module = self.row_invariant_kernels() if weight.dtype == torch.bfloat16 else None
        if module is not None:
            # fn(x, bias) straight into the kernel: a Python closure and rowinv.linear's
            # wrapper cost ~2 us a call, ~0.25 ms a SmolLM2 forward
            return module.BoundLinear(weight.contiguous())
        if not torch.backends.mkldnn.is_available():
            return None
        if weight.dtype == torch.bfloat16 and _onednn_bf16():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())

            def packed_linear(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
                return torch.ops.mkldnn._linear_pointwise(
                    x.contiguous(), packed, bias, "none", [], ""
                )

            return packed_linear

        packed32 = torch.ops.mkldnn._reorder_linear_weight(weight.float().contiguous())
        out_dtype = weight.dtype
        one_row_f_linear = weight.dtype == torch.bfloat16

        def packed_fp32_linear(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            if one_row_f_linear and x.numel() == x.shape[-1]:
                return F.linear(x, weight, bias)
            b32 = None if bias is None else bias.float()
            out = torch.ops.mkldnn._linear_pointwise(
                x.float().contiguous(), packed32, b32, "none", [], ""
            )
            return out.to(out_dtype)

        return packed_fp32_linear

    def make_allocator(self, num_slots: int, page_size: int) -> PagedAllocator:
        """A token-slot (``page_size == 1``) or paged allocator over ``num_slots`` slots."""
        return PagedAllocator(num_slots, page_size, self.device(), self.index_dtype)

    def make_kv_pool(
        self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> TensorKVPool:
        """Zero-initialised ``[num_layers, num_slots, Hkv, D]`` K and V tensors."""
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(
                f"cpu backend: unsupported KV dtype {dtype}; use one of {self.capabilities.dtypes}"
            )
        return TensorKVPool(num_slots, num_layers, num_kv_heads, head_dim, dtype, self.device())

    def make_attention(
        self, kv_pool: TensorKVPool, num_heads: int, num_kv_heads: int, head_dim: int, scale: float
    ) -> SDPAAttention:
        """SDPA attention over ``kv_pool`` (a pool made by :meth:`make_kv_pool`); for bf16
        pools, the row-invariant kernel in its place where it is built (module doc)."""
        if not isinstance(kv_pool, TensorKVPool):
            raise TypeError(
                f"cpu backend: make_attention needs a pool from make_kv_pool, got "
                f"{type(kv_pool).__name__}"
            )
        exact = store_and_attend = None
        # fp32 pools never ask for the extension: asking builds it, and fp32 runs must not wait
        module = self.row_invariant_kernels() if kv_pool.dtype == torch.bfloat16 else None
        if module is not None:
            exact, store_and_attend = rowinv.attention, module.store_and_attend
        return SDPAAttention(
            kv_pool, num_heads, num_kv_heads, head_dim, scale, exact, store_and_attend
        )

    def make_graph_runner(self) -> EagerGraphRunner:
        """An eager runner that enforces the capture / replay rules."""
        return EagerGraphRunner()


def _onednn_bf16() -> bool:
    """oneDNN is built in and this CPU runs its bf16 kernels natively."""
    try:
        return bool(
            torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        )
    except (AttributeError, RuntimeError):
        return False


def _bf16_layer_ops(backend: CPUBackend, reference: KernelSet) -> dict:
    """The decoder-layer kernels (norms, rotary, SiLU-and-mul): the C++ ones for bf16 inputs
    once the extension is built, the reference for every other dtype. The extension is only
    built when a bf16 input first arrives, so fp32 runs never wait for the compiler. Also
    greedy tree verification and the tree build: C++ loops whenever the extension is already
    loaded."""

    def pick(name: str, is_bf16):
        ref = getattr(reference, name)

        def kernel(*args, **kwargs):
            # the extension's entry point itself: these run a few times per layer, and a
            # Python wrapper around each cost as much as the kernel at batch 1
            if is_bf16(*args) and (module := backend.row_invariant_kernels()) is not None:
                return getattr(module, name)(*args, **kwargs)
            return ref(*args, **kwargs)

        kernel.__name__ = kernel.__qualname__ = name
        kernel.__doc__ = ref.__doc__
        return kernel

    def once_loaded(name: str, takes=lambda *_: True):
        # The C++ loop once the extension is loaded (a bf16 model loads it) and ``takes`` the
        # arguments; the reference otherwise, so fp32 runs never wait for the compiler.
        ref = getattr(reference, name)

        def kernel(*args, **kwargs):
            if (
                rowinv.loaded() is not None
                and takes(*args)
                and all(not isinstance(a, torch.Tensor) or a.device.type == "cpu" for a in args)
            ):
                return getattr(rowinv, name)(*args, **kwargs)
            return ref(*args, **kwargs)

        kernel.__name__ = kernel.__qualname__ = name
        kernel.__doc__ = ref.__doc__
        return kernel

    bf16 = torch.bfloat16
    norm = pick("rms_norm", lambda x, w, *_: x.dtype == bf16 and w.dtype == bf16)

    def draft_layer_input(input_ids, embed_weight, features, embed_norm, feature_norm, eps):
        # the reference's steps over this backend's RMSNorm (launches cost nothing here)
        check_draft_layer_input_args(input_ids, embed_weight, features, embed_norm, feature_norm)
        e = norm(torch.nn.functional.embedding(input_ids, embed_weight), embed_norm, eps)
        return torch.cat([e, norm(features, feature_norm, eps)], dim=-1)

    draft_layer_input.__doc__ = reference.draft_layer_input.__doc__
    return {
        "draft_layer_input": draft_layer_input,
        "verify_tree_greedy": once_loaded("verify_tree_greedy"),
        "build_tree": once_loaded("build_tree"),
        "select_top_k": once_loaded("select_top_k"),
        "softmax_topk": once_loaded(
            "softmax_topk", lambda logits, *_: logits.dtype in (bf16, torch.float32)
        ),
        "rms_norm": norm,
        "fused_add_rms_norm": pick(
            "fused_add_rms_norm",
            lambda x, r, w, *_: x.dtype == bf16 and r.dtype == bf16 and w.dtype == bf16,
        ),
        "silu_and_mul": pick("silu_and_mul", lambda x, *_: x.dtype == bf16),
        "rotary_embedding": pick(
            "rotary_embedding",
            lambda pos, q, k, cache, *_: (
                q.dtype == bf16 and k.dtype == bf16 and cache.dtype == torch.float32
            ),
        ),
    }
