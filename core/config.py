"""Configuration: frozen dataclasses, validated on construction, loaded from four layers.

Precedence, highest first: command-line flags > environment variables > config file > defaults.
One exception, from the backend selection rules (:mod:`polyspec.plugins`): ``backend`` set in
the config file beats ``POLYSPEC_BACKEND``, which only fills in when the file does not name one.

Config file (TOML): ``--config FILE``, else ``$POLYSPEC_CONFIG``, else ``polyspec.toml`` in the
working directory when it exists::

    target = "HuggingFaceTB/SmolLM2-135M-Instruct"
    backend = "cpu"
    max_batch_size = 8

    [speculative]
    algorithm = "eagle"
    num_steps = 3
    topk = 1

    [sampling]
    temperature = 0.0
    max_new_tokens = 128

Environment: ``POLYSPEC_<KEY>`` for engine keys (``POLYSPEC_MAX_BATCH_SIZE=4``),
``POLYSPEC_SPECULATIVE_<KEY>`` and ``POLYSPEC_SAMPLING_<KEY>`` for the two tables. See
docs/configuration.md for every key.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from polyspec.errors import ConfigError

ALGORITHMS = ("eagle", "eagle3", "standalone")
"""Speculative algorithms: EAGLE-1/2 head, EAGLE-3 head, a small standalone LM as the draft."""

DRAFT_QUANTIZATIONS = ("auto", "none", "int8")
"""``speculative.draft_quantization`` values (see :class:`SpeculativeConfig`)."""

DTYPES = ("auto", "float32", "bfloat16", "float16")
"""Model dtypes; "auto" lets the backend choose (the checkpoint's dtype where supported)."""

GRAPH_MODES = ("auto", "on", "off")
"""When decode rounds run as captured graphs (see :class:`EngineConfig`)."""

OVERLAP_MODES = ("auto", "on", "off")
"""When greedy decode rounds are queued behind the last one (:class:`EngineConfig`,
``overlap_rounds``)."""

CONSTRAINED_SPECULATION_MODES = ("auto", "on", "off")
"""Which rounds a batch with a constrained request runs (:class:`EngineConfig`,
``constrained_speculation``)."""

CONSTRAINED_DRAFT_MODES = ("auto", "levels", "root")
"""Which of a constrained speculative round's draft levels the grammar masks
(:class:`EngineConfig`, ``constrained_draft``)."""

ENV_VARIABLES = (
    "POLYSPEC_CONFIG", "POLYSPEC_PLUGINS", "POLYSPEC_DISABLE_PLUGIN_AUTOLOAD",
    "POLYSPEC_STRICT_PLUGINS", "POLYSPEC_CPU_KERNELS", "POLYSPEC_ROWINV_ISA",
    "POLYSPEC_CUDA_KERNELS", "POLYSPEC_CUDA_TRITON_ATTENTION", "POLYSPEC_DATA_DIR",
    "POLYSPEC_WEIGHT_PREFETCH", "POLYSPEC_TRITON_DEVICE", "POLYSPEC_TRITON_RECORD",
)  # fmt: skip
"""``POLYSPEC_*`` variables other components read (docs/configuration.md); with the
configuration keys' own, what a misspelled variable is compared with."""


class ConfigWarning(UserWarning):
    """A configuration that runs but is probably not what was meant (a misspelled variable)."""


# Upper bounds of the sizes an engine allocates from (what memory allows is checked when the
# engine starts, polyspec.engine.limits): beyond these a value is a typo, not a machine.
MAX_PAGE_SIZE = 1024
MAX_BATCH_SIZE = 4096
MAX_CONTEXT = 1 << 21
MAX_KV_SLOTS = 2**31 - 1  # slot indices are int32 on some backends
MAX_SEED = 2**63 - 1
"""Seeds are 64-bit signed on every device generator."""
MAX_TENSOR_PARALLEL = 1024
MAX_NUM_STEPS = 8
MAX_TOPK = 8
DEFAULT_CONFIG_FILE = "polyspec.toml"


def _invalid(key: str, value: Any, allowed: str) -> ConfigError:
    """A ConfigError naming the key, the value and what is allowed; ``err.key`` is the key."""
    err = ConfigError(f"{key} = {value!r} is invalid: {allowed}")
    err.key = key  # type: ignore[attr-defined]
    return err


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(key: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
    if lo is not None and hi is not None:
        allowed = f"must be an integer from {lo} to {hi}"
    elif lo is not None:
        allowed = f"must be an integer >= {lo}"
    else:
        allowed = "must be an integer"
    if not _is_int(value):
        raise _invalid(key, value, allowed)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise _invalid(key, value, allowed)
    return value


def _check_opt_str(key: str, value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value.strip():
        raise _invalid(key, value, "must be a non-empty string (a path or model name) or unset")
    return value


def _check_choice(key: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise _invalid(key, value, f"must be one of {', '.join(repr(c) for c in choices)}")
    return value


@dataclasses.dataclass(frozen=True)
class TreeCandidate:
    """A draft tree a head was measured with: ``acceptance`` is its mean tokens per round
    (accepted drafts + the bonus token) on a reference workload (docs/benchmarks.md)."""

    num_steps: int
    topk: int
    num_draft_tokens: int
    acceptance: float

    def __post_init__(self) -> None:
        SpeculativeConfig(  # the same checks as a tree given directly
            algorithm="eagle3",
            num_steps=self.num_steps,
            topk=self.topk,
            num_draft_tokens=self.num_draft_tokens,
        )
        a = self.acceptance
        if (
            isinstance(a, bool)
            or not isinstance(a, (int, float))
            or not 1 <= a <= self.num_steps + 1
        ):
            raise _invalid(
                "speculative.tree_candidates",
                a,
                f"a candidate's acceptance must be a number in [1, num_steps + 1 = "
                f"{self.num_steps + 1}]",
            )
        object.__setattr__(self, "acceptance", float(a))

    @property
    def label(self) -> str:
        return f"S={self.num_steps} K={self.topk} N={self.num_draft_tokens}"


@dataclasses.dataclass(frozen=True)
class BatchTree:
    """The draft tree of rounds with at least ``min_batch_size`` requests
    (``SpeculativeConfig.batch_trees``). ``num_draft_tokens`` None: the default for the tree,
    as in :class:`SpeculativeConfig`. ``num_steps`` 0: plain rounds (the target's next token
    only; the draft catches up when a smaller batch speculates again), with ``topk`` 1 and
    ``num_draft_tokens`` 1 or unset."""

    min_batch_size: int
    num_steps: int
    topk: int = 1
    num_draft_tokens: int | None = None

    def __post_init__(self) -> None:
        _check_int("speculative.batch_trees min_batch_size", self.min_batch_size, 2)
        if _is_int(self.num_steps) and self.num_steps == 0:
            # a plain round verifies its root alone: one token, no top-K
            for key, value in (("topk", self.topk), ("num_draft_tokens", self.num_draft_tokens)):
                if value not in (1, None) or isinstance(value, bool):
                    raise _invalid(
                        f"speculative.batch_trees {key}",
                        value,
                        "a plain entry (num_steps = 0) has 1 or leaves it unset",
                    )
            object.__setattr__(self, "topk", 1)
            object.__setattr__(self, "num_draft_tokens", 1)
            return
        tree = SpeculativeConfig(  # the same checks as the main tree
            algorithm="eagle3",
            num_steps=self.num_steps,
            topk=self.topk,
            num_draft_tokens=self.num_draft_tokens,
        )
        object.__setattr__(self, "num_draft_tokens", tree.num_draft_tokens)

    @property
    def plain(self) -> bool:
        """True for plain rounds (``num_steps`` 0)."""
        return self.num_steps == 0

    @property
    def label(self) -> str:
        if self.plain:
            return "plain"
        return f"S={self.num_steps} K={self.topk} N={self.num_draft_tokens}"

    @property
    def text(self) -> str:
        """The form ``--batch-trees`` takes: ``MIN:S-K-N``, or ``MIN:plain``."""
        if self.plain:
            return f"{self.min_batch_size}:plain"
        return f"{self.min_batch_size}:{self.num_steps}-{self.topk}-{self.num_draft_tokens}"


def parse_batch_trees(text: str) -> tuple[BatchTree, ...]:
    """``"8:3-3-8,24:3-2-6,64:plain"`` (``MIN_BATCH:S-K-N`` or ``MIN_BATCH:plain``,
    comma-separated; "none" or "" for none) -> batch trees.
    :raises ValueError: text not of that form."""
    text = text.strip()
    if text.lower() in ("", "none", "off"):
        return ()
    trees = []
    for part in text.split(","):
        head, sep, tree = part.strip().partition(":")
        if sep and tree.strip().lower() == "plain":
            trees.append(BatchTree(int(head), 0))
            continue
        fields = tree.split("-")
        if not sep or len(fields) != 3:
            raise ValueError(f"{part.strip()!r} is not MIN_BATCH:S-K-N or MIN_BATCH:plain")
        bs, s, k, n = int(head), *map(int, fields)
        trees.append(BatchTree(bs, s, k, n))
    return tuple(trees)


def _as_batch_trees(value: Any) -> tuple[BatchTree, ...]:
    """A list of :class:`BatchTree` (or of their fields as mappings), or the text form."""
    key = "speculative.batch_trees"
    allowed = (
        "must be MIN_BATCH:S-K-N or MIN_BATCH:plain entries (e.g. '8:3-3-8,64:plain') or a "
        "list of {min_batch_size, num_steps, topk, num_draft_tokens} (num_steps 0: plain)"
    )
    if isinstance(value, str):
        try:
            value = parse_batch_trees(value)
        except ValueError as exc:
            raise _invalid(key, value, f"{allowed} ({exc})") from None
    if not isinstance(value, (list, tuple)):
        raise _invalid(key, value, allowed)
    trees = []
    for t in value:
        if isinstance(t, Mapping):
            extra = set(t) - {f.name for f in dataclasses.fields(BatchTree)}
            if extra:
                raise _invalid(key, dict(t), f"{allowed}; unknown keys {sorted(extra)}")
            try:
                t = BatchTree(**t)
            except TypeError:
                raise _invalid(key, dict(t), allowed) from None
        if not isinstance(t, BatchTree):
            raise _invalid(key, t, allowed)
        trees.append(t)
    sizes = [t.min_batch_size for t in trees]
    if sizes != sorted(set(sizes)):
        raise _invalid(
            key, ",".join(t.text for t in trees), "min_batch_size must strictly increase"
        )
    return tuple(trees)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """The draft tree: ``num_steps`` (S) draft levels, ``topk`` (K) children kept per level, and
    ``num_draft_tokens`` (N) tree nodes verified per request, root (bonus token) included.

    ``num_draft_tokens`` None means: ``S + 1`` for a chain (K == 1), else
    ``min(K + (S - 1) * K**2 + 1, 8)``. It is an int after construction.

    ``draft_quantization``: how an EAGLE head's weights are stored for drafting. "int8":
    weight-only int8 (one scale per output row), an error where the backend cannot; "none":
    the model's dtype; "auto" (default): the scheme the backend names for this machine and the
    head's dtype (:meth:`Backend.auto_weight_quantization`; by default the first one listed in
    ``capabilities.weight_quantization``) where it can apply it, else none. It
    changes what the draft proposes (acceptance), never the output.

    ``dynamic_depth``: leave a round's deeper draft levels out of its tree where the draft is
    unsure (dynamic depth, as in DDD, Brown et al. 2024): once the most probable path of the
    current depth has a draft probability below this threshold, the deeper levels' candidates
    get probability 0 (each lane's own token), so the tree takes them only to fill its N nodes;
    verification stays lossless whatever it is given. The levels are masked on the device, in
    eager and captured rounds alike, so a round still runs its S - 1 draft forwards: the
    threshold changes which candidates the tree holds, not what a round costs. 0 turns it off;
    None (default) means the head's ``polyspec.json`` value (with the head's own tree), else 0.

    ``tree_candidates``: trees to choose from when the engine starts (:mod:`polyspec.engine.
    tree_choice`): where rounds run eagerly, the engine times the target and draft forwards
    at each candidate's widths on this machine and keeps the tree with the most tokens per
    second predicted from its acceptance; ``num_steps`` / ``topk`` / ``num_draft_tokens`` then
    become that tree's. Where rounds replay captured graphs, it times whole rounds of each
    candidate and plain rounds at a few batch sizes and keeps the best per batch size, as the
    main tree and ``batch_trees``. Filled from the head's ``polyspec.json`` when no tree setting is given
    and ``auto_tree`` is true (default); empty: the tree is used as given.

    ``batch_trees``: other trees for larger batches. A round of ``bs`` requests uses the last
    entry with ``min_batch_size <= bs``, and the tree above (``num_steps`` / ``topk`` /
    ``num_draft_tokens``) below the first one. On an accelerator a wider tree costs little at
    batch 1 and more as the batch fills it, so the best tree shrinks as the batch grows
    (docs/benchmarks.md); where it does not pay at all, an entry with ``num_steps`` 0
    (``MIN:plain``) runs plain rounds, the draft caught up when speculation resumes. Filled
    from the head's ``polyspec.json`` with its own tree; where the engine times
    ``tree_candidates`` its choice replaces them.
    The output does not depend on the tree.
    """

    algorithm: str
    num_steps: int = 3
    topk: int = 1
    num_draft_tokens: int | None = None
    draft_quantization: str = "auto"
    dynamic_depth: float | None = None
    auto_tree: bool = True
    tree_candidates: tuple[TreeCandidate, ...] = ()
    batch_trees: tuple[BatchTree, ...] = ()

    def __post_init__(self) -> None:
        _check_choice("speculative.algorithm", self.algorithm, ALGORITHMS)
        object.__setattr__(self, "batch_trees", _as_batch_trees(self.batch_trees))
        if not isinstance(self.auto_tree, bool):
            raise _invalid("speculative.auto_tree", self.auto_tree, "must be true or false")
        cands = self.tree_candidates
        if not isinstance(cands, (list, tuple)):
            raise _invalid(
                "speculative.tree_candidates", cands, "must be a list of candidate trees"
            )
        object.__setattr__(
            self,
            "tree_candidates",
            tuple(c if isinstance(c, TreeCandidate) else TreeCandidate(**c) for c in cands),
        )
        _check_choice(
            "speculative.draft_quantization", self.draft_quantization, DRAFT_QUANTIZATIONS
        )
        s = _check_int("speculative.num_steps", self.num_steps, 1, MAX_NUM_STEPS)
        if self.dynamic_depth is not None:
            t = self.dynamic_depth
            if _is_int(t):
                t = float(t)
            if not isinstance(t, float) or not 0.0 <= t < 1.0:
                raise _invalid(
                    "speculative.dynamic_depth",
                    self.dynamic_depth,
                    "must be a probability threshold in [0, 1) (0 = always draft num_steps "
                    "levels), or unset for the head's own value",
                )
            object.__setattr__(self, "dynamic_depth", t)
        k = _check_int("speculative.topk", self.topk, 1, MAX_TOPK)
        max_nodes = k + (s - 1) * k * k + 1  # root + every candidate of the S levels
        n = self.num_draft_tokens
        if n is None:
            n = s + 1 if k == 1 else min(max_nodes, 8)
            object.__setattr__(self, "num_draft_tokens", n)
        if k == 1:
            if n != s + 1:
                raise _invalid(
                    "speculative.num_draft_tokens",
                    n,
                    f"with topk = 1 the tree is a chain, so it must equal num_steps + 1 = {s + 1} "
                    f"(or be left unset)",
                )
        else:
            _check_int("speculative.num_draft_tokens", n, 2, max_nodes)

    @property
    def is_chain(self) -> bool:
        """True when topk == 1 (the draft tree is a single chain of num_steps tokens)."""
        return self.topk == 1

    @property
    def trees(self) -> tuple[tuple[int, int, int, int], ...]:
        """Every tree rounds may use, as (min_batch_size, S, K, N), the main tree first (1)."""
        main = (1, self.num_steps, self.topk, self.num_draft_tokens)
        rest = tuple(
            (t.min_batch_size, t.num_steps, t.topk, t.num_draft_tokens) for t in self.batch_trees
        )
        return (main, *rest)

    def tree_for(self, batch_size: int) -> tuple[int, int, int]:
        """(S, K, N) of a round of ``batch_size`` requests."""
        return next(t[1:] for t in reversed(self.trees) if t[0] <= batch_size)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature 0 is greedy; top_k 0 and top_p 1 disable filtering.

    Structured output (docs/structured-output.md): at most one of ``json_schema`` (a JSON
    Schema as a dict or its JSON text; kept as canonical JSON text), ``regex``, ``grammar``
    (a Lark grammar, llguidance's dialect) or ``choice`` (the output is exactly one of these
    strings). Only the form is checked here; the engine compiles the constraint when the
    request is submitted (an invalid one is a :class:`~polyspec.errors.RequestError` naming
    the field and the grammar engine's message).
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    json_schema: str | Mapping[str, Any] | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        _check_int("sampling.max_new_tokens", self.max_new_tokens, 1)
        _check_constraint(self)
        temperature = self.temperature
        if _is_int(temperature):
            temperature = float(temperature)
        if not isinstance(temperature, float) or not math.isfinite(temperature) or temperature < 0:
            raise _invalid(
                "sampling.temperature",
                self.temperature,
                "must be a finite number >= 0 (0 = greedy)",
            )
        object.__setattr__(self, "temperature", temperature)
        _check_int("sampling.top_k", self.top_k, 0)
        top_p = float(self.top_p) if _is_int(self.top_p) else self.top_p
        if not isinstance(top_p, float) or not (0.0 < top_p <= 1.0):
            raise _invalid("sampling.top_p", self.top_p, "must be a number in (0, 1] (1 = off)")
        object.__setattr__(self, "top_p", top_p)
        object.__setattr__(self, "stop", _as_stop_tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", _as_token_tuple(self.stop_token_ids))
        if not isinstance(self.ignore_eos, bool):
            raise _invalid("sampling.ignore_eos", self.ignore_eos, "must be true or false")
        if self.seed is not None:
            _check_int("sampling.seed", self.seed, 0, MAX_SEED)

    @property
    def greedy(self) -> bool:
        """True when decoding takes the argmax (temperature 0)."""
        return self.temperature == 0.0

    @property
    def constrained(self) -> bool:
        """True when the output must follow a schema, regex, grammar or choice."""
        return any(getattr(self, f) is not None for f in CONSTRAINT_FIELDS)


CONSTRAINT_FIELDS = ("json_schema", "regex", "grammar", "choice")
"""The structured-output fields of :class:`SamplingParams` (at most one per request)."""


def _check_constraint(params: SamplingParams) -> None:
    """Normalise and check the form of a request's structured-output field (its content is
    the grammar engine's to check, at submit)."""
    given = [f for f in CONSTRAINT_FIELDS if getattr(params, f) is not None]
    if len(given) > 1:
        raise _invalid(
            f"sampling.{given[1]}",
            getattr(params, given[1]),
            f"only one of {', '.join(CONSTRAINT_FIELDS)} may be set (got {' and '.join(given)})",
        )
    schema = params.json_schema
    if isinstance(schema, Mapping):
        try:
            text = json.dumps(schema, sort_keys=True, separators=(",", ":"))
        except (TypeError, ValueError) as exc:
            raise _invalid("sampling.json_schema", schema, f"must be JSON: {exc}") from None
        object.__setattr__(params, "json_schema", text)
    elif schema is not None and (not isinstance(schema, str) or not schema.strip()):
        raise _invalid("sampling.json_schema", schema, "must be a JSON Schema (dict or JSON text)")
    for key in ("regex", "grammar"):
        value = getattr(params, key)
        if value is not None and (not isinstance(value, str) or not value):
            raise _invalid(f"sampling.{key}", value, "must be a non-empty string")
    choice = params.choice
    if choice is not None:
        items = list(choice) if isinstance(choice, (list, tuple)) else None
        if not items or not all(isinstance(c, str) and c for c in items):
            raise _invalid("sampling.choice", choice, "must be a list of non-empty strings")
        object.__setattr__(params, "choice", tuple(items))


def _as_stop_tuple(value: Any) -> tuple[str, ...]:
    items = (value,) if isinstance(value, str) else value
    allowed = "must be a string or a list of non-empty strings"
    if not isinstance(items, (list, tuple)):
        raise _invalid("sampling.stop", value, allowed)
    for item in items:
        if not isinstance(item, str) or not item:
            raise _invalid("sampling.stop", value, allowed)
    return tuple(items)


def _as_token_tuple(value: Any) -> tuple[int, ...]:
    items = (value,) if _is_int(value) else value
    allowed = "must be a list of token ids (integers >= 0)"
    if not isinstance(items, (list, tuple)):
        raise _invalid("sampling.stop_token_ids", value, allowed)
    for item in items:
        if not _is_int(item) or item < 0:
            raise _invalid("sampling.stop_token_ids", value, allowed)
    return tuple(items)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything that is fixed for the lifetime of an engine.

    ``target`` / ``draft``: checkpoint paths or names; ``speculative`` None means plain decoding;
    a mapping becomes a SpeculativeConfig, its unset tree keys taken from the head's
    ``polyspec.json`` (docs/configuration.md).
    With an EAGLE algorithm and no ``draft`` the engine uses the draft head bundled for the
    target, if there is one. ``max_tokens_per_step`` is the token budget of one engine step
    (prefill chunks and decode / verify tokens together; the prefill keeps at least a quarter
    of it, or ``prefill_chunk_size`` when smaller, however wide the decode round); ``num_kv_slots`` None sizes the KV pool
    from ``max_batch_size * max_context``. ``prefill_wait_steps`` > 0 lets a waiting request
    wait up to that many engine steps, while others decode, for more rows to free, so that
    requests joining a running batch are prefilled several in one forward rather than one at
    a time (speculative requests finish at different rounds); 0 admits at once. It pays where
    a prefill forward costs about the same for one prompt as for several (an accelerator at
    small batch) and costs the rows left idle meanwhile.

    ``max_graph_batch_size``: the largest batch whose rounds replay captured graphs; larger
    batches run eagerly. None (or ``"auto"``, the default) captures up to ``max_batch_size``,
    as far as the device's free memory allows (:mod:`polyspec.runtime.graphs`).

    ``overlap_rounds``: queue the next all-greedy decode round on the device, from this
    round's device outputs, before the host reads this round's tokens, so that the device
    does not wait while the host commits tokens, checks stops and schedules (as SGLang's
    overlap scheduler). It applies to captured rounds (plain steps, and the rounds of an
    EAGLE head). When requests leave the batch (a stop, the token limit) the queued round
    runs for the others; a greedy request that joins sits it out and is in the round queued
    behind it; any other change (a sampled or constrained request joins) drops it and the
    next round is computed as usual, so the output is the same either way. ``"auto"`` (the
    default) turns it on where the backend's host reads are asynchronous
    (``BackendCapabilities.async_host_reads``: cuda), since where they are not nothing overlaps
    and queuing only adds host work; ``"on"`` / ``"off"`` (or true / false) force it.

    ``constrained_speculation``: the rounds of a batch with a constrained request (structured
    output) in a speculative engine: ``"on"`` its batch size's tree, ``"off"`` plain rounds,
    ``"auto"`` (the default) the kind whose rounds gave more tokens a second, measured as the
    engine runs for each range of batch sizes (a constrained round's masks are host work, and
    whether speculation pays depends on the grammar and the host; docs/structured-output.md).
    The output is the same either way.

    ``constrained_draft``: where the grammar masks a constrained speculative round's draft:
    ``"levels"`` the root's top-K and every level's lanes (no tree node is spent on a token
    the grammar refuses, but the device waits for the host's lane masks between the draft's
    levels), ``"root"`` the root's top-K, and below it only where the grammar forces the
    next tokens (the draft runs whole, its masks known before the round; verification under
    the grammar keeps the output exact). ``"auto"`` (the default): ``"levels"`` where the backend runs
    synchronously (the host's waits cost no device time), ``"root"`` where it runs
    asynchronously (``BackendCapabilities.async_execution``). The output is the same either
    way (docs/structured-output.md).

    ``tensor_parallel_size``: the ranks one engine runs on (docs/distributed.md): the target's
    heads, MLP and vocabulary are split over them, the draft is replicated. Above 1, the
    process that builds the engine becomes rank 0 and starts the others itself, unless
    ``torchrun`` started it (then torchrun's ranks are used). ``distributed_timeout_s``: how
    long a collective may wait for a peer before the engine stops with an error naming it.
    """

    target: str | None = None
    draft: str | None = None
    speculative: SpeculativeConfig | Mapping[str, Any] | None = None
    backend: str | None = None
    dtype: str = "auto"
    page_size: int = 1
    max_batch_size: int = 8
    max_context: int = 4096
    num_kv_slots: int | None = None
    max_tokens_per_step: int = 2048
    prefill_chunk_size: int = 512
    seed: int = 0
    graphs: str = "auto"
    max_graph_batch_size: int | None = None
    prefill_wait_steps: int = 0
    overlap_rounds: str = "auto"
    constrained_speculation: str = "auto"
    constrained_draft: str = "auto"
    tensor_parallel_size: int = 1
    distributed_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "target", _check_opt_str("target", self.target))
        object.__setattr__(self, "draft", _check_opt_str("draft", self.draft))
        if isinstance(self.speculative, Mapping):  # keys left out: the head's, then defaults
            spec = dict(self.speculative)
            given = {k for k, v in spec.items() if v is not None}
            head = _fill_from_head(spec, {"draft": self.draft, "target": self.target})
            try:
                object.__setattr__(self, "speculative", SpeculativeConfig(**spec))
            except ConfigError as exc:  # a value from the head's polyspec.json: name the file
                field = getattr(exc, "key", "").removeprefix("speculative.").split(" ")[0]
                filled = {k for k, v in spec.items() if v is not None} - given
                if head is not None and (field in filled or "tree_candidates" in filled):
                    settings = Path(head) / "polyspec.json"
                    raise ConfigError(
                        f"{exc} (from the head's settings file {settings}; fix or delete it, or "
                        "give the tree with --num-steps/--topk/--num-draft-tokens)"
                    ) from None
                raise
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise _invalid("speculative", self.speculative, "must be a SpeculativeConfig or None")
        if self.backend is not None and (not isinstance(self.backend, str) or not self.backend):
            raise _invalid(
                "backend", self.backend, "must be a backend name (see `polyspec backends`)"
            )
        _check_choice("dtype", self.dtype, DTYPES)
        page = _check_int("page_size", self.page_size, 1, MAX_PAGE_SIZE)
        _check_int("max_batch_size", self.max_batch_size, 1, MAX_BATCH_SIZE)
        _check_int("max_context", self.max_context, 2, MAX_CONTEXT)
        if self.num_kv_slots is not None:
            _check_int("num_kv_slots", self.num_kv_slots, 2 * page, MAX_KV_SLOTS)
            if self.num_kv_slots % page:
                raise _invalid(
                    "num_kv_slots", self.num_kv_slots, f"must be a multiple of page_size = {page}"
                )
        budget = _check_int("max_tokens_per_step", self.max_tokens_per_step, 1)
        _check_int("prefill_chunk_size", self.prefill_chunk_size, 1, budget)
        _check_int("seed", self.seed, 0, MAX_SEED)
        _check_choice("graphs", self.graphs, GRAPH_MODES)
        _check_choice(
            "constrained_speculation", self.constrained_speculation, CONSTRAINED_SPECULATION_MODES
        )
        _check_choice("constrained_draft", self.constrained_draft, CONSTRAINED_DRAFT_MODES)
        if self.max_graph_batch_size == "auto":
            object.__setattr__(self, "max_graph_batch_size", None)
        if self.max_graph_batch_size is not None:
            _check_int("max_graph_batch_size", self.max_graph_batch_size, 1, MAX_BATCH_SIZE)
        _check_int("prefill_wait_steps", self.prefill_wait_steps, 0)
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1, MAX_TENSOR_PARALLEL)
        t = self.distributed_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise _invalid("distributed_timeout_s", t, "must be a positive number of seconds")
        if isinstance(self.overlap_rounds, bool):  # true / false read as on / off
            object.__setattr__(self, "overlap_rounds", "on" if self.overlap_rounds else "off")
        if self.overlap_rounds not in OVERLAP_MODES:
            raise _invalid(
                "overlap_rounds", self.overlap_rounds, "must be 'auto', 'on' or 'off' (or a bool)"
            )
        spec = self.speculative
        if self.draft is not None and spec is None:
            raise _invalid(
                "draft",
                self.draft,
                "a draft model needs a speculative algorithm: set [speculative] algorithm = "
                "'eagle', 'eagle3' or 'standalone' (or remove draft for plain decoding)",
            )
        if spec is not None and spec.algorithm == "standalone" and self.draft is None:
            raise _invalid(
                "draft", None, "algorithm 'standalone' needs a draft model: set draft = PATH"
            )


# -- loading ---------------------------------------------------------------------------------

# tree_candidates come from the head's polyspec.json (or Python), not from flags or files.
_SPEC_FIELDS = tuple(
    f.name for f in dataclasses.fields(SpeculativeConfig) if f.name != "tree_candidates"
)
_SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
_ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(EngineConfig) if f.name != "speculative")

_KINDS: dict[str, str] = {
    "algorithm": "str",
    "num_steps": "int",
    "topk": "int",
    "num_draft_tokens": "opt_int",
    "draft_quantization": "str",
    "dynamic_depth": "opt_float",
    "auto_tree": "bool",
    "batch_trees": "batch_trees",
    "max_new_tokens": "int",
    "temperature": "float",
    "top_k": "int",
    "top_p": "float",
    "stop": "str_list",
    "stop_token_ids": "int_list",
    "ignore_eos": "bool",
    "seed": "opt_int",
    "target": "opt_str",
    "draft": "opt_str",
    "backend": "opt_str",
    "dtype": "str",
    "page_size": "int",
    "max_batch_size": "int",
    "max_context": "int",
    "num_kv_slots": "opt_int",
    "max_tokens_per_step": "int",
    "prefill_chunk_size": "int",
    "graphs": "str",
    "max_graph_batch_size": "auto_int",
    "prefill_wait_steps": "int",
    "overlap_rounds": "auto_bool",
    "constrained_speculation": "str",
    "constrained_draft": "str",
    "tensor_parallel_size": "int",
    "distributed_timeout_s": "float",
}
"""How a string (environment variable, or a CLI value given as text) is parsed, per key."""

_NONE_WORDS = ("none", "null")
_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off")


def _parse_text(key: str, field: str, text: str) -> Any:
    """Turn the text of an env var / CLI value into the field's Python type."""
    kind = _KINDS[field]
    if kind == "batch_trees":  # its own errors say what was wrong in which entry
        return _as_batch_trees(text)
    low = text.strip().lower()
    try:
        if kind.startswith("opt_") and low in _NONE_WORDS:
            return None
        if kind == "auto_int":  # "auto" (or none): the default, else an integer
            return None if low == "auto" or low in _NONE_WORDS else int(text)
        if kind in ("int", "opt_int"):
            return int(text)
        if kind in ("float", "opt_float"):
            return float(text)
        if kind == "auto_bool":  # "auto", or a bool word read as on / off
            if low == "auto":
                return "auto"
            if low in _TRUE_WORDS or low in _FALSE_WORDS:
                return "on" if low in _TRUE_WORDS else "off"
            raise ValueError(text)
        if kind == "bool":
            if low in _TRUE_WORDS:
                return True
            if low in _FALSE_WORDS:
                return False
            raise ValueError(text)
        if kind == "str_list":
            return json.loads(text) if text.lstrip().startswith("[") else text
        if kind == "int_list":
            if text.lstrip().startswith("["):
                return json.loads(text)
            return [int(part) for part in text.replace(",", " ").split()]
    except ValueError as exc:
        expected = {
            "int": "an integer",
            "opt_int": "an integer or 'none'",
            "auto_int": "an integer or 'auto'",
            "float": "a number",
            "opt_float": "a number or 'none'",
            "bool": "one of 1/0, true/false, yes/no, on/off",
            "auto_bool": "auto, or one of 1/0, true/false, yes/no, on/off",
            "str_list": "a string or a JSON list of strings",
            "int_list": "comma-separated integers or a JSON list",
        }[kind]
        raise _invalid(key, text, f"expected {expected}") from exc
    return text


def _section_of_cli_key(key: str) -> tuple[str, str] | None:
    """(section, field) for a CLI key; None when unknown. Sections: engine, speculative, sampling."""
    for prefix, section, fields in (
        ("speculative_", "speculative", _SPEC_FIELDS),
        ("sampling_", "sampling", _SAMPLING_FIELDS),
    ):
        if key.startswith(prefix) and key[len(prefix) :] in fields:
            return section, key[len(prefix) :]
    if key in _ENGINE_FIELDS:
        return "engine", key  # "seed" is the engine seed; the per-request one is sampling_seed
    if key in _SPEC_FIELDS:
        return "speculative", key
    if key in _SAMPLING_FIELDS:
        return "sampling", key
    return None


def cli_keys() -> frozenset[str]:
    """Every key :func:`load_config` accepts in its ``cli`` mapping."""
    keys = set(_ENGINE_FIELDS) | set(_SPEC_FIELDS) | set(_SAMPLING_FIELDS)
    keys |= {f"speculative_{f}" for f in _SPEC_FIELDS} | {f"sampling_{f}" for f in _SAMPLING_FIELDS}
    return frozenset(keys)


@dataclasses.dataclass
class _Layers:
    """Values per section gathered from one source, and where each came from."""

    values: dict[str, dict[str, Any]] = dataclasses.field(
        default_factory=lambda: {"engine": {}, "speculative": {}, "sampling": {}}
    )
    origin: dict[str, str] = dataclasses.field(default_factory=dict)

    def put(self, section: str, field: str, value: Any, origin: str) -> None:
        self.values[section][field] = value
        self.origin[_qualified(section, field)] = origin


def _qualified(section: str, field: str) -> str:
    return field if section == "engine" else f"{section}.{field}"


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError as exc:
            raise ConfigError(
                f"cannot read {path}: Python < 3.11 needs the 'tomli' package (pip install tomli)"
            ) from exc
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc


def _file_layer(path: Path) -> _Layers:
    data = _read_toml(path)
    layers = _Layers()
    origin = f"config file {path}"
    for key, value in data.items():
        if key in ("speculative", "sampling"):
            if not isinstance(value, dict):
                raise ConfigError(f"{key} in {path} must be a table ([{key}]), got {value!r}")
            fields = _SPEC_FIELDS if key == "speculative" else _SAMPLING_FIELDS
            for sub, subvalue in value.items():
                if sub not in fields:
                    raise ConfigError(
                        f"unknown key '{key}.{sub}' (value {subvalue!r}) in {path}; allowed in "
                        f"[{key}]: {', '.join(fields)}"
                    )
                layers.put(key, sub, subvalue, origin)
        elif key in _ENGINE_FIELDS:
            layers.put("engine", key, value, origin)
        else:
            raise ConfigError(
                f"unknown key '{key}' (value {value!r}) in {path}; allowed top-level keys: "
                f"{', '.join(_ENGINE_FIELDS)}, and the tables [speculative] and [sampling]"
            )
    return layers


def _env_layer(env: Mapping[str, str]) -> _Layers:
    layers = _Layers()
    for name, text in sorted(env.items()):
        if not name.startswith("POLYSPEC_") or text == "":
            continue
        rest = name[len("POLYSPEC_") :].lower()
        for prefix, section, fields in (
            ("speculative_", "speculative", _SPEC_FIELDS),
            ("sampling_", "sampling", _SAMPLING_FIELDS),
        ):
            if rest.startswith(prefix):
                field = rest[len(prefix) :]
                if field not in fields:
                    allowed = ", ".join(f"POLYSPEC_{prefix.upper()}{f.upper()}" for f in fields)
                    raise ConfigError(
                        f"unknown environment variable {name}={text!r}; allowed: {allowed}"
                    )
                layers.put(section, field, _parse_text(name, field, text), f"environment {name}")
                break
        else:
            # other POLYSPEC_* variables (POLYSPEC_PLUGINS, ...) belong to other components
            if rest in _ENGINE_FIELDS:
                layers.put("engine", rest, _parse_text(name, rest, text), f"environment {name}")
            elif name not in ENV_VARIABLES:
                _warn_unknown_env(name)
    return layers


def _known_env_names() -> list[str]:
    names = [f"POLYSPEC_{f.upper()}" for f in _ENGINE_FIELDS]
    names += [f"POLYSPEC_SPECULATIVE_{f.upper()}" for f in _SPEC_FIELDS]
    names += [f"POLYSPEC_SAMPLING_{f.upper()}" for f in _SAMPLING_FIELDS]
    return names + list(ENV_VARIABLES)


def _warn_unknown_env(name: str) -> None:
    """Warn about a ``POLYSPEC_*`` variable nobody reads that looks like one somebody does."""
    close = difflib.get_close_matches(name, _known_env_names(), n=1, cutoff=0.8)
    if close:
        warnings.warn(
            f"environment variable {name} is not used by polyspec; did you mean {close[0]}?",
            ConfigWarning,
            stacklevel=4,
        )


def _cli_layer(cli: Mapping[str, Any]) -> _Layers:
    layers = _Layers()
    for key, value in cli.items():
        if value is None:
            continue
        where = _section_of_cli_key(key)
        if where is None:
            raise ConfigError(
                f"unknown option '{key}' (value {value!r}); allowed: {', '.join(sorted(cli_keys()))}"
            )
        section, field = where
        if isinstance(value, str) and _KINDS[field] not in ("str", "opt_str", "str_list"):
            value = _parse_text(f"--{key.replace('_', '-')}", field, value)
        layers.put(section, field, value, f"command line --{key.replace('_', '-')}")
    return layers


def _config_path(config_file: str | Path | None, env: Mapping[str, str]) -> Path | None:
    if config_file is not None or env.get("POLYSPEC_CONFIG"):
        path = Path(config_file if config_file is not None else env["POLYSPEC_CONFIG"])
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist (or is not a file)")
        return path
    default = Path.cwd() / DEFAULT_CONFIG_FILE
    return default if default.is_file() else None


def load_config(
    cli: Mapping[str, Any] | None = None,
    config_file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[EngineConfig, SamplingParams]:
    """Build the engine config and default sampling params from all four layers.

    :param cli: only the flags the user gave (None values are ignored). Keys: engine fields,
        speculative fields (``algorithm``, ``num_steps``, ``topk``, ``num_draft_tokens``, or with
        a ``speculative_`` prefix), sampling fields (``max_new_tokens``, ``temperature``, ...,
        or with a ``sampling_`` prefix; ``seed`` is the engine seed, ``sampling_seed`` the
        sampling one). ``algorithm = "none"`` turns speculative decoding off.
    :param config_file: TOML file; default ``$POLYSPEC_CONFIG``, else ``./polyspec.toml`` if any.
    :param env: environment variables; default ``os.environ``.
    :raises ConfigError: unknown keys or invalid values, naming the key, the value, what is
        allowed and where the value came from.
    """
    merged, origin = _merge(cli, config_file, env)
    try:
        return _build(merged)
    except ConfigError as exc:
        key = getattr(exc, "key", None)
        if key in origin:
            raise ConfigError(f"{exc} (set by {origin[key]})") from None
        raise


def _merge(
    cli: Mapping[str, Any] | None,
    config_file: str | Path | None,
    env: Mapping[str, str] | None,
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """The four layers merged per section, and where each value came from."""
    env = os.environ if env is None else env
    path = _config_path(config_file, env)
    file_layer = _file_layer(path) if path is not None else _Layers()
    env_layer = _env_layer(env)
    layers = (file_layer, env_layer, _cli_layer(cli or {}))
    # backend: file > POLYSPEC_BACKEND (selection rules of polyspec.plugins); CLI still wins
    if "backend" in file_layer.values["engine"]:
        env_layer.values["engine"].pop("backend", None)
        env_layer.origin.pop("backend", None)
    merged: dict[str, dict[str, Any]] = {"engine": {}, "speculative": {}, "sampling": {}}
    origin: dict[str, str] = {}
    for layer in layers:
        for section, values in layer.values.items():
            merged[section].update(values)
        origin.update(layer.origin)
    return merged, origin


def _is_off(algorithm: Any) -> bool:
    return isinstance(algorithm, str) and algorithm.lower() in _NONE_WORDS + ("off",)


def speculation_off(
    cli: Mapping[str, Any] | None = None,
    config_file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
) -> bool:
    """Whether the layers ask for plain decoding explicitly (``algorithm = "none"`` in the
    file, ``POLYSPEC_SPECULATIVE_ALGORITHM=none`` or ``--algorithm none``, whichever layer
    wins), as opposed to leaving the algorithm unset. Same arguments as :func:`load_config`."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)  # load_config warns once
        merged, _ = _merge(cli, config_file, env)
    return _is_off(merged["speculative"].get("algorithm"))


def given_engine_keys(
    cli: Mapping[str, Any] | None = None,
    config_file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The engine keys some layer sets (flag, environment variable, config file), with the
    value that wins; keys left to their defaults are absent. Same arguments as
    :func:`load_config` (for commands whose defaults differ from :class:`EngineConfig`'s)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)  # load_config warns once
        merged, _ = _merge(cli, config_file, env)
    return dict(merged["engine"])


def _build(merged: dict[str, dict[str, Any]]) -> tuple[EngineConfig, SamplingParams]:
    spec_values = merged["speculative"]
    speculative = None
    if spec_values:
        algorithm = spec_values.get("algorithm")
        if algorithm is None:
            raise _invalid(
                "speculative.algorithm",
                None,
                f"speculative options {', '.join(sorted(spec_values))} were given without an "
                f"algorithm; set it to one of {', '.join(repr(a) for a in ALGORITHMS)}",
            )
        if _is_off(algorithm):
            # plain decoding asked for explicitly: a draft from a lower layer is unused
            merged["engine"].pop("draft", None)
        else:
            speculative = spec_values  # EngineConfig fills what is unset from the head
    engine = EngineConfig(speculative=speculative, **merged["engine"])
    return engine, SamplingParams(**merged["sampling"])


def _fill_from_head(spec: dict[str, Any], engine: dict[str, Any]) -> str | os.PathLike | None:
    """Tree settings no layer set come from the EAGLE head's own ``polyspec.json`` (the head
    in ``draft``, or the shipped one where the engine will use it), as SGLang picks settings
    for a known draft when none are given. ``num_draft_tokens``, ``dynamic_depth`` and
    ``batch_trees`` are taken only with the head's own ``num_steps`` and ``topk``: they are
    chosen for that tree (and ``num_draft_tokens`` may not fit another). -> the head whose
    settings were read, or None."""
    if spec.get("algorithm") not in ("eagle", "eagle3"):
        return None
    if all(spec.get(k) is not None for k in ("num_steps", "topk", "num_draft_tokens")):
        return None  # a tree given in full is the user's own: none of the head's settings apply
    from polyspec.defaults import head_settings, shipped_head_path

    head = engine.get("draft")
    if head is None and engine.get("target") is None and spec["algorithm"] == "eagle3":
        head = shipped_head_path()
    if head is None or not isinstance(head, (str, os.PathLike)):
        return None  # EngineConfig reports a bad draft value, or the missing draft
    recommended = head_settings(head)
    if spec.get("batch_trees") is not None:
        spec["batch_trees"] = _as_batch_trees(spec["batch_trees"])
    # Batch trees given mean a tree layout of the user's; "none" (empty) only turns them off.
    tree_keys = ("num_steps", "topk", "num_draft_tokens", "batch_trees")
    given = [k for k in tree_keys if spec.get(k) not in (None, ())]
    if not given and spec.get("auto_tree", True) and recommended.get("candidates"):
        spec.setdefault("tree_candidates", tuple(recommended["candidates"]))
    for key in ("num_steps", "topk"):
        if spec.get(key) is None and key in recommended:
            spec[key] = recommended[key]
    own_tree = all(spec.get(k) == recommended.get(k) for k in ("num_steps", "topk"))
    for key in ("num_draft_tokens", "dynamic_depth", "batch_trees"):  # for the head's own tree
        if spec.get(key) is None and own_tree and key in recommended:
            spec[key] = recommended[key]
    return head
