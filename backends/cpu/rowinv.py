"""Row-invariant CPU kernels (AVX2 + FMA) for bf16 speculative decoding.

The result for one row of `linear` or one query row of `attention` is bitwise the same whatever
other rows come with it, whatever its position, and whatever the thread count, so that verifying
N draft tokens in one forward gives exactly the greedy tokens of N one-token forwards.

The extension is JIT-built on first use (`load()`, through `jit_build.build_extension`: a lock
that dies with its holder, a bounded wait for another process building it, messages on stderr
while it compiles) or ahead of time (`build()`, what `polyspec build-kernels` runs); on machines
that cannot build or run it, `load()` returns None and `unavailable_reason()` says why, so callers
can fall back to stock ops.

`linear` has three paths: "avx2"; "avx512" (16-lane accumulators and taller tiles: a verify
forward of 4-8 rows costs little more than one row); and "amx" (Intel AMX tiles, bf16 inputs
only: up to 16 rows cost about what one does; fp32 inputs run the avx512 kernel). Each has its
own fixed summation order, so their bits differ; a process runs every call on one path, by
default the best the CPU has. POLYSPEC_ROWINV_ISA=avx2|avx512|amx|auto (default auto) forces
one, read when the extension loads: a wrong value, or a path this CPU cannot run, is a
ConfigError. `set_isa()` switches it later (tests, benchmarks); `isa()` says which path runs.
"""

from __future__ import annotations

import functools
import os
import shutil
from types import ModuleType

import torch

from polyspec.errors import ConfigError
from polyspec.kernels import reference

from . import jit_build

_NAME = "polyspec_cpu_rowinv"
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rowinv.cpp")

# -ffp-contract=off: GCC contracts a*b+c into an FMA by default when -mfma is on; doing so in some
# inlined copies but not others would make a row's bits depend on the code path.
# No -ffast-math: it would let the compiler reassociate the fixed accumulation order.
# -fopenmp: at::parallel_for is a header template that only runs in parallel when the including
# translation unit is compiled with OpenMP; without it every call silently runs on one thread.
_CFLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fno-fast-math", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]  # resolves to the libgomp.so.1 torch already loaded (same soname)


def _missing_cpu_flags() -> list[str]:
    """AVX2/FMA flags absent from /proc/cpuinfo; [] where that file does not exist (not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return [flag for flag in ("avx2", "fma") if flag not in flags]
    except OSError:
        pass
    return []


ISA_ENV = "POLYSPEC_ROWINV_ISA"
ISA_CHOICES = ("auto", "avx2", "avx512", "amx")


_NEEDS = {
    "avx512": "it needs AVX-512 F + BW",
    "amx": "it needs AMX-TILE + AMX-BF16, AVX-512, and Linux 5.16+ to grant the tile state",
}


def _isa_request() -> str:
    """POLYSPEC_ROWINV_ISA, checked: a typo must not silently run the other path."""
    value = os.environ.get(ISA_ENV, "auto").strip() or "auto"
    if value not in ISA_CHOICES:
        raise ConfigError(
            f"{ISA_ENV}={value!r}: use 'auto' (the best path the CPU has: AMX, else AVX-512, "
            "else AVX2; the default), 'avx2', 'avx512' or 'amx'"
        )
    return value


def _apply_isa(module: ModuleType, request: str) -> None:
    available = module.available_isas()
    if request != "auto" and request not in available:
        raise ConfigError(
            f"{ISA_ENV}={request!r}, but this CPU cannot run it ({_NEEDS[request]}); the "
            f"paths it can run: {', '.join(available)}"
        )
    module.set_isa(request)


@functools.cache
def _build() -> tuple[ModuleType | None, str]:
    """Build once per process; returns (module, "") or (None, reason). Raises ConfigError for a
    bad POLYSPEC_ROWINV_ISA or POLYSPEC_CPU_BUILD_WAIT: a mistake to fix, not a reason to fall
    back."""
    request = _isa_request()
    module, reason = _compile()
    if module is not None:
        _apply_isa(module, request)
    return module, reason


def _compile() -> tuple[ModuleType | None, str]:
    """Build (or find built) and import the extension; (module, "") or (None, reason)."""
    result = build()
    return result.module, result.reason


def build() -> jit_build.BuildResult:
    """Build (or find built) and import the extension now, in this call (no per-process cache):
    what ``polyspec build-kernels`` runs. Its ``reason`` says why there is no module. Raises
    ConfigError for a bad POLYSPEC_CPU_BUILD_WAIT."""
    wait_s = jit_build.wait_limit()
    try:
        cap = torch.backends.cpu.get_cpu_capability()
        # ATen reports AVX2 only when the CPU has both AVX2 and FMA3, which is what we need.
        if cap not in ("AVX2", "AVX512"):
            return _not_built(f"CPU capability is {cap!r}; the kernels need AVX2 + FMA")
        missing = _missing_cpu_flags()
        if missing:  # ATEN_CPU_CAPABILITY can claim AVX2 on a CPU without it
            return _not_built(f"CPU lacks {', '.join(missing)} (per /proc/cpuinfo)")
        from torch.utils import cpp_extension

        cxx = os.environ.get("CXX", "c++")
        if shutil.which(cxx) is None:
            return _not_built(f"no C++ compiler found ({cxx!r} is not on PATH)")
        if not cpp_extension.is_ninja_available():
            return _not_built("ninja is not available (torch.utils.cpp_extension.load needs it)")
        return jit_build.build_extension(
            _NAME,
            [_SOURCE],
            extra_cflags=_CFLAGS,
            extra_ldflags=_LDFLAGS,
            label="the cpu kernels",
            duration="about a minute",
            wait_s=wait_s,
        )
    except Exception as exc:  # never raise: the caller falls back to stock PyTorch
        return _not_built(f"build or load failed: {type(exc).__name__}: {exc}")


def _not_built(reason: str) -> jit_build.BuildResult:
    return jit_build.BuildResult(None, reason, directory="")


def load() -> ModuleType | None:
    """Return the compiled extension, building it on first call; None if unavailable.
    Raises ConfigError for a bad POLYSPEC_ROWINV_ISA."""
    return _build()[0]


def unavailable_reason() -> str:
    """Why `load()` returns None ("" when the extension is available). Triggers the build."""
    return _build()[1]


def loaded() -> ModuleType | None:
    """The extension if a caller has already built or loaded it in this process, else None
    (never compiles: for kernels that fp32 runs use too, which must not wait for a compiler)."""
    if _build.cache_info().currsize == 0:
        return None
    return _build()[0]


def _module() -> ModuleType:
    module = load()
    if module is None:
        raise RuntimeError(f"rowinv extension unavailable: {unavailable_reason()}")
    return module


def isa() -> str:
    """The path `linear` runs on: "avx2", "avx512" or "amx"."""
    return _module().isa()


def available_isas() -> list[str]:
    """The paths this CPU can run, in order of preference: "avx2", then "avx512", "amx"."""
    return _module().available_isas()


def set_isa(name: str) -> None:
    """Run `linear` on `name` ("avx2", "avx512", "amx" or "auto": the best available) from now on, in
    this process. The paths differ in their bits: switch between runs, never within one."""
    if name not in ISA_CHOICES:
        raise ValueError(f"set_isa({name!r}): use 'auto', 'avx2', 'avx512' or 'amx'")
    _module().set_isa(name)


def linear(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Row-invariant y = x @ w.T + bias with fp32 accumulation.

    x:    [..., K] bfloat16 or float32
    w:    [N, K]   bfloat16, contiguous
    bias: [N]      bfloat16 / float32, or None
    out_dtype: None (x's dtype) or torch.float32 (the fp32 sums before the final rounding: what
          tests compare, since a bf16 output hides almost every 1-ulp difference)
    returns [..., N] (bf16 output is round-to-nearest-even of the fp32 sum).
    """
    if out_dtype not in (None, x.dtype, torch.float32):
        raise ValueError(f"out_dtype must be None, x's dtype or torch.float32, got {out_dtype}")
    if x.dim() == 2:  # the model's case: no reshapes (two dispatches per call, ~140 a round)
        return _module().linear(x, w, bias, out_dtype == torch.float32)
    lead = x.shape[:-1]
    # lead.numel() rather than -1: reshape(-1, 0) is ambiguous when K == 0
    x2 = x.reshape(lead.numel(), x.shape[-1])
    y = _module().linear(x2, w, bias, out_dtype == torch.float32)  # [M, N]
    return y.reshape(*lead, w.shape[0])


def linear_w8(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Row-invariant weight-only int8 linear: y = (x @ q.T) * scale + bias, fp32 math.

    x:     [M, K] bfloat16 or float32
    q:     [N, K] int8, contiguous (``polyspec.kernels.quant.quantize_int8``)
    scale: [N]    float32, one per output row
    bias:  [N]    or None
    out_dtype: None (x's dtype) or torch.float32
    returns [M, N]
    """
    if out_dtype not in (None, x.dtype, torch.float32):
        raise ValueError(f"out_dtype must be None, x's dtype or torch.float32, got {out_dtype}")
    return _module().linear_w8(x, q, scale, bias, out_dtype == torch.float32)


def select_top_k(
    step: int,
    topk_p: torch.Tensor,  # [bs, K] at step 0, [bs*K, K] after; fp32
    topk_index: torch.Tensor,  # same shape; int64 or int32
    hidden: torch.Tensor,  # [bs, F] at step 0, [bs*K, F] after
    scores: torch.Tensor | None,  # [bs, K] fp32; None at step 0
    topk: int,
):
    """``polyspec.kernels.reference.select_top_k``; steps >= 1 in one C++ call (ties: lower
    candidate first), step 0 (a reshape and a repeat) as the reference does it."""
    if (
        step == 0
        or scores is None
        or scores.dtype != torch.float32
        or topk_p.dtype != torch.float32
    ):
        return reference.select_top_k(step, topk_p, topk_index, hidden, scores, topk)
    ids, new_hidden, cs_p, flat, parents = _module().select_top_k_step(
        int(step), topk_p, topk_index, hidden, scores, int(topk)
    )
    bs = scores.shape[0]
    return ids, new_hidden, cs_p, (flat, topk_index.view(bs, topk * topk), parents)


def softmax_topk(
    logits: torch.Tensor,  # [n, V] bf16 or fp32
    k: int,
    index_map: torch.Tensor | None = None,  # [V] int64
) -> tuple[torch.Tensor, torch.Tensor]:  # (topk_p [n, k] fp32, topk_index [n, k] int64)
    """``polyspec.kernels.reference.softmax_topk`` in one pass over the logits (ties: lower id
    first), the ids then mapped through ``index_map``."""
    reference.check_index_map(index_map, logits.shape[-1])
    p, idx = _module().softmax_topk(logits, int(k))
    return p, (idx if index_map is None else index_map[idx])


def attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    scale: float,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Row-invariant attention of each query row over its own ordered list of cache slots.

    q:          [T, Hq, D]   bfloat16 (D a multiple of 8, at most 512)
    k_cache:    [S, Hkv, D]  bfloat16 slot pool (Hq % Hkv == 0; head h reads kv head h // (Hq // Hkv))
    v_cache:    [S, Hkv, D]  bfloat16
    kv_indptr:  [T + 1]      int64 CSR offsets; every row must have at least one slot
    kv_indices: [nnz]        int64 slot ids, attended in the listed order
    returns     [T, Hq, D]   bfloat16 (or float32 with out_dtype=torch.float32: the same fp32
                             values before the final rounding, which makes 1-ulp differences visible)
    """
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
    return _module().attention(
        q, k_cache, v_cache, kv_indptr, kv_indices, float(scale), out_dtype == torch.float32
    )


def rms_norm(
    x: torch.Tensor,  # [T, H] bf16
    weight: torch.Tensor,  # [H] bf16
    eps: float,
) -> torch.Tensor:  # [T, H] bf16
    """``polyspec.kernels.reference.rms_norm`` in one call (bf16 only)."""
    return _module().rms_norm(x, weight, float(eps))


def fused_add_rms_norm(
    x: torch.Tensor,  # [T, H] bf16
    residual: torch.Tensor,  # [T, H] bf16
    weight: torch.Tensor,  # [H] bf16
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, H], [T, H])
    """``polyspec.kernels.reference.fused_add_rms_norm`` in one call (bf16 only)."""
    return _module().fused_add_rms_norm(x, residual, weight, float(eps))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] bf16 -> [T, I]
    """``polyspec.kernels.reference.silu_and_mul`` in one call (bf16 only; any leading dims)."""
    return _module().silu_and_mul(x)


def rotary_embedding(
    positions: torch.Tensor,  # [T]
    q: torch.Tensor,  # [T, Hq, D] bf16
    k: torch.Tensor,  # [T, Hkv, D] bf16
    cos_sin_cache: torch.Tensor,  # [max_pos, D] fp32
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, Hq, D], [T, Hkv, D])
    """``polyspec.kernels.reference.rotary_embedding`` in one call (bf16 q / k only)."""
    return _module().rotary_embedding(positions, q, k, cos_sin_cache, bool(is_neox))


def verify_tree_greedy(
    candidates: torch.Tensor,  # [bs, N]
    retrive_index: torch.Tensor,  # [bs, N]
    retrive_next_token: torch.Tensor,  # [bs, N]
    retrive_next_sibling: torch.Tensor,  # [bs, N]
    target_predict: torch.Tensor,  # [bs, N]
    predicts: torch.Tensor,  # out: [bs * N]
    accept_index: torch.Tensor,  # out: [bs, S + 1]
    accept_length: torch.Tensor,  # out: [bs]
) -> None:
    """``polyspec.kernels.reference.verify_tree_greedy`` as one C++ loop (same checks, same
    outputs, any integer dtypes)."""
    from polyspec.kernels._tree import check_verify_args

    check_verify_args(
        candidates,
        {
            "retrive_index": retrive_index,
            "retrive_next_token": retrive_next_token,
            "retrive_next_sibling": retrive_next_sibling,
            "target_predict": target_predict,
        },
        predicts,
        accept_index,
        accept_length,
    )
    args = (candidates, retrive_index, retrive_next_token, retrive_next_sibling, target_predict)
    pred, index, length = _module().verify_tree_greedy(
        *(t.to(torch.int64).contiguous() for t in args), accept_index.shape[1] - 1
    )
    predicts.copy_(pred.view(predicts.shape))
    accept_index.copy_(index)
    accept_length.copy_(length.view(accept_length.shape))


def build_tree(
    parent_list: torch.Tensor,  # [bs, K*(S-1)+1] ([bs, 0] allowed when S == 1)
    top_scores_index: torch.Tensor,  # [bs, N-1]
    seq_lens: torch.Tensor,  # [bs]
    topk: int,
    num_steps: int,
    num_draft_tokens: int,
    tree_mask_mode,
    tree_mask: torch.Tensor,  # out: [bs, N, N] bool
    positions: torch.Tensor,  # out: [bs*N]
    retrive_index: torch.Tensor,  # out: [bs, N]
    retrive_next_token: torch.Tensor,  # out: [bs, N]
    retrive_next_sibling: torch.Tensor,  # out: [bs, N]
) -> None:
    """``polyspec.kernels.reference.build_tree`` with its parent search, links and ancestor
    walk as one C++ loop (same checks, same outputs)."""
    from polyspec.kernels._tree import check_build_tree_args, write_tree_outputs

    check_build_tree_args(
        parent_list, top_scores_index, seq_lens, topk, num_steps, num_draft_tokens,
        tree_mask_mode, tree_mask, positions, retrive_index, retrive_next_token,
        retrive_next_sibling,
    )  # fmt: skip
    tree, depth, next_token, next_sibling = _module().build_tree(
        parent_list.to(torch.int64).contiguous(),
        top_scores_index.to(torch.int64).contiguous(),
        int(topk),
        int(num_steps),
    )
    write_tree_outputs(
        tree, depth, next_token, next_sibling, seq_lens, tree_mask, positions, retrive_index,
        retrive_next_token, retrive_next_sibling,
    )  # fmt: skip
