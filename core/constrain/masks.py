"""The token bitmasks of one constrained round, built on the host from the batch's matchers
and uploaded as the round's inputs: at the roots, at each draft level's lanes, and at every
node of the verified tree.

Rows of unconstrained requests (a mixed batch) are all ones, so applying a mask leaves them
as they are. A node no output can reach (below a token the grammar refuses, or past the
grammar's end) is all ones too: its row is never used, since verification only accepts a
child its parent's masked distribution allows.

Each mask is computed once a round: a draft lane's path is a node of the tree the round
verifies (the lanes of a level are the best candidates of that level, and only lanes get
children), so the tree walk (:meth:`RoundMasks.tree`, while the device verifies) takes the
lanes' masks and computes only the rest, which are leaves; a round whose draft is masked at
its root only (``EngineConfig.constrained_draft``) has no lanes' masks, and the walk
computes every node's.

A greedy round (``SpecRound.walk_tree``: unless the device verifies asynchronously while
the lanes' masks are known) computes fewer: greedy acceptance reads the masked argmax only
at the nodes it walks, so the tree's masks (:meth:`RoundMasks.greedy_tree`) wait for the
verify forward, which also returns the target's top logits at each node. From the root, a
node's mask and those logits give the token greedy acceptance takes there
(:func:`~polyspec.constrain.matcher.greedy_choice`), and the walk goes on into the child that
drafted it. A walked node that is a lane's path takes the lane's mask; the rest (the leaves
the walk reaches) are computed, one parallel call a level for all requests. The nodes off the
path are never read (verification stops where the walk does) and stay all ones. Where the top
logits do not settle a node's token, every node below it gets its mask.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from polyspec.constrain.matcher import Matcher, advanced, fill_masks, greedy_choice, mask_width

CANDIDATES = 16
"""The target's top logits at each tree node a greedy constrained round reads on the host."""


class DraftVocab:
    """A draft head's own vocabulary as target ids (an EAGLE-3 head's ``d2t``): reads
    target-vocabulary masks as masks over the draft's vocabulary. Made once per worker."""

    def __init__(self, draft_to_target: np.ndarray):  # [V'] int64 target ids
        self._ids = np.asarray(draft_to_target, dtype=np.intp)
        self.size = len(self._ids)
        self.width = mask_width(self.size)
        # an unconstrained row: every draft token allowed, the bits past V' clear
        ones = np.zeros(self.width * 32, dtype=np.uint8)
        ones[: self.size] = 1
        self._ones = np.packbits(ones, bitorder="little").view(np.int32)

    def to_draft(self, masks: np.ndarray) -> np.ndarray:  # [n, W] -> [n, W'] int32
        """The draft token ``j``'s bit of each row is the target token ``d2t[j]``'s. Only
        constrained rows are unpacked (numpy's bit unpacking and ``take``: a few times
        faster than fancy indexing words); an all-ones row stays all ones."""
        out = np.empty((masks.shape[0], self.width), dtype=np.int32)
        out[:] = self._ones
        rows = np.flatnonzero((masks != -1).any(axis=1))
        if rows.size:
            bits = np.unpackbits(masks[rows].view(np.uint8), axis=1, bitorder="little")
            picked = np.packbits(np.take(bits, self._ids, axis=1), axis=1, bitorder="little")
            out8 = out.view(np.uint8)
            out8[rows, : picked.shape[1]] = picked
            out8[rows, picked.shape[1] :] = 0
        return out


def draft_bitmask(
    mask: torch.Tensor,  # [n, W] int32 over the target's vocabulary
    draft_to_target: torch.Tensor,  # [V'] int64: each draft token's target id
) -> torch.Tensor:  # [n, W'] int32 over the draft's vocabulary (bits past V' clear)
    """:meth:`DraftVocab.to_draft` on the device, in a few tensor ops that a captured graph
    can hold: draft token ``j``'s bit is target token ``draft_to_target[j]``'s. A phased
    constrained round converts its root's and lanes' masks this way, so that the host, which
    the device waits for between the draft's levels, builds target-vocabulary masks only."""
    n, size = mask.shape[0], draft_to_target.shape[0]
    width = (size + 31) // 32
    words = mask.long().index_select(1, draft_to_target >> 5) & 0xFFFFFFFF  # [n, V']
    bits = (words >> (draft_to_target & 31)) & 1
    bits = torch.nn.functional.pad(bits, (0, width * 32 - size)).view(n, width, 32)
    shifts = torch.arange(32, device=mask.device, dtype=torch.int64)
    packed = (bits << shifts).sum(-1)  # [n, W'] in [0, 2^32)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


class RoundMasks:
    """The host side of a constrained round (handed to it in its
    :class:`~polyspec.spec.round.HostView`). ``matchers``: one per request, None where it is
    unconstrained; ``vocab_size``: the target's logits width; ``draft_vocab``: the draft
    head's own vocabulary (None: the draft's logits are over the target's); ``upload``: host
    int32 array -> the same on the round's device; ``read``: a device tensor -> its host copy
    on the way (``Backend.read_async``)."""

    def __init__(
        self,
        matchers: Sequence[Matcher | None],
        vocab_size: int,
        upload: Callable[[np.ndarray], torch.Tensor],
        read: Callable[[torch.Tensor], Any],
        draft_vocab: DraftVocab | None = None,
    ):
        self.matchers = list(matchers)
        self.width = mask_width(vocab_size)
        self.computed = 0  # masks computed in the round (the roots' are not counted)
        self.upload = upload
        self.read = read
        self._tree_read: Any = None
        self._tree_shape: tuple[int, int] = (0, 0)
        self.draft_vocab = draft_vocab
        self.executor = next((m.executor for m in self.matchers if m is not None), None)
        # Host seconds spent on the grammar for this round: the matchers' commits of the
        # last round's tokens and their next masks (the scheduler's, between rounds), and
        # this round's masks. Waits for the device (reading the draft) are not counted.
        self.seconds = sum(m.take_seconds() for m in self.matchers if m is not None)
        self._root: np.ndarray | None = None
        self._lanes: list[list[list[int]]] = []  # per request, per lane: its draft path
        # per request: the masks computed this round by draft path (None: no output reaches
        # the path's node), so that a lane's mask serves its tree node too
        self._known: list[dict[tuple[int, ...], np.ndarray | None]] = [{} for _ in matchers]
        # per request, :meth:`greedy_tree`'s grammar states by draft path (None: no output)
        self._states: list[dict[tuple[int, ...], Any]] = [{} for _ in matchers]

    def root(self) -> torch.Tensor:  # [b, W] int32 on the device
        """The mask of each request's next token (after its newest committed one)."""
        return self.upload(self._root_masks())

    def root_draft(self) -> torch.Tensor:  # [b, W'] int32 over the draft's vocabulary
        """:meth:`root` over the draft's own vocabulary (for the draft's first top-K)."""
        root = self._root_masks()
        t = time.perf_counter()
        out = self._to_draft(root)
        self.seconds += time.perf_counter() - t
        return self.upload(out)

    def _root_masks(self) -> np.ndarray:
        if self._root is None:
            t = time.perf_counter()
            out = np.full((len(self.matchers), self.width), -1, dtype=np.int32)
            for i, m in enumerate(self.matchers):
                if m is not None:
                    out[i] = m.next_mask()
                    self.seconds += m.take_seconds()  # where the scheduler had not asked
            self._root = out
            self.seconds += time.perf_counter() - t
        return self._root

    def lanes(
        self,
        step: int,
        tokens: torch.Tensor,  # [b * K] each lane's newest draft token
        parents: torch.Tensor | None,  # [b, K] select_top_k's tree_parents (step >= 1)
        topk: int,
        draft_vocab: bool = True,
    ) -> torch.Tensor:  # [b * K, W'] int32 over the draft's vocabulary, on the device
        """The masks of the draft's next token at each lane of level ``step``: lane ``j`` of
        a level after the first continues lane ``(parents[:, j] - K - K*K*(step-1)) // K`` of
        the level before (select_top_k's candidate ids). ``draft_vocab`` False: over the
        target's vocabulary ([b * K, W]; the caller converts them, :func:`draft_bitmask`)."""
        b, K = len(self.matchers), topk
        read = tokens.view(b, K)
        if step > 0:
            read = torch.cat([read, parents.to(read.dtype)], 1)
        both = read.tolist()  # waits for the draft level (one read)
        toks = [row[:K] for row in both]
        par = None if step == 0 else [row[K:] for row in both]
        t = time.perf_counter()
        if step == 0:
            self._lanes = [[[tok] for tok in row] for row in toks]
        else:
            base = K + K * K * (step - 1)
            self._lanes = [
                [self._lanes[i][(par[i][j] - base) // K] + [toks[i][j]] for j in range(K)]
                for i in range(b)
            ]
        out = np.full((b * K, self.width), -1, dtype=np.int32)
        work = [
            (i, m, [(i * K + j, path) for j, path in enumerate(self._lanes[i])])
            for i, m in enumerate(self.matchers)
            if m is not None
        ]
        self._fill(work, out)
        if draft_vocab:
            out = self._to_draft(out)
        self.seconds += time.perf_counter() - t
        return self.upload(out)

    def _masks_of(self, states: Sequence[tuple[Any, int]], out: np.ndarray) -> None:
        """The masks of grammar ``states`` into their rows of ``out``; a dead end (no token
        allowed) stays all ones, since no output reaches it."""
        fill_masks(self.executor, states, out)
        self.computed += len(states)
        for _, row in states:
            if not out[row].any():
                out[row] = -1

    def _state(self, i: int, path: tuple[int, ...]) -> Any | None:
        """Request ``i``'s grammar state after a draft ``path`` below its root (forked from
        the state one token up, kept for the round); None where no output reaches it."""
        states = self._states[i]
        if path not in states:
            if not path:
                states[path] = self.matchers[i].fork(())
            else:
                above = self._state(i, path[:-1])
                states[path] = None if above is None else advanced(above, path[-1])
        return states[path]

    def start_tree(self, nodes: torch.Tensor) -> None:  # [b, 3, N] int64
        """Start the tree's copy to the host (``nodes``: each request's node tokens, the root
        first, then build_tree's first-child and next-sibling links, -1 for none);
        :meth:`tree` builds its masks. Called before the verify forward is launched, so that
        where the backend runs asynchronously the host walks the tree while the device
        verifies it."""
        self._tree_shape = (nodes.shape[0], nodes.shape[2])
        self._tree_read = self.read(nodes.reshape(-1))

    def tree(self) -> torch.Tensor:  # [b * N, W] int32 on the device
        """The mask of the token after every node of each request's tree (the root's is
        :meth:`root`'s), walked depth first from the root; the lanes' masks are reused."""
        root = self._root_masks()
        trees = self._read_tree()  # waits for the draft
        t = time.perf_counter()
        n = self._tree_shape[1]
        out = np.full((len(trees) * n, self.width), -1, dtype=np.int32)
        work = []
        for i, m in enumerate(self.matchers):
            if m is None:
                continue
            out[i * n] = root[i]
            below = _subtree(*trees[i], 0, [])[1:]  # every node below the root, depth first
            work.append((i, m, [(i * n + node, path) for node, path in below]))
        self._fill(work, out)
        self.seconds += time.perf_counter() - t
        return self.upload(out)

    def _read_tree(self) -> list[tuple[list[int], list[int], list[int]]]:
        """The tree :meth:`start_tree` sent to the host: per request, (node tokens, first
        child, next sibling)."""
        b, n = self._tree_shape
        flat = self._tree_read.wait().tolist()
        self._tree_read = None
        rows = [flat[i * 3 * n : (i + 1) * 3 * n] for i in range(b)]
        return [(r[:n], r[n : 2 * n], r[2 * n :]) for r in rows]

    def greedy_tree(self, top: torch.Tensor) -> torch.Tensor:  # [b * N, W] int32 on device
        """A greedy round's node masks from the verify's ``top`` [b * N, 2C] fp32 (each
        node's C largest target logits, descending, then their token ids; the module
        docstring): the masks of the nodes greedy acceptance walks (a lane's path takes the
        lane's mask, the others are computed a level at a time for all requests, one parallel
        call each), the rest all ones; every mask below a node whose top logits do not settle
        its token."""
        root = self._root_masks()
        b, n = self._tree_shape
        trees = self._read_tree()  # read while the target verified
        rows = self.read(top.reshape(-1)).wait().tolist()  # waits for the verify
        t = time.perf_counter()
        C = len(rows) // (b * n) // 2
        out = np.full((b * n, self.width), -1, dtype=np.int32)
        # (request, node, its draft path) of the nodes the walk has reached
        level = [(i, 0, ()) for i, m in enumerate(self.matchers) if m is not None]
        work = []  # (i, matcher, (row, path) of every node below an unsettled one)
        while level:
            todo, live = [], []  # (state, row) of walked nodes to compute; walked nodes output
            for i, node, path in level:
                known = self._known[i]
                if not path:
                    out[i * n] = root[i]
                elif path in known:  # a lane's
                    if known[path] is None:
                        continue  # no output reaches it (the grammar is complete there)
                    out[i * n + node] = known[path]
                else:
                    state = self._state(i, path)
                    if state is None:
                        continue
                    todo.append((state, i * n + node))
                live.append((i, node, path))
            self._masks_of(todo, out)
            below = []
            for i, node, path in live:
                at = (i * n + node) * 2 * C
                token = greedy_choice(out[i * n + node], rows[at : at + C],
                                      [int(x) for x in rows[at + C : at + 2 * C]])  # fmt: skip
                toks, child, sib = trees[i]
                if token is None:  # every node below gets its mask
                    under = _subtree(toks, child, sib, node, list(path))[1:]
                    work.append((i, self.matchers[i], [(i * n + u, p) for u, p in under]))
                    continue
                nxt = next((c for c in _children(child, sib, node) if toks[c] == token), -1)
                if nxt != -1:  # else the bonus token: the walk ends here
                    below.append((i, nxt, (*path, token)))
            level = below
        self._fill(work, out)
        self.seconds += time.perf_counter() - t
        return self.upload(out)

    def _fill(
        self,
        work: Sequence[tuple[int, Matcher, Sequence[tuple[int, list[int]]]]],
        out: np.ndarray,  # [R, W] int32, all ones where nothing is written
    ) -> None:
        """The masks after draft paths into rows of ``out``: ``work`` holds (request i, its
        matcher, (row of out, draft path) pairs). Masks known this round are copied; each
        other path is forked from its request's matcher and all are computed in one parallel
        call (:func:`~polyspec.constrain.matcher.fill_masks`); a node no output reaches stays
        all ones, and nothing below one already known to be such is forked."""
        jobs: list[tuple[int, tuple[int, ...], int, object]] = []  # (i, path, row, state)
        copies: list[tuple[int, int, tuple[int, ...]]] = []  # (i, row, path computed elsewhere)
        for i, m, nodes in work:
            known = self._known[i]
            todo: dict[tuple[int, ...], int] = {}  # path -> the row computing it
            for row, path in nodes:
                key = tuple(path)
                if key in known:
                    if known[key] is not None:
                        out[row] = known[key]
                elif _unreachable(known, key):
                    known[key] = None
                elif key in todo:
                    copies.append((i, row, key))
                else:
                    todo[key] = row
            for key, row in todo.items():
                state = m.fork(key)
                if state is None:
                    known[key] = None
                else:
                    jobs.append((i, key, row, state))
        fill_masks(self.executor, [(state, row) for _, _, row, state in jobs], out)
        self.computed += len(jobs)
        for i, key, row, _ in jobs:
            if out[row].any():
                self._known[i][key] = out[row]
            else:  # a dead end below this node: no output reaches it
                self._known[i][key] = None
                out[row] = -1
        for i, row, key in copies:
            if self._known[i][key] is not None:
                out[row] = self._known[i][key]

    def _to_draft(self, masks: np.ndarray) -> np.ndarray:  # [n, W] -> [n, W'] int32
        """Target-vocabulary masks as masks over the draft head's own vocabulary."""
        return masks if self.draft_vocab is None else self.draft_vocab.to_draft(masks)


def _unreachable(known: dict[tuple[int, ...], np.ndarray | None], key: tuple[int, ...]) -> bool:
    """Whether a known path above ``key`` leads to a node no output reaches."""
    return any(known.get(key[:d], 0) is None for d in range(1, len(key)))


def _subtree(
    tokens: list[int], first_child: list[int], next_sibling: list[int], node: int, path: list[int]
) -> list[tuple[int, list[int]]]:
    """(node, draft path to it) of ``node`` (at ``path``) and every node below it, depth
    first."""
    out, stack = [], [(node, path)]
    while stack:
        u, at = stack.pop()
        out.append((u, at))
        below = reversed(_children(first_child, next_sibling, u))
        stack += [(c, at + [tokens[c]]) for c in below]
    return out


def _children(first_child: list[int], next_sibling: list[int], node: int) -> list[int]:
    """The children of ``node`` by build_tree's first-child / next-sibling links."""
    out, c = [], first_child[node]
    while c != -1:
        out.append(c)
        c = next_sibling[c]
    return out
