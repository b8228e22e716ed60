"""The backend contract: everything the engine asks of an accelerator, on one page.

A backend plugin's factory returns a :class:`Backend`. The engine (``polyspec.spec``,
``polyspec.engine``) only ever talks to that object; it never asks which vendor it is and
branches only on :class:`BackendCapabilities`. Every capability here is read by the engine and
every :class:`KernelSet` entry is called by it: nothing in this file is optional decoration.
This module imports nothing else from polyspec (it is the bottom of the layers,
docs/architecture.md); ``polyspec.backends.common`` holds ready-made pieces (allocator, KV pool,
SDPA attention, eager graph runner) and ``polyspec.kernels.reference.reference_kernels()`` a
complete :class:`KernelSet` to start from.

Notation used in shapes: ``bs`` requests, ``K`` topk, ``S`` num_steps, ``N`` num_draft_tokens
(tree nodes verified per request, root included), ``T`` tokens in one forward, ``H`` hidden
size, ``Hq``/``Hkv`` query / key-value heads, ``D`` head dim, ``V`` vocabulary size, ``W``
draft slots per lane (:func:`draft_lane_width`).

KV cache model: one slot index space per engine, shared by the target and the draft pool (each
model owns its own :class:`KVPool` tensors, indexed by the same slots). Slot 0 is never handed
out: it is the padding target, so padded index entries may safely point at it. With
``page_size > 1`` a page is ``page_size`` consecutive slots and page ``p`` holds slots
``[p * page_size, (p + 1) * page_size)``; page 0 is reserved.

``req_to_token`` is a ``[max_requests, max_context]`` table: ``req_to_token[r, pos]`` is the
slot holding the K/V of position ``pos`` of the request in row ``r``. Before a forward, the core
writes the slots of the new tokens into it, so that for every mode except DRAFT_DECODE the keys
of request ``b`` are ``req_to_token[req_pool_indices[b], : prefix_lens[b] + extend_lens[b]]``.

Who owns which duty: the attention's :meth:`AttentionBackend.forward` stores a forward's new
K/V; :meth:`KVPool.move` compacts an accepted path's K/V after verification (and copies a
prefix's partial last page into each draft lane); the :class:`KernelSet` does the slot and tree
bookkeeping, the model's layer ops and sampling; the :class:`KVAllocator` hands out slots.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

BACKEND_API_VERSION = 5
"""Version of this contract. A plugin built for another version is refused at load time, with
a message naming both versions."""


def draft_lane_width(num_steps: int, page_size: int) -> int:
    """W, the KV slots each draft lane owns (``lane_locs`` is ``[bs, K, W]``): ``num_steps``
    with token slots, else whole pages covering a prefix's partial last page (up to
    ``page_size - 1`` slots, copied into the lane) plus ``num_steps`` new slots."""
    if page_size == 1:
        return num_steps
    return page_size * ((page_size - 1 + num_steps + page_size - 1) // page_size)


class ForwardMode(enum.Enum):
    """The five attention modes of a speculative engine (docs/backend-guide.md)."""

    EXTEND = "extend"
    """Prefill: new prompt tokens; each sees the cached prefix and earlier new tokens."""
    DECODE = "decode"
    """One query per request; it sees the whole prefix and itself."""
    DRAFT_DECODE = "draft_decode"
    """Step i of the multi-step draft: K lanes per request; a lane sees the shared prefix and its
    own lane slots ``lane_locs[b, l, : lane_lens[b]]``."""
    TARGET_VERIFY = "target_verify"
    """N tree nodes per request; node j sees the prefix and the nodes ``tree_mask[b, j]`` marks."""
    DRAFT_EXTEND = "draft_extend"
    """A block of tokens per request (fixed width or the accepted tokens), causal in the block."""


class TreeMaskMode(enum.Enum):
    """The layout of the tree mask ``build_tree`` writes, named in its ``tree_mask_mode``
    argument. One layout: the one :attr:`ForwardBatch.tree_mask` carries to TARGET_VERIFY."""

    TREE_ONLY = "tree_only"
    """Bool ``[bs, N, N]``: ``mask[b, i, j]`` is True when node j is node i or its ancestor."""


@dataclasses.dataclass(frozen=True)
class BackendCapabilities:
    """What a backend can do. The core branches on these fields, never on a backend's name."""

    graph_capture: bool = False
    """The graph runner really captures graphs (replay is cheaper than eager)."""
    graph_needs_prepare: bool = False
    """Replaying a captured graph needs ``GraphRunner.prepare`` with new host-side parameters."""
    max_graph_shapes: int | None = None
    """How many graph keys may be captured; None = unlimited."""
    tree_attention: bool = True
    """TARGET_VERIFY with an arbitrary tree mask (topk > 1). False: chains only (topk == 1)."""
    page_sizes: tuple[int, ...] | None = None
    """Supported KV page sizes; None = any positive size."""
    index_dtype: str = "int64"
    """dtype of slot and position indices the backend's kernels take: "int64" or "int32"."""
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
    """Model dtypes the attention and model kernels support ("auto" picks among them)."""
    static_metadata: bool = False
    """:meth:`AttentionBackend.build_static_metadata` is implemented, so forwards can be
    captured into graphs (the engine captures only when ``graph_capture`` is True as well)."""
    weight_quantization: tuple[str, ...] = ()
    """Weight-only quantization schemes :meth:`Backend.quantized_linear_fn` implements
    (:data:`polyspec.kernels.quant.SCHEMES`: ``"int8"``). The engine quantizes a draft head's
    weights only with a scheme listed here."""
    async_execution: bool = False
    """Kernels run asynchronously to the host and ``synchronize`` waits for them. Timing
    phases then costs speed (each boundary sync stops the host from running ahead of the
    device), so benchmarks time phases in a run of their own."""
    async_host_reads: bool = False
    """:meth:`Backend.read_async` returns before the copy is done (pinned memory and an
    event), so the host can queue the next decode round while the device still runs this one;
    ``EngineConfig.overlap_rounds = "auto"`` turns overlapped rounds on where this is True."""

    distributed_backend: str | None = "gloo"
    """The ``torch.distributed`` backend the ranks of a tensor-parallel engine on this
    backend's devices talk through (``"gloo"``, ``"nccl"``, ``"hccl"``, ...), or None when this
    backend cannot run tensor parallel. Data only: the engine passes it to
    ``torch.distributed.init_process_group`` and checks that torch provides it."""
    graph_collectives: bool = False
    """Collectives (all-reduce, all-gather) may be recorded inside this backend's captured
    graphs. False: with more than one rank the engine runs every forward eagerly."""

    def supports_page_size(self, page_size: int) -> bool:
        """Whether ``page_size`` is one of :attr:`page_sizes` (any positive size when None)."""
        return page_size >= 1 and (self.page_sizes is None or page_size in self.page_sizes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly view (used by ``polyspec backends --json``)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out


@dataclasses.dataclass(frozen=True)
class HostLengths:
    """The host lists of one forward (as :class:`ForwardBatch`'s ``*_cpu`` fields)."""

    prefix_lens: list[int]
    extend_lens: list[int]
    lane_lens: list[int] | None = None  # DRAFT_DECODE only


@dataclasses.dataclass
class ForwardBatch:
    """What one model forward computes, in backend-neutral terms.

    Built by the core (``polyspec.runtime``); turned into backend-specific
    :class:`AttentionMetadata` by :meth:`AttentionBackend.build_metadata` once per forward.
    Token order in ``input_ids`` is request-major: request 0's tokens, then request 1's, ...
    For DRAFT_DECODE it is ``[bs, K]`` flattened (lane-major within a request).

    Index tensors are in the backend's index dtype (``capabilities.index_dtype``). The ``*_cpu``
    host lists equal their device tensors and are filled for every eager forward, so building
    metadata never needs a device-to-host read; in a captured forward they are None and a
    backend that needs host lengths gets them through :meth:`GraphRunner.prepare`: the forward's
    :attr:`host_lengths` turns the parameters the engine passes to ``prepare`` before each
    replay into this forward's host lists.
    """

    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] slots receiving the new tokens' K/V
    req_pool_indices: torch.Tensor  # [bs] rows of req_to_token
    req_to_token: torch.Tensor  # [max_requests, max_context]
    prefix_lens: torch.Tensor  # [bs] keys before the new tokens (shared prefix for DRAFT_DECODE)
    extend_lens: torch.Tensor  # [bs] queries per request (1 DECODE, K DRAFT_DECODE, N VERIFY)
    prefix_lens_cpu: list[int] | None = None  # host copy (None only in captured forwards)
    extend_lens_cpu: list[int] | None = None  # host copy (None only in captured forwards)
    tree_mask: torch.Tensor | None = None  # TARGET_VERIFY: [bs, N, N] bool (TREE_ONLY layout)
    lane_locs: torch.Tensor | None = None  # DRAFT_DECODE: [bs, K, W] slots of each lane
    lane_lens: torch.Tensor | None = None  # DRAFT_DECODE: [bs] lane slots visible this step
    lane_lens_cpu: list[int] | None = None  # DRAFT_DECODE: host copy of lane_lens
    topk: int = 1  # DRAFT_DECODE: K lanes per request; TARGET_VERIFY: the tree's K (1: a chain)
    host_lengths: Callable[[Mapping[str, Any]], HostLengths] | None = None
    """Captured forwards only: ``host_lengths(host_params)`` gives this forward's host lists
    (one entry per row of the captured batch, padding rows included) for the ``host_params``
    of :meth:`GraphRunner.prepare` (``{}``: the capture's own inputs, all padding rows). A
    backend with ``graph_needs_prepare`` keeps it and calls it in ``prepare``."""

    @property
    def batch_size(self) -> int:
        """bs, the number of requests."""
        return int(self.req_pool_indices.shape[0])

    @property
    def num_tokens(self) -> int:
        """T, the number of new tokens (query rows)."""
        return int(self.input_ids.shape[0])


class Rotary(NamedTuple):
    """The rotary position embedding an attention applies in its forward
    (:attr:`AttentionBackend.rotary_in_forward`), as ``KernelSet.rotary_embedding`` takes it."""

    positions: torch.Tensor  # [T]
    cos_sin_cache: torch.Tensor  # [max_pos, D] fp32: D/2 cos columns then D/2 sin columns
    is_neox: bool


class AttentionMetadata:
    """Backend-specific, precomputed per forward and reused by every layer. Opaque to the core."""


class AttentionBackend(abc.ABC):
    """Attention of one model over its KV pool, for all five :class:`ForwardMode` s."""

    rotary_in_forward: bool = False
    """True: the model hands :meth:`forward` ``q`` and ``k`` before rotary position embedding,
    with ``rotary``, and the backend applies it (bitwise as its KernelSet's
    ``rotary_embedding`` would) on its way to storing ``k`` and attending: one pass over q and
    k instead of two."""

    @abc.abstractmethod
    def build_metadata(self, batch: ForwardBatch) -> AttentionMetadata:
        """Precompute index tensors / masks for ``batch``; called once per forward."""

    def build_static_metadata(self, batch: ForwardBatch, max_prefix_len: int) -> AttentionMetadata:
        """Metadata for a forward that is captured into a graph and replayed.

        Differences from :meth:`build_metadata`, all so that the computation can be recorded
        once and replayed with new values in the same buffers:

        * only ``batch``'s device tensors may be read: the ``*_cpu`` lists are None, and
          nothing may synchronise with the host (no ``.item()`` / ``.tolist()`` / ``bool()``
          of a device tensor, no tensor built from a Python list);
        * every output shape depends only on the tensors' shapes and ``max_prefix_len``, an
          upper bound of ``prefix_lens`` over every replay (keys past a request's prefix are
          masked out, not cut off);
        * the token layout is uniform: ``T = bs * Q`` with ``Q = T // bs`` query rows per
          request (Q = 1 DECODE, K DRAFT_DECODE, N TARGET_VERIFY, a fixed block width
          EXTEND / DRAFT_EXTEND). Request ``b`` owns tokens ``[b * Q, (b + 1) * Q)``, of which
          the first ``extend_lens[b]`` are real; for DRAFT_DECODE, all K are real and the
          lanes are ``lane_locs[:, :, :W]`` with ``lane_lens`` on the device;
        * padding requests (rows the engine added to reach a captured batch size) have
          ``req_pool_indices``, ``prefix_lens``, ``extend_lens``, ``lane_lens`` and the tree
          mask all zero, and ``out_cache_loc`` 0 (the padding slot). Padding tokens must not
          fail or write anywhere else; their outputs are finite but meaningless.

        Called while the graph is captured and again at every replay (eager runners). The
        default raises ``NotImplementedError``: the engine then never captures this backend.
        """
        raise NotImplementedError(
            f"{type(self).__name__} has no build_static_metadata; declare "
            "static_metadata=False in the capabilities and the engine runs eagerly"
        )

    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        layer: int,
        metadata: AttentionMetadata,
        rotary: Rotary | None = None,
    ) -> torch.Tensor:  # [T, Hq, D]
        """Store ``k``/``v`` at the batch's ``out_cache_loc`` in layer ``layer`` of the pool,
        then attend each query to the keys its mode makes visible (softmax scale given at
        construction; GQA: query head h reads kv head ``h // (Hq // Hkv)``). ``rotary`` is
        passed only where :attr:`rotary_in_forward` is True: ``q`` and ``k`` are then
        unrotated."""


class KVPool(abc.ABC):
    """Per-model K/V storage: for each layer a ``[num_slots, Hkv, D]`` tensor for K and for V.

    The one owner of K/V data movement: the attention stores a forward's new K/V (through
    :meth:`write` or a fused kernel of its own), and the engine calls :meth:`move` to compact an
    accepted path and to copy a prefix's partial last page into the draft lanes."""

    num_slots: int
    """Slots per layer (slot 0 included)."""
    num_layers: int
    """Layers of the model this pool serves."""

    @abc.abstractmethod
    def k_cache(self, layer: int) -> torch.Tensor:  # [num_slots, Hkv, D]
        """The K tensor of ``layer``."""

    @abc.abstractmethod
    def v_cache(self, layer: int) -> torch.Tensor:  # [num_slots, Hkv, D]
        """The V tensor of ``layer``."""

    @abc.abstractmethod
    def write(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """``k_cache(layer)[loc] = k`` and ``v_cache(layer)[loc] = v``, cast to the pool
        dtype: ``loc`` [T] slots; ``k``/``v`` [T, Hkv, D]. The conformance suite fills pools
        through it."""

    @abc.abstractmethod
    def move(self, dst_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        """Copy every layer's K/V from ``src_loc`` [n] to ``dst_loc`` [n]; all sources are read
        before any destination is written, so overlapping lists are safe (an accepted path's
        compaction moves slots onto slots of the same tree). Called by the engine every
        speculative round, with device index tensors (no host sync)."""


class KVAllocator(abc.ABC):
    """Hands out KV slots (``page_size == 1``) or whole pages of slots (``page_size > 1``).

    Slot 0 (page 0) is reserved. Allocation returns slot indices on the backend's device, in the
    backend's index dtype; freeing a slot that is not allocated raises ``ValueError``.
    """

    num_slots: int
    """Slots managed (slot 0 included, never handed out)."""
    page_size: int
    """Slots per page (1: token slots)."""

    @abc.abstractmethod
    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """``num_tokens`` slots (a multiple of ``page_size``: whole pages, each page's slots
        consecutive), or None when not enough are free (nothing is allocated then)."""

    def alloc_host(self, num_tokens: int) -> torch.Tensor | None:
        """:meth:`alloc` with the slots on the host (CPU, int64): the engine uploads them
        without waiting for the device work queued before, and keeps them, so that it frees
        a request's slots without reading them back from the device (a read that waits for
        every queued round). The default reads :meth:`alloc`'s slots back; an allocator
        whose free lists live on the host returns them as they are."""
        slots = self.alloc(num_tokens)
        return None if slots is None else slots.to(device="cpu", dtype=torch.int64)

    @abc.abstractmethod
    def free(self, slots: torch.Tensor) -> None:
        """Return slots [n] (on the device or the host). With pages, every page touched must
        be passed whole."""

    @property
    @abc.abstractmethod
    def available(self) -> int:
        """Exact number of free slots (``page_size`` times free pages)."""

    @abc.abstractmethod
    def backup_state(self) -> Any:
        """An opaque snapshot of the free lists."""

    @abc.abstractmethod
    def restore_state(self, state: Any) -> None:
        """Return to a snapshot taken by :meth:`backup_state`."""


class GraphRunner(abc.ABC):
    """Capture-and-replay of fixed-shape computations (CUDA graphs, NPU graphs, or eager).

    Rules every implementation enforces, eager ones included: a replay reaches its inputs only
    through the static buffers given at capture (new values are copied into them), and only
    captured keys can be replayed.
    """

    @abc.abstractmethod
    def capture(
        self,
        key: Any,
        fn: Callable[[Mapping[str, torch.Tensor]], Any],
        static_inputs: Mapping[str, torch.Tensor],
    ) -> Any:
        """Record ``fn(static_inputs)`` under ``key``; returns its (static) outputs."""

    @abc.abstractmethod
    def can_run(self, key: Any) -> bool:
        """True when ``key`` was captured."""

    def prepare(self, key: Any, host_params: Mapping[str, Any]) -> None:
        """Update host-side parameters of a captured graph before replay (Ascend graphs need
        the new sequence lengths). The default does nothing.

        The engine calls it (where ``graph_needs_prepare``) before every replay with
        ``{"batch_size": bs, "max_prefix_len": <the key's prefix bucket>}`` and the replay's
        per-request host lists (``bs`` entries each, padding rows left out): a decode round
        passes ``"seq_lens"`` (committed lengths), a captured prefill ``"prefix_lens"`` and
        ``"extend_lens"``. Each captured forward's :attr:`ForwardBatch.host_lengths` maps
        these to that forward's lists."""

    @abc.abstractmethod
    def replay(self, key: Any, new_inputs: Mapping[str, torch.Tensor]) -> Any:
        """Copy ``new_inputs`` into the static buffers of the same names (each must fit in its
        buffer: same dtype and rank, leading dimension <= the captured one), run the recorded
        computation, and return the static outputs."""


@dataclasses.dataclass(frozen=True)
class KernelSet:
    """The named kernels the engine calls (docs/backend-guide.md, "The KernelSet override pattern").

    Each field is a callable with exactly the signature and semantics of the function of the same
    name in :mod:`polyspec.kernels.reference` (documented there, with shapes). A backend starts
    from ``polyspec.kernels.reference.reference_kernels()`` and overrides the ones it
    accelerates with :func:`dataclasses.replace`. Index arguments arrive in the backend's
    index dtype; sampling probabilities arrive in float32. The conformance suite compares every
    entry with the reference.
    """

    select_top_k: Callable[..., Any]
    """Draft: one level of top-K tree expansion (scores, parents, next tokens)."""
    organize_draft_results: Callable[..., Any]
    """Draft: the N-1 best candidates of the S levels by path score."""
    build_tree: Callable[..., Any]
    """Tree: positions, the TREE_ONLY mask and the ``retrive_*`` links of each request's tree."""
    verify_tree_greedy: Callable[..., Any]
    """Accept: the longest path whose tokens match the target's argmax (all-greedy batches)."""
    verify_tree_sampling: Callable[..., Any]
    """Accept: lossless tree speculative sampling (batches with a sampled request)."""
    assign_draft_cache_locs: Callable[..., Any]
    """Draft: each lane's ``[W]`` slots and the prefix-tail copies paging needs."""
    assign_req_to_token: Callable[..., Any]
    """KV bookkeeping: write newly owned slots into ``req_to_token``."""
    assign_extend_cache_locs: Callable[..., Any]
    """KV bookkeeping: read a forward's ``out_cache_loc`` out of ``req_to_token``."""
    assign_block_cache_locs: Callable[..., Any]
    """KV bookkeeping: a fixed-width block's slots and positions per request (captured
    forwards), the padding slot past each request's length."""
    assign_accept_locs: Callable[..., Any]
    """Accept -> draft extend: where the accepted path's KV moves, and the extend's indices."""
    rms_norm: Callable[..., Any]
    """Model: RMSNorm."""
    fused_add_rms_norm: Callable[..., Any]
    """Model: residual add, then RMSNorm (both results)."""
    draft_layer_input: Callable[..., Any]
    """EAGLE-3 head: its layer's input, the token embeddings and the features each RMS-normed,
    side by side."""
    rotary_embedding: Callable[..., Any]
    """Model: rotary position embedding of q and k."""
    silu_and_mul: Callable[..., Any]
    """Model: the gated MLP's SiLU(gate) * up."""
    softmax_topk: Callable[..., Any]
    """Draft head: softmax over the vocabulary and its top-K (the next level's candidates)."""
    top_k_top_p_renorm: Callable[..., Any]
    """Sampling: keep the top-k / top-p mass of each row and renormalise."""
    sample: Callable[..., Any]
    """Sampling: one token per row from probabilities and exponential noise."""
    argmax: Callable[..., Any]
    """Greedy decoding and verification: each row's first index of its maximum logit."""
    apply_token_bitmask: Callable[..., Any]
    """Structured output: ``-inf`` at the logits a row's token bitmask does not allow."""

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The field names, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))


class HostRead:
    """A device-to-host copy that may still be in flight (:meth:`Backend.read_async`)."""

    def __init__(self, host: torch.Tensor, wait_fn: Callable[[], None] | None = None) -> None:
        """``host`` receives the copy; ``wait_fn`` blocks until it has landed (None: it has)."""
        self._host = host
        self._wait_fn = wait_fn

    def wait(self) -> torch.Tensor:
        """Block until the copy has landed; the host tensor (1-D, the source's dtype)."""
        if self._wait_fn is not None:
            self._wait_fn()
            self._wait_fn = None
        return self._host


class Backend(abc.ABC):
    """One accelerator. Created by a plugin's factory; held by the engine for its lifetime."""

    name: str
    """Registered backend name ("cpu", "cuda", "npu", ...)."""
    device_type: str
    """torch device type string ("cpu", "cuda", "npu")."""
    api_version: int = BACKEND_API_VERSION
    """The contract version this backend implements (leave the default)."""
    capabilities: BackendCapabilities
    """What it can do (the same as its plugin's ``BackendSpec.capabilities``)."""
    kernels: KernelSet
    """The kernels the engine and the models call."""

    local_rank: int = 0
    """The local rank this process runs as (:meth:`bind_local_rank`); 0 without tensor
    parallelism."""

    def device(self, rank: int | None = None) -> torch.device:
        """The torch device of local rank ``rank`` (None: this process's, :attr:`local_rank`).
        Every tensor the engine makes goes on ``device()``."""
        rank = self.local_rank if rank is None else rank
        return (
            torch.device(self.device_type, rank)
            if self.device_type != "cpu"
            else torch.device("cpu")
        )

    def device_count(self) -> int | None:
        """How many devices of this kind one host offers to ranks (the most local ranks a
        tensor-parallel engine may start), or None when ranks share one device without limit
        (the CPU). The default: None."""
        return None

    def bind_local_rank(self, rank: int) -> None:
        """Make this process local rank ``rank`` of a tensor-parallel engine, before any model
        or tensor is made: :meth:`device` then means ``device(rank)``. A backend whose runtime
        has a current device makes ``device(rank)`` current here (NCCL and HCCL need it). The
        default records the rank."""
        self.local_rank = rank

    def share_host(self, local_ranks: int) -> None:
        """``local_ranks`` ranks of a tensor-parallel engine (this process one of them) run on
        this host; called once per rank, after :meth:`bind_local_rank`. A backend whose
        kernels run on the host's cores divides them among the ranks here. The default does
        nothing (each rank has a device of its own)."""

    def synchronize(self) -> None:
        """Wait for queued device work (timing); a no-op on synchronous devices."""

    def memory_info(self) -> tuple[int, int]:
        """(free bytes, total bytes) of device memory now, or (0, 0) where the backend cannot
        tell (the default). The engine reads it before allocating the KV cache (refusing one
        that would not fit) and, where ``graph_capture`` is True, around each graph capture:
        it measures what the graphs take and captures no larger batch bucket once the free
        memory would fall below a margin (those batches run eagerly). Called a few times per
        capture, never per round, so it may query the device runtime."""
        return (0, 0)

    @property
    def index_dtype(self) -> torch.dtype:
        """``capabilities.index_dtype`` as a torch dtype: the engine builds index tensors in it."""
        return getattr(torch, self.capabilities.index_dtype)

    def host_tensor(
        self,
        values: list[int] | torch.Tensor,  # [n]: a list, or a 1-D CPU tensor (copied)
        dtype: torch.dtype,
    ) -> torch.Tensor:  # [n] on the device
        """A 1-D device tensor of host values (slot indices, lengths, token ids, mask words;
        a sampled round's settings as float32), built without waiting for the device work
        already queued. The engine calls this several times per decode round, and hands a
        CPU tensor where it has one (a structured-output round's masks: tens of thousands of
        words, which a list would cost milliseconds to build); the result never shares memory
        with ``values``. A plain ``torch.tensor(values, device=...)`` from pageable memory
        synchronises the stream on CUDA-like devices, so a backend overrides this with a
        pinned, asynchronous copy. The default is the plain construction."""
        if isinstance(values, torch.Tensor):
            return values.to(device=self.device(), dtype=dtype, copy=True)
        return torch.tensor(values, dtype=dtype, device=self.device())

    def read_async(self, tensor: torch.Tensor) -> HostRead:  # [n] device -> [n] host
        """Start copying a 1-D device tensor to the host, queued behind the device work
        already queued, and return at once; :meth:`HostRead.wait` gives the host copy. Later
        device work may overwrite ``tensor``: the copy is of its value at this point of the
        queue. The engine uses it to queue the next decode round before reading this one's
        tokens (``EngineConfig.overlap_rounds``). The default copies now, synchronously,
        which is correct on every device and overlaps nothing; a backend with asynchronous
        queues overrides it with a copy into pinned memory and an event, and declares
        ``capabilities.async_host_reads``. The engine keeps at most two reads in flight and
        waits for each before it starts the one after next, so a backend may reuse a host
        buffer from the third read on, never earlier (``test_host_reads.py``)."""
        return HostRead(tensor.to("cpu", copy=True))

    def row_invariant(self, dtype: torch.dtype) -> bool:
        """Whether this backend's model forwards in ``dtype`` give a token bitwise the same
        logits whatever other tokens share the forward (an EXTEND row, a verify row and the
        DECODE step at the same position agree), which makes greedy speculative output equal
        plain greedy output token for token in that dtype, near-ties included. A claim the
        conformance suite checks (``test_row_invariance.py``); the default makes none."""
        return False

    def linear_fn(
        self,
        weight: torch.Tensor,  # [out, in], as returned by prepare_linear_weight
    ) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None:
        """A faster way to compute ``F.linear(x, weight, bias)`` for this one weight, called
        as ``fn(x [T, in], bias [out] | None) -> [T, out]`` with ``x`` of the weight's dtype,
        or None (the default: the model calls ``F.linear``). Called once per weight at load
        time, after :meth:`prepare_linear_weight`; the weight itself stays readable as it is
        (training and weight tying read it), so a backend that repacks keeps its own copy
        inside the callable (the cpu backend prepacks bf16 weights for oneDNN)."""
        return None

    def quantized_linear_fn(
        self,
        weight: torch.Tensor,  # [out, in] float
        scheme: str,
    ) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None:
        """``weight`` quantized with ``scheme`` (one of ``capabilities.weight_quantization``),
        as a callable ``fn(x [T, in], bias [out] | None) -> [T, out]`` in ``x``'s dtype, that
        computes :func:`polyspec.kernels.quant.linear_int8` of the quantized weight (any
        summation order; the conformance suite bounds the difference). Called once per draft
        head weight at engine start; the callable keeps the quantized copy, ``weight`` stays as
        it is. None: not for this weight (the head then reads it unquantized). The default
        quantizes nothing."""
        return None

    def auto_weight_quantization(self, dtype: torch.dtype) -> str | None:
        """The scheme ``speculative.draft_quantization = "auto"`` applies to a draft head of
        ``dtype``: one of ``capabilities.weight_quantization`` where drafting is faster with
        it on this machine, None where the head should stay in ``dtype``. An explicit scheme
        is applied whatever this says. The default: the first scheme listed."""
        listed = self.capabilities.weight_quantization
        return listed[0] if listed else None

    def prepare_linear_weight(self, weight: torch.Tensor) -> torch.Tensor:  # [out, in]
        """The tensor ``F.linear`` should read for ``weight``: same values and shape, possibly
        another memory layout (the cpu backend stores fp32 weights column-major, which its
        small-M GEMMs run up to 2x faster on). Called once per weight at load time. The
        default keeps the weight as it is."""
        return weight

    @abc.abstractmethod
    def make_allocator(self, num_slots: int, page_size: int) -> KVAllocator:
        """An allocator over ``num_slots`` slots (a multiple of ``page_size``)."""

    @abc.abstractmethod
    def make_kv_pool(
        self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> KVPool:
        """Zero-initialised K/V storage for one model."""

    @abc.abstractmethod
    def make_attention(
        self, kv_pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int, scale: float
    ) -> AttentionBackend:
        """Attention for one model over ``kv_pool``."""

    @abc.abstractmethod
    def make_graph_runner(self) -> GraphRunner:
        """A graph runner (an eager one that enforces the rules is acceptable)."""
