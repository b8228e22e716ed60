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
the lanes' masks are known) needs no tree masks: greedy acceptance under the grammar takes,
at each node it reaches, the masked argmax of the target's logits, which the host reads off
the target's top logits at the node (returned by the verify forward) and the grammar's
verdict on each of them (:func:`~polyspec.constrain.matcher.greedy_choice`; the verdict is
:meth:`Matcher.allows`, ~1 us a token against ~50 us for a mask, except where the grammar
forces bytes: there the node's mask decides). Only where those top logits do not settle it
does the host take the argmax of the node's logits row under the node's mask.
:meth:`RoundMasks.greedy_walk` walks each request's tree this way from the root into the
child that drafted the chosen token, committing each token to the matcher as it goes, and
hands the device the chosen token of every walked node, which acceptance takes instead of
the target's argmax. The round's output is then known before the device has finished it:
the next round's root masks (:meth:`RoundMasks.next_roots`) are computed while it does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from polyspec.constrain.matcher import (
    Matcher,
    allowed_by,
    fill_masks,
    greedy_choice,
    mask_width,
    masked_argmax,
    next_masks,
)

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
        self._in_vocab = np.zeros(int(self._ids.max()) + 1 if self.size else 0, dtype=bool)
        self._in_vocab[self._ids] = True

    def has(self, token: int) -> bool:
        """Whether the draft can propose target token ``token``."""
        return bool(self._in_vocab[token]) if token < len(self._in_vocab) else False

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

    def draft_levels(self, num_steps: int, draft_vocab: bool = True) -> torch.Tensor:
        """The masks of a draft whose lanes the host does not mask (``constrained_draft``
        ``root``) at its levels 1 .. S-1, one per request and level ([b, S-1, W'] int32 on
        the device; ``draft_vocab`` False: over the target's vocabulary, [b, S-1, W]).

        Where the grammar forces the next tokens (a JSON key, the punctuation around it, the
        rest of an enum's value), each is the only token its level's mask allows, and the
        first free token after them is held to the grammar's mask there
        (:meth:`Matcher.lookahead`): the draft proposes the forced tokens whatever the head
        would have guessed, and its nodes go to what the grammar leaves open. Elsewhere the
        rows allow every token (a node off the forced path is never accepted, so the one
        mask of a level serves all its lanes). A forced token the draft cannot propose
        (outside an EAGLE-3 head's own vocabulary) ends the forced run there."""
        t = time.perf_counter()
        depth = num_steps - 1
        # the masks after the forced runs not computed ahead (next_roots), in one call
        next_masks([m for m in self.matchers if m is not None], num_steps)
        out = np.full((len(self.matchers), depth, self.width), -1, dtype=np.int32)
        for i, m in enumerate(self.matchers):
            if m is None or m.done:
                continue
            forced, after = m.lookahead(num_steps)
            m.take_seconds()  # (this call's own time counts it)
            if self.draft_vocab is not None:  # the run ends at a token the draft lacks
                n = next((j for j, t in enumerate(forced) if not self.draft_vocab.has(t)), None)
                forced, after = (forced, after) if n is None else (forced[:n], None)
            for level, token in enumerate(forced[1:], start=1):  # level 0 is the root's mask
                out[i, level - 1] = 0
                out[i, level - 1].view(np.uint32)[token >> 5] = np.uint32(1 << (token & 31))
            if forced and after is not None:  # the free token after the run
                out[i, len(forced) - 1] = after
        if draft_vocab:
            out = self._to_draft(out.reshape(-1, self.width)).reshape(len(self.matchers), depth, -1)
        self.seconds += time.perf_counter() - t
        return self.upload(out)

    def _root_masks(self) -> np.ndarray:
        if self._root is None:
            t = time.perf_counter()
            out = np.full((len(self.matchers), self.width), -1, dtype=np.int32)
            for i, m in enumerate(self.matchers):
                if m is not None:
                    out[i] = m.next_mask()
                    m.take_seconds()  # where the scheduler had not asked: counted below
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

    def greedy_walk(
        self,
        top: torch.Tensor,  # [b * N, 2C] fp32: each node's C largest target logits, then ids
        logits: torch.Tensor,  # [b * N, V] the target's logits at the nodes
    ) -> torch.Tensor:  # [b * N] int32 on the device
        """A greedy round's acceptance under the grammar, on the host (the module docstring)
        -> the token greedy decoding takes at each node the walk reaches (-1 at the others,
        and at every node of an unconstrained request: the device's argmax), which the
        round's acceptance uses instead of the target's argmax there. Each walked token is
        committed to its request's matcher (:meth:`Matcher.walk`) as it is chosen."""
        b, n = self._tree_shape
        trees = self._read_tree()  # read while the target verified
        rows = self.read(top.reshape(-1)).wait().tolist()  # waits for the verify
        t = time.perf_counter()
        C = len(rows) // (b * n) // 2
        out = np.full(b * n, -1, dtype=np.int32)
        root = self._root_masks()
        for i, m in enumerate(self.matchers):
            if m is None:
                continue
            toks, child, sib = trees[i]
            node = 0
            while node != -1:
                row = i * n + node
                at = row * 2 * C
                ids = [int(x) for x in rows[at + C : at + 2 * C]]
                # the grammar's verdict on a token: the root's mask, known; a node's mask
                # where the grammar forces bytes (Matcher.allows is wider there); else asked
                mask = root[i] if node == 0 else None
                if mask is None and m.forced():
                    mask = m.mask_now()
                    self.computed += 1
                allowed = m.allows if mask is None else allowed_by(mask)
                token = greedy_choice(allowed, rows[at : at + C], ids)
                if token is None:  # the top logits do not settle it: the masked argmax
                    if mask is None:
                        mask = m.mask_now()
                        self.computed += 1
                    if not mask.any():  # no token can follow: the output ends here
                        m.end_walk()
                        break
                    token = masked_argmax(mask, self.read(logits[row].float()).wait().numpy())
                out[row] = token
                if not m.walk(token):  # the grammar is complete: the output ends here
                    break
                # into the child that drafted the token; none: it is the bonus token
                node = next((c for c in _children(child, sib, node) if toks[c] == token), -1)
        self.seconds += time.perf_counter() - t
        return self.upload(out)

    def next_roots(self, num_steps: int = 0) -> None:
        """After :meth:`greedy_walk`: each request's next mask (the next round's root), which
        the host computes while the device finishes the round (their time is the next
        round's, as the scheduler's are); and where the next round's draft of ``num_steps``
        levels takes :meth:`draft_levels`, the masks after the forced tokens."""
        next_masks([m for m in self.matchers if m is not None], num_steps)

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
