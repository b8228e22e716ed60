"""An Ascend-shaped constrained backend on the CPU, for testing the engine without an NPU.

It is the shared backend mechanism (``polyspec.backends.common``: the cpu backend's exact
numerics) and the reference kernels behind the constraints Ascend NPUs impose, each
enforced loudly so that an engine path that would break on Ascend breaks here first:

* **int32 indices** (``index_dtype="int32"``): Ascend's cache / paged-attention operators take
  int32 slot mappings and block tables. Every kernel argument that holds slots, rows, lengths or
  tree links, and every index tensor the attention and KV pool receive, must be int32; an int64
  one raises ``TypeError``.
* **host-side sequence lengths**: the fused attention operator takes ``actual_seq_lengths`` as
  host lists, which the contract promises in every eager forward. ``build_metadata`` raises
  unless ``prefix_lens_cpu`` / ``extend_lens_cpu`` (and ``lane_lens_cpu`` in DRAFT_DECODE) are
  filled and equal the device tensors.
* **page size 128 only** (``page_sizes=(128,)``): the KV cache is read through block tables, so
  every request's slots must be whole, consecutive 128-slot pages (checked per forward) and a
  DRAFT_DECODE lane's shared prefix must end on a page boundary.
* **graphs need a prepare step** (``graph_needs_prepare=True``, ``static_metadata=True``, so
  the engine captures its rounds and prefills here): replaying a captured graph without a
  :meth:`AscendLikeGraphRunner.prepare` since the previous replay raises, as Ascend graphs
  need their host-side sequence lengths updated before each replay. ``prepare`` takes the
  engine's parameters only in the contract's form (``batch_size`` within the key's batch
  bucket, ``max_prefix_len``, per-request host lists of ``batch_size`` ints); and every
  captured forward's ``ForwardBatch.host_lengths``, applied to the parameters of the replay
  that runs it (``{}`` at capture), must give exactly that forward's device lengths
  (``prefix_lens``, ``extend_lens``, DRAFT_DECODE's ``lane_lens``): the lengths a real
  backend's ``prepare`` would hand to its captured attention.
* **few graph shapes** (``max_graph_shapes=8``): capturing a ninth key raises.
* **fp32-only sampling**: ``top_k_top_p_renorm``, ``sample`` and ``verify_tree_sampling``
  reject other floating dtypes (the contract passes sampling probabilities in float32).

Register it for the conformance suite through the test plugin package
``tests/plugins/polyspec-ascend-like`` (entry point ``ascend-like``), then run
``pytest --pyargs polyspec.testing --polyspec-backend ascend-like``. Plugin authors can subclass
it or reuse its checks.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from polyspec.backend import Backend, BackendCapabilities, ForwardBatch, ForwardMode, KernelSet
from polyspec.backends.common import (
    EagerGraphRunner,
    PagedAllocator,
    SDPAAttention,
    SDPAMetadata,
    TensorKVPool,
)
from polyspec.backends.common.graph import check_inputs
from polyspec.kernels.reference import reference_kernels

PAGE_SIZE = 128
"""The only KV page size (Ascend's paged attention block size)."""

MAX_GRAPH_SHAPES = 8
"""How many graph keys one runner may capture."""

ASCEND_LIKE_CAPABILITIES = BackendCapabilities(
    graph_capture=True,
    graph_needs_prepare=True,
    static_metadata=True,
    max_graph_shapes=MAX_GRAPH_SHAPES,
    tree_attention=True,
    page_sizes=(PAGE_SIZE,),
    index_dtype="int32",
    dtypes=("float32", "bfloat16", "float16"),
    distributed_backend="gloo",  # HCCL's place: the ranks share the CPU here
)
"""Ascend's constraints (``graph_capture`` is declared as on Ascend; replay runs eagerly)."""

INDEX_ARGUMENTS: dict[str, tuple[str, ...]] = {
    "assign_draft_cache_locs": (
        "req_pool_indices",
        "req_to_token",
        "seq_lens",
        "alloc_slots",
        "lane_locs",
        "tail_lens",
        "copy_src",
        "copy_dst",
    ),
    "assign_req_to_token": ("req_pool_indices", "req_to_token", "start", "end", "slots"),
    "assign_extend_cache_locs": ("req_pool_indices", "req_to_token", "start", "end", "out"),
    "build_tree": ("seq_lens", "retrive_index", "retrive_next_token", "retrive_next_sibling"),
    "verify_tree_greedy": (
        "retrive_index",
        "retrive_next_token",
        "retrive_next_sibling",
        "accept_index",
        "accept_length",
    ),
    "verify_tree_sampling": (
        "retrive_index",
        "retrive_next_token",
        "retrive_next_sibling",
        "accept_index",
        "accept_length",
    ),
}
"""Kernel arguments holding slots, request rows, lengths or tree links: int32 only. Token ids,
positions and draft-tree candidate ids stay free (torch's top-k and embedding produce int64)."""

SAMPLING_ARGUMENTS: dict[str, tuple[str, ...]] = {
    "top_k_top_p_renorm": ("probs", "top_p"),
    "sample": ("probs", "exp_noise"),
    "verify_tree_sampling": ("target_probs", "draft_probs", "coins", "final_coins"),
}
"""Floating arguments of the sampling kernels: one of :data:`SAMPLING_DTYPES` only."""

SAMPLING_DTYPES = ("float32",)
"""The floating dtypes the sampling kernels accept (what Ascend's sampling operators take)."""


def require_int32(where: str, name: str, t: torch.Tensor | None) -> None:
    """Raise ``TypeError`` unless ``t`` (an index tensor; None is allowed) is int32."""
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(
            f"{where}: {name} is {t.dtype}, but this backend's index dtype is int32 "
            f"(capabilities.index_dtype); create index tensors with backend.index_dtype "
            f"(Ascend's cache and attention operators take int32 slot indices)"
        )


def _checked_kernel(name: str, fn: Callable[..., Any], sampling_dtypes: tuple[str, ...]):
    """``fn`` with its index arguments checked for int32 and its sampling arguments for
    ``sampling_dtypes`` before it runs."""
    signature = inspect.signature(fn)
    index_names = INDEX_ARGUMENTS.get(name, ())
    float_names = SAMPLING_ARGUMENTS.get(name, ())
    allowed = tuple(getattr(torch, d) for d in sampling_dtypes)

    @functools.wraps(fn)
    def kernel(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs).arguments
        where = f"ascend-like kernel {name}"
        for arg in index_names:
            require_int32(where, arg, bound.get(arg))
        for arg in float_names:
            t = bound.get(arg)
            if isinstance(t, torch.Tensor) and t.dtype not in allowed:
                raise TypeError(
                    f"{where}: {arg} is {t.dtype}, but this backend's sampling kernels accept "
                    f"only {list(sampling_dtypes)}; the contract passes sampling probabilities "
                    f"in {sampling_dtypes[0]}"
                )
        return fn(*args, **kwargs)

    return kernel


def ascend_like_kernels(base: KernelSet | None = None) -> KernelSet:
    """``base`` (default: the reference set) with every kernel wrapped in the Ascend checks."""
    base = base or reference_kernels()
    return KernelSet(
        **{n: _checked_kernel(n, getattr(base, n), SAMPLING_DTYPES) for n in KernelSet.names()}
    )


class AscendLikeKVPool(TensorKVPool):
    """The shared pool, taking int32 slot indices only."""

    def write(
        self,
        layer: int,
        loc: torch.Tensor,  # [T] int32
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
    ) -> None:
        """Store ``k``/``v`` at ``loc`` (int32) of ``layer``."""
        require_int32("ascend-like KV pool write", "loc", loc)
        super().write(layer, loc, k, v)

    def move(
        self,
        dst_loc: torch.Tensor,  # [n] int32
        src_loc: torch.Tensor,  # [n] int32
    ) -> None:
        """Copy every layer's K/V from ``src_loc`` to ``dst_loc`` (both int32)."""
        require_int32("ascend-like KV pool move", "dst_loc", dst_loc)
        require_int32("ascend-like KV pool move", "src_loc", src_loc)
        super().move(dst_loc, src_loc)


class AscendLikeAttention(SDPAAttention):
    """The shared SDPA attention behind Ascend's input rules (see the module docstring)."""

    def build_metadata(self, batch: ForwardBatch) -> SDPAMetadata:
        """Check int32 indices, host lengths and the page structure, then build as SDPA does."""
        where = f"ascend-like attention ({batch.mode.value})"
        for name in _INDEX_FIELDS:
            require_int32(where, name, getattr(batch, name))
        _check_host_list(where, "prefix_lens", batch.prefix_lens_cpu, batch.prefix_lens)
        _check_host_list(where, "extend_lens", batch.extend_lens_cpu, batch.extend_lens)
        if batch.mode is ForwardMode.DRAFT_DECODE:
            if batch.lane_lens is None:
                raise ValueError(f"{where}: DRAFT_DECODE needs lane_lens [bs]")
            _check_host_list(where, "lane_lens", batch.lane_lens_cpu, batch.lane_lens)
        _check_pages(where, batch)
        return super().build_metadata(batch)

    def build_static_metadata(self, batch: ForwardBatch, max_prefix_len: int) -> SDPAMetadata:
        """Check int32 indices and that ``batch.host_lengths`` of the current replay's host
        parameters (:func:`replay_host_params`) equals the device lengths, then the page
        structure with those lists; then build as SDPA does."""
        where = f"ascend-like captured attention ({batch.mode.value})"
        for name in _INDEX_FIELDS:
            require_int32(where, name, getattr(batch, name))
        if batch.host_lengths is None:
            raise ValueError(
                f"{where}: ForwardBatch.host_lengths is missing; a backend with "
                f"graph_needs_prepare computes a captured forward's host sequence lengths from "
                f"the parameters of GraphRunner.prepare through it"
            )
        params = replay_host_params()
        lengths = batch.host_lengths(params)
        _check_host_list(where, "prefix_lens", lengths.prefix_lens, batch.prefix_lens, params)
        _check_host_list(where, "extend_lens", lengths.extend_lens, batch.extend_lens, params)
        if batch.mode is ForwardMode.DRAFT_DECODE:
            if batch.lane_lens is None:
                raise ValueError(f"{where}: DRAFT_DECODE needs lane_lens [bs]")
            _check_host_list(where, "lane_lens", lengths.lane_lens, batch.lane_lens, params)
        checked = dataclasses.replace(
            batch,
            prefix_lens_cpu=list(lengths.prefix_lens),
            extend_lens_cpu=list(lengths.extend_lens),
            lane_lens_cpu=lengths.lane_lens,
        )
        _check_pages(where, checked)
        return super().build_static_metadata(batch, max_prefix_len)


_INDEX_FIELDS = (
    "out_cache_loc",
    "req_pool_indices",
    "req_to_token",
    "prefix_lens",
    "extend_lens",
    "lane_locs",
    "lane_lens",
)

_replaying: list[Mapping[str, Any]] = []  # the host parameters of the replay in progress


def replay_host_params() -> Mapping[str, Any]:
    """The parameters the running :class:`AscendLikeGraphRunner` replay was prepared with;
    ``{}`` during a capture and outside any replay (a forward's own inputs)."""
    return _replaying[-1] if _replaying else {}


def _check_host_list(
    where: str,
    name: str,
    host: list[int] | None,
    dev: torch.Tensor,
    params: Mapping[str, Any] | None = None,
) -> None:
    """``host`` must be a list equal to ``dev`` [bs] (costs a sync: this is a test backend).
    ``params``: a captured forward's, whose host lists come from ``host_lengths(params)``."""
    if params is not None:
        values = [int(x) for x in dev.tolist()]
        if host is None or [int(x) for x in host] != values:
            raise ValueError(
                f"{where}: ForwardBatch.host_lengths({dict(params)}) gives {name} = "
                f"{None if host is None else list(host)}, but the captured forward's device "
                f"tensor {name} = {values}; the engine's GraphRunner.prepare parameters must "
                f"describe the batch the replay runs"
            )
        return
    if host is None:
        raise ValueError(
            f"{where}: ForwardBatch.{name}_cpu is missing; this backend needs host-side sequence "
            f"lengths in every eager forward (the contract): fill {name}_cpu with the same "
            f"values as {name}"
        )
    values = [int(x) for x in dev.tolist()]
    if list(host) != values:
        raise ValueError(
            f"{where}: {name}_cpu = {list(host)} disagrees with the device tensor {name} = "
            f"{values}; both must describe the same batch"
        )


def _check_pages(where: str, batch: ForwardBatch) -> None:
    """Every key the batch reads must be reachable through a block table of ``PAGE_SIZE``-slot
    pages (what Ascend's paged attention reads): position p of a request lives at slot
    ``block_table[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE``."""
    prefix = list(batch.prefix_lens_cpu or [])
    extend = list(batch.extend_lens_cpu or [])
    # A captured batch's padding requests (extend 0) attend for discarded outputs only: their
    # rows (row 0 of the request table) need no page layout.
    if batch.mode is ForwardMode.DRAFT_DECODE:
        lengths = [p if e > 0 else 0 for p, e in zip(prefix, extend)]
        if any(p % PAGE_SIZE for p in prefix):
            raise ValueError(
                f"{where}: a lane's shared prefix must end on a page boundary (page size "
                f"{PAGE_SIZE}), got prefix_lens {prefix}; copy the prefix's partial last page "
                f"into every lane (assign_draft_cache_locs with page_size={PAGE_SIZE})"
            )
        lanes = batch.lane_locs  # [bs, K, W]
        if lanes is None or lanes.dim() != 3 or lanes.shape[2] % PAGE_SIZE:
            got = None if lanes is None else list(lanes.shape)
            raise ValueError(
                f"{where}: lane_locs must be [bs, K, W] with W a whole number of {PAGE_SIZE}-slot "
                f"pages, got {got}"
            )
        # the lanes of live requests (a captured batch's padding requests, extend 0, read none)
        live = torch.tensor([e > 0 for e in extend], device=lanes.device)  # [bs]
        used = live[:, None, None].expand(lanes.shape).reshape(-1, lanes.shape[2])
        _check_page_table(where, "lane_locs", lanes.reshape(-1, lanes.shape[2]).long(), used)
    else:
        lengths = [p + e if e > 0 else 0 for p, e in zip(prefix, extend)]
    if not lengths or max(lengths) == 0:
        return
    width = min(-(-max(lengths) // PAGE_SIZE) * PAGE_SIZE, batch.req_to_token.shape[1])
    rows = batch.req_pool_indices.to(device=batch.req_to_token.device, dtype=torch.int64)
    table = batch.req_to_token.index_select(0, rows)[:, :width].long()  # [bs, width]
    if width % PAGE_SIZE:  # a table narrower than whole pages: pad (those columns are unused)
        table = torch.nn.functional.pad(table, (0, PAGE_SIZE - width % PAGE_SIZE))
    lens = torch.tensor(lengths, device=table.device)  # [bs]
    cols = torch.arange(table.shape[1], device=table.device)  # [W]
    _check_page_table(where, "req_to_token", table, cols[None, :] < lens[:, None])


def _check_page_table(
    where: str,
    name: str,
    table: torch.Tensor,  # [rows, W] int64 slots, W a multiple of PAGE_SIZE
    used: torch.Tensor | None,  # [rows, W] bool: the positions read (None: all)
) -> None:
    """Raise unless each page of ``table``'s used positions is one page-aligned slot page."""
    pages = table.view(table.shape[0], -1, PAGE_SIZE)  # [rows, P, PAGE_SIZE]
    first = pages[:, :, :1]  # [rows, P, 1]: slot of the page's first position
    expected = first + torch.arange(PAGE_SIZE, device=table.device)  # [rows, P, PAGE_SIZE]
    ok = (pages == expected) & (first % PAGE_SIZE == 0) & (first > 0)
    ok = ok.view_as(table)
    if used is not None:
        ok = ok | ~used
    if not bool(ok.all()):
        r, c = (~ok).nonzero()[0].tolist()
        raise ValueError(
            f"{where}: {name}[{r}, {c}] = {int(table[r, c])} breaks the block-table layout: "
            f"the positions of each {PAGE_SIZE}-position page must map to one whole, "
            f"page-aligned page of slots (allocate with page_size={PAGE_SIZE})"
        )


@dataclasses.dataclass
class _Prepared:
    host_params: dict[str, Any]


class AscendLikeGraphRunner(EagerGraphRunner):
    """Eager replay with Ascend's graph rules: at most ``max_shapes`` keys, and a
    :meth:`prepare` with host-side parameters before every replay."""

    def __init__(self, max_shapes: int = MAX_GRAPH_SHAPES) -> None:
        """A runner that may capture up to ``max_shapes`` keys."""
        super().__init__()
        self.max_shapes = max_shapes
        self._prepared: dict[Any, _Prepared] = {}

    def capture(
        self,
        key: Any,
        fn: Callable[[Mapping[str, torch.Tensor]], Any],
        static_inputs: Mapping[str, torch.Tensor],
    ) -> Any:
        """As the eager runner; raises ``RuntimeError`` beyond ``max_shapes`` keys."""
        if key not in self._graphs and len(self._graphs) >= self.max_shapes:
            raise RuntimeError(
                f"ascend-like graph runner: cannot capture {key!r}: {self.max_shapes} graph "
                f"shapes are already captured (capabilities.max_graph_shapes); capture fewer "
                f"batch-size buckets or run larger shapes eagerly"
            )
        return super().capture(key, fn, static_inputs)

    def prepare(self, key: Any, host_params: Mapping[str, Any]) -> None:
        """Record the host-side parameters the next replay of ``key`` runs with, in the
        contract's form (``GraphRunner.prepare``): ``batch_size`` (an int from 1 to the
        captured rows), ``max_prefix_len`` (an int), and per-request host lists of
        ``batch_size`` non-negative ints. The replay's captured forwards check their
        ``host_lengths`` against them (:meth:`AscendLikeAttention.build_static_metadata`)."""
        graph = self._get(key)
        where = f"ascend-like graph runner: prepare({key!r})"
        if not isinstance(host_params, Mapping):
            raise TypeError(f"{where} needs a mapping, got {type(host_params).__name__}")
        rows = _captured_rows(graph.inputs)
        bs = host_params.get("batch_size")
        if type(bs) is not int or not 1 <= bs <= rows:
            raise ValueError(
                f"{where}: batch_size must be an int in [1, {rows}] (the captured rows), got {bs!r}"
            )
        if type(host_params.get("max_prefix_len")) is not int:
            raise ValueError(f"{where}: max_prefix_len must be an int (the prefix bucket)")
        lists = {n: v for n, v in host_params.items() if n not in ("batch_size", "max_prefix_len")}
        if not lists:
            raise ValueError(
                f"{where}: no per-request host lists (e.g. seq_lens): the captured attention "
                f"needs the replay's sequence lengths on the host"
            )
        for name, value in lists.items():
            if isinstance(value, torch.Tensor) or not isinstance(value, list | tuple):
                raise TypeError(
                    f"{where}: host parameter {name!r} must be a list of int, got "
                    f"{type(value).__name__}: Ascend reads them on the host at replay"
                )
            if len(value) != bs or any(type(x) is not int or x < 0 for x in value):
                raise ValueError(
                    f"{where}: host parameter {name!r} must hold batch_size = {bs} non-negative "
                    f"ints, got {list(value)}"
                )
        self._prepared[key] = _Prepared(dict(host_params))

    def replay(self, key: Any, new_inputs: Mapping[str, torch.Tensor]) -> Any:
        """Replay ``key``; raises ``RuntimeError`` unless :meth:`prepare` ran since the last
        replay (the prepared parameters are consumed)."""
        graph = self._get(key)
        check_inputs(key, new_inputs, graph.inputs)  # bad inputs are reported as such first
        if key not in self._prepared:
            raise RuntimeError(
                f"ascend-like graph runner: replay of {key!r} without prepare(): this backend's "
                f"graphs need their host-side parameters (sequence lengths) updated before "
                f"every replay (capabilities.graph_needs_prepare)"
            )
        _replaying.append(self._prepared.pop(key).host_params)
        try:
            return super().replay(key, new_inputs)
        finally:
            _replaying.pop()


def _captured_rows(inputs: Mapping[str, torch.Tensor]) -> int:
    """The request rows of a captured computation (``CapturedForwards``' inputs: a ``[b, ...]``
    per-request ``host`` tensor; otherwise the leading dimension of the first input)."""
    t = inputs.get("host", next(iter(inputs.values()), None))
    return int(t.shape[0]) if isinstance(t, torch.Tensor) and t.dim() else 1


class AscendLikeBackend(Backend):
    """The shared mechanism and reference kernels under Ascend's constraints (module
    docstring); device ``cpu``."""

    name = "ascend-like"
    device_type = "cpu"

    def __init__(self) -> None:
        """Reference kernels wrapped in the int32 / sampling-dtype checks."""
        self.capabilities = ASCEND_LIKE_CAPABILITIES
        self.kernels = ascend_like_kernels()

    def make_allocator(self, num_slots: int, page_size: int) -> PagedAllocator:
        """A paged allocator handing out int32 slots; only ``page_size == 128``."""
        if not self.capabilities.supports_page_size(page_size):
            raise ValueError(
                f"ascend-like backend: page_size {page_size} is not supported; use "
                f"page_size={PAGE_SIZE} (capabilities.page_sizes)"
            )
        return PagedAllocator(num_slots, page_size, self.device(), self.index_dtype)

    def make_kv_pool(
        self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> AscendLikeKVPool:
        """Zero-initialised K/V tensors taking int32 slot indices."""
        if str(dtype).removeprefix("torch.") not in self.capabilities.dtypes:
            raise ValueError(
                f"ascend-like backend: unsupported KV dtype {dtype}; use one of "
                f"{list(self.capabilities.dtypes)}"
            )
        return AscendLikeKVPool(num_slots, num_layers, num_kv_heads, head_dim, dtype, self.device())

    def make_attention(
        self,
        kv_pool: AscendLikeKVPool,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
    ) -> AscendLikeAttention:
        """Checked SDPA attention over a pool from :meth:`make_kv_pool`."""
        if not isinstance(kv_pool, AscendLikeKVPool):
            raise TypeError(
                f"ascend-like backend: make_attention needs a pool from make_kv_pool, got "
                f"{type(kv_pool).__name__}"
            )
        return AscendLikeAttention(kv_pool, num_heads, num_kv_heads, head_dim, scale)

    def make_graph_runner(self) -> AscendLikeGraphRunner:
        """A runner enforcing prepare-before-replay and the graph-shape limit."""
        return AscendLikeGraphRunner(self.capabilities.max_graph_shapes or MAX_GRAPH_SHAPES)
