"""What the plain and the EAGLE worker share: request state, KV bookkeeping, target prefill,
and the driving of a decode round (inputs, executor, result)."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from polyspec.backend import Backend, ForwardMode, HostLengths
from polyspec.constrain import ConstraintViolation, DraftVocab, Matcher, RoundMasks
from polyspec.runtime.batch_builder import BatchBuilder
from polyspec.runtime.executor import Launched, RoundExecutor
from polyspec.runtime.graphs import (
    CapturedForwards,
    GraphBuckets,
    block_slots,
    padded,
    static_batch,
)
from polyspec.runtime.kv_cache import KVCacheManager
from polyspec.runtime.model_runner import ModelRunner
from polyspec.runtime.req_pool import ReqToTokenPool
from polyspec.runtime.sampling import RequestSampler, SamplingBatch
from polyspec.spec.round import (
    PLAIN,
    HostView,
    RoundParts,
    SpecRound,
    Tree,
    level_keys,
    next_round_inputs,
)


@dataclasses.dataclass
class SeqState:
    """A request as the worker sees it."""

    row: int
    prompt: list[int]
    sampler: RequestSampler
    prefilled: int = 0  # prompt tokens whose target KV is written
    seq_len: int = 0  # tokens whose target KV is committed (the last token is not among them)
    last_token: int = -1  # the newest token: sampled / bonus, its KV not yet written
    # EAGLE only: the draft's view after its prefill's draft extend (after a decode round, the
    # worker keeps it batched for the whole round)
    topk_p: torch.Tensor | None = None  # [K]
    topk_index: torch.Tensor | None = None  # [K]
    draft_feature: torch.Tensor | None = None  # [H]
    # structured output: the request's grammar, advanced by every token it commits
    matcher: Matcher | None = None
    # the committed length at which it has max_new_tokens tokens (None: no limit given)
    end_len: int | None = None
    # the tokens after the prompt, the newest included (position len(prompt) + i)
    generated: list[int] = dataclasses.field(default_factory=list)
    # a draft's: positions it has read (behind seq_len after plain rounds, which skip it)
    draft_len: int = 0

    def tokens(self, start: int, end: int) -> list[int]:
        """The tokens at positions ``[start, end)`` (at most ``seq_len + 1``: the newest)."""
        n = len(self.prompt)
        head = self.prompt[start:end] if start < n else []
        return head + self.generated[max(start - n, 0) : max(end - n, 0)]


class PhaseTimer:
    """Wall time per phase; synchronises the device only when enabled (benchmarks)."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.enabled = False
        self.seconds: dict[str, float] = defaultdict(float)
        self._t = 0.0

    def start(self) -> None:
        if self.enabled:
            self.backend.synchronize()
            self._t = time.perf_counter()

    def lap(self, phase: str) -> None:
        if self.enabled:
            self.backend.synchronize()
            now = time.perf_counter()
            self.seconds[phase] += now - self._t
            self._t = now


def uses_graphs(caps, graphs: str) -> bool:
    """Whether a worker on a backend with capabilities ``caps`` replays captured graphs for
    the engine option ``graphs`` ("on", "off", "auto": where the backend captures)."""
    return caps.static_metadata and (graphs == "on" or (graphs == "auto" and caps.graph_capture))


def uses_overlap(caps, overlap_rounds: str) -> bool:
    """Whether the engine queues each greedy decode round behind the last one for the engine
    option ``overlap_rounds`` ("on", "off", "auto": where the backend's host reads are
    asynchronous, the only place the queued round can run while the host works)."""
    return overlap_rounds == "on" or (overlap_rounds == "auto" and caps.async_host_reads)


class WorkerBase:
    """Owns the target model runner, the slot bookkeeping and each request's state, and runs
    decode rounds (:class:`polyspec.spec.round.SpecRound`) through the round executor."""

    extra_kv_per_request = 0  # slots a request may hold beyond its tokens (verify width)
    scratch_kv = 0  # transient slots for the whole batch (draft lanes)
    # Positions a decode round allocates ahead of its need (within the request's reservation):
    # one allocation (and its host-to-device copies) every several rounds, not every round.
    kv_lookahead = 64
    # Per-request token widths a prefill chunk is padded to when its forwards replay a graph.
    prefill_widths = (16, 32, 64, 128, 256, 512)

    def __init__(
        self,
        backend: Backend,
        target: torch.nn.Module,
        dtype: torch.dtype,
        max_batch_size: int,
        max_context: int,
        num_kv_slots: int,
        page_size: int,
        capture_layers: tuple[int, ...] = (),
        graphs: str = "off",
        max_graph_batch_size: int | None = None,
        max_graph_prefill_tokens: int = 2048,
        constrained_draft: str = "auto",
    ):
        self.backend = backend
        self.kernels = backend.kernels
        self.device = backend.device()
        self._aranges: dict[tuple, torch.Tensor] = {}
        self.page_size = page_size
        self.target = target
        self.num_kv_slots = num_kv_slots
        self.allocator = backend.make_allocator(num_kv_slots, page_size)
        self.req_pool = ReqToTokenPool(
            max_batch_size, max_context, self.device, backend.index_dtype, page_size
        )
        self.kv = KVCacheManager(self.allocator, self.req_pool, self.kernels, backend.host_tensor)
        self.builder = BatchBuilder(backend, self.req_pool)
        self.target_runner = ModelRunner(target, backend, num_kv_slots, dtype, capture_layers)
        self.states: dict[int, SeqState] = {}
        self.timer = PhaseTimer(backend)
        caps = backend.capabilities
        use_graphs = uses_graphs(caps, graphs)
        self.graphs: CapturedForwards | None = None
        # Prefill graphs only where the graph budget is unbounded: a backend that can hold a
        # few shapes (max_graph_shapes) keeps them for the decode rounds, which run far more.
        self.graph_prefill_tokens = max_graph_prefill_tokens if caps.max_graph_shapes is None else 0
        if use_graphs:
            width = self.req_pool.req_to_token.shape[1]
            buckets = GraphBuckets.default(max_batch_size, max_graph_batch_size, width)
            self.graphs = CapturedForwards(backend, buckets)
        self.executor = RoundExecutor(backend, self.graphs)
        # A greedy round queued on the device behind the last one (overlap_rounds), with its
        # tree; the rounds queued so far, how many of them the next call could use (the
        # others were dropped: the batch changed otherwise than a queued round can follow),
        # how many of those after requests had left, and how many with requests that had
        # joined sitting it out.
        self._queued: tuple[Tree, Launched] | None = None
        # A constrained round's first phase, queued behind the round before it: a plain
        # round's forward (its next tokens need the host's masks, its forward does not), a
        # greedy speculative round's draft and verify (queued once the walk has settled the
        # roots' masks); how many were queued / used by the next call / used after requests
        # had left.
        self._forward: Launched | None = None
        self.queued_forwards = {"queued": 0, "used": 0, "used_by_fewer": 0}
        self.queued_rounds = {"queued": 0, "used": 0, "used_by_fewer": 0, "joined_after": 0}
        self._rounds: dict[tuple[Tree, bool, bool], SpecRound] = {}
        self.rounds_by_tree: dict[str, int] = {}
        # Dynamic depth's threshold, and rounds by the number of levels drafted (index 1..S).
        self.dynamic_depth = 0.0
        self.drafted_levels: list[int] = []
        # Structured output: host seconds spent building masks, masks computed in the rounds
        # (the roots' are the scheduler's), and constrained rounds run.
        self.mask_seconds = 0.0
        self.masks_computed = 0
        self.constrained_rounds = 0
        # Whether a constrained round masks its draft lanes (EngineConfig.constrained_draft):
        # "auto" masks them where the device does not run ahead of the host, whose waits
        # between the draft's levels cost nothing there.
        self.mask_lanes = constrained_draft == "levels" or (
            constrained_draft == "auto" and not caps.async_execution
        )

    def reset_stats(self) -> None:
        """Zero the round statistics (rounds by tree and by levels drafted, queued rounds,
        the phase timer, structured output's): after rounds run for the engine's own
        measurements at start-up."""
        self.rounds_by_tree = dict.fromkeys(self.rounds_by_tree, 0)
        self.drafted_levels = [0] * len(self.drafted_levels)
        self.queued_rounds = {"queued": 0, "used": 0, "used_by_fewer": 0, "joined_after": 0}
        self.queued_forwards = {"queued": 0, "used": 0, "used_by_fewer": 0}
        self.timer.seconds.clear()
        self.mask_seconds = 0.0
        self.masks_computed = 0
        self.constrained_rounds = 0

    # -- one decode round -----------------------------------------------------------------------
    # The timer's phases: the host's preparation of a round, and a replayed round (draft to
    # draft extend in one program; an eager round laps its own phases as it goes).
    prepare_phase = "draft"
    round_phase = "verify"

    def _lap(self, phase: str) -> None:
        self.timer.lap(phase)

    def tree_for(self, bs: int) -> Tree:  # noqa: ARG002
        """The draft tree of a round of ``bs`` requests."""
        return PLAIN

    plain_tree = PLAIN  # the tree of this worker's plain rounds

    def round_tokens(self, bs: int) -> int:
        """Tokens per request the target verifies in a round of ``bs`` requests (its tree's
        N; 1 for a plain round): what a round takes of an engine step's token budget."""
        return self.tree_for(bs).num_draft_tokens

    def round_parts(self) -> RoundParts:
        """What the rounds compute with (the models, their runners, the slot tables)."""
        raise NotImplementedError

    def round_fn(self, tree: Tree, greedy: bool, constrained: bool = False) -> SpecRound:
        """The round function of ``tree``, greedy or sampled, constrained or not (one object
        each, so that the executor records one computation per name)."""
        key = (tree, greedy, constrained)
        if key not in self._rounds:
            stop_below = self.dynamic_depth if tree.num_steps > 1 else 0.0
            self._rounds[key] = SpecRound(
                self.round_parts(), tree, greedy, stop_below, constrained, self.mask_lanes
            )
        return self._rounds[key]

    def round_graphs(self, greedy: bool = True, batch_size: int = 1) -> tuple[str, ...]:
        """The captured computations a round of ``batch_size`` requests replays when it fits a
        graph bucket (for benchmarks that time the forwards by replaying them)."""
        return (self.round_fn(self.tree_for(batch_size), greedy).__name__,)

    def decode(
        self, rids: Sequence[int], lookahead: bool = False, plain: bool = False
    ) -> list[list[int]]:
        """One round for ``rids`` -> each request's new tokens. ``lookahead``: queue the next
        round behind this one (``EngineConfig.overlap_rounds``): a greedy round without a
        constraint whole, a constrained plain round's forward (its next tokens need the
        host's masks), a constrained greedy speculative round's draft and verify (its
        acceptance is walked on the host). A request that has just joined may get no token
        (``[]``) when the round the last call queued is run for the others: it sits this
        round out and is in the one queued behind it. ``plain``: a plain round whatever the
        batch size's tree (the engine's choice for a constrained batch,
        ``EngineConfig.constrained_speculation``)."""
        sts = [self.states[r] for r in rids]
        self.timer.start()
        # The last call may have queued this round: for these requests, or for a batch some
        # of them have left since (their rows are not read) or some have joined since (they
        # sit it out).
        taken = self._take_queued(rids, sts)
        forward = self._take_forward(rids)
        masks = None
        if taken is not None:
            tree, launched, rows, joined = taken
            greedy = True
        else:
            tree, rows, joined = self.tree_for(len(sts)), None, 0
            if plain:
                tree = self.plain_tree
            greedy = all(s.sampler.greedy for s in sts)
            # A round with a constrained request works with the host in the middle (the
            # grammar's masks), and nothing is queued behind it.
            masks = self._round_masks(sts)
            launched = self._launch(tree, rids, sts, greedy, masks, lookahead, forward)
        self.rounds_by_tree[tree.label] = self.rounds_by_tree.get(tree.label, 0) + 1
        if lookahead and greedy and masks is None:
            self._keep_queued(tree, self._queue_next(tree, launched, rids, sts, rows, joined))
        members = sts[: len(sts) - joined]
        return self._finish(tree, launched, members, rows) + [[] for _ in range(joined)]

    def _launch(
        self, tree: Tree, rids, sts, greedy: bool, masks, lookahead: bool, forward=None
    ) -> Launched:
        """Launch a round of ``tree`` for ``rids`` (copying its outputs out of the graph's
        buffers when another round may be queued behind it). ``forward``: a constrained plain
        round's forward the last call queued for these requests (:meth:`_plain_phases`)."""
        # Slots for the tree's nodes (and the draft extend's tokens). The rejected nodes'
        # slots are not freed after the round (the next round's tree reuses them), and growth
        # allocates ahead within the request's reservation: most rounds neither allocate nor
        # free.
        seq_lens = [s.seq_len for s in sts]
        width = _round_width(tree)
        self.kv.ensure([s.row for s in sts], [n + width for n in seq_lens], self.kv_lookahead)
        fn = self.round_fn(tree, greedy, masks is not None)
        inputs = self._round_inputs(tree, rids, sts, greedy)
        if masks is not None and tree.num_steps == 0:
            inputs["root_mask"] = masks.root()  # [bs, W] int32
        self.timer.lap(self.prepare_phase)
        host = HostView(seq_lens, self._lap, masks)
        if masks is not None and tree.num_steps == 0 and self._splits_plain(sts, lookahead):
            launched = self._plain_phases(fn, rids, sts, inputs, host, forward)
        elif masks is None or tree.num_steps == 0:
            launched = self.executor.launch(
                rids, fn.__name__, fn, inputs, max(seq_lens), host,
                copy=lookahead and greedy and masks is None,
            )  # fmt: skip
        elif self.executor.captures(len(sts), max(seq_lens)):
            launched = self._launch_phases(fn, rids, sts, inputs, host, lookahead, forward)
        else:  # the whole round eagerly, every draft level masked
            launched = self.executor.launch(
                rids, fn.__name__, fn, inputs, max(seq_lens), host, eager=True
            )
        if masks is not None:
            if fn.walk_tree and tree.num_steps > 0:  # the walk committed the round's tokens:
                # the next roots' masks (and forced tokens') while the device accepts
                masks.next_roots(0 if fn.mask_lanes else tree.num_steps)
            self.mask_seconds += masks.seconds
            self.masks_computed += masks.computed
            self.constrained_rounds += 1
        return launched

    def _splits_plain(self, sts, lookahead: bool) -> bool:
        """Whether a constrained plain round runs as its two phases, the next round's forward
        queued behind it: ``overlap_rounds``, and both rounds' batches replay graphs that
        need no host lengths."""
        if not lookahead or self.graphs is None or self.graphs.needs_prepare:
            return False
        return self.executor.captures(len(sts), max(s.seq_len for s in sts) + 1)

    def _plain_phases(self, fn: SpecRound, rids, sts, inputs, host, forward) -> Launched:
        """A constrained plain round as its phases (:meth:`SpecRound.phases`): the forward
        (the one the last call queued, else launched now), the next tokens under the roots'
        masks (its result starting towards the host), then the next round's forward queued
        from those tokens on the device, before the host reads them: the device runs it
        while the host commits the tokens, schedules and builds the next masks. The queued
        forward is used by the next call for the same requests, or for those of them that
        have not finished, in the same order (:meth:`_take_forward`), and dropped otherwise
        (it writes each root's KV past the committed prefix, as a queued round does). -> the
        round's result."""
        forward_phase, next_phase = fn.phases()
        bs, max_prefix = len(rids), max(s.seq_len for s in sts)
        if forward is not None and forward.name == forward_phase.__name__:
            self.queued_forwards["used"] += 1
            self.queued_forwards["used_by_fewer"] += len(forward.key) > bs
        else:
            forward = self.executor.launch(
                rids, forward_phase.__name__, forward_phase, {"host": inputs["host"]},
                max_prefix, host,
            )  # fmt: skip
        step = {**inputs, "logits": forward.outputs[0][:bs]}  # and root_mask, the roots' masks
        out = self.executor.launch(
            rids, next_phase.__name__, next_phase, step, max_prefix, host, copy=True
        )
        out = dataclasses.replace(out, name=fn.__name__, fn=fn, inputs=dict(inputs))
        need = [min(s.seq_len + 1, self._end_len(s) - 1) + 1 for s in sts]
        self.kv.ensure([s.row for s in sts], need, self.kv_lookahead)
        nxt = next_round_inputs(fn.tree, inputs, out.outputs, out.rows)
        self._forward = self.executor.queue(
            tuple(rids), forward_phase.__name__, forward_phase, nxt, max_prefix + 1
        )
        self.queued_forwards["queued"] += self._forward is not None
        return out

    def _take_forward(self, rids: Sequence[int]) -> Launched | None:
        """The constrained round's first phase the last call queued, when it holds every
        request of ``rids`` in the same order (the caller uses it if this round is of the
        same kind): as it is, or, for a plain round's forward where requests have left since
        (finished), its logits rows of those that remain, each row its own request's (the
        forward is row-invariant). Either way it is gone."""
        queued, self._forward = self._forward, None
        if queued is None or queued.key == tuple(rids):
            return queued
        if not queued.name.endswith(".forward"):  # a draft-and-verify phase: its batch only
            return None
        at = {r: i for i, r in enumerate(queued.key)}
        rows = [at.get(r, -1) for r in rids]
        if min(rows) < 0 or rows != sorted(rows):  # a request joined, or the order changed
            return None
        logits = queued.outputs[0].index_select(0, self.builder.long(rows))  # [bs, V]
        # (``key`` the requests it served before: the caller counts a use by fewer)
        return dataclasses.replace(queued, outputs=(logits,), rows=len(rows))

    def _launch_phases(
        self, fn: SpecRound, rids, sts, inputs, host, lookahead: bool = False, forward=None
    ) -> Launched:
        """A constrained speculative round where the batch replays graphs: its phases
        (:meth:`SpecRound.phases`), each replayed, the host's work between them: the root's
        mask before the draft, each level's lanes' masks after it (the device waits for
        them), and the tree's node masks while the device verifies (the tree starts towards
        the host as the verify is queued), or greedy acceptance walked on the host after the
        verify (where the host reads nothing in between, draft and verify are one phase).
        ``forward``: that one phase, queued by the last call behind its round for these
        requests (:meth:`_queue_draft_verify`, with ``lookahead``). -> the accept phase, as
        the round's."""
        *levels, verify, accept = fn.phases()
        if fn.verifies_in_draft:  # one phase: the whole draft, then the verify
            levels, verify = [*levels, verify], None
        masks, bs, K = host.masks, len(rids), fn.tree.topk
        max_prefix = max(s.seq_len for s in sts)
        launch = functools.partial(self.executor.launch, rids, max_prefix=max_prefix, host=host)
        if forward is not None and forward.name == levels[0].__name__ and len(levels) == 1:
            out = forward  # queued behind the last round, under the same masks
            self.queued_forwards["used"] += 1
        else:
            out = launch(levels[0].__name__, levels[0], self._draft_inputs(fn, inputs, masks))
        for i, phase in enumerate(levels[1:], start=1):
            keys = level_keys(i, fn.stop_below > 0)
            level = {k: t[:bs] for k, t in zip(keys, out.outputs)}
            tokens, parents = level["input_ids"].reshape(-1), level["parents"]
            lane_masks = masks.lanes(i - 1, tokens, parents if i > 1 else None, K, False)
            level["lane_masks"] = lane_masks.view(bs, K, -1)  # [bs, K, W] int32
            out = launch(phase.__name__, phase, {"host": inputs["host"], **level})
        # copies of what the accept phase reads (a replay may overwrite a graph's outputs)
        nodes, *drawn, drafted = (t[:bs] for t in out.outputs[:4])
        nodes, drafted = nodes.clone(), drafted.clone()
        masks.start_tree(nodes)
        tree = {"host": inputs["host"], "nodes": nodes}
        if verify is None:  # the verify ran in the draft's phase
            second, verified = out, out.outputs[4:]
        else:
            tree_mask, positions = drawn
            second = launch(verify.__name__, verify, {**tree, "tree_mask": tree_mask,
                                                      "positions": positions})  # fmt: skip
            verified = second.outputs
        # hidden states, or logits and their top where the round walks the tree (walk_tree)
        first, feats, *top = (t.view(second.rows, -1, t.shape[-1])[:bs] for t in verified)
        self._lap("draft")
        queue = False
        if top:  # greedy acceptance walked on the host, from the target's top logits
            node = {"node_choice": masks.greedy_walk(top[0], first.flatten(0, 1)).view(bs, -1)}
            queue = lookahead and verify is None and self._draft_verify_queues(fn.tree, sts)
        else:  # every node's mask, while the device verifies
            node = {"node_masks": masks.tree().view(bs, -1, masks.width)}
        self._lap("verify")
        sampled = {k: v for k, v in inputs.items() if k not in self._draft_keys}  # coins...
        last = {**tree, **sampled, ("logits" if top else "hidden"): first, "features": feats,
                **node, "drafted": drafted}  # fmt: skip
        # (its outputs copied where the next round's first phase is queued behind it)
        out = launch(accept.__name__, accept, last, copy=queue)
        out = dataclasses.replace(out, name=fn.__name__, fn=fn, inputs=dict(inputs))
        if queue:
            self._queue_draft_verify(fn, rids, sts, out, masks, levels[0])
        return out

    _draft_keys = ("host", "topk_p", "topk_index", "hidden")
    """A phased round's inputs its draft reads: the requests' table, an EAGLE head's state."""

    def _draft_inputs(self, fn: SpecRound, inputs, masks: RoundMasks) -> dict:
        """A phased round's first phase's inputs: the requests' table and the draft state of
        ``inputs``, the roots' masks and, where the draft's levels take the forced tokens,
        theirs."""
        state = {k: v for k, v in inputs.items() if k in self._draft_keys}
        state["root_mask"] = masks.root()  # [bs, W] int32 (the phase takes the draft's vocab)
        if not fn.mask_lanes and fn.tree.num_steps > 1:  # [bs, S-1, W] int32, the same
            state["level_masks"] = masks.draft_levels(fn.tree.num_steps, draft_vocab=False)
        return state

    def _draft_verify_queues(self, tree: Tree, sts) -> bool:
        """Whether the next round's draft-and-verify phase may be queued behind this greedy
        round's accept phase, once its walk has committed the round's tokens: the batch
        stays (no request can reach its token limit in this round, no request's output ended
        in the walk), the next round runs the same tree, and its batch replays graphs that
        need no host lengths."""
        depth = tree.num_steps + 1
        if tree != self.tree_for(len(sts)) or self.graphs is None or self.graphs.needs_prepare:
            return False
        if any(s.seq_len + depth >= self._end_len(s) for s in sts):
            return False
        if any(s.matcher is not None and s.matcher.walk_ended for s in sts):
            return False
        return self.executor.captures(len(sts), max(s.seq_len for s in sts) + depth)

    def _queue_draft_verify(self, fn: SpecRound, rids, sts, launched, masks, phase) -> None:
        """Queue the next round's draft-and-verify phase behind ``launched`` (this round's
        accept phase), from its outputs on the device (the prefixes grown by the accepted
        tokens, the bonus tokens as roots, the draft extend's state) and the next roots'
        masks, which the walk's committed tokens settle: the device drafts and verifies the
        next round while the host reads this one's result, commits it and schedules. The
        next call takes it for the same requests in the same order (:meth:`_take_forward`)
        and drops it otherwise (its writes lie past every committed prefix)."""
        tree, depth = fn.tree, fn.tree.num_steps + 1
        masks.next_roots(0 if fn.mask_lanes else tree.num_steps)  # (the caller's finds them)
        width = _round_width(tree)
        need = [s.seq_len + depth + width for s in sts]
        self.kv.ensure([s.row for s in sts], need, self.kv_lookahead)
        nxt = next_round_inputs(tree, launched.inputs, launched.outputs, launched.rows)
        walked = self._round_masks(sts)  # the next round's, from the walked matchers
        try:
            state = self._draft_inputs(fn, {**launched.inputs, **nxt}, walked)
        except ConstraintViolation:  # a dead end: the next call fails that request alone
            return
        finally:
            self.mask_seconds += walked.seconds
        max_prefix = max(s.seq_len for s in sts) + depth
        self._forward = self.executor.queue(tuple(rids), phase.__name__, phase, state, max_prefix)
        self.queued_forwards["queued"] += self._forward is not None

    def _round_masks(self, sts: Sequence[SeqState]) -> RoundMasks | None:
        """The mask builder of a round with a constrained request, else None."""
        if all(s.matcher is None for s in sts):
            return None
        return RoundMasks(
            [s.matcher for s in sts], self.target.config.vocab_size, self._upload_mask,
            self.backend.read_async, self._draft_vocab(),
        )  # fmt: skip

    def _upload_mask(self, masks: np.ndarray) -> torch.Tensor:  # [n, W] int32 host -> device
        """Through the backend's upload, which does not wait for the device work queued."""
        flat = self.backend.host_tensor(torch.from_numpy(masks).reshape(-1), torch.int32)
        return flat.view(masks.shape)

    def _upload_float(self, values: torch.Tensor) -> torch.Tensor:  # [n] fp32 host -> device
        return self.backend.host_tensor(values, torch.float32)

    def _draft_vocab(self) -> DraftVocab | None:
        """The draft's vocabulary as target ids, when its logits are over a vocabulary of
        its own (an EAGLE-3 head's reduced one); None: over the target's."""
        return None

    def _round_inputs(
        self, tree: Tree, rids, sts, greedy: bool, prefilled: bool = False
    ) -> dict[str, torch.Tensor]:
        """The round's inputs on the device (see :mod:`polyspec.spec.round`): the requests'
        table rows, lengths, roots and verify widths in one upload, and a sampled round's
        settings and random draws (from each request's own stream). ``prefilled``: requests
        whose last step was their prefill (an EAGLE head's state is then each one's own)."""
        bs, N = len(sts), tree.num_draft_tokens
        values = [s.row for s in sts] + [s.seq_len for s in sts]
        values += [s.last_token for s in sts] + [N] * bs + [self._end_len(s) for s in sts]
        inputs = {"host": self.builder.long(values).view(5, bs).t()}
        if not greedy:
            sb = SamplingBatch([s.sampler for s in sts], 1, self.device, self._upload_float)
            inputs["sampling"] = sb.params()
            if tree.num_steps == 0:
                inputs["noise"] = sb.exponential(self.target.config.vocab_size)
            else:
                inputs["coins"] = sb.uniform(N + 1)
        return inputs

    def _end_len(self, s: SeqState) -> int:
        """The committed length at which a request has all its tokens (a round queued behind
        the one that takes it there leaves it out); without a token limit, the longest whose
        round fits the request table."""
        if s.end_len is not None:
            return s.end_len
        return self.req_pool.max_context - self.extra_kv_per_request

    def _queue_next(
        self, tree: Tree, launched: Launched, rids, sts, rows, joined: int = 0
    ) -> Launched | None:
        """Queue the round after ``launched`` for ``rids`` (``rows``: the rows of the first
        ``len(rids) - joined`` in it, None for all; the last ``joined`` are not in it) from
        its outputs on the device (its accepted lengths and bonus tokens give the next
        prefixes and roots), before the host has read them. A request that round takes to
        its token limit is a padding request of the queued one (the device knows, the host
        not yet). Its writes lie past the prefixes the host commits from ``launched``, so
        when the batch changes otherwise than it can follow (a sampled or constrained request
        joins) the queued round is simply dropped; a request that leaves (a stop) has its
        row ignored."""
        if tree != self.tree_for(len(sts)):  # the next round's tree is another (batch size)
            return None
        depth = tree.num_steps + 1
        # The next round starts at most ``depth`` past the prefixes the host knows (a
        # request that sat this round out: at its prefix).
        members, new = sts[: len(sts) - joined], sts[len(sts) - joined :]
        if not new and all(s.seq_len + 1 >= self._end_len(s) for s in members):
            return None  # the round takes every request to its limit (it commits at least
            # one token each): a round queued behind it would be padding, and the device
            # would run it before the next request's prefill
        if tree.num_steps and any(s.draft_len < s.seq_len for s in new):
            return None  # a joining request's draft is behind (its prefill skipped it): the
            # next round catches it up first (a draft extend, which cannot be queued here)
        max_prefix = max([s.seq_len + depth for s in members] + [s.seq_len for s in new])
        if not launched.captured or not self.executor.captures(len(sts), max_prefix):
            return None
        # slots for a request still short of its limit then (a longer one is padding)
        width = _round_width(tree)
        need = [min(s.seq_len + depth, self._end_len(s) - 1) + width for s in members]
        need += [s.seq_len + width for s in new]
        self.kv.ensure([s.row for s in sts], need, self.kv_lookahead)
        inputs = next_round_inputs(tree, launched.inputs, launched.outputs, launched.rows)
        if rows is not None:
            keep = self.builder.long(rows)
            inputs = {name: t.index_select(0, keep) for name, t in inputs.items()}
        if joined:  # the requests that sat this round out: their inputs from the host
            more = self._round_inputs(tree, rids[len(sts) - joined :], new, True, prefilled=True)
            inputs = {name: torch.cat([t, more[name]]) for name, t in inputs.items()}
        return self.executor.queue_next(launched, inputs, max_prefix, key=tuple(rids))

    def _finish(self, tree: Tree, launched: Launched, sts, rows=None) -> list[list[int]]:
        """Read a launched round's result (the round's one wait for the device), keep its
        draft state and commit its tokens (``rows``: the requests' rows in the round, None
        for all)."""
        host = launched.result().tolist()
        self.timer.lap(self.round_phase)
        n, b = len(launched.key), launched.rows
        S, N = tree.num_steps, tree.num_draft_tokens
        rows = range(len(sts)) if rows is None else rows
        accepted = [host[r] for r in rows]
        paths = [host[b + r * (S + 1) : b + (r + 1) * (S + 1)] for r in rows]
        predicted = host[b + b * (S + 1) : b + b * (S + 1) + n * N]  # [n * N]
        path_nodes = [p[: a + 1] for p, a in zip(paths, accepted)]  # global node ids
        if self.dynamic_depth > 0 and S > 1:
            self.drafted_levels[host[-1]] += 1
        self.timer.lap("accept")
        self._keep_state(launched)
        out = []
        for s, a, path in zip(sts, accepted, path_nodes):
            toks = [predicted[g] for g in path]  # the accepted drafts and the bonus token
            s.seq_len, s.last_token = s.seq_len + a + 1, toks[-1]
            s.generated += toks
            if S > 0:  # the draft extend has read the accepted tokens
                s.draft_len = s.seq_len
            if s.matcher is not None:  # the output ends where the grammar does
                toks = toks[: s.matcher.advance(toks)]
            out.append(toks)
        self.timer.lap("other")
        return out

    def _keep_state(self, launched: Launched) -> None:
        """Keep what the next round reads from this one (an EAGLE head's draft state)."""

    def _take_queued(
        self, rids: Sequence[int], sts
    ) -> tuple[Tree, Launched, list[int] | None, int] | None:
        """The round the last call queued behind itself -> (its tree, the round, the rows in
        it of the requests of ``rids`` it holds (None: exactly ``rids``), how many requests
        at the end of ``rids`` it does not hold), when it holds the first of ``rids`` in
        order (requests that have left since are ignored), each still short of its token
        limit when queued, and the others have joined since, greedy and unconstrained (they
        sit the round out); else None. Either way it is gone (a queued round is used once, or
        dropped)."""
        queued, self._queued = self._queued, None
        if queued is None:
            return None
        tree, launched = queued
        key = tuple(rids)
        rows, joined = None, 0
        if launched.key != key:
            at = {r: i for i, r in enumerate(launched.key)}
            held = next((i for i, r in enumerate(key) if r not in at), len(key))
            rows, joined = [at[r] for r in key[:held]], len(key) - held
            if not rows or rows != sorted(rows) or any(r in at for r in key[held:]):
                return None
            if any(not s.sampler.greedy or s.matcher is not None for s in sts[held:]):
                return None
        # The queued round left out a request its predecessor took to its limit; the host,
        # having read that predecessor, has finished such a request (its row is padding).
        if any(s.seq_len >= self._end_len(s) for s in sts[: len(sts) - joined]):
            return None
        self.queued_rounds["used"] += 1
        self.queued_rounds["used_by_fewer"] += rows is not None and len(rows) < len(launched.key)
        self.queued_rounds["joined_after"] += joined > 0
        return tree, launched, rows, joined

    def drop_queued(self) -> None:
        """Drop what the last call queued behind its round (its writes lie past the
        committed prefixes): the next call computes its round afresh."""
        self._queued = self._forward = None

    def _keep_queued(self, tree: Tree, queued: Launched | None) -> None:
        """Hold a round just queued behind this one (None: none could be) for the next call."""
        self._queued = None if queued is None else (tree, queued)
        self.queued_rounds["queued"] += queued is not None

    # -- request lifecycle -------------------------------------------------------------------
    def kv_need(self, prompt_len: int, max_new_tokens: int) -> int:
        """Slots a request may hold at its peak (what the scheduler reserves for it)."""
        ps = self.page_size
        n = prompt_len + max_new_tokens + self.extra_kv_per_request + ps
        return (n + ps - 1) // ps * ps

    def add_request(
        self,
        rid: int,
        prompt: Sequence[int],
        sampler: RequestSampler,
        kv_reserved: int | None = None,
        matcher: Matcher | None = None,
        max_new_tokens: int | None = None,
    ) -> None:
        """``kv_reserved``: the slots the scheduler reserved for the request (:meth:`kv_need`);
        decode rounds may allocate ahead within them. ``matcher``: the request's grammar
        (structured output), None for an unconstrained request. ``max_new_tokens``: its
        token limit (a queued round leaves out a request that has reached it)."""
        row = self.kv.add_request(kv_reserved)
        end = None if max_new_tokens is None else len(prompt) + max_new_tokens - 1
        self.states[rid] = SeqState(
            row=row, prompt=list(prompt), sampler=sampler, matcher=matcher, end_len=end
        )

    def remove_request(self, rid: int) -> None:
        # A round queued for a batch with this request stays: the next round of the others
        # is that round, its row ignored. Its writes to the slots freed here are queued on
        # the device before those of any request that gets them next.
        st = self.states.pop(rid)
        self.kv.remove_request(st.row)

    # -- prefill ------------------------------------------------------------------------------
    def _target_extend(self, rids: Sequence[int], ends: Sequence[int]):
        """Target EXTEND over prompt[prefilled:end] of each request.

        Returns (hidden [T, H], aux [T, A*H] | None, the host lists starts / lens)."""
        # A queued plain forward is dropped: the prefill's graphs may overwrite its logits,
        # and the batch is changing.
        self._forward = None
        sts = [self.states[r] for r in rids]
        rows = [s.row for s in sts]
        starts = [s.prefilled for s in sts]
        lens = [e - s for s, e in zip(starts, ends)]
        self.kv.ensure(rows, list(ends))
        ids = [t for s, e in zip(sts, ends) for t in s.prompt[s.prefilled : e]]
        hidden, aux = self._extend(self.target_runner, rows, starts, lens, ids)
        for s, e in zip(sts, ends):
            s.prefilled = e
            s.seq_len = e
        return hidden, aux, starts, lens

    def _extend(
        self,
        runner: ModelRunner,
        rows: Sequence[int],
        starts: Sequence[int],
        lens: Sequence[int],
        ids: Sequence[int] | torch.Tensor,  # [T]: host ints or int64 on the device
        features: torch.Tensor | None = None,  # [T, F]: a draft's input features
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """EXTEND (the target runner) or DRAFT_EXTEND (``features`` given, or a standalone
        draft) over ``lens[i]`` tokens of row ``rows[i]`` from ``starts[i]``; ``ids`` [T]
        concatenated (a device tensor: ids the host has not read, such as a prefill's first
        tokens). -> the runner's two outputs for the T tokens, concatenated.

        Replays a graph when the batch fits one: each request's chunk is padded to the
        smallest of :attr:`prefill_widths` that holds the longest, so that a prefill costs one
        replay instead of a launch per kernel per layer. A batch too wide for one (a long
        prompt among many short ones) replays a few, its requests grouped by length
        (:meth:`_extend_grouped`); only where that fails too does it run eagerly."""
        draft = runner is not self.target_runner
        if not isinstance(ids, torch.Tensor):
            ids = self.builder.long(ids)
        out = self._extend_graphed(runner, draft, rows, starts, lens, ids, features)
        if out is None:
            out = self._extend_grouped(runner, draft, rows, starts, lens, ids, features)
        if out is not None:
            return out
        mode = ForwardMode.DRAFT_EXTEND if draft else ForwardMode.EXTEND
        batch = self.builder.build(mode, rows, starts, lens, ids)
        if draft:
            return runner.forward_draft(batch, features)
        return runner.forward_target(batch)

    max_prefill_groups = 4  # graph replays one prefill may be split into

    def _extend_grouped(self, runner, draft: bool, rows, starts, lens, ids, features):
        """:meth:`_extend` as a few graph replays over groups of requests of similar length
        (shortest first, each group as wide as its longest); None where a request fits no
        graph or more than :attr:`max_prefill_groups` would be needed. A row's result does
        not depend on the rows beside it (row-invariant kernels, attention per request), so
        the grouping changes no value."""
        if self.graphs is None or not self.graph_prefill_tokens or len(rows) < 2:
            return None
        groups: list[list[int]] = []
        for i in sorted(range(len(rows)), key=lambda i: lens[i]):
            g = groups[-1] + [i] if groups else [i]
            if groups and self._prefill_width(len(g), lens[i], max(starts[j] for j in g)):
                groups[-1] = g
            elif self._prefill_width(1, lens[i], starts[i]) is None:
                return None  # this request fits no graph on its own
            else:
                groups.append([i])
        if len(groups) > self.max_prefill_groups:
            return None
        offsets = [0, *itertools.accumulate(lens)]
        parts = []
        for g in groups:
            at = [t for i in g for t in range(offsets[i], offsets[i + 1])]
            at_t = self.builder.long(at)
            out = self._extend_graphed(
                runner, draft, [rows[i] for i in g], [starts[i] for i in g],
                [lens[i] for i in g], ids.index_select(0, at_t),
                None if features is None else features.index_select(0, at_t),
            )  # fmt: skip
            if out is None:  # the backend's graph budget is spent
                return None
            parts.append((at_t, out))
        total = offsets[-1]
        merged = []
        for k in range(2):
            first = parts[0][1][k]
            if first is None:
                merged.append(None)
                continue
            full = first.new_empty(total, *first.shape[1:])
            for at_t, out in parts:
                full.index_copy_(0, at_t, out[k])
            merged.append(full)
        return merged[0], merged[1]

    def arange(self, n: int, step: int = 1) -> torch.Tensor:  # [n] int64: 0, step, 2 * step..
        """A cached ``torch.arange(0, n * step, step)`` on the device, read-only: made once
        (the first time, which for a captured computation is its warm-up, outside the graph),
        so captured rounds do not spend a launch on each index constant."""
        key = (n, step)
        if key not in self._aranges:
            self._aranges[key] = torch.arange(0, n * step, step, device=self.device)
        return self._aranges[key]

    def level_lens(self, levels: int, b: int) -> torch.Tensor:  # [levels, b] index dtype
        """A cached ``[levels, b]`` table whose row i holds i + 1 (the draft lanes' lengths at
        each level without paging), made once as :meth:`arange` is."""
        key = ("levels", levels, b)
        if key not in self._aranges:
            table = torch.arange(1, levels + 1, device=self.device)[:, None].expand(levels, b)
            self._aranges[key] = table.to(self.backend.index_dtype).contiguous()
        return self._aranges[key]

    def _prefill_width(self, bs: int, max_len: int, max_start: int) -> int | None:
        """The padded per-request width of a captured prefill; None to run it eagerly."""
        b = self.graphs.buckets.batch_bucket(bs)
        width = next((w for w in self.prefill_widths if w >= max_len), None)
        if b is None or width is None or b * width > self.graph_prefill_tokens:
            return None
        if self.graphs.buckets.prefix_bucket(max_start) is None:
            return None
        return width

    def _extend_graphed(self, runner, draft: bool, rows, starts, lens, ids, features):
        """:meth:`_extend` through a graph replay; None when this batch runs eagerly."""
        if self.graphs is None or not self.graph_prefill_tokens:
            return None
        graphs = self.graphs
        kind = "draft_prefill" if draft else "prefill"
        fn = functools.partial(self._extend_graph, runner, draft)
        if f"{kind}_{self.prefill_widths[0]}" not in graphs.names:
            # Every width is declared at the first prefill, whichever it runs, so that a
            # warm-up's capture_all records them all (a lazy capture would land in a timed run).
            dev = self.device
            host = {"host": (1, (4,), torch.int64, dev)}  # rows, starts, lens, 0 per request
            per_token = {"input_ids": ((), torch.int64)}
            if features is not None:
                per_token["features"] = (tuple(features.shape[1:]), features.dtype)
            for w in self.prefill_widths:
                t = {**host, **{n: (w, shape, dt, dev) for n, (shape, dt) in per_token.items()}}
                graphs.declare(f"{kind}_{w}", fn, t, max_batch=self.graph_prefill_tokens // w)
        bs = len(rows)
        width = self._prefill_width(bs, max(lens), max(starts))
        if width is None:
            return None
        # request i's tokens at [i * width, i * width + lens[i]), the padding id 0
        keep = [t for i, n in enumerate(lens) for t in range(i * width, i * width + n)]
        keep_t = self.builder.long(keep)
        inputs = {
            "host": self.builder.long([*rows, *starts, *lens, *[0] * bs]).view(4, bs).t(),
            "input_ids": ids.new_zeros(bs * width).index_copy_(0, keep_t, ids),
        }
        if features is not None:
            spread = features.new_zeros(bs * width, *features.shape[1:])
            inputs["features"] = spread.index_copy_(0, keep_t, features)
        host_params = {"prefix_lens": list(starts), "extend_lens": list(lens)}
        out = graphs.run(f"{kind}_{width}", bs, max(starts), inputs, fn, host_params)
        if out is None:
            return None
        first, second = out
        return first.index_select(0, keep_t), (
            None if second is None else second.index_select(0, keep_t)
        )

    def _extend_graph(self, runner, draft: bool, s, bs: int, max_prefix: int):
        """A captured prefill forward over ``bs`` requests of a fixed width each (the padding
        tokens past ``lens`` write the padding slot 0)."""
        table = self.req_pool.req_to_token
        host = s["host"].t().to(self.backend.index_dtype)
        rows, starts, lens = host[0], host[1], host[2]
        width = s["input_ids"].shape[0] // bs
        slots, positions = block_slots(self.kernels, table, rows, starts, lens, width)
        mode = ForwardMode.DRAFT_EXTEND if draft else ForwardMode.EXTEND
        batch = static_batch(mode, table, rows, starts, lens, s["input_ids"], positions, slots)
        batch.host_lengths = functools.partial(_prefill_lengths, rows=bs)
        if draft:
            return runner.forward_draft(batch, s.get("features"), static_prefix=max_prefix)
        return runner.forward_target(batch, static_prefix=max_prefix)

    def _last_rows(self, lens: Sequence[int], done: Sequence[int]) -> torch.Tensor:  # [n] int64
        """The rows of an extend's output holding the last token of requests ``done`` (indices
        into ``lens``, each request's tokens in it), uploaded without waiting for the device
        (indexing a device tensor with a host list copies the index synchronously: a wait for
        all the work queued, after which the device idles while the host prepares more)."""
        ends = list(itertools.accumulate(lens))
        return self.builder.long([ends[i] - 1 for i in done])

    def _sample_first(self, rids: Sequence[int], last_hidden: torch.Tensor) -> list[int]:
        """First generated token of requests whose prompt is now complete (``last_hidden``
        [n, H], their last prompt rows)."""
        return self._commit_first(rids, self._first_tokens(rids, last_hidden))

    def _first_tokens(
        self,
        rids: Sequence[int],
        last_hidden: torch.Tensor,  # [n, H]
    ) -> torch.Tensor:  # [n] int64 on the device, not read yet
        """The first tokens of requests whose prompt is now complete, left on the device so
        that work depending on them (a draft's extend) queues before the host waits for them."""
        sts = [self.states[r] for r in rids]
        logits = self.target.compute_logits(last_hidden)
        masks = self._round_masks(sts)
        if masks is not None:
            self.kernels.apply_token_bitmask(logits, masks.root())
        sb = SamplingBatch([s.sampler for s in sts], 1, self.device, self._upload_float)
        return sb.sample(logits, self.kernels)

    def _commit_first(self, rids: Sequence[int], tokens: torch.Tensor) -> list[int]:  # [n]
        """Read the first tokens of :meth:`_first_tokens` (the prefill's one wait for the
        device) and commit them to their requests."""
        sts = [self.states[r] for r in rids]
        tokens = tokens.tolist()
        for s, t in zip(sts, tokens):
            s.last_token = t
            s.generated.append(t)
            if s.matcher is not None:
                s.matcher.advance([t])
        return tokens


def _prefill_lengths(host_params: Mapping[str, Any], rows: int) -> HostLengths:
    """A captured prefill forward's ``ForwardBatch.host_lengths``: the replay's starts and
    lengths (``GraphRunner.prepare``'s ``"prefix_lens"`` / ``"extend_lens"``), padding
    requests 0."""
    return HostLengths(
        padded(host_params, "prefix_lens", rows), padded(host_params, "extend_lens", rows)
    )


def _round_width(tree: Tree) -> int:
    """Positions past its prefix a round writes for a request: the tree's N nodes, and the
    draft extend's S + 1 tokens."""
    return max(tree.num_draft_tokens, tree.num_steps + 1)
