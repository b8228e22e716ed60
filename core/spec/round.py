"""THE decode round, once: draft -> build tree -> verify -> accept -> compact KV -> draft extend.

:class:`SpecRound` is one function over device tensors and fixed-shape batches of ``b``
requests; :class:`polyspec.runtime.executor.RoundExecutor` decides how it runs (replayed from a
graph captured per batch bucket, eagerly at the batch's exact size, or queued behind the last
round) and the round does not know which. What differs between those runs reaches it as
values: ``max_prefix`` (a graph's prefix bucket, or None for attention metadata built for the
exact batch) and ``host`` (the batch's lengths on the host, which eager forwards hand to the
backend; None inside a graph).

Plain decoding is the same program without a draft: a one-node tree (the newest token), its
forward a DECODE, acceptance the sampling of the next token. A speculative engine runs that
tree too (``batch_trees`` ``MIN:plain``, for batches where speculation does not pay), without
its draft: an EAGLE head's round keeps the target's feature at the root (``plain_features``),
from which the worker brings the draft up to date before the next speculative round (a
standalone LM reads the committed tokens then).
A standalone draft LM differs from an EAGLE head only in where its draft state comes from: it
stores token p at position p, so the round starts with its forward over the root; an EAGLE
head's state is the last round's draft extend.

Inputs (``[b, ...]`` each; a graph's padding requests are zeros: row 0, length 0, width 0):

- ``host`` [b, 5] int64: request table row, committed length, newest token (the tree's root),
  verify width N (0 marks a padding request), and the committed length at which the request
  has all its tokens (read only by :func:`next_round_inputs`);
- ``topk_p`` / ``topk_index`` [b, K'] and ``hidden`` [b, H]: an EAGLE head's draft state (K' the
  widest tree's K: a narrower tree reads its first K columns);
- sampled rounds: ``sampling`` [b, 4] fp32 (temperature, top_k, top_p, 1 for a sampled request)
  and their draws: ``coins`` [b, N + 1] (speculative) or ``noise`` [b, V] (plain).

Structured output (a constrained round, ``constrained=True``): the host's
:class:`~polyspec.constrain.RoundMasks` (``host.masks``) gives token bitmasks built from each
request's grammar matcher, which the round applies with the ``apply_token_bitmask`` kernel:
the root's mask to the draft's first top-K (and to plain decoding's logits), each draft
level's lane masks to the draft's logits before its top-K, and one mask per tree node to the
target's verify logits, so both greedy and sampled acceptance follow the constrained target
distribution. Run whole (eagerly at the batch's exact size, the drafted tokens read on the
host for the lanes' masks), or where the batch replays graphs as phases
(:meth:`SpecRound.phases`): ``.draft`` (the root's top-K under ``root_mask`` [b, W], an
input; level 0), ``.level1`` .. ``.level{S-1}`` (the lanes' top-K under ``lane_masks``
[b, K, W], built by the host from the level before; the last one builds the tree; both over
the target's vocabulary, an EAGLE-3 head's own taken on the device); with the lanes
unmasked (``constrained_draft`` "root") ``.draft`` runs every level, level i's lanes under
``level_masks`` [b, S-1, W] row i - 1 (the grammar's forced tokens, known before the round),
``.verify`` (the target's forward over the tree, while the host reads the tree) and
``.accept`` (the logits under ``node_masks`` [b, N, W], acceptance, compaction, the draft
extend). A sampled round's host builds every node's mask while the device verifies; a
greedy round's (``walk_tree``) walks greedy acceptance under the grammar after the verify
(:meth:`~polyspec.constrain.RoundMasks.greedy_walk`), from the target's top logits at each
node, which its ``.verify`` returns too ([b * N, 2C], :func:`top_logits`), and its
``.accept`` takes the walk's token at each walked node (``node_choice`` [b, N] int32, -1
elsewhere: the argmax) instead of masks; unless the device verifies asynchronously and the
lanes are masked (then the tree's other nodes, leaves, are built while it verifies). Never
queued: the grammar advances on the host between rounds. A constrained plain round needs
only the root's mask, which it takes as an input (``root_mask`` [b, W] int32), so it
replays a graph like any plain round; where rounds are overlapped it runs as two phases,
``.forward`` (the roots' logits) and ``.next`` (the next tokens under ``root_mask``), and
the next round's ``.forward``, which needs no mask, is queued behind it. An unconstrained
round is the plain function, with none of this.

Output: the packed host vector ``[b] accepted draft tokens + [b, S + 1] accepted path (global
node ids) + [b * N] each node's predicted token + [1] draft levels drafted``, then an EAGLE
head's next draft state ``(topk_p [b, K'], topk_index [b, K'], feature [b, H])`` (none after a
plain round: :class:`~polyspec.spec.eagle_worker.EagleWorker` catches the draft up first).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from polyspec.backend import ForwardMode, HostLengths, KernelSet, TreeMaskMode
from polyspec.constrain import RoundMasks, draft_bitmask
from polyspec.constrain.masks import CANDIDATES
from polyspec.runtime.graphs import block_slots, padded, static_batch
from polyspec.runtime.model_runner import ModelRunner
from polyspec.runtime.sampling import target_probs


class Tree(NamedTuple):
    """One draft tree a round may use (``SpeculativeConfig.trees``)."""

    num_steps: int  # S
    topk: int  # K
    num_draft_tokens: int  # N
    lane_width: int  # W, the slots each draft lane owns
    suffix: str  # of its graphs' names: "" for the main tree, "@S-K-N" for a batch tree

    @property
    def label(self) -> str:
        if self.num_steps == 0:
            return "plain"
        return f"S={self.num_steps} K={self.topk} N={self.num_draft_tokens}"


PLAIN = Tree(0, 1, 1, 0, "")
"""Plain decoding's tree: the root only."""

PLAIN_ROUNDS = Tree(0, 1, 1, 0, "@plain")
"""The same tree in a speculative engine (``batch_trees`` ``MIN:plain``): its graphs are named
apart from the speculative rounds' (``round_greedy@plain``)."""


class HostView(NamedTuple):
    """The host's side of an eager round (exact batch, no padding): the lengths its forwards
    hand to the backend, where its phases end (the worker's phase timer), and a constrained
    round's mask builder."""

    seq_lens: list[int]  # [bs] committed lengths
    lap: Callable[[str], None]  # lap(phase): the phase that ends here
    masks: RoundMasks | None = None  # structured output (constrained rounds only)


@dataclasses.dataclass(frozen=True)
class RoundParts:
    """What a round computes with: the models, their runners and the slot tables."""

    kernels: KernelSet
    target: torch.nn.Module
    target_runner: ModelRunner
    draft: torch.nn.Module | None  # None: plain decoding
    draft_runner: ModelRunner | None
    req_to_token: torch.Tensor  # [R, C]
    lane_scratch: torch.Tensor | None  # [max_bs * K * W] the draft lanes' slots
    page_size: int
    index_dtype: torch.dtype
    use_aux: bool  # the head reads the target's aux features (EAGLE-3)
    state_topk: int  # K', the top-K kept between rounds (the widest tree's)
    arange: Callable[[int], torch.Tensor]  # cached arange on the device
    # [slots + 1, F]: an EAGLE head's input feature at each plain round's root, by the root's
    # KV slot (the last row takes the padding requests' writes); None without a head
    plain_features: torch.Tensor | None = None
    # the device runs asynchronously to the host (Capabilities.async_execution): the host
    # can build a constrained round's masks while it verifies (SpecRound.walk_tree)
    async_device: bool = False
    # cached [levels, b] tables of the draft lanes' lengths without paging (row i: i + 1)
    level_lens: Callable[[int, int], torch.Tensor] | None = None


class DraftLevel(NamedTuple):
    """The draft loop's state after a level (:meth:`SpecRound.level`), and the next level's
    candidates (:meth:`SpecRound.lane_topk`)."""

    input_ids: torch.Tensor | None  # [b * K] the lanes' newest tokens
    parents: torch.Tensor | None  # [b, K] (level 0: [b, K + 1]) select_top_k's tree_parents
    logit_h: torch.Tensor | None  # [b * K, H] the lanes' draft forward (None at the last level)
    hidden: torch.Tensor  # [b * K, F] the lanes' features ([b, F] before level 0)
    scores: torch.Tensor | None  # [b, K] the lanes' path probabilities
    levels: tuple[list, list, list]  # each level's (scores, tokens, parents) so far
    stopped: torch.Tensor | None  # [] bool, dynamic depth: the levels below are not drafted
    drafted: torch.Tensor | None  # [] int64, dynamic depth: levels drafted past the first
    topk_p: torch.Tensor | None = None  # [b or b * K, K] the next level's candidates
    topk_index: torch.Tensor | None = None  # [b or b * K, K]


class SpecRound:
    """One round of one tree, greedy or sampled (see the module docstring)."""

    def __init__(
        self,
        parts: RoundParts,
        tree: Tree,
        greedy: bool,
        stop_below: float = 0.0,
        constrained: bool = False,
        mask_lanes: bool = True,
    ):
        """``mask_lanes`` (a constrained round): the grammar masks each draft level's lanes
        before their top-K, the device waiting for the host between levels; False: only the
        root's top-K is masked, and the draft runs whole (``EngineConfig.constrained_draft``)."""
        self.p = parts
        self.tree = tree
        self.greedy = greedy
        self.constrained = constrained
        self.mask_lanes = mask_lanes
        # A greedy constrained round's host walks greedy acceptance under the grammar after
        # the verify (RoundMasks.greedy_walk), except where the device verifies
        # asynchronously and the lanes' masks are known: their tree's other nodes are
        # leaves, whose masks the host builds while the device verifies. Without lane masks
        # every node would need its own, more than the verify hides (H100:
        # docs/benchmarks.md, "Structured output (GPU)").
        self.walk_tree = constrained and greedy and not (parts.async_device and mask_lanes)
        # Where the host reads nothing between the draft and the verify (the draft's levels
        # under masks known before the round, acceptance walked after the verify), the two
        # are one phase: one graph replay a round fewer (phases).
        self.verifies_in_draft = self.walk_tree and not mask_lanes
        self.standalone = parts.draft is not None and parts.draft.algorithm == "standalone"
        # dynamic depth: deeper levels of a round whose best path is below it get probability 0
        self.stop_below = stop_below
        # its graphs' name: round_greedy, round_sampled@3-3-8, decode_greedy, ...
        kind = "decode" if parts.draft is None else "round"
        mode = ("greedy" if greedy else "sampled") + ("_constrained" if constrained else "")
        self.__name__ = f"{kind}_{mode}{tree.suffix}"
        self._phases: tuple[RoundPhase, ...] | None = None
        # the widest forward of a round, and the last round's extend lengths (_extend_lens)
        self._widest = max(tree.num_draft_tokens, tree.num_steps + 1, tree.topk)
        self._extends: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(
        self, inputs: Mapping[str, torch.Tensor], b: int, max_prefix: int | None, host: Any
    ) -> tuple[torch.Tensor, ...]:
        p, tree = self.p, self.tree
        rows, seq_lens, roots, live = self._columns(inputs["host"])
        if tree.num_steps == 0:  # plain decoding: the root's forward and the next token
            return self.plain_round(rows, seq_lens, roots, live, inputs, b, max_prefix, host)
        masks = host.masks if self.constrained else None
        # (a constrained round's root top-K under the grammar's mask at the root; its lanes'
        # masked by the host level by level, or by the forced tokens' masks known before)
        root_mask = None if masks is None else masks.root_draft()
        lane_masks, level_masks = None, None
        if masks is not None and self.mask_lanes:
            lane_masks = masks
        elif masks is not None and tree.num_steps > 1:
            level_masks = masks.draft_levels(tree.num_steps)
        candidates, tree_mask, positions, next_token, next_sibling, drafted = self.draft_tree(
            rows, seq_lens, roots, live, inputs, b, max_prefix, host, root_mask, lane_masks,
            level_masks,
        )  # fmt: skip
        if masks is not None:  # the tree on its way to the host while the target verifies
            masks.start_tree(tree_nodes(candidates, next_token, next_sibling))
        _lap(host, "draft")
        # 4. the target's forward over the tree (a constrained round's: masked per node)
        hidden, feats = self.verify_hidden(
            rows, seq_lens, candidates, live, positions, tree_mask, max_prefix, host
        )
        logits = self.logits(hidden)
        choice = None
        if self.walk_tree:  # greedy acceptance under the grammar, walked on the host
            choice = masks.greedy_walk(top_logits(logits), logits).long()
        elif masks is not None:
            p.kernels.apply_token_bitmask(logits, masks.tree())
        _lap(host, "verify")
        return self.accept_and_extend(
            rows, seq_lens, live, inputs, candidates, next_token, next_sibling, logits, feats,
            drafted, max_prefix, host, choice,
        )  # fmt: skip

    def draft_tree(
        self, rows, seq_lens, roots, live, inputs, b: int, max_prefix, host, root_mask=None,
        masks=None, level_masks=None,
    ):  # fmt: skip
        """Steps 1-3: the draft's state, its S levels and the tree -> (candidates [b, N],
        tree_mask [b, N, N], positions [b * N], next_token / next_sibling [b, N], levels
        drafted [1]). ``root_mask`` [b, W'] (a constrained round): the root's top-K under it;
        ``masks`` (an eager constrained round): each level's lanes masked too, or
        ``level_masks`` [b, S-1, W']: one mask per level for all its lanes."""
        topk_p, topk_index, hidden, draft_lens = self.draft_state(
            rows, seq_lens, roots, live, inputs, max_prefix, host, root_mask
        )
        # 2. S levels of top-K, S - 1 draft forwards; 3. the tree of the N - 1 best
        levels, drafted = self.draft(
            rows, draft_lens, live, topk_p, topk_index, hidden, b, max_prefix, host, masks,
            level_masks,
        )  # fmt: skip
        return (*self.build_tree(levels, roots, seq_lens), drafted)

    def draft_state(self, rows, seq_lens, roots, live, inputs, max_prefix, host, root_mask):
        """Step 1, the draft's state -> (topk_p [b, K'], topk_index [b, K'], feature [b, F],
        the draft's prefix lengths [b]): an EAGLE head's from the last round, a standalone
        LM's from its forward over the root (it stores token p at position p); the root's
        top-K under ``root_mask`` [b, W'] where given."""
        p = self.p
        if self.standalone:
            state = self.root_forward(rows, seq_lens, roots, live, max_prefix, host, root_mask)
            return (*state, seq_lens + 1)  # the root is in the draft's prefix
        state = inputs["topk_p"], inputs["topk_index"], inputs["hidden"]
        if root_mask is not None:
            logit_h = p.draft.feature_logit_hidden(state[2])
            state = (*p.draft.topk(logit_h, p.state_topk, root_mask), state[2])
        return (*state, seq_lens)

    def accept_and_extend(
        self, rows, seq_lens, live, inputs, candidates, next_token, next_sibling, logits, feats,
        drafted, max_prefix, host, choice=None,
    ):  # fmt: skip
        """Steps 5-7 over the verified tree (``logits`` [b * N, V], masked where constrained;
        ``choice`` [b * N] where the host walked greedy acceptance) -> the packed host vector,
        then an EAGLE head's next draft state."""
        p, tree = self.p, self.tree
        # 5. accept: the longest path the target agrees with, and its bonus token
        predicts, accept_index, accept_length = self.accept(
            candidates, next_token, next_sibling, logits, inputs, choice
        )
        # 6. the accepted path's target KV to the front (a chain's path is always in place)
        locs = self.accept_locs(rows, seq_lens, inputs["host"], accept_index, accept_length)
        if tree.topk > 1:
            p.target_runner.kv_pool.move(locs[1], locs[0])
        _lap(host, "accept")
        # 7. draft extend over the accepted tokens: the next round's draft state
        packed = torch.cat([accept_length.long(), accept_index.long().flatten(), predicts, drafted])
        if self.standalone:
            self.standalone_extend(rows, seq_lens, live, predicts, locs, max_prefix, host)
            next_state = ()
        else:
            next_state = self.draft_extend(
                rows, seq_lens, live, predicts, feats, locs, max_prefix, host
            )
        _lap(host, "draft_extend")
        return packed, *next_state

    def phases(self) -> tuple[RoundPhase, ...]:
        """A constrained speculative round as computations that replay graphs, with the
        host's work between them (module docstring): ``.draft`` (step 1, the root's top-K
        under ``root_mask``, and the draft's level 0), ``.level1`` .. ``.level{S-1}`` (each
        the lanes' top-K under the ``lane_masks`` the host built from the level before, then
        its level; the last one builds the tree), ``.verify`` (the target's forward over the
        tree, to its hidden states) and ``.accept`` (the logits masked by ``node_masks``,
        steps 5-7). Without lane masks (:attr:`mask_lanes` False) ``.draft`` runs every level
        and builds the tree; where a greedy round then walks its acceptance on the host, the
        host reads nothing between the draft and the verify, and ``.draft_verify`` is the two
        in one (:attr:`verifies_in_draft`). A plain round's phases are ``.forward`` (the
        target's forward of the roots, to logits) and ``.next`` (the next tokens under
        ``root_mask``): the next round's forward is queued behind this one before the host
        has read its tokens, and the host builds the next masks while the device runs it
        (:meth:`~polyspec.spec.base.WorkerBase.decode`)."""
        if self._phases is None and self.tree.num_steps == 0:
            self._phases = (
                RoundPhase(f"{self.__name__}.forward", self._plain_forward_phase),
                RoundPhase(f"{self.__name__}.next", self._plain_next_phase),
            )
        if self._phases is None and self.verifies_in_draft:
            self._phases = (
                RoundPhase(f"{self.__name__}.draft_verify", self._draft_verify_phase),
                RoundPhase(f"{self.__name__}.accept", self._accept_phase),
            )
        if self._phases is None:
            S = self.tree.num_steps if self.mask_lanes else 1
            levels = [RoundPhase(f"{self.__name__}.draft", functools.partial(self._level_phase, 0))]
            levels += [
                RoundPhase(f"{self.__name__}.level{i}", functools.partial(self._level_phase, i))
                for i in range(1, S)
            ]
            self._phases = (
                *levels,
                RoundPhase(f"{self.__name__}.verify", self._verify_phase),
                RoundPhase(f"{self.__name__}.accept", self._accept_phase),
            )
        return self._phases

    def _level_phase(self, i: int, inputs, b: int, max_prefix, host):
        """Level ``i`` of a phased round's draft (:meth:`phases`). Below the last level ->
        the loop's state (:func:`level_outputs`, the lanes' tokens and parents first: the
        host builds the next level's masks from them); the last level -> (nodes [b, 3, N]
        int64 (:func:`tree_nodes`, the host's read), tree_mask [b, N, N], positions [b, N],
        levels drafted [b] (the same for every request)); without lane masks, level 0 runs
        every level and returns the last one's."""
        rows, seq_lens, roots, live = self._columns(inputs["host"])
        if i == 0:
            root_mask = torch.where(live.view(-1, 1) > 0, inputs["root_mask"], -1)  # padding
            topk_p, topk_index, hidden, draft_lens = self.draft_state(
                rows, seq_lens, roots, live, inputs, max_prefix, host, self._to_draft(root_mask)
            )
            if not self.mask_lanes:  # the whole draft, its levels under the forced tokens
                level_masks = None
                if self.tree.num_steps > 1:
                    level_masks = torch.where(live.view(-1, 1, 1) > 0, inputs["level_masks"], -1)
                    depth = self.tree.num_steps - 1
                    level_masks = self._to_draft(level_masks.flatten(0, 1)).view(b, depth, -1)
                levels, drafted = self.draft(
                    rows, draft_lens, live, topk_p, topk_index, hidden, b, max_prefix, host,
                    level_masks=level_masks,
                )  # fmt: skip
                return self._tree_outputs(levels, roots, seq_lens, drafted, b)
            state = self.first_level(topk_p, topk_index, hidden)
        else:
            draft_lens = seq_lens + 1 if self.standalone else seq_lens
            lane_masks = torch.where(live.view(-1, 1, 1) > 0, inputs["lane_masks"], -1)
            lane_masks = self._to_draft(lane_masks.flatten(0, 1))
            state = self.lane_topk(level_inputs(inputs, i - 1), lane_masks)
        S = self.tree.num_steps
        lanes = self.lane_slots(rows, draft_lens, b, copy_prefix=i == 0) if S > 1 else None
        level = self.level(i, state, rows, live, lanes, max_prefix, host)
        if i < S - 1:
            return level_outputs(level, b)
        drafted = self.levels_drafted(level)
        return self._tree_outputs(level.levels, roots, seq_lens, drafted, b)

    def _draft_verify_phase(self, inputs, b: int, max_prefix, host):
        """The draft's phase and the verify's in one (:attr:`verifies_in_draft`) -> (nodes
        [b, 3, N], tree_mask [b, N, N], positions [b, N], levels drafted [b], then the
        verify's logits [b * N, V], features and top logits)."""
        nodes, tree_mask, positions, drafted = self._level_phase(0, inputs, b, max_prefix, host)
        tree = {"host": inputs["host"], "nodes": nodes, "tree_mask": tree_mask,
                "positions": positions}  # fmt: skip
        return nodes, tree_mask, positions, drafted, *self._verify_phase(tree, b, max_prefix, host)

    def _tree_outputs(self, levels, roots, seq_lens, drafted, b: int):
        """A phased draft's last outputs: (nodes [b, 3, N], tree_mask [b, N, N], positions
        [b, N], levels drafted [b]) of the tree built from ``levels``."""
        candidates, tree_mask, positions, next_token, next_sibling = self.build_tree(
            levels, roots, seq_lens
        )
        nodes = tree_nodes(candidates, next_token, next_sibling)
        return nodes, tree_mask, positions.view(b, -1), drafted.repeat(b)

    def _to_draft(self, mask: torch.Tensor) -> torch.Tensor:  # [n, W] -> [n, W'] int32
        """A phase's target-vocabulary mask over the draft's vocabulary (an EAGLE-3 head's
        own, converted on the device), or as it is (a draft over the target's)."""
        d2t = getattr(self.p.draft, "draft_to_target", None)
        return mask if d2t is None else draft_bitmask(mask, d2t)

    def _verify_phase(self, inputs, b: int, max_prefix, host):
        """-> (hidden [b * N, H], draft features [b * N, F]) of the tree ``nodes``; where the
        round walks the tree (:attr:`walk_tree`), (logits [b * N, V], features, the target's
        top logits at each node (:func:`top_logits`, [b * N, 2C]), from which the host builds
        the node masks)."""
        rows, seq_lens, _, live = self._columns(inputs["host"])
        hidden, feats = self.verify_hidden(
            rows, seq_lens, inputs["nodes"][:, 0], live, inputs["positions"].reshape(-1),
            inputs["tree_mask"], max_prefix, host,
        )  # fmt: skip
        if not self.walk_tree:
            return hidden, feats
        logits = self.p.target.compute_logits(hidden)
        return logits, feats, top_logits(logits)

    def _accept_phase(self, inputs, b: int, max_prefix, host):
        """The logits of ``hidden`` [b, N, H] (or ``logits`` [b, N, V], where the round walks
        the tree) under ``node_masks`` [b, N, W] (a padding request's zeros read as all
        ones), then steps 5-7 (:meth:`accept_and_extend`)."""
        p = self.p
        rows, seq_lens, _, live = self._columns(inputs["host"])
        nodes = inputs["nodes"]
        idx = seq_lens.dtype
        candidates = nodes[:, 0].contiguous()
        next_token, next_sibling = nodes[:, 1].to(idx), nodes[:, 2].to(idx)
        choice = None
        if self.walk_tree:  # the host's greedy tokens (a padding request's zeros read as -1)
            logits = inputs["logits"].flatten(0, 1)
            choice = torch.where(live.view(-1, 1) > 0, inputs["node_choice"].long(), -1)
            choice = choice.flatten()
        else:
            logits = p.target.compute_logits(inputs["hidden"].flatten(0, 1))
            masks = torch.where(live.view(-1, 1, 1) > 0, inputs["node_masks"], -1)
            p.kernels.apply_token_bitmask(logits, masks.flatten(0, 1))
        return self.accept_and_extend(
            rows, seq_lens, live, inputs, candidates, next_token, next_sibling, logits,
            inputs["features"].flatten(0, 1), inputs["drafted"][:1], max_prefix, host, choice,
        )  # fmt: skip

    def plain_round(self, rows, seq_lens, roots, live, inputs, b: int, max_prefix, host):
        """A round of the plain tree: the target's DECODE of the root and the next token. In a
        speculative engine the draft does not run: an EAGLE head's input feature at the root
        is kept for it (:meth:`keep_feature`)."""
        logits = self.plain_forward(rows, seq_lens, roots, live, max_prefix, host)
        packed = self.plain_next(logits, inputs, b)
        _lap(host, "verify")
        return (packed,)

    def plain_forward(self, rows, seq_lens, roots, live, max_prefix, host) -> torch.Tensor:
        """A plain round's forward: the target's DECODE of each root -> logits [b, V]
        (:meth:`logits`; an EAGLE head's input feature at the root kept,
        :meth:`keep_feature`)."""
        logits, feats = self.verify(
            rows, seq_lens, roots[:, None], live, None, None, max_prefix, host
        )
        if self.p.plain_features is not None:
            self.keep_feature(rows, seq_lens, live, feats)
        return logits

    def plain_next(self, logits, inputs, b: int) -> torch.Tensor:  # [b, V] -> [3b + 1] int64
        """A plain round's next token from each root's ``logits`` (a constrained round's under
        ``root_mask``, an input: a plain round replays a graph too), packed as a round's
        result: no draft accepted, each request's own row its bonus node."""
        if self.constrained:
            self.p.kernels.apply_token_bitmask(logits, inputs["root_mask"])
        predicts = self.sample_next(logits, inputs)  # [b]
        none = torch.zeros_like(predicts)
        return torch.cat([none, self.p.arange(b), predicts, none[:1]])

    def _plain_forward_phase(self, inputs, b: int, max_prefix, host):
        """A constrained plain round's first phase (:meth:`phases`) -> (logits [b, V],)."""
        rows, seq_lens, roots, live = self._columns(inputs["host"])
        return (self.plain_forward(rows, seq_lens, roots, live, max_prefix, host),)

    def _plain_next_phase(self, inputs, b: int, max_prefix, host):  # noqa: ARG002
        """Its second phase: the next tokens from ``logits`` [b, V] under ``root_mask``
        [b, W] -> (the round's result,)."""
        return (self.plain_next(inputs["logits"], inputs, b),)

    def keep_feature(self, rows, seq_lens, live, feats) -> None:
        """``plain_features[slot of (row, seq_len)] = feats`` [b, F] for each live request: the
        feature the head pairs with the committed token at that position, when the worker
        brings it up to date. A padding request writes the spare last row."""
        kept = self.p.plain_features
        slots = self.p.req_to_token[rows.long(), seq_lens.long()]  # [b]
        at = torch.where(live > 0, slots, kept.shape[0] - 1).long()
        kept.index_copy_(0, at, feats.to(kept.dtype))

    # -- the steps, in the order they run --------------------------------------------------------
    def _columns(self, per_request: torch.Tensor):
        """[b, 5] int64 -> rows, committed lengths (index dtype), roots (int64), and 1 / 0
        for a live / padding request (index dtype)."""
        cols = per_request.t().contiguous()
        lens = cols.to(self.p.index_dtype)
        return lens[0], lens[1], cols[2], lens[3].clamp(max=1)  # widths: N live, 0 padding

    def _forward(
        self, runner: ModelRunner, mode: ForwardMode, rows, prefix, extend: int, live,
        input_ids, positions, out_loc, max_prefix, host, rule, features=None, **extra,
    ):  # fmt: skip
        """One forward of ``extend`` tokens per request (0 for padding requests) after
        ``prefix`` [b]. ``rule(seq_lens)``: the same prefix lengths (and in DRAFT_DECODE the
        lane lengths, else None) on the host, from the committed lengths: applied to
        ``host.seq_lens`` for an eager forward, and kept as the captured forward's
        ``host_lengths`` (applied to the lengths the engine passes to ``GraphRunner.prepare``
        before each replay, padding requests holding 0 as on the device)."""
        batch = static_batch(
            mode, self.p.req_to_token, rows, prefix, self._extend_lens(live, extend), input_ids,
            positions, out_loc, **extra,
        )  # fmt: skip
        if host is not None:
            host_prefix, host_lanes = rule(list(host.seq_lens))
            batch.prefix_lens_cpu = list(host_prefix)
            batch.extend_lens_cpu = [extend] * len(host_prefix)
            batch.lane_lens_cpu = host_lanes
        else:
            batch.host_lengths = _captured_lengths(rule, extend, int(rows.shape[0]))
        if runner is self.p.target_runner:
            return runner.forward_target(batch, static_prefix=max_prefix)
        return runner.forward_draft(batch, features, static_prefix=max_prefix)

    def _extend_lens(self, live: torch.Tensor, extend: int) -> torch.Tensor:  # [b] -> [b]
        """``live * extend``: the round's forwards (widths 1, K, N, S + 1) read rows of one
        ``[w, b]`` table, made at its first forward by one launch, not a launch each (inside a
        captured round every launch costs its latency). Kept for the ``live`` it was made
        from, so each round, capture and phase makes its own."""
        if self._extends is None or self._extends[0] is not live:
            table = live.new_empty(self._widest + 1, live.shape[0])
            torch.mul(self.p.arange(self._widest + 1)[:, None], live[None, :], out=table)
            self._extends = (live, table)
        return self._extends[1][extend]

    def root_forward(self, rows, seq_lens, roots, live, max_prefix, host, bitmask=None):
        """A standalone draft's forward over each root (position seq_len) -> its draft state
        (topk_p [b, K'], topk_index [b, K'], feature [b, H]); ``bitmask`` [b, W] (a
        constrained round): its top-K among the tokens the grammar allows."""
        p = self.p
        slots, positions = block_slots(p.kernels, p.req_to_token, rows, seq_lens, live, 1)
        logit_h, feature = self._forward(
            p.draft_runner, ForwardMode.DRAFT_EXTEND, rows, seq_lens, 1, live, roots,
            positions, slots, max_prefix, host, _committed,
        )  # fmt: skip
        if bitmask is None:
            return (*p.draft.topk(logit_h, p.state_topk), feature)
        return (*p.draft.topk(logit_h, p.state_topk, bitmask), feature)

    def draft(
        self, rows, draft_lens, live, topk_p, topk_index, hidden, b, max_prefix, host,
        masks=None, level_masks=None,
    ):  # fmt: skip
        """S levels of top-K expansion (``select_top_k``) with a DRAFT_DECODE forward between
        levels; each of a request's K lanes writes its own scratch slots. -> each level's
        (parents, scores, tokens), for ``organize_draft_results``, and the number of levels
        drafted [1] (fewer than S where dynamic depth stopped). ``masks``: a constrained
        round's (the root's top-K is already the grammar's): each level's draft logits are
        masked per lane before its top-K, so no tree node is spent on a token the grammar
        refuses while allowed ones remain. ``level_masks`` [b, S-1, W'] instead: level i's
        lanes all under row i - 1 (:meth:`~polyspec.constrain.RoundMasks.draft_levels`)."""
        K, S = self.tree.topk, self.tree.num_steps
        lanes = self.lane_slots(rows, draft_lens, b) if S > 1 else None
        state = self.first_level(topk_p, topk_index, hidden)
        level = self.level(0, state, rows, live, lanes, max_prefix, host)
        for i in range(1, S):
            lane_masks = None
            if masks is not None:  # the grammar at each lane's path: the next level's mask
                lane_masks = masks.lanes(
                    i - 1, level.input_ids, level.parents if i > 1 else None, K
                )
            elif level_masks is not None:  # [b, W'] -> each of the request's K lanes
                lane_masks = level_masks[:, i - 1, None].expand(-1, K, -1).reshape(b * K, -1)
            state = self.lane_topk(level, lane_masks)
            level = self.level(i, state, rows, live, lanes, max_prefix, host)
        return level.levels, self.levels_drafted(level)

    def first_level(self, topk_p, topk_index, hidden) -> DraftLevel:
        """The loop's state before level 0: the root's top-K (this tree's K of the K' kept)."""
        K = self.tree.topk
        if topk_p.shape[1] != K:  # the state kept for a wider tree: this tree's top-K first
            topk_p, topk_index = topk_p[:, :K].contiguous(), topk_index[:, :K].contiguous()
        return DraftLevel(
            None, None, None, hidden, None, ([], [], []), None, None, topk_p, topk_index
        )

    def level(self, i: int, state: DraftLevel, rows, live, lanes, max_prefix, host) -> DraftLevel:
        """Level ``i`` of the draft from ``state`` (its ``topk_p`` / ``topk_index`` the
        candidates): ``select_top_k``, then, below the last level, the lanes' DRAFT_DECODE
        forward (its ``logit_h`` for the next level's top-K)."""
        p, K = self.p, self.tree.topk
        input_ids, hidden, scores, tree_level = p.kernels.select_top_k(
            i, state.topk_p, state.topk_index, state.hidden, state.scores, K
        )
        levels = tuple([*acc, t] for acc, t in zip(state.levels, tree_level))
        logit_h = None
        if i < self.tree.num_steps - 1:
            lane_locs, prefix, out_locs, positions, lane_lens = lanes
            logit_h, hidden = self._forward(
                p.draft_runner, ForwardMode.DRAFT_DECODE, rows, prefix, K, live, input_ids,
                positions[i].view(-1), out_locs[i].view(-1), max_prefix, host,
                self._lanes_rule(i), hidden, lane_locs=lane_locs, lane_lens=lane_lens[i], topk=K,
            )  # fmt: skip
        return DraftLevel(
            input_ids, tree_level[2], logit_h, hidden, scores, levels, state.stopped,
            state.drafted,
        )  # fmt: skip

    def lane_topk(self, level: DraftLevel, lane_masks=None) -> DraftLevel:
        """The next level's candidates: each lane's top-K of the draft (under ``lane_masks``
        [b * K, W'] where given) and dynamic depth."""
        p, K = self.p, self.tree.topk
        if lane_masks is None:
            topk_p, topk_index = p.draft.topk(level.logit_h, K)
        else:
            topk_p, topk_index = p.draft.topk(level.logit_h, K, lane_masks)
        stopped, drafted = level.stopped, level.drafted
        if self.stop_below > 0:
            # Dynamic depth on the device: once no request's best path of this level reaches
            # the threshold, the deeper levels' candidates (each lane's own token) get
            # probability 0, so the tree keeps its N nodes and takes them only where the
            # drafted levels have too few.
            low = level.scores.max() < self.stop_below
            stopped = low if stopped is None else stopped | low
            drafted = (~stopped).long() if drafted is None else drafted + ~stopped
            topk_p = torch.where(stopped, 0.0, topk_p)
            own = level.input_ids.view(-1, 1).expand(-1, K)
            topk_index = torch.where(stopped, own, topk_index)
        return level._replace(
            topk_p=topk_p, topk_index=topk_index, stopped=stopped, drafted=drafted
        )

    def levels_drafted(self, level: DraftLevel) -> torch.Tensor:  # [1] int64
        """The levels drafted: S, or fewer where dynamic depth stopped."""
        if level.drafted is None:  # S: the last entry of a cached [0, S], no launch
            return self.p.arange(2, self.tree.num_steps)[1:]
        return (level.drafted + 1).view(1)

    def lane_slots(self, rows, draft_lens, b: int, copy_prefix: bool = True):
        """Where the lanes write, every level at once (a few launches for the whole loop): ->
        (lane_locs [b, K, W], prefix [b], out_locs [S-1, b, K], positions [S-1, b, K],
        lane_lens [S-1, b]); level i writes lane column tail + i at position seq_len + i.
        ``copy_prefix``: copy the prefix's partial last page into each lane (once a round)."""
        p, S, K = self.p, self.tree.num_steps, self.tree.topk
        lane_locs, tails = self._assign_lanes(rows, draft_lens, b, copy_prefix)
        lens = draft_lens.to(torch.int64)
        steps = p.arange(S - 1)
        # [S-1, b, K], each made by one launch
        positions = lens.view(1, b, 1) + steps.view(-1, 1, 1).expand(-1, b, K)
        if p.page_size == 1:  # no prefix tail in the lanes: level i writes lane column i
            out_locs = lane_locs.permute(2, 0, 1)[: S - 1].contiguous()
            return lane_locs, draft_lens.to(rows.dtype), out_locs, positions, p.level_lens(S - 1, b)
        start = lens - tails  # the lane's page-aligned prefix
        col = steps[:, None] + tails[None, :]  # [S-1, b]
        out_locs = lane_locs.permute(2, 0, 1).gather(0, col[:, :, None].expand(-1, -1, K))
        return lane_locs, start.to(rows.dtype), out_locs, positions, (col + 1).to(rows.dtype)

    def _lanes_rule(self, i: int):
        """Level ``i``'s lengths on the host (eager forwards, and the captured forwards'
        prepare): the lanes' page-aligned prefixes and their lengths."""
        grow, ps = (1 if self.standalone else 0), self.p.page_size

        def rule(seq_lens: list[int]) -> tuple[list[int], list[int]]:
            lens = [n + grow for n in seq_lens]
            return [n - n % ps for n in lens], [n % ps + i + 1 for n in lens]

        return rule

    def _assign_lanes(self, rows, draft_lens, b: int, copy_prefix: bool = True):
        """The lanes' slots ([b, K, W]) and each request's prefix tail in its last page (int64
        [b]); with pages (and ``copy_prefix``), every lane gets a copy of that tail first."""
        p, tree = self.p, self.tree
        K, ps, W = tree.topk, p.page_size, tree.lane_width
        idx, dev = p.index_dtype, rows.device
        lane_locs = torch.empty(b, K, W, dtype=idx, device=dev)
        tail = torch.empty(b, dtype=idx, device=dev)
        copy_src = torch.empty(b * K * (ps - 1), dtype=idx, device=dev)
        copy_dst = torch.empty(b * K * (ps - 1), dtype=idx, device=dev)
        scratch = p.lane_scratch[: b * K * W]  # padding requests get lanes too
        p.kernels.assign_draft_cache_locs(
            rows, p.req_to_token, draft_lens, scratch, K, tree.num_steps, ps, lane_locs, tail,
            copy_src, copy_dst,
        )  # fmt: skip
        if ps > 1 and copy_prefix:
            p.draft_runner.kv_pool.move(copy_dst, copy_src)
        return lane_locs, tail.to(torch.int64)

    def build_tree(self, levels, roots, seq_lens):
        """``organize_draft_results`` then ``build_tree`` -> candidates [b, N] (root first),
        tree_mask [b, N, N], positions [b * N], next_token / next_sibling links [b, N]."""
        p, tree = self.p, self.tree
        parents, top_scores_index, draft_tokens = p.kernels.organize_draft_results(
            *levels, tree.num_draft_tokens
        )
        b, N, dev = roots.shape[0], tree.num_draft_tokens, roots.device
        candidates = torch.cat([roots[:, None], draft_tokens], dim=1)
        tree_mask = torch.empty(b, N, N, dtype=torch.bool, device=dev)
        positions = torch.empty(b * N, dtype=torch.int64, device=dev)
        links = [torch.empty(b, N, dtype=seq_lens.dtype, device=dev) for _ in range(3)]
        p.kernels.build_tree(
            parents, top_scores_index, seq_lens, tree.topk, tree.num_steps, N,
            TreeMaskMode.TREE_ONLY, tree_mask, positions, *links,
        )  # fmt: skip
        return candidates, tree_mask, positions, links[1], links[2]

    def verify(self, rows, seq_lens, candidates, live, positions, tree_mask, max_prefix, host):
        """The target's forward over each request's N candidates (TARGET_VERIFY with the tree
        mask; a one-node tree is a DECODE) -> (logits [b * N, V], draft features [b * N, F])."""
        hidden, feats = self.verify_hidden(
            rows, seq_lens, candidates, live, positions, tree_mask, max_prefix, host
        )
        return self.logits(hidden), feats

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, V]
        """The target's logits over ``hidden``: fp32, except in an unconstrained greedy round,
        where all that reads them is the argmax and they stay in the model's dtype (the first
        maximal index of bf16 logits is that of their exact fp32 copy, which would cost a
        launch and an [n, V] fp32 write a forward)."""
        if self.greedy and not self.constrained:
            return self.p.target.lm_logits(hidden)
        return self.p.target.compute_logits(hidden)

    def verify_hidden(
        self, rows, seq_lens, candidates, live, positions, tree_mask, max_prefix, host
    ):  # fmt: skip
        """:meth:`verify` up to the target's final hidden states: (hidden [b * N, H], draft
        features [b * N, F])."""
        p = self.p
        n = candidates.shape[1]
        lens = self._extend_lens(live, n)
        slots, pos = block_slots(p.kernels, p.req_to_token, rows, seq_lens, lens, n)
        mode, extra = ForwardMode.DECODE, {}
        if tree_mask is not None:
            mode, pos = ForwardMode.TARGET_VERIFY, positions
            extra = {"tree_mask": tree_mask, "topk": self.tree.topk}
        hidden, aux = self._forward(
            p.target_runner, mode, rows, seq_lens, n, live, candidates.reshape(-1), pos, slots,
            max_prefix, host, _committed, **extra,
        )  # fmt: skip
        return hidden, (aux if p.use_aux else hidden)

    def sample_next(self, logits, inputs) -> torch.Tensor:  # [b, V] -> [b] int64
        """Plain decoding's acceptance: the next token (argmax, or a draw with the noise)."""
        if self.greedy:
            return self.p.kernels.argmax(logits)
        probs = target_probs(logits, inputs["sampling"], self.p.kernels)
        return self.p.kernels.sample(probs, inputs["noise"])

    def accept(self, candidates, next_token, next_sibling, logits, inputs, choice=None):
        """Greedy (``verify_tree_greedy``) or lossless speculative sampling
        (``verify_tree_sampling``; a greedy request's target is one-hot at the argmax, so
        mixed batches are exact) -> (predicts [b * N], accept_index [b, S + 1], accept_length
        [b]). ``choice`` [b * N] int64 (greedy): the host's token at a node, where not -1,
        instead of the argmax (:meth:`~polyspec.constrain.RoundMasks.greedy_walk`)."""
        p, tree = self.p, self.tree
        b, N = candidates.shape
        S, idx, dev = tree.num_steps, next_token.dtype, logits.device
        # build_tree's retrive_index is b * N + j; made here because a graph's padding
        # requests have zeroed inputs, which would point them at request 0's nodes
        retrive_index = p.arange(b * N).view(b, N).to(idx)
        predicts = torch.empty(b * N, dtype=torch.int64, device=dev)
        accept_index = torch.empty(b, S + 1, dtype=idx, device=dev)
        accept_length = torch.empty(b, dtype=idx, device=dev)
        outs = (predicts, accept_index, accept_length)
        if self.greedy:
            target_predict = p.kernels.argmax(logits)
            if choice is not None:
                target_predict = torch.where(choice >= 0, choice, target_predict)
            target_predict = target_predict.view(b, N)
            p.kernels.verify_tree_greedy(
                candidates, retrive_index, next_token, next_sibling, target_predict, *outs
            )
        else:
            params = inputs["sampling"].repeat_interleave(N, dim=0)  # [b * N, 4]
            probs = target_probs(logits, params, p.kernels).view(b, N, -1)
            coins = inputs["coins"]
            p.kernels.verify_tree_sampling(
                candidates, retrive_index, next_token, next_sibling, probs, None,
                coins[:, :N].contiguous(), coins[:, N].contiguous(), *outs,
            )  # fmt: skip
        return outs

    def accept_locs(self, rows, seq_lens, per_request, accept_index, accept_length):
        """``assign_accept_locs`` -> (src_loc, dst_loc, positions, path_node, extend_lens,
        last_index), ``[b * (S + 1)]`` / ``[b]``: where each accepted node's target KV is and
        goes, and the draft extend's positions, verify rows and newest-token rows."""
        p = self.p
        b, depth = accept_index.shape
        table, dev = p.req_to_token, accept_index.device
        locs = (
            *(torch.empty(b * depth, dtype=table.dtype, device=dev) for _ in range(2)),
            *(torch.empty(b * depth, dtype=torch.int64, device=dev) for _ in range(2)),
            torch.empty(b, dtype=rows.dtype, device=dev),
            torch.empty(b, dtype=torch.int64, device=dev),
        )
        widths = per_request[:, 3].to(rows.dtype)
        p.kernels.assign_accept_locs(
            rows, table, seq_lens, widths, accept_index, accept_length,
            self.tree.num_draft_tokens, *locs,
        )  # fmt: skip
        return locs

    def draft_extend(self, rows, seq_lens, live, predicts, feats, locs, max_prefix, host):
        """The EAGLE head reads (feature at node, token predicted after it) for each accepted
        node, at a fixed width S + 1 per request: past the path its last node again, written
        to the padding slot and never read by a real token (they come after it) ->
        (topk_p [b, K'], topk_index [b, K'], next feature [b, H])."""
        p = self.p
        _, dst_loc, positions, path_node, _, last_index = locs
        logit_h, next_feat = self._forward(
            p.draft_runner, ForwardMode.DRAFT_EXTEND, rows, seq_lens, self.tree.num_steps + 1,
            live, predicts[path_node], positions, dst_loc, max_prefix, host, _committed,
            feats[path_node],
        )  # fmt: skip
        topk_p, topk_index = p.draft.topk(logit_h[last_index], p.state_topk)
        return topk_p, topk_index, next_feat[last_index]

    def standalone_extend(self, rows, seq_lens, live, predicts, locs, max_prefix, host):
        """A standalone LM already holds the root; it reads the accepted draft tokens at
        positions seq_len + 1.. (fixed width S; past the path, the last node again, its KV
        past the new length). The bonus token is the next round's root forward."""
        p, S = self.p, self.tree.num_steps
        # the token at position seq_len + 1 + d is the one node d of the path predicted
        path_node = locs[3].view(-1, S + 1)[:, :S].reshape(-1)  # depths 0..S-1
        start = seq_lens + 1
        lens = self._extend_lens(live, S)
        slots, positions = block_slots(p.kernels, p.req_to_token, rows, start, lens, S)
        self._forward(
            p.draft_runner, ForwardMode.DRAFT_EXTEND, rows, start, S, live,
            predicts[path_node], positions, slots, max_prefix, host, _after_root,
        )  # fmt: skip


class RoundPhase:
    """One of :meth:`SpecRound.phases`: a round function (``fn(inputs, b, max_prefix, host)``,
    as the executor runs it) named for its graphs."""

    def __init__(self, name: str, fn: Callable[..., tuple[torch.Tensor, ...]]):
        self.__name__ = name
        self._fn = fn

    def __call__(
        self, inputs: Mapping[str, torch.Tensor], b: int, max_prefix: int | None, host: Any
    ) -> tuple[torch.Tensor, ...]:
        return self._fn(inputs, b, max_prefix, host)


LEVEL_KEYS = ("input_ids", "parents", "logit_h", "hidden", "scores")
"""The names of a phased round's draft state between levels (:func:`level_outputs`), then
``level{j}_{scores,tokens,parents}`` per level drafted, then ``stopped`` and ``drafted``
under dynamic depth."""


def level_outputs(level: DraftLevel, b: int) -> tuple[torch.Tensor, ...]:
    """A draft level's state as per-request tensors ([b, ...] each), in the order of
    :func:`level_keys`."""
    lanes = (level.logit_h, level.hidden)  # [b * K, H] each
    out = [level.input_ids.view(b, -1), level.parents]
    out += [t.view(b, -1, t.shape[-1]) for t in lanes] + [level.scores]
    for scores, tokens, parents in zip(*level.levels):
        out += [scores, tokens, parents]
    if level.stopped is not None:
        out += [level.stopped.view(1).repeat(b), level.drafted.view(1).repeat(b)]
    return tuple(out)


def level_keys(num_levels: int, dynamic_depth: bool) -> tuple[str, ...]:
    """The names of :func:`level_outputs` after ``num_levels`` levels."""
    keys = [*LEVEL_KEYS]
    for j in range(num_levels):
        keys += [f"level{j}_scores", f"level{j}_tokens", f"level{j}_parents"]
    return (*keys, *(("stopped", "drafted") if dynamic_depth else ()))


def level_inputs(inputs: Mapping[str, torch.Tensor], i: int) -> DraftLevel:
    """The state after level ``i`` from a phase's inputs (:func:`level_outputs` by name)."""
    levels = tuple(
        [inputs[f"level{j}_{part}"] for j in range(i + 1)]
        for part in ("scores", "tokens", "parents")
    )
    stopped = inputs["stopped"][0] if "stopped" in inputs else None
    drafted = inputs["drafted"][0] if "drafted" in inputs else None
    return DraftLevel(
        inputs["input_ids"].reshape(-1), inputs["parents"], inputs["logit_h"].flatten(0, 1),
        inputs["hidden"].flatten(0, 1), inputs["scores"], levels, stopped, drafted,
    )  # fmt: skip


def top_logits(logits: torch.Tensor) -> torch.Tensor:  # [n, V] -> [n, 2C] fp32
    """Each row's C largest logits, descending, then their token ids (exact in fp32: ids
    below 2^24), in one tensor for the host's read (a greedy constrained round's walk,
    :meth:`~polyspec.constrain.RoundMasks.greedy_walk`)."""
    values, ids = logits.float().topk(CANDIDATES, dim=-1)
    return torch.cat([values, ids.float()], dim=1)


def tree_nodes(
    candidates: torch.Tensor,  # [b, N] node tokens, the root first
    next_token: torch.Tensor,  # [b, N] build_tree's first-child links (-1: none)
    next_sibling: torch.Tensor,  # [b, N] build_tree's next-sibling links (-1: none)
) -> torch.Tensor:  # [b, 3, N] int64
    """A tree as one tensor for the host's read (a constrained round's node masks)."""
    return torch.stack([candidates.long(), next_token.long(), next_sibling.long()], dim=1)


def _committed(seq_lens: list[int]) -> tuple[list[int], None]:
    """A forward after the committed tokens: its prefixes are the committed lengths."""
    return seq_lens, None


def _after_root(seq_lens: list[int]) -> tuple[list[int], None]:
    """A standalone draft's extend: its prefixes hold the root too."""
    return [n + 1 for n in seq_lens], None


def _captured_lengths(rule, extend: int, rows: int) -> Callable[[Mapping[str, Any]], HostLengths]:
    """A captured forward's ``ForwardBatch.host_lengths``: ``rule`` applied to the replay's
    committed lengths (``GraphRunner.prepare``'s ``"seq_lens"``) padded with zeros to the
    graph's ``rows``; the padding requests extend by 0 tokens, as their ``live`` is 0."""

    def host_lengths(host_params: Mapping[str, Any]) -> HostLengths:
        live = len(host_params.get("seq_lens", ()))
        prefix, lanes = rule(padded(host_params, "seq_lens", rows))
        extend_lens = [extend] * live + [0] * (rows - live)
        return HostLengths(list(prefix), extend_lens, None if lanes is None else list(lanes))

    return host_lengths


def _lap(host: HostView | None, phase: str) -> None:
    """End a phase of the worker's timer where the round has a host side (eager)."""
    if host is not None:
        host.lap(phase)


def next_round_inputs(
    tree: Tree, inputs: Mapping[str, torch.Tensor], outputs: Sequence[torch.Tensor], b: int
) -> dict[str, torch.Tensor]:
    """The inputs of the round after one with ``outputs`` (``b`` rows), on the device: each
    prefix grown by the accepted tokens and the bonus token, which is the next root; the draft
    state from the draft extend. A request that round took to its token limit becomes a
    padding request (its rounds are over; the host finishes it when it reads ``outputs``)."""
    prev = inputs["host"]  # [bs, 5]
    bs, depth = prev.shape[0], tree.num_steps + 1
    packed = outputs[0]
    accepted = packed[:bs]  # [bs]
    paths = packed[b : b + b * depth].view(b, depth)[:bs]  # [bs, S + 1] global node ids
    last = paths.gather(1, accepted.view(bs, 1)).view(bs)  # the bonus token's node
    roots = packed[b + b * depth :].index_select(0, last)  # [bs]
    seq_lens = prev[:, 1] + accepted + 1
    host = torch.stack([prev[:, 0], seq_lens, roots, prev[:, 3], prev[:, 4]], dim=1)
    # a request this round took to its token limit is done: a padding request (zeros) here
    nxt = {"host": host.masked_fill((seq_lens >= prev[:, 4]).view(bs, 1), 0)}
    if "topk_p" in inputs:  # a speculative round of an EAGLE head: its draft extend's state
        for name, t in zip(("topk_p", "topk_index", "hidden"), outputs[1:]):
            nxt[name] = t[:bs]
    return nxt
