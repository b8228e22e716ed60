"""The user-facing facade: ``polyspec.LLM``."""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from polyspec.backend import draft_lane_width
from polyspec.config import EngineConfig, SamplingParams, SpeculativeConfig
from polyspec.constrain import GrammarCache
from polyspec.defaults import default_target_path, shipped_head_path
from polyspec.engine.request import RequestOutput
from polyspec.engine.scheduler import Scheduler
from polyspec.engine.stop import StopChecker
from polyspec.errors import ConfigError, RequestError
from polyspec.spec.base import uses_overlap

if TYPE_CHECKING:
    import torch

    from polyspec.backend import Backend
    from polyspec.engine.loop import EngineLoop, RequestHandle
    from polyspec.model.tokenizer import Tokenizer


class LLM:
    """A target model, optionally with a draft, behind a continuous-batching engine.

    >>> llm = LLM(target="path/or/model.gguf", draft="path/to/eagle3-head",
    ...           speculative=SpeculativeConfig(algorithm="eagle3", num_steps=3, topk=1))
    >>> out = llm.generate(["Hello"], SamplingParams(max_new_tokens=32))[0]
    >>> out.text, out.token_ids, out.stats.mean_acceptance_length
    """

    def __init__(
        self,
        target: str | Path | None = None,
        draft: str | Path | None = None,
        speculative: SpeculativeConfig | None = None,
        backend: str | None = None,
        dtype: str = "auto",
        page_size: int = 1,
        max_batch_size: int = 8,
        max_context: int = 4096,
        num_kv_slots: int | None = None,
        config: EngineConfig | None = None,
        **engine_kwargs,
    ):
        if config is None:
            config = EngineConfig(
                target=None if target is None else str(target),
                draft=None if draft is None else str(draft),
                speculative=speculative,
                backend=backend,
                dtype=dtype,
                page_size=page_size,
                max_batch_size=max_batch_size,
                max_context=max_context,
                num_kv_slots=num_kv_slots,
                **engine_kwargs,
            )
        self.config = config
        self._ids = itertools.count()
        self.tp = None
        self._spawned = None
        self._build()

    # -- tensor parallelism -------------------------------------------------------------------
    @property
    def is_leader(self) -> bool:
        """Whether this process is rank 0 (always, without tensor parallelism): it owns the
        tokenizer and the scheduler; the other ranks :meth:`follow`."""
        return self.tp is None or self.tp.is_leader

    def _join_ranks(self, target_path: Path):
        """This process's :class:`~polyspec.parallel.TPGroup` (None at size 1): the sizes are
        checked against the model, the devices and the backend before anything starts; then
        rank 0 spawns the other ranks, or joins torchrun's."""
        import os

        from polyspec.engine import ranks
        from polyspec.model.loader import read_model_config
        from polyspec.parallel import launch
        from polyspec.parallel.shard import check_shardable

        cfg = self.config
        n = cfg.tensor_parallel_size
        if n == 1:
            return None
        mc = read_model_config(target_path)
        check_shardable(n, mc.num_heads, mc.num_kv_heads, mc.intermediate_size, mc.vocab_size,
                        f"the target {target_path.name}")  # fmt: skip
        be = self.backend
        name = launch.check_distributed_backend(be.capabilities.distributed_backend, be.name)
        tp = ranks.joined_group()
        torchrun = launch.under_torchrun()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", n)) if torchrun else n
        if tp is None:
            launch.check_devices(n, local, be)
            timeout = cfg.distributed_timeout_s
            if torchrun:
                tp = launch.join_torchrun(n, name, timeout)
            else:
                tp, self._spawned = launch.spawn_ranks(
                    n, name, timeout, ranks.spawned_rank_main, (cfg, name, timeout)
                )
                import atexit

                atexit.register(self.stop_ranks)
        be.bind_local_rank(tp.local_rank)
        be.share_host(local)
        return tp

    def follow(self) -> None:
        """On a rank other than 0: run rank 0's calls until it stops the ranks
        (:meth:`stop_ranks`), then leave the process groups.

        :raises RankFailure: rank 0 went away or the ranks fell out of step."""
        from polyspec.engine.ranks import follow
        from polyspec.parallel.launch import leave

        if self.is_leader:
            raise ConfigError("follow() is for ranks other than 0; rank 0 generates")
        try:
            follow(self.worker, self.tp)
        finally:
            leave()

    def stop_ranks(self, timeout_s: float = 10.0) -> None:
        """On rank 0: stop the other ranks (they leave :meth:`follow`) and leave the process
        groups; ranks this process spawned are joined, and killed after ``timeout_s``. A no-op
        without tensor parallelism, or once done."""
        if self.tp is None or not self.is_leader:
            return
        import threading

        from polyspec.parallel.launch import leave

        self.shutdown()
        worker = self.worker
        # A rank stuck in a collective would hold the stop message up to the collective
        # timeout: send it from a thread, and stop waiting after timeout_s.
        sender = threading.Thread(target=worker.stop, daemon=True)
        sender.start()
        sender.join(timeout_s)
        if self._spawned is not None:
            self._spawned.join(timeout_s)
            self._spawned = None
        if not sender.is_alive():
            leave()
        self.tp = None

    # -- construction -------------------------------------------------------------------------
    def _build(self) -> None:
        from polyspec.model.loader import load_draft, load_target, load_tokenizer
        from polyspec.model.quantize import check_draft_quantization
        from polyspec.plugins import create_backend

        cfg = self.config
        self.backend = create_backend(cfg.backend)
        caps = self.backend.capabilities
        if not caps.supports_page_size(cfg.page_size):
            raise ConfigError(
                f"page_size = {cfg.page_size} is not supported by backend {self.backend.name!r}; "
                f"allowed: {list(caps.page_sizes or [])}"
            )
        if cfg.speculative is not None:
            check_draft_quantization(
                cfg.speculative.draft_quantization, cfg.speculative.algorithm, self.backend
            )
        target_path = Path(cfg.target) if cfg.target else default_target_path()
        self.target_path = target_path
        self.tp = self._join_ranks(target_path)  # before any weight is read
        # Only rank 0 owns a tokenizer: the other ranks see token ids alone.
        self.tokenizer = load_tokenizer(target_path) if self.is_leader else None
        self.target = load_target(target_path, self.backend, cfg.dtype, tp=self.tp)
        self.dtype = next(self.target.parameters()).dtype

        spec = cfg.speculative
        self.draft = None
        self.draft_path = None
        if spec is not None:
            draft_path = cfg.draft
            if draft_path is None:
                if cfg.target is None and shipped_head_path() is not None:
                    draft_path = shipped_head_path()
                else:
                    raise ConfigError(
                        f"speculative algorithm {spec.algorithm!r} needs a draft: pass draft=PATH "
                        "(--draft), or leave speculative unset for plain decoding"
                    )
            self.draft_path = Path(draft_path)
            draft = load_draft(
                self.draft_path, self.target, spec.algorithm, self.backend, self.dtype
            )
            if spec.algorithm == "standalone":
                from polyspec.spec.standalone import StandaloneDraft

                draft = StandaloneDraft(draft)
            self.draft = draft
        self._start_engine()

    @classmethod
    def from_modules(
        cls,
        target: torch.nn.Module,
        draft: torch.nn.Module | None = None,
        speculative: SpeculativeConfig | None = None,
        backend: str | Backend | None = None,
        tokenizer: Tokenizer | None = None,
        **engine_kwargs: Any,
    ) -> LLM:
        """An engine over modules already built in memory, skipping checkpoint loading (for
        benchmarks at a model size nobody wants to write to disk, and tests).

        ``target``: a :class:`~polyspec.model.llama.CausalLM`; ``draft``: a
        :class:`~polyspec.model.eagle.DraftHead` of ``speculative.algorithm`` ("eagle" /
        "eagle3"), or a CausalLM for "standalone"; both must already live on ``backend``'s
        device, built with its kernels (``backend.kernels``). ``backend``: a Backend instance
        (the one the modules were built for) or a name (None: the selection rules). Weights get
        the backend's preferred layout, as the loaders give them. ``tokenizer`` None: generate
        with ``prompt_token_ids=`` only; outputs then have ``text == ""`` and stop strings are
        refused. ``engine_kwargs``: the other :class:`EngineConfig` fields (``max_batch_size``,
        ``max_context``, ``num_kv_slots``, ``page_size``, ``graphs``, ...); ``dtype`` is the
        target's own."""
        from polyspec.backend import Backend
        from polyspec.model.llama import CausalLM
        from polyspec.model.loader import apply_weight_layout
        from polyspec.plugins import create_backend

        if "target" in engine_kwargs or "draft" in engine_kwargs or "dtype" in engine_kwargs:
            raise ConfigError(
                "LLM.from_modules takes the models themselves: target / draft / dtype come from "
                "the modules, not from engine_kwargs"
            )
        if (draft is None) != (speculative is None):
            raise ConfigError(
                "LLM.from_modules: pass both draft and speculative (speculative decoding) or "
                "neither (plain decoding)"
            )
        be = backend if isinstance(backend, Backend) else create_backend(backend)
        dtype = next(target.parameters()).dtype
        device = next(target.parameters()).device
        if device != be.device():
            raise ConfigError(
                f"LLM.from_modules: the target lives on {device}, backend {be.name!r} runs on "
                f"{be.device()}; build the modules on backend.device()"
            )
        placeholder = "<in-memory module>"
        config = EngineConfig(
            target=placeholder,
            draft=None if draft is None else placeholder,
            speculative=speculative,
            backend=be.name,
            dtype=str(dtype).removeprefix("torch."),
            **engine_kwargs,
        )
        if not be.capabilities.supports_page_size(config.page_size):
            raise ConfigError(
                f"page_size = {config.page_size} is not supported by backend {be.name!r}; "
                f"allowed: {list(be.capabilities.page_sizes or [])}"
            )
        wrap = isinstance(draft, CausalLM)  # a standalone draft, not yet adapted
        if draft is not None:
            algo = speculative.algorithm
            kind = "standalone" if wrap else getattr(draft, "algorithm", "")
            if kind != algo:
                raise ConfigError(
                    f"LLM.from_modules: speculative algorithm {algo!r} needs "
                    + ("a CausalLM draft" if algo == "standalone" else f"a DraftHead({algo!r})")
                    + f", got {type(draft).__name__} ({kind or 'unknown kind'})"
                )
            from polyspec.model.quantize import check_draft_quantization

            check_draft_quantization(speculative.draft_quantization, algo, be)
        apply_weight_layout(target, be)
        if draft is not None:
            apply_weight_layout(draft, be)
            if wrap:
                from polyspec.spec.standalone import StandaloneDraft

                draft = StandaloneDraft(draft)
        self = cls.__new__(cls)
        self.tp = None
        self._spawned = None
        self.config = config
        self._ids = itertools.count()
        self.backend = be
        self.target_path = None
        self.draft_path = None
        self.tokenizer = tokenizer
        self.target = target.eval()
        self.dtype = dtype
        self.draft = None if draft is None else draft.eval()
        self._start_engine()
        return self

    def _start_engine(self) -> None:
        """The worker and the scheduler over ``self.target`` / ``self.draft``."""
        from polyspec.engine.limits import cap_max_context, check_kv_memory

        self.notes: list[str] = []  # settings the engine changed, for the user (the CLI prints)
        tp = getattr(self, "tp", None)
        caps = self.backend.capabilities
        if tp is not None and not caps.graph_collectives and self.config.graphs != "off":
            # Collectives cannot be recorded in this backend's graphs: every rank runs eagerly.
            if self.config.graphs == "on" or caps.graph_capture:
                self.notes.append(
                    f"graphs off: backend {self.backend.name!r} cannot capture collectives, "
                    f"so tensor-parallel rounds run eagerly"
                )
            self.config = dataclasses.replace(self.config, graphs="off")
        self.config, note = cap_max_context(self.config, self.target.config.max_position_embeddings)
        if note:
            self.notes.append(note)
        if self.draft is not None:
            self._check_topk()
        self.draft_quantization = "none"
        if self.draft is not None:
            from polyspec.model.quantize import quantize_draft

            self.draft_quantization = quantize_draft(
                self.draft, self.backend, self.config.speculative.draft_quantization
            )
        self.tree_choice = None
        timed_trees: list = []  # candidates whose rounds are timed once the worker is built
        if self.draft is not None and self.config.speculative.tree_candidates:
            if tp is None:
                timed_trees = self._choose_tree()
            else:  # timed per rank, trees could differ; every rank must run the same tree
                from polyspec.config import TreeCandidate

                spec = self.config.speculative
                chosen = TreeCandidate(spec.num_steps, spec.topk, spec.num_draft_tokens, 1.0)
                self.tree_choice = {
                    "chosen": chosen.label,
                    "reason": "tensor parallel: every rank runs the head's recommended tree",
                }
        cfg = self.config
        spec = cfg.speculative
        num_slots = cfg.num_kv_slots or self._default_num_slots(timed_trees)
        ps = cfg.page_size
        num_slots = (num_slots + ps - 1) // ps * ps
        models = [self.target.config]
        if self.draft is not None and getattr(self.draft, "config", None) is not None:
            models.append(self.draft.config)
        free, total = self.backend.memory_info()
        check_kv_memory(
            cfg, num_slots, models, self.dtype, self.backend.index_dtype, (free, total),
            f"backend {self.backend.name!r} ({self.backend.device()})",
        )  # fmt: skip
        kw = dict(
            max_batch_size=cfg.max_batch_size,
            max_context=cfg.max_context,
            num_kv_slots=num_slots,
            page_size=ps,
            graphs=cfg.graphs,
            max_graph_batch_size=cfg.max_graph_batch_size,
            max_graph_prefill_tokens=2 * cfg.max_tokens_per_step,  # padded to widths
            constrained_draft=cfg.constrained_draft,
        )
        if self.draft is None:
            from polyspec.spec.plain_worker import PlainWorker

            self.worker = PlainWorker(self.backend, self.target, self.dtype, **kw)
        else:
            from polyspec.spec.eagle_worker import EagleWorker

            runnable = [(c.num_steps, c.topk, c.num_draft_tokens) for c in timed_trees]
            self.worker = EagleWorker(
                self.backend, self.target, self.draft, spec, self.dtype, runnable=runnable, **kw
            )
            if timed_trees:
                self._choose_by_batch_size(timed_trees)
                spec = self.config.speculative
        if tp is not None and tp.is_leader:
            from polyspec.engine.ranks import LeaderWorker

            self.worker = LeaderWorker(self.worker, tp)
        eos = tuple(self.target.config.eos_token_ids)
        if not eos and self.tokenizer is not None:
            eos = tuple(self.tokenizer.eos_token_ids)
        self.eos_token_ids = eos
        grammars = None  # llguidance is imported by the first constrained request, not here
        if self.tokenizer is not None:
            grammars = GrammarCache(self.tokenizer, self.target.config.vocab_size, eos)
        self.scheduler = Scheduler(self.worker, cfg, StopChecker(self.tokenizer, eos), grammars)
        self._engine: EngineLoop | None = None
        self._engine_lock = threading.RLock()

    def _check_topk(self) -> None:
        """A draft tree cannot keep more children per level than the draft has tokens."""
        vocab = getattr(self.draft, "draft_vocab_size", None) or self.target.config.vocab_size
        spec = self.config.speculative
        widest = max(k for _, _, k, _ in spec.trees)
        if widest > vocab:
            raise ConfigError(
                f"speculative.topk = {widest} is more than the draft can propose: its "
                f"vocabulary has {vocab} tokens; lower topk (or batch_trees' K) to at most "
                f"{vocab}"
            )

    def _choose_tree(self) -> list:
        """Settle ``speculative.tree_candidates`` for this machine
        (:mod:`polyspec.engine.tree_choice`). Where rounds run eagerly: times the candidates'
        forwards on a small worker of its own, then keeps the tree predicted fastest in
        ``self.config``. Where they replay captured graphs (and the backend's graph budget
        is unbounded): -> the candidates whose rounds the worker times once it is built
        (:meth:`_choose_by_batch_size`). Else the tree stays as given (the head's
        recommendation). -> [] when nothing is left to time."""
        from polyspec.engine import tree_choice
        from polyspec.spec.base import uses_graphs
        from polyspec.spec.eagle_worker import EagleWorker

        cfg = self.config
        spec = cfg.speculative
        caps = self.backend.capabilities
        # A backend without tree attention verifies chains only (EagleWorker refuses topk > 1).
        cands = [c for c in spec.tree_candidates if caps.tree_attention or c.topk == 1]
        if uses_graphs(caps, cfg.graphs) and caps.max_graph_shapes is None and cands:
            # The head's recommended trees (measured on a GPU for their batch sizes) and the
            # candidates that accept clearly more than they do, against plain rounds: timing
            # every candidate at every batch size would not fit the start-up budget (each new
            # tree's round is captured before it is timed).
            trees = tree_choice.recommended(cands, spec.trees)
            return trees + tree_choice.deeper(cands, trees) if trees else cands
        if uses_graphs(caps, cfg.graphs):
            chosen = tree_choice.TreeCandidate(
                spec.num_steps, spec.topk, spec.num_draft_tokens, 1.0
            ).label
            for t in spec.batch_trees:
                chosen += f"; from batch {t.min_batch_size}: {t.label}"
            self.tree_choice = {
                "chosen": chosen,
                "reason": "rounds replay captured graphs, and the backend holds a limited "
                "number of them: the head's recommended tree(s)",
            }
            return []
        if not cands:
            return []
        widest = max(cands, key=lambda c: (c.topk, c.num_steps))
        spec = dataclasses.replace(
            spec, num_steps=widest.num_steps, topk=widest.topk,
            num_draft_tokens=widest.num_draft_tokens, batch_trees=(),
        )  # fmt: skip
        ps = cfg.page_size
        target_w, draft_w = tree_choice.widths(cands)
        context = tree_choice.PREFIX_LEN + max(target_w + draft_w) + 2 * ps
        lanes = spec.topk * draft_lane_width(spec.num_steps, ps)
        slots = (2 * context + spec.num_draft_tokens + lanes + 4 * ps + ps - 1) // ps * ps
        probe = EagleWorker(
            self.backend, self.target, self.draft, spec, self.dtype, max_batch_size=1,
            max_context=context, num_kv_slots=slots, page_size=ps, graphs="off",
            runnable=[(c.num_steps, c.topk, c.num_draft_tokens) for c in cands],
        )  # fmt: skip
        costs = tree_choice.measure_costs(probe, cands)
        # The prediction ranks the trees; whole rounds of the best few decide among them.
        best = tree_choice.finalists(cands, costs)
        seconds, _ = tree_choice.time_rounds(probe, best, [1])
        del probe
        round_s = seconds.get(1, {})
        chosen = tree_choice.choose_timed(best, round_s) or tree_choice.choose_tree(cands, costs)
        self.tree_choice = tree_choice.report(cands, costs, chosen, round_s)
        # One tree for every batch size: the head's batch trees were chosen for graphed
        # rounds, and only batch 1 was timed here.
        spec = dataclasses.replace(
            spec, num_steps=chosen.num_steps, topk=chosen.topk,
            num_draft_tokens=chosen.num_draft_tokens, batch_trees=(),
        )  # fmt: skip
        self.config = dataclasses.replace(cfg, speculative=spec)
        return []

    def _choose_by_batch_size(self, cands: list) -> None:
        """Time ``cands``' rounds and plain rounds on the worker at batch sizes 1, 4, 16, ...
        up to ``max_batch_size`` (:func:`polyspec.engine.tree_choice.time_rounds`), then run
        the option of the most predicted tokens/s at each batch size: the worker's trees and
        ``speculative``'s tree and ``batch_trees`` become that schedule."""
        from polyspec.config import BatchTree
        from polyspec.engine import tree_choice

        cfg = self.config
        sizes, b = [], 1
        while b < cfg.max_batch_size:
            sizes.append(b)
            b *= 4
        sizes.append(cfg.max_batch_size)
        spec = cfg.speculative
        start = time.perf_counter()
        overlap = uses_overlap(self.worker.backend.capabilities, cfg.overlap_rounds)
        # The head's recommended trees and plain rounds at every batch size first; then, in a
        # budget of their own, the deeper candidates at the sizes where they still may win.
        first = tree_choice.recommended(cands, spec.trees) or list(cands)
        later = [c for c in cands if c not in first]
        seconds, stopped = tree_choice.time_rounds(self.worker, first, sizes, overlap=overlap)
        note = stopped
        if later and seconds:
            deeper, why = tree_choice.time_rounds(
                self.worker, later, sorted(seconds), tree_choice.DEEPER_BUDGET_S,
                overlap=overlap, known=seconds, rivals=first,
            )  # fmt: skip
            seconds = {bs: {**times, **deeper.get(bs, {})} for bs, times in seconds.items()}
            if why is not None and note is None:
                note = f"the deeper trees' timing: {why}"
        elapsed = time.perf_counter() - start
        if not seconds:  # not even batch 1 was timed: the head's tree(s) as given
            self.worker.use_trees(spec.trees)
            main = tree_choice.TreeCandidate(spec.num_steps, spec.topk, spec.num_draft_tokens, 1)
            self.tree_choice = {
                "chosen": main.label,
                "reason": f"no round could be timed ({stopped}): the head's recommended tree",
            }
            return
        schedule = tree_choice.batch_schedule(cands, seconds, cfg.max_batch_size)
        if stopped is not None and schedule[-1][1] is not None:
            # Batch sizes past the largest one timed keep the head's trees for them.
            top = max(seconds)
            for t in spec.batch_trees:
                if t.min_batch_size > top and t.num_steps > 0:
                    c = tree_choice.TreeCandidate(t.num_steps, t.topk, t.num_draft_tokens, 1.0)
                    schedule.append((t.min_batch_size, c))
        main = schedule[0][1]
        rest = tuple(
            BatchTree(bs, 0)
            if c is None
            else BatchTree(bs, c.num_steps, c.topk, c.num_draft_tokens)
            for bs, c in schedule[1:]
        )
        spec = dataclasses.replace(
            spec, num_steps=main.num_steps, topk=main.topk,
            num_draft_tokens=main.num_draft_tokens, batch_trees=rest,
        )  # fmt: skip
        self.worker.use_trees(spec.trees)
        self.config = dataclasses.replace(cfg, speculative=spec)
        self.tree_choice = tree_choice.batch_report(cands, seconds, schedule, elapsed, note)

    def _default_num_slots(self, timed_trees: Sequence = ()) -> int:
        """KV slots for ``max_batch_size`` requests of the configured trees (and of
        ``timed_trees``, which the engine times at start-up)."""
        cfg = self.config
        spec = cfg.speculative
        trees = spec.trees if spec else ()
        trees += tuple((1, c.num_steps, c.topk, c.num_draft_tokens) for c in timed_trees)
        per_req = min(cfg.max_context, 2048) + max((n for *_, n in trees), default=1)
        lanes = max((k * draft_lane_width(s, cfg.page_size) for _, s, k, _ in trees), default=0)
        return cfg.max_batch_size * (per_req + lanes + 2 * cfg.page_size) + cfg.page_size

    # -- generation ---------------------------------------------------------------------------
    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (raw text, no chat template; see :meth:`chat`) or each list
        of prompt token ids. Returns one output per request, in input order.

        Every request is checked before any runs: a bad one raises :class:`RequestError`
        naming its index (``exc.index``) and what was wrong, and nothing is run. A request
        that fails while running (a device error) gets ``finish_reason == "error"`` with the
        cause in ``error``; the others finish. Several threads may call this (and
        :meth:`chat`) on one LLM at once: the requests of all calls share the engine loop's
        batches (:attr:`engine`), each call waits for its own."""
        if (prompts is None) == (prompt_token_ids is None):
            raise ConfigError("pass exactly one of prompts or prompt_token_ids")
        if isinstance(prompts, str):
            prompts = [prompts]
        if prompts is not None:
            self._need_tokenizer("text prompts (pass prompt_token_ids=)")
            texts: list[str | None] = list(prompts)
            for i, p in enumerate(texts):
                if not isinstance(p, str):
                    raise RequestError(
                        "prompts", p, f"prompts[{i}] is a {type(p).__name__}, not a string", i
                    )
            ids = [self.tokenizer.encode(p) for p in texts]
        else:
            if isinstance(prompt_token_ids, (str, bytes)) or not hasattr(
                prompt_token_ids, "__len__"
            ):
                raise ConfigError(
                    "prompt_token_ids must be a list of prompts, each a list of token ids"
                )
            ids = list(prompt_token_ids)
            texts = [None] * len(ids)
        params = SamplingParams() if sampling_params is None else sampling_params
        if isinstance(params, SamplingParams):
            params = [params] * len(ids)
        if not isinstance(params, Sequence) or isinstance(params, str):
            raise ConfigError(
                f"sampling_params must be a SamplingParams or a list of them, got "
                f"{type(params).__name__}"
            )
        if len(params) != len(ids):
            raise ConfigError(
                f"{len(params)} sampling_params for {len(ids)} prompts: give one, or one per prompt"
            )
        if any(isinstance(p, SamplingParams) and p.stop for p in params):
            self._need_tokenizer("stop strings")
        engine = self.engine
        for i, (p_ids, p) in enumerate(zip(ids, params)):  # all checked before any runs
            try:
                ids[i] = engine.check(p_ids, p)
            except RequestError as exc:
                raise RequestError(exc.field, exc.value, str(exc), index=i) from None
        handles = []
        try:
            for t, p_ids, p in zip(texts, ids, params):
                handles.append(engine.submit(p_ids, p, prompt=t, stream=False, start=False))
        except BaseException:
            for h in handles:
                h.abort()
            raise
        return self._wait(handles, progress)

    def chat(
        self,
        messages: str | Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> list[RequestOutput]:
        """Like :meth:`generate`, with the model's chat template applied. ``messages`` is one
        user prompt, a list of user prompts, one conversation (a list of
        ``{"role", "content"}``) or a list of conversations."""
        self._need_tokenizer("chat")
        if isinstance(messages, str):
            convs = [[{"role": "user", "content": messages}]]
        elif messages and isinstance(messages[0], dict):
            convs = [list(messages)]
        else:
            convs = [
                [{"role": "user", "content": c}] if isinstance(c, str) else list(c)
                for c in messages
            ]
        ids = [self.tokenizer.apply_chat_template(c, tokenize=True) for c in convs]
        outs = self.generate(
            prompt_token_ids=ids, sampling_params=sampling_params, progress=progress
        )
        for o, c in zip(outs, convs):
            o.prompt = c[-1]["content"]
        return outs

    def _need_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            raise ConfigError(
                f"{what} need(s) a tokenizer; this engine was built by LLM.from_modules without "
                "one (pass tokenizer=)"
            )

    def _wait(self, handles: list[RequestHandle], progress) -> list[RequestOutput]:
        """Wait for this call's own requests; abort them if the wait is cut short (Ctrl-C)."""
        done: queue.SimpleQueue[RequestHandle] = queue.SimpleQueue()
        counted = 0

        def count(block: bool) -> bool:  # take finished handles; True once all are
            nonlocal counted
            while counted < len(handles):
                try:
                    done.get(block=block)
                except queue.Empty:
                    break
                counted += 1
                if progress is not None:
                    progress(counted, len(handles))
            return counted == len(handles)

        try:
            for h in handles:
                h.add_done_callback(done.put)
            # This thread runs the steps itself unless another one drives the loop already.
            self.engine.drive(lambda: count(block=False))
            count(block=True)
        except BaseException:
            for h in handles:
                h.abort()
            raise
        return [h.result() for h in handles]

    def warm_up(self, progress: Callable[[int, int], None] | None = None) -> dict[str, float]:
        """Capture, before the first request, every graph a batch of up to ``max_batch_size``
        requests with up to ``max_context`` tokens can replay; -> ``{"graphs": new graphs,
        "seconds": time taken}``. Without it each graph is captured on first use, inside
        some request's time: a server whose batch changes as requests come and go meets new
        (batch, context) buckets for minutes (``polyspec serve`` calls this before it reports
        ready). A no-op where the engine does not capture (``graphs`` off). ``progress(done,
        total)``: called after each graph.

        A few short greedy and sampled requests run first, at batch 1 and at the first batch
        size of each draft tree (and, where structured output can run, constrained ones too),
        so that every round and prefill computation is known; then each is captured for
        every bucket it can serve (a tree's rounds for the batch sizes that use that tree), on
        one rank: tensor-parallel ranks capture together, on first use. The engine loop the
        requests ran on is shut down after, so a loop made next (a server's) counts from
        zero."""
        graphs = self.worker.graphs
        if graphs is None:
            return {"graphs": 0, "seconds": 0.0}
        t0 = time.perf_counter()
        cfg = self.config
        served = self._served_trees()
        vocab = int(self.target.config.vocab_size)
        prompt = [1 + i % (vocab - 1) for i in range(8)]
        greedy = SamplingParams(max_new_tokens=16, ignore_eos=True)
        sampled = SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=1.0, seed=0)
        before = graphs.num_captured
        for sizes in served.values():
            for params in (greedy, sampled):
                self.generate(prompt_token_ids=[prompt] * sizes[0], sampling_params=params)
        # A batch with a constrained request may run plain rounds at any size in a speculative
        # engine (EngineConfig.constrained_speculation): they run here at batch 1 too, and
        # their graphs are captured for every bucket.
        choice = self.scheduler.constrained
        plain_any_size = self._plain_rounds_at_any_size(served)
        if self.scheduler.grammars is not None and importlib.util.find_spec("llguidance"):
            # a constrained batch's rounds: a plain round's graph, a speculative round's phases
            # (the rounds of the kind the choice forces; these rounds do not count as its
            # measurements)
            choice.forced = choice.mode == "off"
            try:
                for sizes in served.values():
                    for params in (greedy, sampled):
                        constrained = dataclasses.replace(params, regex="[a-z]{1,24}")
                        prompts = [prompt] * sizes[0]
                        self.generate(prompt_token_ids=prompts, sampling_params=constrained)
                choice.forced = True
                for params in (greedy, sampled) if plain_any_size else ():
                    constrained = dataclasses.replace(params, regex="[a-z]{1,24}")
                    self.generate(prompt_token_ids=[prompt], sampling_params=constrained)
            finally:
                choice.forced = None
        if self.tp is None:
            self.restrict_graphs()
            graphs.capture_all(cfg.max_batch_size, cfg.max_context, progress)
        self.shutdown()
        return {"graphs": graphs.num_captured - before, "seconds": time.perf_counter() - t0}

    def _served_trees(self) -> dict[Any, list[int]]:
        """Each draft tree the rounds use (plain rounds' too) -> the batch sizes that use it."""
        served: dict[Any, list[int]] = {}
        for bs in range(1, self.config.max_batch_size + 1):
            served.setdefault(self.worker.tree_for(bs), []).append(bs)
        return served

    def _plain_rounds_at_any_size(self, served: Mapping[Any, list[int]]) -> bool:
        """Whether a constrained batch may run plain rounds at a size whose tree speculates
        (``constrained_speculation`` not ``on``, in a speculative engine; ``served``:
        :meth:`_served_trees`)."""
        return self.scheduler.constrained.mode != "on" and any(t.num_steps for t in served)

    def restrict_graphs(self) -> None:
        """Have the graph capture (:meth:`CapturedForwards.capture_all`) record each draft
        tree's rounds for the batch buckets whose sizes run that tree only, and a constrained
        batch's plain rounds for every size where they may run: a wide tree's verify at a
        batch size that never runs it would hold gigabytes of device memory."""
        graphs, worker = self.worker.graphs, self.worker
        if graphs is None:
            return
        top = graphs.buckets.batch_sizes[-1]
        served = self._served_trees()
        plain_any_size = self._plain_rounds_at_any_size(served)
        for tree, sizes in served.items():
            lo = graphs.buckets.batch_bucket(sizes[0]) or top
            hi = graphs.buckets.batch_bucket(sizes[-1]) or top
            for g in (True, False):
                constrained = worker.round_fn(tree, g, True)
                names = [worker.round_fn(tree, g).__name__, constrained.__name__]
                names += [phase.__name__ for phase in constrained.phases()]
                for name in names:
                    graphs.restrict(name, lo, hi)
                if plain_any_size and tree == worker.plain_tree:
                    for name in (constrained.__name__, *names[2:]):  # and its phases
                        graphs.restrict(name, 1, hi)

    @property
    def engine(self) -> EngineLoop:
        """The engine loop every call of this LLM goes through: the one built for it
        (``EngineLoop(llm, max_queued_requests=...)``), else a default one, made on first use;
        a new one once the last was shut down."""
        if not self.is_leader:
            raise ConfigError(
                f"this process is rank {self.tp.rank} of a tensor-parallel engine: only rank 0 "
                "takes requests; call llm.follow() here"
            )
        with self._engine_lock:
            if self._engine is None or self._engine._stopping:
                from polyspec.engine.loop import EngineLoop

                EngineLoop(self)  # registers itself as self._engine
            return self._engine

    def shutdown(self, grace_s: float = 0.0) -> None:
        """Stop the engine loop (:meth:`EngineLoop.shutdown`); the next call starts a new one."""
        with self._engine_lock:
            engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown(grace_s)

    @property
    def kv_slots_free(self) -> int:
        """Free KV slots right now (all of them, minus slot 0, when idle)."""
        return self.worker.allocator.available
