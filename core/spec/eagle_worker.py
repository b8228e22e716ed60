"""The speculative worker: prefill for a draft (an EAGLE-1/2/3 head or a standalone draft
model) and the draft state kept between rounds; the round itself is
:class:`polyspec.spec.round.SpecRound`, run through the worker's round executor."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from polyspec.backend import draft_lane_width
from polyspec.config import SpeculativeConfig
from polyspec.constrain import DraftVocab
from polyspec.errors import ConfigError
from polyspec.runtime.executor import Launched
from polyspec.runtime.kv_cache import OutOfKVSlots
from polyspec.runtime.model_runner import ModelRunner
from polyspec.spec.base import SeqState, WorkerBase
from polyspec.spec.round import PLAIN_ROUNDS, RoundParts, Tree


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
    def __init__(
        self,
        backend,
        target,
        draft,
        spec: SpeculativeConfig,
        dtype,
        runnable: Sequence[tuple[int, int, int]] = (),
        **kw,
    ):
        """``runnable``: other trees (S, K, N) that :meth:`use_trees` may switch the rounds to
        (the buffers are sized for them too)."""
        caps = backend.capabilities
        runnable = tuple((1, *t) for t in runnable)  # as SpeculativeConfig.trees' entries
        widest = max(k for _, _, k, _ in (*spec.trees, *runnable))
        if widest > 1 and not caps.tree_attention:
            raise ConfigError(
                f"backend {backend.name!r} verifies chains only (no tree attention); "
                f"set topk = 1 in every tree (got topk = {widest})"
            )
        super().__init__(backend, target, dtype, capture_layers=tuple(draft.aux_layer_ids), **kw)
        self.draft = draft
        self.spec = spec
        self._main_shape = spec.trees[0][1:]  # (S, K, N): its graphs are named plainly
        # (min batch size, tree), ascending: the rounds' trees by batch size
        self.trees = self._schedule(spec.trees)
        # What the buffers are sized for: those trees and any other one a round may switch to
        # (``runnable``: the trees the engine times at start-up, :meth:`use_trees`).
        sized = [t for _, t in self.trees] + [t for _, t in self._schedule(runnable)]
        # The draft keeps the top-K of the widest tree between rounds: a round of a narrower
        # tree reads its first K columns (top-K is sorted, so they are that tree's top-K).
        self.state_topk = max(t.topk for t in sized)
        self.dynamic_depth = spec.dynamic_depth or 0.0
        # Dynamic depth's statistics: rounds by the number of levels drafted (index 1..S).
        self.drafted_levels = [0] * (max(t.num_steps for t in sized) + 1)
        self._lanes = max(t.topk * t.lane_width if t.num_steps > 1 else 0 for t in sized)
        self.scratch_kv = kw["max_batch_size"] * self._lanes
        self._settle(self.trees)
        self.draft_runner = ModelRunner(draft, backend, self.num_kv_slots, dtype)
        self.use_aux = bool(draft.aux_layer_ids)
        # A standalone LM has no target features: it reads token p at position p, so each
        # round starts with one draft forward over the root (bonus) token.
        self.root_forward = draft.algorithm == "standalone"
        self._draft_batch: _DraftBatch | None = None
        # Plain rounds skip the draft; an EAGLE head's input feature at each of their roots
        # (and at a prompt prefilled then) is kept here by its KV slot, a spare row for
        # padding requests, until the next speculative round catches the head up over every
        # position it has not read (:meth:`_catch_up`), as drafting throughout would have.
        # It costs F values a slot (H for an EAGLE head, 3H for an EAGLE-3 head: 15 % of
        # SmolLM2's KV bytes); a head caught up over part of what it missed drafts worse
        # (docs/benchmarks.md, "Catch-up after plain rounds").
        self.plain_features = None
        if not self.root_forward:
            width = target.config.hidden_size * max(1, len(draft.aux_layer_ids))
            self.plain_features = torch.zeros(
                self.num_kv_slots + 1, width, dtype=dtype, device=self.device
            )
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

    def _schedule(self, trees: Sequence[tuple[int, int, int, int]]) -> list[tuple[int, Tree]]:
        """(min batch size, S, K, N) entries -> (min batch size, Tree). A round function's
        graphs are named for its tree: the configured main tree plainly (``round_greedy``),
        every other one by its shape (``round_greedy@3-3-8``, ``round_greedy@plain`` for
        S = 0, the plain tree). Each lane holds the prefix's partial last page (copied) plus
        its draft tokens."""
        out = []
        for b, s, k, n in trees:
            if s == 0:
                out.append((b, PLAIN_ROUNDS))
            else:
                suffix = "" if (s, k, n) == self._main_shape else f"@{s}-{k}-{n}"
                out.append((b, Tree(s, k, n, draft_lane_width(s, self.page_size), suffix)))
        return out

    def _settle(self, trees: Sequence[tuple[int, Tree]]) -> None:
        """Make ``trees`` the rounds' trees, and what depends on them."""
        self.trees = list(trees)
        main = self.trees[0][1]
        # The main tree's (a batch of one): what callers that know one tree read.
        self.num_steps, self.topk, self.num_draft_tokens = main[:3]
        self.lane_width = main.lane_width
        self.rounds_by_tree = {t.label: 0 for _, t in self.trees}
        # A round writes a request's N tree nodes and its draft extend's S + 1 tokens.
        self.extra_kv_per_request = max(max(t[2], t[0] + 1) for _, t in self.trees)
        # The most tokens a round can commit for a request (the deepest tree's S + 1).
        self.max_round_tokens = max(t.num_steps for _, t in self.trees) + 1

    def use_trees(self, trees: Sequence[tuple[int, int, int, int]]) -> None:
        """Switch the rounds to ``trees`` ((min batch size, S, K, N) ascending from 1, S = 0
        for plain rounds), each of them the constructor's or in its ``runnable``. Called
        before the scheduler starts (it reads the KV widths then): at start-up, while the
        engine times the trees, and with its choice."""
        schedule = self._schedule(trees)
        for _, t in schedule:
            lanes = t.topk * t.lane_width if t.num_steps > 1 else 0
            if (
                t.topk > self.state_topk
                or lanes > self._lanes
                or t.num_steps >= len(self.drafted_levels)
            ):
                raise ValueError(f"tree {t.label} is wider than this worker's buffers")
        self._settle(schedule)
        if self.graphs is not None:
            # A tree timed at start-up and not chosen: its rounds' graphs are not captured
            # for every batch size by a warm-up (the deepest ones' verify logits alone are
            # gigabytes at large batches).
            kept = {t for _, t in schedule}
            for (tree, _, _), fn in self._rounds.items():
                if tree not in kept:
                    self.graphs.forget([fn.__name__, *(p.__name__ for p in fn.phases())])

    plain_tree = PLAIN_ROUNDS

    def tree_for(self, bs: int) -> Tree:
        """The draft tree of a round of ``bs`` requests."""
        return next(t for b, t in reversed(self.trees) if b <= bs)

    # -- prefill ------------------------------------------------------------------------------
    def prefill(self, rids: Sequence[int], ends: Sequence[int]) -> dict[int, int]:
        """Target extend over a prompt chunk, then draft extend over the shifted chunk (left
        to the request's first speculative round while the batch's rounds are plain)."""
        self.timer.start()
        self._own_draft_batch()
        hidden, aux, starts, lens = self._target_extend(rids, ends)
        sts = [self.states[r] for r in rids]
        done = [i for i, s in enumerate(sts) if ends[i] == len(s.prompt)]
        last = self._last_rows(lens, done) if done else None  # [len(done)]
        done_rids = [rids[i] for i in done]
        first_t = self._first_tokens(done_rids, hidden.index_select(0, last)) if done else None
        if self.tree_for(len(self.states)).num_steps == 0:
            # Rounds of a batch this large are plain: the draft reads the prompt when the
            # request's first speculative round catches it up (never, if the batch stays this
            # large), so speculation costs a plain engine no draft prefill. An EAGLE head's
            # features of the chunk are kept for that catch-up.
            if not self.root_forward:
                self._keep_prompt_features(sts, starts, lens, aux if self.use_aux else hidden)
            first = dict(zip(done_rids, self._commit_first(done_rids, first_t))) if done else {}
            self.timer.lap("prefill")
            return first
        # The draft's extend is queued before the host reads the first tokens: an EAGLE head
        # reads a completed prompt's first token at its last position, scattered in on the
        # device (the device would idle while the host built the extend after that read).
        ids: list[int] = []
        first_at: list[int] = []  # where in ids each done request's first token goes
        for s, st, e in zip(sts, starts, ends):
            if self.root_forward:
                ids.extend(s.prompt[st:e])
            else:  # an EAGLE head pairs the target feature at position p with token p + 1
                ids.extend(s.prompt[st + 1 : e])
                if e == len(s.prompt):
                    first_at.append(len(ids))
                ids.append(s.prompt[e] if e < len(s.prompt) else 0)
        ids_t = self.builder.long(ids)
        if first_at:
            ids_t.index_copy_(0, self.builder.long(first_at), first_t)
        features = None if self.root_forward else (aux if self.use_aux else hidden)
        logit_h, next_feat = self._extend(
            self.draft_runner, [s.row for s in sts], starts, lens, ids_t, features
        )
        for s, e in zip(sts, ends):
            s.draft_len = e
        if done and not self.root_forward:
            self._keep_head_state([sts[i] for i in done], logit_h, next_feat, last)
        first = dict(zip(done_rids, self._commit_first(done_rids, first_t))) if done else {}
        self.timer.lap("prefill")
        return first

    def _keep_prompt_features(self, sts, starts, lens, features) -> None:
        """``plain_features[slot of p] = features`` [T, F] (a prefill's, concatenated) for
        each position ``p`` of each request's chunk: where a plain round keeps its root's."""
        ends = [st + n for st, n in zip(starts, lens)]
        slots = self.builder.slots([s.row for s in sts], starts, ends).long()
        self.plain_features.index_copy_(0, slots, features.to(self.plain_features.dtype))

    # -- the draft's state between rounds -----------------------------------------------------
    def _catch_up(self, sts: Sequence[SeqState]) -> None:
        """Bring the draft up to date for the requests of ``sts`` whose last rounds were plain
        (they skip it): one draft extend over the positions it has not read (an EAGLE head's
        from the features the prefill and the plain rounds kept), as a prefill's, and for an
        EAGLE head the state the next round drafts from."""
        behind = [s for s in sts if s.draft_len < s.seq_len]
        if not behind:
            return
        self._own_draft_batch()  # the extend may replay graphs
        starts = [s.draft_len for s in behind]
        ends = [s.seq_len for s in behind]
        ids: list[int] = []
        for s, start, n in zip(behind, starts, ends):
            if self.root_forward:  # token p at position p; the round reads the root
                ids += s.tokens(start, n)
            else:  # an EAGLE head pairs the feature at position p with token p + 1
                ids += s.tokens(start + 1, n + 1)
        lens = [n - st for st, n in zip(starts, ends)]
        features = None
        if not self.root_forward:
            slots = self.builder.slots([s.row for s in behind], starts, ends).long()
            features = self.plain_features.index_select(0, slots)
        logit_h, next_feat = self._extend(
            self.draft_runner, [s.row for s in behind], starts, lens, ids, features
        )
        if not self.root_forward:
            last = self._last_rows(lens, range(len(lens)))
            self._keep_head_state(behind, logit_h, next_feat, last)
        for s in behind:
            s.draft_len = s.seq_len

    def _keep_head_state(self, sts, logit_h, next_feat, last) -> None:
        """Each request's EAGLE state after a draft extend (a prefill's, a catch-up's): the
        head's top-K at its last row of the extend and the feature there. ``logit_h`` [T, H],
        ``next_feat`` [T, H], ``last`` [len(sts)] rows into them."""
        topk_p, topk_index = self.draft.topk(logit_h.index_select(0, last), self.state_topk)
        for s, p, t, f in zip(sts, topk_p, topk_index, next_feat.index_select(0, last)):
            s.topk_p, s.topk_index, s.draft_feature = p, t, f

    def _draft_state(self, rids: Sequence[int], sts: Sequence[SeqState]):
        """(topk_p [bs, K], topk_index [bs, K], feature [bs, H]) of this round's requests: the
        last round's tensors as they are when it had the same requests in the same order,
        their rows gathered when it had these and others (that have left since); otherwise
        stacked from that round's rows and the requests' own views (a prefill's, or a
        catch-up's after plain rounds)."""
        self._catch_up(sts)
        last = self._draft_batch
        if last is not None and last.rids == tuple(rids):
            self._draft_batch = None
            return last.topk_p, last.topk_index, last.feature
        if last is not None and set(rids) <= set(last.rids):
            at = {r: i for i, r in enumerate(last.rids)}  # requests left: its rows, gathered
            keep = self.builder.long([at[r] for r in rids])
            state = tuple(t.index_select(0, keep) for t in (last.topk_p, last.topk_index))
            state += (last.feature.index_select(0, keep),)
            self._release_draft_batch(rids)
            return state
        rows = self._release_draft_batch(rids)
        parts = [
            rows[r] if r in rows else (s.topk_p, s.topk_index, s.draft_feature)
            for r, s in zip(rids, sts)
        ]
        return tuple(torch.stack(col) for col in zip(*parts))

    def _release_draft_batch(self, rids: Sequence[int]) -> dict[int, tuple]:
        """Drop the kept batched state -> its rows by request id (views); a request of it
        that sits this round out (not in ``rids``) keeps a copy of its own."""
        last, self._draft_batch = self._draft_batch, None
        if last is None or not any(r in self.states for r in last.rids):
            return {}
        cols = [t.unbind(0) for t in (last.topk_p, last.topk_index, last.feature)]
        rows = dict(zip(last.rids, zip(*cols)))
        here = set(rids)
        for r in last.rids:
            if r not in here and r in self.states:
                s = self.states[r]
                s.topk_p, s.topk_index, s.draft_feature = (t.clone() for t in rows[r])
        return rows

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

    # -- the round's parts, inputs and kept state ---------------------------------------------
    def round_parts(self) -> RoundParts:
        return RoundParts(
            self.kernels, self.target, self.target_runner, self.draft, self.draft_runner,
            self.req_pool.req_to_token, self.lane_scratch, self.page_size,
            self.backend.index_dtype, self.use_aux, self.state_topk, self.arange,
            self.plain_features, self.backend.capabilities.async_execution, self.level_lens,
        )  # fmt: skip

    def _round_inputs(
        self, tree: Tree, rids, sts, greedy: bool, prefilled: bool = False
    ) -> dict[str, torch.Tensor]:
        inputs = super()._round_inputs(tree, rids, sts, greedy, prefilled)
        if self.root_forward:  # a standalone LM's state is its KV, caught up after plain rounds
            if tree.num_steps > 0 and not prefilled:
                self._catch_up(sts)
            return inputs
        if prefilled and tree.num_steps == 0:
            return inputs
        if prefilled:  # each request's own state, from its prefill
            cols = zip(*((s.topk_p, s.topk_index, s.draft_feature) for s in sts))
            inputs.update(zip(("topk_p", "topk_index", "hidden"), map(torch.stack, cols)))
        elif tree.num_steps == 0:  # a plain round reads no draft state
            self._release_draft_batch(rids)
        else:  # an EAGLE head drafts from the last round's draft extend
            state = self._draft_state(rids, sts)
            inputs.update(zip(("topk_p", "topk_index", "hidden"), state))
        return inputs

    def _draft_vocab(self) -> DraftVocab | None:
        """The head's reduced vocabulary as target ids (an EAGLE-3 head's ``d2t``), or None."""
        d2t = getattr(self.draft, "draft_to_target", None)
        if d2t is None:
            return None
        if getattr(self, "_draft_vocab_map", None) is None:  # once: the head's map is fixed
            self._draft_vocab_map = DraftVocab(d2t.cpu().numpy())
        return self._draft_vocab_map

    def _keep_state(self, launched: Launched) -> None:
        if len(launched.outputs) > 1:  # an EAGLE head's speculative round
            bs = len(launched.key)
            self._keep_draft_state(launched.key, *(t[:bs] for t in launched.outputs[1:]))
        else:  # a plain round: the head is behind, caught up before it drafts again
            self._draft_batch = None
