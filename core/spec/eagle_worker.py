"""The EAGLE worker: draft -> build tree -> verify -> accept -> draft extend (DESIGN.md §4).

Works for EAGLE-1/2 heads, EAGLE-3 heads and standalone draft models alike: the draft is any
module with the draft-head interface (``forward``, ``topk``, ``probs``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from polyspec.backend import ForwardMode, TreeMaskMode
from polyspec.config import SpeculativeConfig
from polyspec.errors import ConfigError
from polyspec.runtime.graphs import block_slots, static_batch
from polyspec.runtime.kv_cache import OutOfKVSlots
from polyspec.runtime.model_runner import ModelRunner
from polyspec.runtime.sampling import SamplingBatch
from polyspec.spec.base import SeqState, WorkerBase


class EagleWorker(WorkerBase):
    def __init__(self, backend, target, draft, spec: SpeculativeConfig, dtype, **kw):
        caps = backend.capabilities
        if spec.topk > 1 and not caps.tree_attention:
            raise ConfigError(
                f"backend {backend.name!r} verifies chains only (no tree attention); "
                f"set topk = 1 (got topk = {spec.topk})"
            )
        super().__init__(backend, target, dtype, capture_layers=tuple(draft.aux_layer_ids), **kw)
        self.draft = draft
        self.spec = spec
        self.topk, self.num_steps, self.num_draft_tokens = (
            spec.topk,
            spec.num_steps,
            spec.num_draft_tokens,
        )
        ps = self.page_size
        # Each lane holds the prefix's partial last page (copied) plus its draft tokens.
        self.lane_width = self.num_steps if ps == 1 else ps * -(-(ps - 1 + self.num_steps) // ps)
        self.extra_kv_per_request = self.num_draft_tokens
        self.scratch_kv = kw["max_batch_size"] * self.topk * self.lane_width
        self.draft_runner = ModelRunner(draft, backend, self.num_kv_slots, dtype)
        self.use_aux = bool(draft.aux_layer_ids)
        # A standalone LM has no target features: it reads token p at position p, so each
        # round starts with one draft forward over the root (bonus) token.
        self.root_forward = draft.algorithm == "standalone"
        # The draft lanes' slots are taken once for the largest batch and reused every round:
        # a per-round alloc / free would cost a device-to-host sync (free checks the slots)
        # in the middle of the round. The scheduler already keeps scratch_kv out of its budget.
        self.lane_scratch = None
        if self.num_steps > 1:
            self.lane_scratch = self.allocator.alloc(self.scratch_kv)
            if self.lane_scratch is None:
                raise OutOfKVSlots(
                    f"out of KV slots for the draft lanes: needed {self.scratch_kv}, "
                    f"{self.allocator.available} free; raise num_kv_slots"
                )

    # -- prefill ------------------------------------------------------------------------------
    def prefill(self, rids: Sequence[int], ends: Sequence[int]) -> dict[int, int]:
        """Target extend over a prompt chunk, then draft extend over the shifted chunk."""
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
        batch = self.builder.build(
            ForwardMode.DRAFT_EXTEND, [s.row for s in sts], starts, lens, self.builder.long(ids)
        )
        logit_h, next_feat = self.draft_runner.forward_draft(batch, aux if self.use_aux else hidden)
        if done and not self.root_forward:
            self._store_draft_view(
                [sts[i] for i in done], logit_h[last[done]], next_feat[last[done]]
            )
        return first

    def _store_draft_view(self, sts: list[SeqState], logit_h, next_feat) -> None:
        topk_p, topk_index = self.draft.topk(logit_h, self.topk)
        for i, s in enumerate(sts):
            s.topk_p, s.topk_index, s.draft_feature = topk_p[i], topk_index[i], next_feat[i]

    # -- one decode round ---------------------------------------------------------------------
    def decode(self, rids: Sequence[int]) -> list[list[int]]:
        sts = [self.states[r] for r in rids]
        bs, N, S = len(sts), self.num_draft_tokens, self.num_steps
        rows = [s.row for s in sts]
        seq_lens = [s.seq_len for s in sts]
        idx, dev = self.backend.index_dtype, self.device

        self.timer.start()
        self.kv.ensure(rows, [n + N for n in seq_lens])
        # Uploaded once, read by the draft, the tree, the verify and the draft extend.
        rows_t, seq_t = self.builder.index(rows), self.builder.index(seq_lens)
        if self.root_forward:
            batch = self.builder.build(
                ForwardMode.DRAFT_EXTEND, rows, seq_lens, [1] * bs,
                self.builder.long([s.last_token for s in sts]),
            )  # fmt: skip
            logit_h, next_feat = self.draft_runner.forward_draft(batch, None)
            self._store_draft_view(sts, logit_h, next_feat)
        if self.root_forward:  # the standalone draft holds the root too
            draft_prefix = [n + 1 for n in seq_lens]
            draft_seq_t = self.builder.index(draft_prefix)
        else:
            draft_prefix, draft_seq_t = seq_lens, seq_t
        roots = self.builder.long([s.last_token for s in sts])
        tree = self._draft(sts, rows, draft_prefix, rows_t, draft_seq_t, roots, seq_t)
        candidates, tree_mask, positions, retrive_index, next_token, next_sibling = tree
        self.timer.lap("draft")

        sb = SamplingBatch([s.sampler for s in sts], N, dev)
        verified = None
        if sb.all_greedy:
            verified = self._verify_greedy_graphed(rows_t, seq_t, max(seq_lens), tree)
        if verified is not None:
            predicts, feats, packed, b = verified
            self.timer.lap("verify")
        else:
            logits, feats = self._verify(
                rows, seq_lens, rows_t, seq_t, candidates, positions, tree_mask
            )
            self.timer.lap("verify")
            predicts = torch.empty(bs * N, dtype=torch.int64, device=dev)
            accept_index = torch.empty(bs, S + 1, dtype=idx, device=dev)
            accept_length = torch.empty(bs, dtype=idx, device=dev)
            if sb.all_greedy:
                target_predict = logits.argmax(-1).view(bs, N)
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
        # The one host sync of the round (the engine needs the tokens anyway): lengths, paths
        # and every node's predicted token in a single device-to-host copy. ``b`` rows each:
        # the batch, or the captured bucket it was padded to.
        host = packed.tolist()
        accepted = host[:bs]
        paths = [host[b + r * (S + 1) : b + (r + 1) * (S + 1)] for r in range(bs)]
        predicted = host[b + b * (S + 1) : b + b * (S + 1) + bs * N]  # [bs * N]
        path_nodes = [p[: a + 1] for p, a in zip(paths, accepted)]  # global node ids
        self._compact(rows, seq_lens, path_nodes, N)
        new_lens = [n + a + 1 for n, a in zip(seq_lens, accepted)]
        self.kv.truncate(rows, new_lens)
        self.timer.lap("accept")

        ext = [a + 1 for a in accepted]
        if self.root_forward:
            new_tokens_t = predicts[self.builder.long([g for p in path_nodes for g in p])]
            self._standalone_extend(rows, seq_lens, accepted, new_tokens_t)
        else:
            self._draft_extend(sts, rows, seq_lens, rows_t, seq_t, ext, path_nodes, predicts, feats)
        self.timer.lap("draft_extend")

        out = []
        for s, path, new_len in zip(sts, path_nodes, new_lens):
            toks = [predicted[g] for g in path]
            s.seq_len, s.last_token = new_len, toks[-1]
            out.append(toks)
        self.timer.lap("other")
        return out

    def _verify(self, rows, seq_lens, rows_t, seq_t, candidates, positions, tree_mask):
        """Target forward over the tree -> (logits [bs * N, V], draft features [bs * N, F])."""
        bs, N = candidates.shape
        graphs = self.graphed(bs, max(seq_lens))
        if graphs is not None:
            inputs = {
                "input_ids": candidates.flatten(),
                "positions": positions,
                "tree_mask": tree_mask,
                "rows": rows_t,
                "seq_lens": seq_t,
                "extend_lens": torch.full_like(rows_t, N),
            }
            out = graphs.run("verify", bs, max(seq_lens), inputs, self._verify_graph)
            if out is not None:
                return out[0][: bs * N], out[1][: bs * N]
        batch = self.builder.build(
            ForwardMode.TARGET_VERIFY, rows, seq_lens, [N] * bs, candidates.flatten(),
            positions=positions, tree_mask=tree_mask,
        )  # fmt: skip
        hidden, aux = self.target_runner.forward_target(batch)
        return self.target.compute_logits(hidden), (aux if self.use_aux else hidden)

    def _verify_graph(self, s, bs: int, max_prefix: int):
        table = self.req_pool.req_to_token
        n = self.num_draft_tokens
        slots, _ = block_slots(table, s["rows"], s["seq_lens"], s["extend_lens"], n)
        batch = static_batch(
            ForwardMode.TARGET_VERIFY, table, s["rows"], s["seq_lens"], s["extend_lens"],
            s["input_ids"], s["positions"], slots, tree_mask=s["tree_mask"],
        )  # fmt: skip
        hidden, aux = self.target_runner.forward_target(batch, static_prefix=max_prefix)
        return self.target.compute_logits(hidden), (aux if self.use_aux else hidden)

    def _verify_greedy_graphed(self, rows_t, seq_t, max_prefix: int, tree):
        """Target verify and greedy acceptance in one replay -> (predicts [b * N], features
        [b * N, F], packed host vector, bucket b), or None when this batch runs eagerly."""
        bs, N = tree[0].shape
        graphs = self.graphed(bs, max_prefix)
        if graphs is None:
            return None
        candidates, tree_mask, positions, _, next_token, next_sibling = tree
        inputs = {
            "input_ids": candidates.flatten(),
            "positions": positions,
            "tree_mask": tree_mask,
            "next_token": next_token,
            "next_sibling": next_sibling,
            "rows": rows_t,
            "seq_lens": seq_t,
            "extend_lens": torch.full_like(rows_t, N),
        }
        out = graphs.run("verify_greedy", bs, max_prefix, inputs, self._verify_greedy_graph)
        if out is None:
            return None
        predicts, feats, packed = out
        return predicts, feats, packed, graphs.buckets.batch_bucket(bs)

    def _verify_greedy_graph(self, s, bs: int, max_prefix: int):
        logits, feats = self._verify_graph(s, bs, max_prefix)
        N, S, idx = self.num_draft_tokens, self.num_steps, s["rows"].dtype
        dev = logits.device
        candidates = s["input_ids"].view(bs, N)
        # build_tree's retrive_index is b * N + j; rebuilt here because the padding rows of
        # an input buffer are zeroed, which would point them at request 0's nodes.
        retrive_index = torch.arange(bs * N, device=dev).view(bs, N).to(idx)
        predicts = torch.empty(bs * N, dtype=torch.int64, device=dev)
        accept_index = torch.empty(bs, S + 1, dtype=idx, device=dev)
        accept_length = torch.empty(bs, dtype=idx, device=dev)
        self.kernels.verify_tree_greedy(
            candidates, retrive_index, s["next_token"], s["next_sibling"],
            logits.argmax(-1).view(bs, N), predicts, accept_index, accept_length,
        )  # fmt: skip
        return predicts, feats, _pack_verified(accept_length, accept_index, predicts)

    def _draft_extend(
        self, sts, rows, seq_lens, rows_t, seq_t, ext, path_nodes, predicts, feats
    ) -> None:
        """Draft extend over the accepted tokens: (target feature at node, next token) pairs;
        stores each request's draft view for the next round."""
        bs, width = len(rows), self.num_steps + 1
        graphs = self.graphed(bs, max(seq_lens))
        if graphs is not None:
            # Fixed width S + 1 per request: the path, then its last node repeated (masked).
            padded = [p + [p[-1]] * (width - len(p)) for p in path_nodes]
            index = self.builder.long([g for p in padded for g in p])
            inputs = {
                "input_ids": predicts[index],
                "features": feats[index],
                "rows": rows_t,
                "seq_lens": seq_t,
                "extend_lens": self.builder.index(ext),
            }
            out = graphs.run("draft_extend", bs, max(seq_lens), inputs, self._draft_extend_graph)
            if out is not None:
                topk_p, topk_index, next_feat = (t[:bs].clone() for t in out)
                for i, s in enumerate(sts):
                    s.topk_p, s.topk_index, s.draft_feature = topk_p[i], topk_index[i], next_feat[i]
                return
        flat = self.builder.long([g for p in path_nodes for g in p])
        batch = self.builder.build(ForwardMode.DRAFT_EXTEND, rows, seq_lens, ext, predicts[flat])
        logit_h, next_feat = self.draft_runner.forward_draft(batch, feats[flat])
        last = self.builder.long(ext).cumsum(0) - 1
        self._store_draft_view(sts, logit_h[last], next_feat[last])

    def _draft_extend_graph(self, s, bs: int, max_prefix: int):
        table, width = self.req_pool.req_to_token, self.num_steps + 1
        ext = s["extend_lens"]
        slots, positions = block_slots(table, s["rows"], s["seq_lens"], ext, width)
        batch = static_batch(
            ForwardMode.DRAFT_EXTEND, table, s["rows"], s["seq_lens"], ext,
            s["input_ids"], positions, slots,
        )  # fmt: skip
        logit_h, next_feat = self.draft_runner.forward_draft(
            batch, s["features"], static_prefix=max_prefix
        )
        last = torch.arange(bs, device=ext.device) * width + (ext.to(torch.int64) - 1).clamp(min=0)
        topk_p, topk_index = self.draft.topk(logit_h[last], self.topk)
        return topk_p, topk_index, next_feat[last]

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

    def _compact(self, rows, seq_lens, path_nodes, N) -> None:
        """Move the accepted path's target KV to the front: node j of the tree was written at
        position seq_len + j; the node at depth d must end up at position seq_len + d."""
        src_pos, dst_pos, src_rows = [], [], []
        for b, (row, n, path) in enumerate(zip(rows, seq_lens, path_nodes)):
            for d, g in enumerate(path):
                j = g - b * N
                if j != d:
                    src_rows.append(row)
                    src_pos.append(n + j)
                    dst_pos.append(n + d)
        if not src_pos:  # chains (topk == 1) are always in place
            return
        table = self.req_pool.req_to_token
        r = self.builder.long(src_rows)
        src = table[r, self.builder.long(src_pos)]
        dst = table[r, self.builder.long(dst_pos)]
        self.target_runner.kv_pool.move(dst, src)

    # -- multi-step draft ---------------------------------------------------------------------
    def _draft(self, sts, rows, seq_lens, rows_t, seq_t, roots, target_seq_t):
        """S levels of top-K expansion with S-1 draft forwards (DRAFT_DECODE), then the tree.

        ``seq_lens`` / ``seq_t``: the draft's prefix lengths; ``roots`` [bs]: each request's
        last token; ``target_seq_t`` [bs]: the target's prefix lengths (the tree's positions).
        Returns :meth:`_build_tree`'s tensors."""
        bs, K, S, ps = len(sts), self.topk, self.num_steps, self.page_size
        topk_p = torch.stack([s.topk_p for s in sts])  # [bs, K]
        topk_index = torch.stack([s.topk_index for s in sts])  # [bs, K]
        hidden = torch.stack([s.draft_feature for s in sts])  # [bs, H]
        if S > 1:
            graphs = None if self.root_forward else self.graphed(bs, max(seq_lens))
            if graphs is not None:
                inputs = {
                    "topk_p": topk_p,
                    "topk_index": topk_index,
                    "hidden": hidden,
                    "rows": rows_t,
                    "seq_lens": seq_t,
                    "roots": roots,
                }
                out = graphs.run("draft", bs, max(seq_lens), inputs, self._draft_graph)
                if out is not None:
                    candidates, tree_mask, positions, *links = out
                    return (candidates[:bs], tree_mask[:bs], positions[: bs * self.num_draft_tokens],
                            *(t[:bs] for t in links))  # fmt: skip
            scratch = self.lane_scratch[: bs * K * self.lane_width]
            lane_locs, tail_t = self._assign_lanes(rows_t, seq_t, scratch)
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

        return self._build_tree(
            *self._expand_tree(topk_p, topk_index, hidden, draft_step), roots, target_seq_t
        )

    def _build_tree(self, parent_list, top_scores_index, draft_tokens, roots, seq_lens):
        """``build_tree`` over the drafted levels -> (candidates [bs, N] (root first),
        tree_mask [bs, N, N], positions [bs * N], retrive_index, next_token, next_sibling
        [bs, N] each)."""
        bs, N = roots.shape[0], self.num_draft_tokens
        idx, dev = seq_lens.dtype, roots.device
        candidates = torch.cat([roots[:, None], draft_tokens], dim=1)
        tree_mask = torch.empty(bs, N, N, dtype=torch.bool, device=dev)
        positions = torch.empty(bs * N, dtype=torch.int64, device=dev)
        links = [torch.empty(bs, N, dtype=idx, device=dev) for _ in range(3)]
        self.kernels.build_tree(
            parent_list, top_scores_index, seq_lens, self.topk, self.num_steps, N,
            TreeMaskMode.TREE_ONLY, tree_mask, positions, *links,
        )  # fmt: skip
        return candidates, tree_mask, positions, *links

    def _expand_tree(self, topk_p, topk_index, hidden, draft_step):
        """S levels of top-K expansion (``select_top_k``), then ``organize_draft_results``.
        ``draft_step(i, input_ids [bs*K], hidden [bs*K, F])`` runs the draft forward between
        level i and i+1 and returns (logit hidden, next hidden)."""
        K, S = self.topk, self.num_steps
        scores = None
        levels: tuple[list, list, list] = ([], [], [])
        for i in range(S):
            input_ids, hidden, scores, level = self.kernels.select_top_k(
                i, topk_p, topk_index, hidden, scores, K
            )
            for acc, t in zip(levels, level):
                acc.append(t)
            if i == S - 1:
                break
            logit_h, hidden = draft_step(i, input_ids, hidden)
            topk_p, topk_index = self.draft.topk(logit_h, K)
        return self.kernels.organize_draft_results(*levels, self.num_draft_tokens)

    def _draft_graph(self, s, bs: int, max_prefix: int):
        """The captured multi-step draft (S > 1): lane slots, the loop of :meth:`_draft` and
        the tree, over device tensors only."""
        K, table = self.topk, self.req_pool.req_to_token
        topk_p, topk_index, hidden = s["topk_p"], s["topk_index"], s["hidden"]
        rows = s["rows"]
        # Padding requests (row 0, length 0) get lanes too: the scratch holds the whole bucket.
        # Only EAGLE heads are captured, whose prefix is the target's: seq_lens serves both.
        scratch = self.lane_scratch[: bs * K * self.lane_width]
        lane_locs, tails = self._assign_lanes(rows, s["seq_lens"], scratch)
        seq_lens = s["seq_lens"].to(torch.int64)
        idx = rows.dtype
        prefix = (seq_lens - tails).to(idx)
        extend = torch.full_like(rows, K)

        def draft_step(i: int, input_ids: torch.Tensor, hidden: torch.Tensor):
            col = (tails + i).view(bs, 1, 1).expand(bs, K, 1)
            batch = static_batch(
                ForwardMode.DRAFT_DECODE, table, rows, prefix, extend, input_ids,
                (seq_lens + i).repeat_interleave(K),
                lane_locs.gather(2, col).flatten(),
                lane_locs=lane_locs, lane_lens=(tails + i + 1).to(idx), topk=K,
            )  # fmt: skip
            return self.draft_runner.forward_draft(batch, hidden, static_prefix=max_prefix)

        levels = self._expand_tree(topk_p, topk_index, hidden, draft_step)
        return self._build_tree(*levels, s["roots"], s["seq_lens"])

    def _assign_lanes(self, rows_t, seq_t, scratch):
        bs, K, ps, W = rows_t.shape[0], self.topk, self.page_size, self.lane_width
        idx, dev = self.backend.index_dtype, self.device
        lane_locs = torch.empty(bs, K, W, dtype=idx, device=dev)
        tail = torch.empty(bs, dtype=idx, device=dev)
        copy_src = torch.empty(bs * K * (ps - 1), dtype=idx, device=dev)
        copy_dst = torch.empty(bs * K * (ps - 1), dtype=idx, device=dev)
        self.kernels.assign_draft_cache_locs(
            rows_t, self.req_pool.req_to_token, seq_t, scratch, K, self.num_steps, ps, lane_locs, tail, copy_src, copy_dst,
        )  # fmt: skip
        if ps > 1:
            self.draft_runner.kv_pool.move(copy_dst, copy_src)
        return lane_locs, tail.to(torch.int64)


def _pack_verified(accept_length, accept_index, predicts) -> torch.Tensor:
    """[bs] + [bs, S+1] + [bs * N] -> one int64 vector, for a single device-to-host copy."""
    return torch.cat(
        [accept_length.to(torch.int64), accept_index.to(torch.int64).flatten(), predicts]
    )
