"""The token bitmasks of one constrained round, built on the host from the batch's matchers
and uploaded as the round's inputs: at the roots, at each draft level's lanes, and at every
node of the verified tree.

Rows of unconstrained requests (a mixed batch) are all ones, so applying a mask leaves them
as they are. A node no output can reach (below a token the grammar refuses, or past the
grammar's end) is all ones too: its row is never used, since verification only accepts a
child its parent's masked distribution allows.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from polyspec.constrain.matcher import Matcher, mask_width


class RoundMasks:
    """The host side of a constrained round (handed to it in its
    :class:`~polyspec.spec.round.HostView`). ``matchers``: one per request, None where it is
    unconstrained; ``vocab_size``: the target's logits width; ``draft_to_target``: the draft
    head's vocabulary as target ids (None: the draft's logits are over the target's);
    ``upload``: host int32 array -> the same on the round's device; ``read``: a device
    tensor -> its host copy on the way (``Backend.read_async``)."""

    def __init__(
        self,
        matchers: Sequence[Matcher | None],
        vocab_size: int,
        upload: Callable[[np.ndarray], torch.Tensor],
        read: Callable[[torch.Tensor], Any],
        draft_to_target: np.ndarray | None = None,
    ):
        self.matchers = list(matchers)
        self.width = mask_width(vocab_size)
        self.upload = upload
        self.read = read
        self._tree_read: Any = None
        self._tree_shape: tuple[int, int] = (0, 0)
        self.draft_to_target = draft_to_target
        self.seconds = 0.0  # host time spent building masks
        self._root: np.ndarray | None = None
        self._lanes: list[list[list[int]]] = []  # per request, per lane: its draft path

    def root(self) -> torch.Tensor:  # [b, W] int32 on the device
        """The mask of each request's next token (after its newest committed one)."""
        return self.upload(self._root_masks())

    def root_draft(self) -> torch.Tensor:  # [b, W'] int32 over the draft's vocabulary
        """:meth:`root` over the draft's own vocabulary (for the draft's first top-K)."""
        return self.upload(self._to_draft(self._root_masks()))

    def _root_masks(self) -> np.ndarray:
        if self._root is None:
            t = time.perf_counter()
            out = np.full((len(self.matchers), self.width), -1, dtype=np.int32)
            for i, m in enumerate(self.matchers):
                if m is not None:
                    out[i] = m.next_mask()
            self._root = out
            self.seconds += time.perf_counter() - t
        return self._root

    def lanes(
        self,
        step: int,
        tokens: torch.Tensor,  # [b * K] each lane's newest draft token
        parents: torch.Tensor | None,  # [b, K] select_top_k's tree_parents (step >= 1)
        topk: int,
    ) -> torch.Tensor:  # [b * K, W'] int32 over the draft's vocabulary, on the device
        """The masks of the draft's next token at each lane of level ``step``: lane ``j`` of
        a level after the first continues lane ``(parents[:, j] - K - K*K*(step-1)) // K`` of
        the level before (select_top_k's candidate ids)."""
        t = time.perf_counter()
        b, K = len(self.matchers), topk
        toks = tokens.view(b, K).tolist()
        if step == 0:
            self._lanes = [[[tok] for tok in row] for row in toks]
        else:
            base = K + K * K * (step - 1)
            par = parents.tolist()
            self._lanes = [
                [self._lanes[i][(par[i][j] - base) // K] + [toks[i][j]] for j in range(K)]
                for i in range(b)
            ]
        out = np.full((b * K, self.width), -1, dtype=np.int32)
        for i, m in enumerate(self.matchers):
            if m is None:
                continue
            for j, path in enumerate(self._lanes[i]):
                if not m.fill_after(path, out[i * K + j]):
                    out[i * K + j] = -1
        self.seconds += time.perf_counter() - t
        return self.upload(self._to_draft(out))

    def start_tree(
        self,
        candidates: torch.Tensor,  # [b, N] node tokens, the root first
        first_child: torch.Tensor,  # [b, N] build_tree's retrive_next_token (-1: none)
        next_sibling: torch.Tensor,  # [b, N] build_tree's retrive_next_sibling (-1: none)
    ) -> None:
        """Start the tree's copy to the host; :meth:`tree` builds its masks. Called before
        the verify forward is launched, so that where the backend runs asynchronously the
        host walks the tree while the device verifies it."""
        self._tree_shape = tuple(candidates.shape)
        packed = torch.cat([t.reshape(-1).long() for t in (candidates, first_child, next_sibling)])
        self._tree_read = self.read(packed)

    def tree(self) -> torch.Tensor:  # [b * N, W] int32 on the device
        """The mask of the token after every node of each request's tree (the root's is
        :meth:`root`'s), walked depth first from the root, the matcher rolled back after
        each branch."""
        root = self._root_masks()
        t = time.perf_counter()
        b, n = self._tree_shape
        flat = self._tree_read.wait().tolist()
        self._tree_read = None
        rows = [flat[k * b * n : (k + 1) * b * n] for k in range(3)]
        toks, child, sib = ([r[i * n : (i + 1) * n] for i in range(b)] for r in rows)
        out = np.full((b * n, self.width), -1, dtype=np.int32)
        for i, m in enumerate(self.matchers):
            if m is None:
                continue
            out[i * n] = root[i]
            stack = [(c, [toks[i][c]]) for c in _children(child[i], sib[i], 0)]
            while stack:
                node, path = stack.pop()
                if not m.fill_after(path, out[i * n + node]):
                    out[i * n + node] = -1
                    continue  # nothing below a node no output reaches matters either
                stack += [(c, path + [toks[i][c]]) for c in _children(child[i], sib[i], node)]
        self.seconds += time.perf_counter() - t
        return self.upload(out)

    def _to_draft(self, masks: np.ndarray) -> np.ndarray:  # [n, W] -> [n, W'] int32
        """Target-vocabulary masks as masks over the draft head's own vocabulary."""
        if self.draft_to_target is None:
            return masks
        bits = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little")
        picked = bits[:, self.draft_to_target]
        words = mask_width(picked.shape[1])
        packed = np.zeros((masks.shape[0], words * 4), dtype=np.uint8)
        packed[:, : (picked.shape[1] + 7) // 8] = np.packbits(picked, axis=1, bitorder="little")
        return packed.view(np.int32)


def _children(first_child: list[int], next_sibling: list[int], node: int) -> list[int]:
    """The children of ``node`` by build_tree's first-child / next-sibling links."""
    out, c = [], first_child[node]
    while c != -1:
        out.append(c)
        c = next_sibling[c]
    return out
