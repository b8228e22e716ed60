"""The EAGLE worker: draft -> build tree -> verify -> accept -> draft extend (docs/architecture.md).

Works for EAGLE-1/2 heads, EAGLE-3 heads and standalone draft models alike: the draft is any
module with the draft-head interface (``forward``, ``topk``, ``probs``).

Host work per round is kept small because on an accelerator with graphs it is most of what a
round spends outside its forwards: a round uploads its host values once (:class:`_RoundInputs`),
keeps the draft's state batched from one round to the next (:class:`_DraftBatch`), and an
all-greedy round of an EAGLE head replays a single captured graph that drafts, builds the tree,
verifies, accepts, compacts the accepted path's KV and runs the draft extend
(:meth:`EagleWorker._round_greedy_graph`), leaving the host one device-to-host copy.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import NamedTuple

import torch

from polyspec.backend import ForwardMode, HostRead, TreeMaskMode, draft_lane_width
from polyspec.config import SpeculativeConfig
from polyspec.errors import ConfigError
from polyspec.runtime.graphs import block_slots, static_batch
from polyspec.runtime.kv_cache import OutOfKVSlots
from polyspec.runtime.model_runner import ModelRunner
from polyspec.runtime.sampling import SamplingBatch, greedy_ids
from polyspec.spec.base import SeqState, WorkerBase

ROUND_GREEDY = "round_greedy"
"""The captured computation of a whole all-greedy round (EAGLE heads)."""


class _Tree(NamedTuple):
    """One draft tree a round may use (``SpeculativeConfig.trees``)."""

    num_steps: int  # S
    topk: int  # K
    num_draft_tokens: int  # N
    lane_width: int  # W, the slots each draft lane owns
    suffix: str  # of its graphs' names: "" for the main tree, "@S-K-N" for a batch tree

    @property
    def label(self) -> str:
        return f"S={self.num_steps} K={self.topk} N={self.num_draft_tokens}"


class _Columns(NamedTuple):
    """A round's per-request values on the device."""

    rows: torch.Tensor  # [bs] request table rows (index dtype)
    seq_lens: torch.Tensor  # [bs] committed lengths: the prefix of the round (index dtype)
    roots: torch.Tensor  # [bs] the newest token, the tree's root (int64)
    widths: torch.Tensor  # [bs] verify width N; 0 for the padding requests of a graph


class _AcceptLocs(NamedTuple):
    """``assign_accept_locs``'s outputs: the accepted path's KV moves and the draft extend's
    fixed-width batch (S + 1 tokens per request)."""

    src_loc: torch.Tensor  # [b * (S + 1)] where each accepted node's target KV is
    dst_loc: torch.Tensor  # [b * (S + 1)] where it goes; also the draft extend's slots
    positions: torch.Tensor  # [b * (S + 1)] the draft extend's positions (int64)
    path_node: torch.Tensor  # [b * (S + 1)] verify row of each draft extend token (int64)
    extend_lens: torch.Tensor  # [b] accepted tokens + 1; 0 for a graph's padding requests
    last_index: torch.Tensor  # [b] draft extend row of each request's newest token (int64)


def _columns(packed: torch.Tensor, index_dtype: torch.dtype) -> _Columns:
    """[4, bs] int64 (rows, lengths, roots, widths) -> :class:`_Columns` (views where the index
    dtype is int64)."""
    lens = packed.to(index_dtype)
    return _Columns(lens[0], lens[1], packed[2], lens[3])


class _RoundInputs:
    """A round's host values in one upload (one copy instead of one per list, and one graph
    input). ``per_request`` [bs, 4] is what the captured computations take (a graph's padding
    requests get zeros: row 0, length 0, width 0); ``cols`` are the eager steps' views."""

    def __init__(self, builder, sts: Sequence[SeqState], width: int, index_dtype: torch.dtype):
        bs = len(sts)
        values = [s.row for s in sts] + [s.seq_len for s in sts]
        values += [s.last_token for s in sts] + [width] * bs
        self.packed = builder.long(values).view(4, bs)
        self.index_dtype = index_dtype

    @property
    def per_request(self) -> torch.Tensor:  # [bs, 4]
        return self.packed.t()

    @functools.cached_property
    def cols(self) -> _Columns:
        return _columns(self.packed, self.index_dtype)


@dataclasses.dataclass
class _Launched:
    """A captured all-greedy round on the device queue whose tokens the host has not read.
    With ``read`` set (a round queued behind another, ``EngineConfig.overlap_rounds``) its
    outputs are copies: the next replay of the same graph overwrites the static ones."""

    rids: tuple[int, ...]
    tree: _Tree
    bucket: int  # b, the graph's batch bucket
    packed: torch.Tensor  # [b + b * (S + 1) + b * N] int64, :func:`_pack_verified`
    read: HostRead | None  # ``packed`` on its way to the host, when queued behind another
    next_state: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # [bs, K'], [bs, K'], [bs, H]
    per_request: torch.Tensor  # [bs, 4] the round's inputs: rows, seq_lens, roots, widths


@dataclasses.dataclass
class _DraftBatch:
    """The draft's view of each request after the last round's draft extend, kept batched in
    that round's request order: when the next round has the same requests in the same order
    (no request joined or left), it reads these tensors as they are. They may be a graph's
    static outputs, which the next replay of the same graph overwrites, and so may the replay
    of a graph captured before it (graphs share one memory pool): the next round reads them
    before any replay, a round with other requests copies what it needs, and a prefill, which
    replays graphs of its own in between, first copies them (:meth:`_own_draft_batch`)."""

    rids: tuple[int, ...]
    topk_p: torch.Tensor  # [bs, K]
    topk_index: torch.Tensor  # [bs, K]
    feature: torch.Tensor  # [bs, H]


class EagleWorker(WorkerBase):
    def __init__(self, backend, target, draft, spec: SpeculativeConfig, dtype, **kw):
        caps = backend.capabilities
        widest = max(k for _, _, k, _ in spec.trees)
        if widest > 1 and not caps.tree_attention:
            raise ConfigError(
                f"backend {backend.name!r} verifies chains only (no tree attention); "
                f"set topk = 1 in every tree (got topk = {widest})"
            )
        super().__init__(backend, target, dtype, capture_layers=tuple(draft.aux_layer_ids), **kw)
        self.draft = draft
        self.spec = spec
        ps = self.page_size
        # (min batch size, tree), ascending. Each lane holds the prefix's partial last page
        # (copied) plus its draft tokens.
        self.trees = [
            (b, _Tree(s, k, n, draft_lane_width(s, ps), "" if b == 1 else f"@{s}-{k}-{n}"))
            for b, s, k, n in spec.trees
        ]
        main = self.trees[0][1]
        # The main tree's (a batch of one): what callers that know one tree read.
        self.num_steps, self.topk, self.num_draft_tokens = main[:3]
        self.lane_width = main.lane_width
        # The draft keeps the top-K of the widest tree between rounds: a round of a narrower
        # tree reads its first K columns (top-K is sorted, so they are that tree's top-K).
        self.state_topk = max(t.topk for _, t in self.trees)
        self.dynamic_depth = spec.dynamic_depth or 0.0
        # Dynamic depth's statistics: rounds by the number of levels drafted (index 1..S).
        self.drafted_levels = [0] * (max(t.num_steps for _, t in self.trees) + 1)
        self.rounds_by_tree = {t.label: 0 for _, t in self.trees}
        self.extra_kv_per_request = max(t.num_draft_tokens for _, t in self.trees)
        lanes = max(t.topk * t.lane_width if t.num_steps > 1 else 0 for _, t in self.trees)
        self.scratch_kv = kw["max_batch_size"] * lanes
        # The most tokens a round can commit for a request (the deepest tree's S + 1).
        self.max_round_tokens = max(t.num_steps for _, t in self.trees) + 1
        self.draft_runner = ModelRunner(draft, backend, self.num_kv_slots, dtype)
        self.use_aux = bool(draft.aux_layer_ids)
        # A standalone LM has no target features: it reads token p at position p, so each
        # round starts with one draft forward over the root (bonus) token.
        self.root_forward = draft.algorithm == "standalone"
        self._draft_batch: _DraftBatch | None = None
        # The draft lanes' slots are taken once for the largest batch and reused every round:
        # a per-round alloc / free would cost a device-to-host sync (free checks the slots)
        # in the middle of the round. The scheduler already keeps scratch_kv out of its budget.
        self.lane_scratch = None
        if self.scratch_kv:
            self.lane_scratch = self.allocator.alloc(self.scratch_kv)
            if self.lane_scratch is None:
                raise OutOfKVSlots(
                    f"out of KV slots for the draft lanes: needed {self.scratch_kv}, "
                    f"{self.allocator.available} free; raise num_kv_slots"
                )

    def tree_for(self, bs: int) -> _Tree:
        """The draft tree of a round of ``bs`` requests."""
        return next(t for b, t in reversed(self.trees) if b <= bs)

    def round_graphs(self, greedy: bool = True, batch_size: int = 1) -> tuple[str, ...]:
        """The captured computations a round of ``batch_size`` requests replays when it fits a
        graph bucket (for benchmarks that time the forwards by replaying them)."""
        tree = self.tree_for(batch_size)
        if self.root_forward:  # its draft and draft extend run eagerly
            names = ("verify_greedy",) if greedy else ("verify",)
        elif greedy:
            names = (ROUND_GREEDY,)
        else:
            names = (("draft",) if tree.num_steps > 1 else ()) + ("verify", "draft_extend")
        return tuple(n + tree.suffix for n in names)

    # -- prefill ------------------------------------------------------------------------------
    def prefill(self, rids: Sequence[int], ends: Sequence[int]) -> dict[int, int]:
        """Target extend over a prompt chunk, then draft extend over the shifted chunk."""
        self.timer.start()
        self._own_draft_batch()
        hidden, aux, starts, lens = self._target_extend(rids, ends)
        sts = [self.states[r] for r in rids]
        done = [i for i, s in enumerate(sts) if ends[i] == len(s.prompt)]
        last = self.builder.long(lens).cumsum(0) - 1
        first: dict[int, int] = {}
        if done:
            tokens = self._sample_first([rids[i] for i in done], hidden[last[done]])
            first = {rids[i]: t for i, t in zip(done, tokens)}
        ids = []
        for r, s, st, e in zip(rids, sts, starts, ends):
            if self.root_forward:
                ids.extend(s.prompt[st:e])
            else:  # an EAGLE head pairs the target feature at position p with token p + 1
                ids.extend(s.prompt[st + 1 : e] + [first[r] if r in first else s.prompt[e]])
        features = None if self.root_forward else (aux if self.use_aux else hidden)
        logit_h, next_feat = self._extend(
            self.draft_runner, [s.row for s in sts], starts, lens, ids, features
        )
        if done and not self.root_forward:
            topk_p, topk_index = self.draft.topk(logit_h[last[done]], self.state_topk)
            for i, p, t, f in zip(done, topk_p, topk_index, next_feat[last[done]]):
                sts[i].topk_p, sts[i].topk_index, sts[i].draft_feature = p, t, f
        self.timer.lap("prefill")
        return first

    # -- the draft's state between rounds -----------------------------------------------------
    def _draft_state(self, rids: Sequence[int], sts: Sequence[SeqState]):
        """(topk_p [bs, K], topk_index [bs, K], feature [bs, H]) of this round's requests: the
        last round's tensors as they are when it had the same requests in the same order;
        otherwise stacked from that round's rows and the prefilled requests' own views."""
        last, self._draft_batch = self._draft_batch, None
        if last is not None and last.rids == tuple(rids):
            return last.topk_p, last.topk_index, last.feature
        rows = {}
        if last is not None and any(r in self.states for r in last.rids):
            views = zip(last.topk_p.unbind(0), last.topk_index.unbind(0), last.feature.unbind(0))
            rows = dict(zip(last.rids, views))
            here = set(rids)
            for r in last.rids:  # one sitting this round out keeps a copy of its own
                if r not in here and r in self.states:
                    s = self.states[r]
                    s.topk_p, s.topk_index, s.draft_feature = (t.clone() for t in rows[r])
        parts = [
            rows[r] if r in rows else (s.topk_p, s.topk_index, s.draft_feature)
            for r, s in zip(rids, sts)
        ]
        return tuple(torch.stack(col) for col in zip(*parts))

    def _own_draft_batch(self) -> None:
        """Copy the kept draft state out of the round graph's static outputs before other
        graphs replay (a prefill's): a graph captured earlier may reuse that memory."""
        last = self._draft_batch
        if last is not None and self.graphs is not None:
            self._draft_batch = dataclasses.replace(
                last,
                topk_p=last.topk_p.clone(),
                topk_index=last.topk_index.clone(),
                feature=last.feature.clone(),
            )

    def _keep_draft_state(self, rids: Sequence[int], topk_p, topk_index, feature) -> None:
        self._draft_batch = _DraftBatch(tuple(rids), topk_p, topk_index, feature)

    # -- one decode round ---------------------------------------------------------------------
    def decode(self, rids: Sequence[int], lookahead: bool = False) -> list[list[int]]:
        """One round for ``rids`` -> each request's new tokens. ``lookahead``: the scheduler
        allows queueing the next round behind this one (no request can reach its token limit
        in this round, ``EngineConfig.overlap_rounds``)."""
        sts = [self.states[r] for r in rids]
        tree = self.tree_for(len(sts))
        self.rounds_by_tree[tree.label] += 1
        N = tree.num_draft_tokens
        self.timer.start()
        greedy = not self.root_forward and all(s.sampler.greedy for s in sts)
        launched = self._take_queued(rids)  # the last call may have queued this very round
        if launched is None:  # none queued, or for a batch that has changed since
            # Slots for the N tree nodes of each request. The rejected nodes' slots are not
            # freed after the round (the next round's tree reuses them), and growth allocates
            # ahead within the request's reservation: most rounds neither allocate nor free.
            self.kv.ensure([s.row for s in sts], [s.seq_len + N for s in sts], self.kv_lookahead)
            inp = _RoundInputs(self.builder, sts, N, self.backend.index_dtype)
            if self.root_forward:
                state = self._root_forward(sts, inp)
            else:
                state = self._draft_state(rids, sts)
            if greedy:
                max_prefix = max(s.seq_len for s in sts)
                launched = self._launch_greedy(
                    tree, rids, inp.per_request, state, max_prefix, copy=lookahead
                )
            if launched is None:
                return self._staged_round(tree, rids, sts, inp, state)
        if lookahead and greedy:
            self._keep_queued(self._queue_next(launched, sts))
        return self._finish_greedy(launched, sts)

    def _launch_greedy(
        self, tree: _Tree, rids, per_request, state, max_prefix: int, copy: bool
    ) -> _Launched | None:
        """Queue an all-greedy round of an EAGLE head as one replay
        (:meth:`_round_greedy_graph`) from its inputs on the device (``per_request`` [bs, 4],
        the draft ``state``); None when the batch runs eagerly. ``copy``: another round will
        be queued behind this one before its tokens are read, so its outputs are copied out
        of the graph's static buffers and its packed values start towards the host."""
        bs = len(rids)
        graphs = self.graphed(bs, max_prefix)
        if graphs is None:
            return None
        topk_p, topk_index, hidden = state
        inputs = {"host": per_request, "topk_p": topk_p, "topk_index": topk_index, "hidden": hidden}
        self.timer.lap("draft")
        fn = functools.partial(self._round_greedy_graph, tree)
        out = graphs.run(ROUND_GREEDY + tree.suffix, bs, max_prefix, inputs, fn)
        if out is None:
            return None
        packed, next_p, next_index, next_feat = out
        next_state = (next_p[:bs], next_index[:bs], next_feat[:bs])
        read = None
        if copy:
            packed = packed.clone()
            next_state = tuple(t.clone() for t in next_state)
            read = self.backend.read_async(packed)
        b = graphs.buckets.batch_bucket(bs)
        return _Launched(tuple(rids), tree, b, packed, read, next_state, per_request)

    def _queue_next(self, launched: _Launched, sts) -> _Launched | None:
        """Queue the round after ``launched`` from its outputs on the device (its accepted
        lengths and bonus tokens give the next prefixes and roots), before the host has read
        them. Its writes lie past the prefixes the host commits from ``launched``, so when
        the batch changes instead (a request stops) the queued round is simply dropped."""
        tree, bs, b = launched.tree, len(sts), launched.bucket
        depth, N = tree.num_steps + 1, tree.num_draft_tokens
        # The next round starts at most ``depth`` past the prefixes the host knows.
        max_prefix = max(s.seq_len for s in sts) + depth
        if self.graphed(bs, max_prefix) is None:
            return None
        self.kv.ensure(
            [s.row for s in sts], [s.seq_len + depth + N for s in sts], self.kv_lookahead
        )
        packed = launched.packed
        accepted = packed[:bs]  # [bs]
        paths = packed[b : b + b * depth].view(b, depth)[:bs]  # [bs, S + 1] global node ids
        last = paths.gather(1, accepted.view(bs, 1)).view(bs)  # the bonus token's node
        roots = packed[b + b * depth :].index_select(0, last)  # [bs]
        prev = launched.per_request  # [bs, 4]
        per_request = torch.stack(
            [prev[:, 0], prev[:, 1] + accepted + 1, roots, prev[:, 3]], dim=1
        )  # fmt: skip
        return self._launch_greedy(
            tree, launched.rids, per_request, launched.next_state, max_prefix, copy=True
        )

    def _finish_greedy(self, launched: _Launched, sts) -> list[list[int]]:
        """Read a launched round's tokens (the round's one wait for the device), keep its
        draft state and commit its tokens."""
        host = launched.read.wait() if launched.read is not None else launched.packed
        # Timed as verify: the draft forwards and the draft extend run inside the same graph.
        self.timer.lap("verify")
        bs = len(sts)
        accepted, path_nodes, predicted = self._read_verified(
            launched.tree, host.tolist(), bs, launched.bucket
        )
        self.timer.lap("accept")
        self._keep_draft_state(launched.rids, *launched.next_state)
        return self._commit(sts, accepted, path_nodes, predicted)

    def _round_greedy_graph(self, tree: _Tree, s, bs: int, max_prefix: int):
        """The captured all-greedy round: draft, tree, verify, greedy acceptance, compaction of
        the accepted path's target KV and draft extend, over device tensors only.
        -> (packed host vector, next topk_p [b, K'], topk_index [b, K'], feature [b, H]),
        K' the widest tree's K."""
        cols = self._graph_columns(s)
        drafted = self._draft_core(
            tree, cols, s["topk_p"], s["topk_index"], s["hidden"], bs, max_prefix
        )
        candidates, tree_mask, positions, _, next_token, next_sibling = drafted
        logits, feats = self._verify_core(
            tree, cols, candidates.flatten(), positions, tree_mask, max_prefix
        )
        predicts, accept_index, accept_length = self._accept_greedy(
            tree, candidates, next_token, next_sibling, logits
        )
        locs = self._accept_locs(tree, cols, accept_index, accept_length)
        if tree.topk > 1:  # a chain's path is always in place
            self._compact(locs)
        next_state = self._draft_extend_core(cols, predicts, feats, locs, bs, max_prefix)
        return _pack_verified(accept_length, accept_index, predicts), *next_state

    def _staged_round(self, tree: _Tree, rids, sts, inp: _RoundInputs, state):
        """A round step by step: each step replays its own graph where the batch fits a
        bucket, else runs eagerly; sampled acceptance runs between them. -> new tokens per
        request."""
        bs, N, S = len(sts), tree.num_draft_tokens, tree.num_steps
        rows = [s.row for s in sts]
        seq_lens = [s.seq_len for s in sts]
        idx, dev = self.backend.index_dtype, self.device
        drafted = self._draft(tree, state, rows, seq_lens, inp)
        candidates, tree_mask, positions, retrive_index, next_token, next_sibling = drafted
        self.timer.lap("draft")

        sb = SamplingBatch([s.sampler for s in sts], N, dev)
        verified = None
        if sb.all_greedy:
            verified = self._verify_greedy_graphed(tree, inp, max(seq_lens), drafted)
        if verified is not None:
            predicts, feats, accept_index, accept_length, packed, b = verified
            self.timer.lap("verify")
        else:
            logits, feats = self._verify(
                tree, rows, seq_lens, inp, candidates, positions, tree_mask
            )
            self.timer.lap("verify")
            predicts = torch.empty(bs * N, dtype=torch.int64, device=dev)
            accept_index = torch.empty(bs, S + 1, dtype=idx, device=dev)
            accept_length = torch.empty(bs, dtype=idx, device=dev)
            if sb.all_greedy:
                target_predict = greedy_ids(logits).view(bs, N)
                self.kernels.verify_tree_greedy(
                    candidates, retrive_index, next_token, next_sibling, target_predict,
                    predicts, accept_index, accept_length,
                )  # fmt: skip
            else:
                probs = sb.probs(logits, self.kernels).view(bs, N, -1)
                coins = sb.uniform(N + 1)
                self.kernels.verify_tree_sampling(
                    candidates, retrive_index, next_token, next_sibling, probs, None,
                    coins[:, :N].contiguous(), coins[:, N].contiguous(),
                    predicts, accept_index, accept_length,
                )  # fmt: skip
            packed, b = _pack_verified(accept_length, accept_index, predicts), bs
        accepted, path_nodes, predicted = self._read_verified(tree, packed.tolist(), bs, b)
        accept_index, accept_length = accept_index[:bs], accept_length[:bs]
        if _path_moved(path_nodes, N):  # chains (topk == 1) are always in place
            self._compact(self._accept_locs(tree, inp.cols, accept_index, accept_length))
        self.timer.lap("accept")

        if self.root_forward:
            new_tokens_t = predicts[self.builder.long([g for p in path_nodes for g in p])]
            self._standalone_extend(rows, seq_lens, accepted, new_tokens_t)
        else:
            self._draft_extend(
                tree, rids, rows, seq_lens, inp, accepted, path_nodes,
                predicts[: bs * N], feats[: bs * N], accept_index, accept_length,
            )  # fmt: skip
        self.timer.lap("draft_extend")
        return self._commit(sts, accepted, path_nodes, predicted)

    def _read_verified(self, tree: _Tree, host: list[int], bs: int, b: int):
        """The round's verified values, read in one device-to-host copy (the round's one host
        sync; the engine needs the tokens anyway): lengths, paths and every node's predicted
        token. ``host`` is :func:`_pack_verified`'s vector for ``b`` rows (the batch, or the
        captured bucket it was padded to).
        -> (accepted [bs], path node ids [bs][1 + accepted], predicted token per node)."""
        S, N = tree.num_steps, tree.num_draft_tokens
        accepted = host[:bs]
        paths = [host[b + r * (S + 1) : b + (r + 1) * (S + 1)] for r in range(bs)]
        predicted = host[b + b * (S + 1) : b + b * (S + 1) + bs * N]  # [bs * N]
        path_nodes = [p[: a + 1] for p, a in zip(paths, accepted)]  # global node ids
        return accepted, path_nodes, predicted

    def _commit(self, sts, accepted, path_nodes, predicted) -> list[list[int]]:
        """Each request's new tokens (its accepted path's predictions: the accepted drafts and
        the bonus token); updates its length and newest token."""
        out = []
        for s, a, path in zip(sts, accepted, path_nodes):
            toks = [predicted[g] for g in path]
            s.seq_len, s.last_token = s.seq_len + a + 1, toks[-1]
            out.append(toks)
        self.timer.lap("other")
        return out

    # -- verify ---------------------------------------------------------------------------------
    def _verify(self, tree: _Tree, rows, seq_lens, inp, candidates, positions, tree_mask):
        """Target forward over the tree -> (logits [bs * N, V], draft features [bs * N, F])."""
        bs, N = candidates.shape
        graphs = self.graphed(bs, max(seq_lens))
        if graphs is not None:
            inputs = {
                "input_ids": candidates.flatten(),
                "positions": positions,
                "tree_mask": tree_mask,
                "host": inp.per_request,
            }
            fn = functools.partial(self._verify_graph, tree)
            out = graphs.run("verify" + tree.suffix, bs, max(seq_lens), inputs, fn)
            if out is not None:
                return out[0][: bs * N], out[1][: bs * N]
        batch = self.builder.build(
            ForwardMode.TARGET_VERIFY, rows, seq_lens, [N] * bs, candidates.flatten(),
            positions=positions, tree_mask=tree_mask,
        )  # fmt: skip
        hidden, aux = self.target_runner.forward_target(batch)
        return self.target.compute_logits(hidden), (aux if self.use_aux else hidden)

    def _graph_columns(self, s) -> _Columns:
        """A captured computation's per-request values, from its ``host`` input [b, 4]."""
        return _columns(s["host"].t().contiguous(), self.backend.index_dtype)

    def _verify_graph(self, tree: _Tree, s, bs: int, max_prefix: int):
        cols = self._graph_columns(s)
        return self._verify_core(
            tree, cols, s["input_ids"], s["positions"], s["tree_mask"], max_prefix
        )

    def _verify_core(
        self, tree: _Tree, cols: _Columns, input_ids, positions, tree_mask, max_prefix: int
    ):
        """The captured verify forward -> (logits [b * N, V], draft features [b * N, F])."""
        table = self.req_pool.req_to_token
        n = tree.num_draft_tokens
        slots, _ = block_slots(table, cols.rows, cols.seq_lens, cols.widths, n, self.arange(n))
        batch = static_batch(
            ForwardMode.TARGET_VERIFY, table, cols.rows, cols.seq_lens, cols.widths,
            input_ids, positions, slots, tree_mask=tree_mask,
        )  # fmt: skip
        hidden, aux = self.target_runner.forward_target(batch, static_prefix=max_prefix)
        return self.target.compute_logits(hidden), (aux if self.use_aux else hidden)

    def _verify_greedy_graphed(self, tree: _Tree, inp: _RoundInputs, max_prefix: int, drafted):
        """Target verify and greedy acceptance in one replay -> (predicts [b * N], features
        [b * N, F], accept_index [b, S + 1], accept_length [b], packed host vector, bucket b),
        or None when this batch runs eagerly."""
        bs = drafted[0].shape[0]
        graphs = self.graphed(bs, max_prefix)
        if graphs is None:
            return None
        candidates, tree_mask, positions, _, next_token, next_sibling = drafted
        inputs = {
            "input_ids": candidates.flatten(),
            "positions": positions,
            "tree_mask": tree_mask,
            "next_token": next_token,
            "next_sibling": next_sibling,
            "host": inp.per_request,
        }
        fn = functools.partial(self._verify_greedy_graph, tree)
        out = graphs.run("verify_greedy" + tree.suffix, bs, max_prefix, inputs, fn)
        if out is None:
            return None
        return (*out, graphs.buckets.batch_bucket(bs))

    def _verify_greedy_graph(self, tree: _Tree, s, bs: int, max_prefix: int):
        cols = self._graph_columns(s)
        logits, feats = self._verify_core(
            tree, cols, s["input_ids"], s["positions"], s["tree_mask"], max_prefix
        )
        candidates = s["input_ids"].view(bs, tree.num_draft_tokens)
        predicts, accept_index, accept_length = self._accept_greedy(
            tree, candidates, s["next_token"], s["next_sibling"], logits
        )
        packed = _pack_verified(accept_length, accept_index, predicts)
        return predicts, feats, accept_index, accept_length, packed

    def _accept_greedy(self, tree: _Tree, candidates, next_token, next_sibling, logits):
        """Greedy acceptance inside a captured computation -> (predicts [b * N], accept_index
        [b, S + 1], accept_length [b])."""
        bs, N = candidates.shape
        S, idx, dev = tree.num_steps, next_token.dtype, logits.device
        # build_tree's retrive_index is b * N + j; rebuilt here because the padding rows of
        # an input buffer are zeroed, which would point them at request 0's nodes.
        retrive_index = self.arange(bs * N).view(bs, N).to(idx)
        predicts = torch.empty(bs * N, dtype=torch.int64, device=dev)
        accept_index = torch.empty(bs, S + 1, dtype=idx, device=dev)
        accept_length = torch.empty(bs, dtype=idx, device=dev)
        self.kernels.verify_tree_greedy(
            candidates, retrive_index, next_token, next_sibling,
            greedy_ids(logits).view(bs, N), predicts, accept_index, accept_length,
        )  # fmt: skip
        return predicts, accept_index, accept_length

    # -- accept ---------------------------------------------------------------------------------
    def _accept_locs(self, tree: _Tree, cols: _Columns, accept_index, accept_length) -> _AcceptLocs:
        """``assign_accept_locs`` over a round's accepted paths (``accept_index`` [b, S + 1],
        ``accept_length`` [b]): device work only, so it runs inside a captured round too; a
        graph's padding requests (width 0) move nothing and extend nothing."""
        b, depth = accept_index.shape
        table, dev = self.req_pool.req_to_token, accept_index.device
        locs = _AcceptLocs(
            *(torch.empty(b * depth, dtype=table.dtype, device=dev) for _ in range(2)),
            *(torch.empty(b * depth, dtype=torch.int64, device=dev) for _ in range(2)),
            torch.empty(b, dtype=cols.rows.dtype, device=dev),
            torch.empty(b, dtype=torch.int64, device=dev),
        )
        self.kernels.assign_accept_locs(
            cols.rows, table, cols.seq_lens, cols.widths, accept_index, accept_length,
            tree.num_draft_tokens, *locs,
        )  # fmt: skip
        return locs

    def _compact(self, locs: _AcceptLocs) -> None:
        """Move the accepted path's target KV to the front: node j of a request's tree was
        written at position seq_len + j; the node at depth d must end up at seq_len + d. Nodes
        already in place move onto themselves (``move_kv`` gathers every source first)."""
        self.target_runner.kv_pool.move(locs.dst_loc, locs.src_loc)

    # -- draft extend ---------------------------------------------------------------------------
    def _draft_extend(
        self, tree: _Tree, rids, rows, seq_lens, inp, accepted, path_nodes, predicts, feats,
        accept_index, accept_length,
    ) -> None:  # fmt: skip
        """Draft extend over the accepted tokens: (target feature at node, next token) pairs;
        keeps the draft's view for the next round."""
        bs = len(rows)
        graphs = self.graphed(bs, max(seq_lens))
        if graphs is not None:
            inputs = {
                "predicts": predicts,
                "features": feats,
                "accept_index": accept_index,
                "accept_length": accept_length,
                "host": inp.per_request,
            }
            fn = functools.partial(self._draft_extend_graph, tree)
            out = graphs.run("draft_extend" + tree.suffix, bs, max(seq_lens), inputs, fn)
            if out is not None:
                self._keep_draft_state(rids, *(t[:bs] for t in out))
                return
        ext = [a + 1 for a in accepted]
        flat = self.builder.long([g for p in path_nodes for g in p])
        batch = self.builder.build(ForwardMode.DRAFT_EXTEND, rows, seq_lens, ext, predicts[flat])
        logit_h, next_feat = self.draft_runner.forward_draft(batch, feats[flat])
        last = self.builder.long(ext).cumsum(0) - 1
        topk_p, topk_index = self.draft.topk(logit_h[last], self.state_topk)
        self._keep_draft_state(rids, topk_p, topk_index, next_feat[last])

    def _draft_extend_graph(self, tree: _Tree, s, bs: int, max_prefix: int):
        cols = self._graph_columns(s)
        locs = self._accept_locs(tree, cols, s["accept_index"], s["accept_length"])
        return self._draft_extend_core(cols, s["predicts"], s["features"], locs, bs, max_prefix)

    def _draft_extend_core(
        self, cols: _Columns, predicts, feats, locs: _AcceptLocs, bs: int, max_prefix: int
    ):
        """The captured draft extend, at a fixed width S + 1 per request: the accepted path's
        (feature at node, token predicted after it) pairs, then its last node repeated (masked
        past the path), gathered from the verify's outputs on the device (``predicts`` [b * N],
        ``feats`` [b * N, F]). -> (topk_p [b, K'], topk_index [b, K'], next feature [b, H]),
        K' the widest tree's K."""
        batch = static_batch(
            ForwardMode.DRAFT_EXTEND, self.req_pool.req_to_token, cols.rows, cols.seq_lens,
            locs.extend_lens, predicts[locs.path_node], locs.positions, locs.dst_loc,
        )  # fmt: skip
        logit_h, next_feat = self.draft_runner.forward_draft(
            batch, feats[locs.path_node], static_prefix=max_prefix
        )
        topk_p, topk_index = self.draft.topk(logit_h[locs.last_index], self.state_topk)
        return topk_p, topk_index, next_feat[locs.last_index]

    # -- standalone draft -----------------------------------------------------------------------
    def _root_forward(self, sts, inp: _RoundInputs):
        """The standalone draft's forward over each root -> its draft state (topk_p, topk_index,
        feature), batched."""
        bs = len(sts)
        seq_lens = [s.seq_len for s in sts]
        batch = self.builder.build(
            ForwardMode.DRAFT_EXTEND, [s.row for s in sts], seq_lens, [1] * bs, inp.cols.roots
        )
        logit_h, next_feat = self.draft_runner.forward_draft(batch, None)
        topk_p, topk_index = self.draft.topk(logit_h, self.state_topk)
        return topk_p, topk_index, next_feat

    def _standalone_extend(self, rows, seq_lens, accepted, new_tokens) -> None:
        """The standalone draft already holds the root; it reads the accepted draft tokens
        (not the bonus, which the next round's root forward reads)."""
        keep = [b for b, a in enumerate(accepted) if a > 0]
        if not keep:
            return
        starts = [0]
        for a in accepted:
            starts.append(starts[-1] + a + 1)
        ids = torch.cat([new_tokens[starts[b] : starts[b] + accepted[b]] for b in keep])
        batch = self.builder.build(
            ForwardMode.DRAFT_EXTEND, [rows[b] for b in keep], [seq_lens[b] + 1 for b in keep],
            [accepted[b] for b in keep], ids,
        )  # fmt: skip
        self.draft_runner.forward_draft(batch, None)

    # -- multi-step draft ---------------------------------------------------------------------
    def _draft(self, tree: _Tree, state, rows, target_lens, inp: _RoundInputs):
        """S levels of top-K expansion with S-1 draft forwards (DRAFT_DECODE), then the tree.

        ``state``: the draft's (topk_p, topk_index, feature) [bs, ...]; ``target_lens``: the
        target's prefix lengths (host). A standalone draft's prefix holds the root as well.
        Returns :meth:`_build_tree`'s tensors."""
        topk_p, topk_index, hidden = state
        cols = inp.cols
        bs, K, S, ps = len(rows), tree.topk, tree.num_steps, self.page_size
        if self.root_forward:
            seq_lens, seq_t = [n + 1 for n in target_lens], cols.seq_lens + 1
        else:
            seq_lens, seq_t = target_lens, cols.seq_lens
        if S > 1:
            graphs = None if self.root_forward else self.graphed(bs, max(seq_lens))
            if graphs is not None:
                inputs = {
                    "topk_p": topk_p,
                    "topk_index": topk_index,
                    "hidden": hidden,
                    "host": inp.per_request,
                }
                fn = functools.partial(self._draft_graph, tree)
                out = graphs.run("draft" + tree.suffix, bs, max(seq_lens), inputs, fn)
                if out is not None:
                    candidates, tree_mask, positions, *links = out
                    return (candidates[:bs], tree_mask[:bs], positions[: bs * tree.num_draft_tokens],
                            *(t[:bs] for t in links))  # fmt: skip
            scratch = self.lane_scratch[: bs * K * tree.lane_width]
            lane_locs, tail_t = self._assign_lanes(tree, cols.rows, seq_t, scratch)
            tails = [n % ps for n in seq_lens] if ps > 1 else [0] * bs

        def draft_step(i: int, input_ids: torch.Tensor, hidden: torch.Tensor):
            # Step i+1 drafts the tokens at depth i+1, stored at position seq_len + i.
            col = (tail_t + i).view(bs, 1, 1).expand(bs, K, 1)
            out_loc = lane_locs.gather(2, col).flatten()
            positions = seq_t.to(torch.int64).add(i).repeat_interleave(K)
            lane_lens = [t + i + 1 for t in tails]
            batch = self.builder.build(
                ForwardMode.DRAFT_DECODE, rows, [n - t for n, t in zip(seq_lens, tails)], [K] * bs,
                input_ids, positions=positions, out_cache_loc=out_loc, lane_locs=lane_locs,
                lane_lens=self.builder.index(lane_lens), topk=K,
            )  # fmt: skip
            batch.lane_lens_cpu = lane_lens
            return self.draft_runner.forward_draft(batch, hidden)

        levels = self._expand_tree(tree, topk_p, topk_index, hidden, draft_step, self.dynamic_depth)
        return self._build_tree(tree, *levels, cols.roots, cols.seq_lens)

    def _build_tree(
        self, tree: _Tree, parent_list, top_scores_index, draft_tokens, roots, seq_lens
    ):
        """``build_tree`` over the drafted levels -> (candidates [bs, N] (root first),
        tree_mask [bs, N, N], positions [bs * N], retrive_index, next_token, next_sibling
        [bs, N] each)."""
        bs, N = roots.shape[0], tree.num_draft_tokens
        idx, dev = seq_lens.dtype, roots.device
        candidates = torch.cat([roots[:, None], draft_tokens], dim=1)
        tree_mask = torch.empty(bs, N, N, dtype=torch.bool, device=dev)
        positions = torch.empty(bs * N, dtype=torch.int64, device=dev)
        links = [torch.empty(bs, N, dtype=idx, device=dev) for _ in range(3)]
        self.kernels.build_tree(
            parent_list, top_scores_index, seq_lens, tree.topk, tree.num_steps, N,
            TreeMaskMode.TREE_ONLY, tree_mask, positions, *links,
        )  # fmt: skip
        return candidates, tree_mask, positions, *links

    def _expand_tree(
        self, tree: _Tree, topk_p, topk_index, hidden, draft_step, stop_below: float = 0.0
    ):
        """S levels of top-K expansion (``select_top_k``), then ``organize_draft_results``.
        ``topk_p`` / ``topk_index`` [bs, K'] may be wider than the tree's K (the draft state
        kept for the widest tree): their first K columns are this tree's.
        ``draft_step(i, input_ids [bs*K], hidden [bs*K, F])`` runs the draft forward between
        level i and i+1 and returns (logit hidden, next hidden).

        ``stop_below`` > 0 (dynamic depth; eager rounds only, it reads the scores on the host):
        once no request's best path of the current level reaches that draft probability, the
        deeper levels get no draft forward. Their candidates (each lane's own token, repeated)
        get probability 0, so the tree keeps its shape and N nodes and takes them only where
        the drafted levels have too few candidates."""
        K, S = tree.topk, tree.num_steps
        if topk_p.shape[1] != K:
            topk_p, topk_index = topk_p[:, :K].contiguous(), topk_index[:, :K].contiguous()
        scores = None
        levels: tuple[list, list, list] = ([], [], [])
        drafted = S
        for i in range(S):
            input_ids, hidden, scores, level = self.kernels.select_top_k(
                i, topk_p, topk_index, hidden, scores, K
            )
            for acc, t in zip(levels, level):
                acc.append(t)
            if i == S - 1:
                break
            if drafted == S and stop_below > 0 and float(scores.max()) < stop_below:
                drafted = i + 1
            if drafted < S:
                topk_p = scores.new_zeros(input_ids.numel(), K)  # [bs*K, K]
                topk_index = input_ids.view(-1, 1).expand(-1, K).contiguous()
                continue
            logit_h, hidden = draft_step(i, input_ids, hidden)
            topk_p, topk_index = self.draft.topk(logit_h, K)
        if stop_below > 0:
            self.drafted_levels[drafted] += 1
        return self.kernels.organize_draft_results(*levels, tree.num_draft_tokens)

    def _draft_graph(self, tree: _Tree, s, bs: int, max_prefix: int):
        cols = self._graph_columns(s)
        return self._draft_core(
            tree, cols, s["topk_p"], s["topk_index"], s["hidden"], bs, max_prefix
        )

    def _draft_core(
        self, tree: _Tree, cols: _Columns, topk_p, topk_index, hidden, bs: int, max_prefix: int
    ):
        """The captured multi-step draft: lane slots, the loop of :meth:`_draft` and the tree,
        over device tensors only. Only EAGLE heads are captured, whose prefix is the
        target's: ``cols.seq_lens`` serves both."""
        K, table = tree.topk, self.req_pool.req_to_token
        rows, seq_t = cols.rows, cols.seq_lens
        if tree.num_steps > 1:
            # Padding requests (row 0, length 0) get lanes too: the scratch holds the bucket.
            scratch = self.lane_scratch[: bs * K * tree.lane_width]
            lane_locs, tails = self._assign_lanes(tree, rows, seq_t, scratch)
            start = seq_t.to(torch.int64) - tails  # the lane's page-aligned prefix
            prefix = start.to(rows.dtype)
            extend = torch.full_like(rows, K)
            # Every step's lane column, slots, positions and lane lengths at once: a few
            # launches for the whole loop instead of a few per step (in a graph each launch
            # costs its latency). Step i writes lane column tails + i at position seq_len + i.
            col = self.arange(tree.num_steps - 1)[:, None] + tails[None, :]  # [S-1, bs]
            out_locs = lane_locs.gather(2, col.t()[:, None, :].expand(bs, K, -1))  # [bs, K, S-1]
            out_locs = out_locs.permute(2, 0, 1).contiguous()  # [S-1, bs, K]
            positions = (col + start[None, :])[:, :, None].expand(-1, -1, K).contiguous()
            lane_lens = (col + 1).to(rows.dtype)  # [S-1, bs]

        def draft_step(i: int, input_ids: torch.Tensor, hidden: torch.Tensor):
            batch = static_batch(
                ForwardMode.DRAFT_DECODE, table, rows, prefix, extend, input_ids,
                positions[i].view(-1), out_locs[i].view(-1),
                lane_locs=lane_locs, lane_lens=lane_lens[i], topk=K,
            )  # fmt: skip
            return self.draft_runner.forward_draft(batch, hidden, static_prefix=max_prefix)

        levels = self._expand_tree(tree, topk_p, topk_index, hidden, draft_step)
        return self._build_tree(tree, *levels, cols.roots, seq_t)

    def _assign_lanes(self, tree: _Tree, rows_t, seq_t, scratch):
        bs, K, ps, W = rows_t.shape[0], tree.topk, self.page_size, tree.lane_width
        idx, dev = self.backend.index_dtype, self.device
        lane_locs = torch.empty(bs, K, W, dtype=idx, device=dev)
        tail = torch.empty(bs, dtype=idx, device=dev)
        copy_src = torch.empty(bs * K * (ps - 1), dtype=idx, device=dev)
        copy_dst = torch.empty(bs * K * (ps - 1), dtype=idx, device=dev)
        self.kernels.assign_draft_cache_locs(
            rows_t, self.req_pool.req_to_token, seq_t, scratch, K, tree.num_steps, ps, lane_locs, tail, copy_src, copy_dst,
        )  # fmt: skip
        if ps > 1:
            self.draft_runner.kv_pool.move(copy_dst, copy_src)
        return lane_locs, tail.to(torch.int64)


def _path_moved(path_nodes: Sequence[Sequence[int]], n: int) -> bool:
    """True when some accepted node sits away from its depth (request b's node j at depth d
    with j != d), i.e. when the accepted path's KV has to be compacted."""
    return any(g - b * n != d for b, p in enumerate(path_nodes) for d, g in enumerate(p))


def _pack_verified(accept_length, accept_index, predicts) -> torch.Tensor:
    """[bs] + [bs, S+1] + [bs * N] -> one int64 vector, for a single device-to-host copy."""
    return torch.cat(
        [accept_length.to(torch.int64), accept_index.to(torch.int64).flatten(), predicts]
    )
