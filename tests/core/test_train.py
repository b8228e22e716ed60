"""train-draft: the trainable EAGLE-3 head computes what the inference head computes (TTT
steps included), the exported checkpoint loads and drafts losslessly, and the CLI runs."""

from __future__ import annotations

import copy
import dataclasses
import json
import lzma
import shutil

import pytest
import torch

from polyspec.backends.cpu.backend import CPUBackend
from polyspec.config import SamplingParams, SpeculativeConfig
from polyspec.model.loader import default_aux_layers, load_draft, load_target
from polyspec.testing.builders import build_tiny_target
from polyspec.testing.forward import SingleRequest
from polyspec.train.export import export_eagle3
from polyspec.train.features import extract_features
from polyspec.train.head import Eagle3Trainable


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    backend = CPUBackend()
    target_path = build_tiny_target(root / "target", seed=0)
    target = load_target(target_path, backend, "float32")
    ids = [5, 17, 33, 2, 250, 91, 14, 7, 66, 120, 3, 48]
    aux_layers = default_aux_layers(target.config.num_layers)
    feats = extract_features(target, backend, [(ids, 3)], aux_layers)[0]
    draft_ids = torch.arange(0, target.config.vocab_size, 2)
    torch.manual_seed(0)
    head = Eagle3Trainable(target.config, int(draft_ids.numel()), 64)
    head.init_from_target(target, draft_ids)
    with torch.no_grad():  # move away from the symmetric warm start
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    export_eagle3(head, draft_ids, aux_layers, root / "head", dtype=torch.float32)
    return root, backend, target, target_path, head, feats, draft_ids


def test_ttt_steps_match_inference_head(setup):
    root, backend, target, _, head, feats, draft_ids = setup
    ids = feats.ids
    t = len(ids)
    aux = feats.aux.float()[None]
    nxt = torch.cat([ids[1:], ids[:1]])  # token p + 1 at position p (last one unused)
    with torch.no_grad():
        logits = head(aux, target.embed(nxt).float()[None], ttt_steps=3)
    draft = load_draft(root / "head", target, "eagle3", backend, "float32")
    # step 0: the inference head over every position, fed the target's features
    req = SingleRequest(draft, backend)
    batch, meta = req.next_batch(nxt[: t - 1])
    with torch.no_grad():
        lh, feat0 = draft(
            batch.input_ids, feats.aux.float()[: t - 1], batch.positions, req.attn, meta
        )
        torch.testing.assert_close(
            draft.compute_logits(lh), logits[0][0, : t - 1], rtol=1e-4, atol=1e-4
        )
    # steps 1 and 2 at position p: step-0 KV up to p - j, then the head's own features
    for j in (1, 2):
        for p in (j + 1, t - 2):
            req = SingleRequest(draft, backend)
            with torch.no_grad():
                batch, meta = req.next_batch(nxt[: p - j + 1])
                _, f = draft(
                    batch.input_ids, feats.aux.float()[: p - j + 1], batch.positions, req.attn, meta
                )
                f = f[-1:]
                for step in range(1, j + 1):
                    q = p - j + step
                    batch, meta = req.next_batch(nxt[q : q + 1])
                    lh, f = draft(batch.input_ids, f, batch.positions, req.attn, meta)
            torch.testing.assert_close(
                draft.compute_logits(lh)[0], logits[j][0, p], rtol=1e-4, atol=1e-4
            )


def test_exported_head_drafts_losslessly(setup):
    from polyspec.engine.llm import LLM

    root, _, _, target_path, *_ = setup
    cfg = json.loads((root / "head" / "config.json").read_text())
    assert (
        cfg["draft_vocab_size"] == 150 and "eagle_aux_hidden_state_layer_ids" in cfg["eagle_config"]
    )
    prompts = [[5, 6, 7, 8], [40, 41, 42]]
    p = SamplingParams(max_new_tokens=10, ignore_eos=True)
    plain = LLM(target=target_path, backend="cpu", dtype="float32", max_context=128)
    spec = LLM(target=target_path, draft=root / "head", backend="cpu", dtype="float32",
               max_context=128, speculative=SpeculativeConfig(algorithm="eagle3", num_steps=3))  # fmt: skip
    want = [o.token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=p)]
    assert [o.token_ids for o in spec.generate(prompt_token_ids=prompts, sampling_params=p)] == want


def test_train_draft_cli_end_to_end_and_resume(setup, tmp_path):
    from polyspec.cli import main

    _, _, _, target_path, *_ = setup
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(12)))
    out = tmp_path / "head"
    argv = ["train-draft", "--target", str(target_path), "--prompts", str(prompts), "--out",
            str(out), "--steps", "8", "--num-prompts", "12", "--max-new-tokens", "8",
            "--draft-vocab-size", "64", "--batch-tokens", "256", "--ttt-steps", "2"]  # fmt: skip
    assert main(argv) == 0
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == 8 and len(log[-1]["acc_per_step"]) == 2
    answers = (out / "answers.jsonl").read_text()
    # a second run without --resume refuses to clobber a checkpoint; with it, it reuses answers
    (out / "checkpoint.pt").write_bytes(b"")
    assert main(argv) == 2
    (out / "checkpoint.pt").unlink()
    assert main(argv + ["--resume", "--steps", "10"]) == 0
    assert (out / "answers.jsonl").read_text() == answers


def test_train_draft_sampled_answers_generate_only(setup, tmp_path):
    """--samples-per-prompt M: the greedy answer of every prompt first, then M - 1 sampled
    ones per prompt (seeded: a rerun writes the same text); --generate-only stops there, and a
    resume with fewer samples reuses what is written."""
    from polyspec.cli import main

    _, _, _, target_path, *_ = setup
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(4)))
    argv = ["train-draft", "--target", str(target_path), "--prompts", str(prompts),
            "--max-new-tokens", "12", "--gen-batch-size", "3", "--samples-per-prompt", "3",
            "--generate-only"]  # fmt: skip
    assert main(argv + ["--out", str(tmp_path / "a")]) == 0
    assert main(argv + ["--out", str(tmp_path / "b")]) == 0
    assert not (tmp_path / "a" / "model.safetensors").exists()
    recs = [json.loads(x) for x in (tmp_path / "a" / "answers.jsonl").read_text().splitlines()]
    again = [json.loads(x) for x in (tmp_path / "b" / "answers.jsonl").read_text().splitlines()]
    assert sorted(r["index"] for r in recs) == list(range(12)) and recs == again
    by_index = {r["index"]: r["answer_ids"] for r in recs}
    # the sampled answers differ from the greedy one for at least one prompt
    assert any(by_index[i] != by_index[i + 4] or by_index[i] != by_index[i + 8] for i in range(4))
    text = (tmp_path / "a" / "answers.jsonl").read_text()
    short = ["--samples-per-prompt", "2", "--steps", "2", "--draft-vocab-size", "64",
             "--batch-tokens", "256", "--ttt-steps", "2", "--resume"]  # fmt: skip
    assert main(argv[:-3] + short + ["--out", str(tmp_path / "a")]) == 0
    assert (tmp_path / "a" / "answers.jsonl").read_text() == text  # nothing regenerated
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["answers"] == 8


def test_self_prompts_prefix_and_generation(setup, tmp_path):
    """--self-prompts: the target writes user turns from the chat template's opening of one
    (seeded: a rerun writes the same file); the kept ones are answered after the file prompts,
    and an answers file written for other prompts is refused, not silently mixed in."""
    from polyspec.cli import main
    from polyspec.model.loader import load_tokenizer
    from polyspec.train.self_prompts import user_turn_prefix

    _, _, _, target_path, *_ = setup
    tok = load_tokenizer(target_path)
    prefix = user_turn_prefix(tok)
    full = tok.apply_chat_template([{"role": "user", "content": "hello there"}], tokenize=True)
    assert len(prefix) > 0 and full[: len(prefix)] == prefix
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(3)))
    argv = ["train-draft", "--target", str(target_path), "--prompts", str(prompts),
            "--self-prompts", "10", "--max-new-tokens", "6", "--gen-batch-size", "4",
            "--generate-only"]  # fmt: skip
    for name in ("a", "b"):
        assert main(argv + ["--out", str(tmp_path / name)]) == 0
    written = (tmp_path / "a" / "self_prompts.jsonl").read_text()
    assert written == (tmp_path / "b" / "self_prompts.jsonl").read_text()
    recs = [json.loads(x) for x in written.splitlines()]
    assert sorted(r["index"] for r in recs) == list(range(10))
    kept = {
        r["prompt"] for r in recs if r["finish_reason"] == "stop" and len(r["prompt"].split()) >= 3
    }
    answers = (tmp_path / "a" / "answers.jsonl").read_text().splitlines()
    assert len(answers) == 3 + len(kept)
    # the same answers file with another prompt file: refused
    prompts.write_text("".join(json.dumps({"prompt": f"other {i}"}) + "\n" for i in range(3)))
    assert main(argv + ["--out", str(tmp_path / "a")]) == 2
    assert (tmp_path / "a" / "answers.jsonl").read_text().splitlines() == answers


def test_self_prompt_openers(setup, tmp_path):
    """--self-prompt-openers: job j's prompt starts with opener j mod len (an empty line is a
    plain draw), the opener is recorded, a resume with another list regenerates the jobs it
    changes, and a missing openers file is a clear error before any model work."""
    from polyspec.cli import main

    _, _, _, target_path, *_ = setup
    openers = tmp_path / "openers.txt"
    openers.write_text("Write a poem\n\nImagine you are\n")
    argv = ["train-draft", "--target", str(target_path), "--self-prompts", "6",
            "--max-new-tokens", "4", "--gen-batch-size", "4", "--generate-only",
            "--out", str(tmp_path / "h"), "--self-prompt-openers", str(openers)]  # fmt: skip
    assert main(argv) == 0
    recs = {r["index"]: r for r in map(json.loads, (tmp_path / "h" / "self_prompts.jsonl").open())}
    want = ["Write a poem", "", "Imagine you are"] * 2
    for j, opener in enumerate(want):
        assert recs[j].get("opener", "") == opener
        assert recs[j]["prompt"].startswith(opener)
    # Another list over the same self_prompts.jsonl (a file prompt keeps the run from
    # failing if the tiny target keeps none of its prompts)
    (tmp_path / "h2").mkdir()
    shutil.copy(tmp_path / "h" / "self_prompts.jsonl", tmp_path / "h2")
    openers.write_text("Solve\n")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "question"}) + "\n")
    argv2 = [x if x != str(tmp_path / "h") else str(tmp_path / "h2") for x in argv]
    assert main(argv2 + ["--resume", "--prompts", str(prompts)]) == 0
    recs = [json.loads(x) for x in (tmp_path / "h2" / "self_prompts.jsonl").open()]
    latest = {r["index"]: r for r in recs}  # the last record of a job wins
    assert all(latest[j].get("opener") == "Solve" for j in range(6))
    assert main(argv[:-1] + [str(tmp_path / "missing.txt")]) == 2


def test_train_time_budget_sets_the_step_count(setup, tmp_path):
    """--time-budget: the first timed steps fix the total (never below them, never above
    --steps), the schedule runs to that total, and --max-answers caps the answers used."""
    from polyspec.cli import main

    _, _, _, target_path, *_ = setup
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(6)))
    out = tmp_path / "head"
    argv = ["train-draft", "--target", str(target_path), "--prompts", str(prompts), "--out",
            str(out), "--steps", "40", "--max-new-tokens", "6", "--draft-vocab-size", "64",
            "--batch-tokens", "128", "--ttt-steps", "2", "--time-budget", "0.001",
            "--max-answers", "4"]  # fmt: skip
    assert main(argv) == 0
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == log[-1]["total_steps"] == 21
    assert json.loads((out / "summary.json").read_text())["answers"] == 4
    assert len((out / "answers.jsonl").read_text().splitlines()) == 4


def test_train_draft_init_from_a_trained_head(setup, tmp_path):
    """--init-from: training starts from the given head's weights and keeps its vocabulary;
    a head for another target, or a missing one, is refused before any generation."""
    from safetensors.torch import load_file

    from polyspec.cli import main
    from polyspec.errors import ConfigError
    from polyspec.train.warm_start import load_trained_head

    root, _, target, target_path, head, _, draft_ids = setup
    aux_layers = default_aux_layers(target.config.num_layers)
    state, ids = load_trained_head(root / "head", target.config, aux_layers)
    assert torch.equal(ids, draft_ids)
    for k, v in head.state_dict().items():
        torch.testing.assert_close(state[k], v.float())
    with pytest.raises(ConfigError, match="reads layer outputs"):
        load_trained_head(root / "head", target.config, (1, 2, 3))
    with pytest.raises(ConfigError, match="config.json and model.safetensors"):
        load_trained_head(tmp_path / "nowhere", target.config, aux_layers)

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(6)))
    out = tmp_path / "warm"
    argv = ["train-draft", "--target", str(target_path), "--prompts", str(prompts), "--out",
            str(out), "--steps", "2", "--lr", "1e-9", "--max-new-tokens", "8",
            "--batch-tokens", "256", "--ttt-steps", "2", "--init-from", str(root / "head")]  # fmt: skip
    assert main(argv) == 0
    new = load_file(str(out / "model.safetensors"))
    old = load_file(str(root / "head" / "model.safetensors"))
    assert torch.equal(new["t2d"], old["t2d"]) and torch.equal(new["d2t"], old["d2t"])
    # two steps at lr 1e-9 leave the warm-started weights where they were (bf16 export)
    for k in ("fc.weight", "lm_head.weight", "midlayer.self_attn.q_proj.weight"):
        torch.testing.assert_close(new[k].float(), old[k].float(), rtol=1e-2, atol=1e-2)
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads((root / "head" / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "hidden_size": cfg["hidden_size"] + 1}))
    (bad / "model.safetensors").write_bytes((root / "head" / "model.safetensors").read_bytes())
    argv[argv.index(str(root / "head"))] = str(bad)
    argv[argv.index(str(out))] = str(tmp_path / "warm2")
    assert main(argv) == 2
    assert not (tmp_path / "warm2" / "answers.jsonl").exists()


def test_train_draft_init_from_grows_the_draft_vocabulary(setup, tmp_path):
    """--init-from with a larger --draft-vocab-size keeps every drafted token and its trained
    lm_head row, adds the answers' most frequent other tokens with the target's rows; a
    smaller size is refused before any generation."""
    from safetensors.torch import load_file

    from polyspec.cli import main

    root, _, target, target_path, _, _, draft_ids = setup
    vocab = target.config.vocab_size
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(6)))
    grown_size = draft_ids.numel() + 16
    argv = ["train-draft", "--target", str(target_path), "--prompts", str(prompts), "--out",
            str(tmp_path / "grown"), "--steps", "2", "--lr", "1e-9", "--max-new-tokens", "8",
            "--batch-tokens", "256", "--ttt-steps", "2", "--init-from", str(root / "head"),
            "--draft-vocab-size", str(grown_size)]  # fmt: skip
    assert main(argv) == 0
    new = load_file(str(tmp_path / "grown" / "model.safetensors"))
    old = load_file(str(root / "head" / "model.safetensors"))
    new_ids = torch.nonzero(new["t2d"]).flatten()
    assert new_ids.numel() == grown_size == new["lm_head.weight"].shape[0]
    assert torch.equal(new_ids, new["d2t"] + torch.arange(grown_size))
    assert torch.isin(draft_ids, new_ids).all()
    kept = torch.isin(new_ids, draft_ids)
    torch.testing.assert_close(
        new["lm_head.weight"][kept].float(), old["lm_head.weight"].float(), rtol=1e-2, atol=1e-2
    )
    added = new_ids[~kept]
    torch.testing.assert_close(
        new["lm_head.weight"][~kept].float(),
        target.lm_head_weight[added].float().to(torch.bfloat16).float(),
        rtol=1e-2,
        atol=1e-2,
    )
    answers = [
        json.loads(x) for x in (tmp_path / "grown" / "answers.jsonl").read_text().splitlines()
    ]
    seen = {t for a in answers for t in a["answer_ids"]} - set(draft_ids.tolist())
    assert seen <= set(added.tolist())  # answer tokens come before unseen ones

    for size, out in ((draft_ids.numel() - 1, "shrunk"), (vocab + 1, "too_big")):
        argv[argv.index("--draft-vocab-size") + 1] = str(size)
        argv[argv.index("--out") + 1] = str(tmp_path / out)
        assert main(argv) == 2
        assert not (tmp_path / out / "answers.jsonl").exists()


def test_train_draft_extra_answers(setup, tmp_path):
    """--extra-answers: an earlier run's answers.jsonl joins the training text (counted in the
    summary); a missing file, a malformed record or ids outside the vocabulary are refused
    before any generation."""
    from polyspec.cli import main

    _, _, target, target_path, *_ = setup
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(3)))
    base = ["train-draft", "--target", str(target_path), "--prompts", str(prompts),
            "--max-new-tokens", "8", "--steps", "2", "--draft-vocab-size", "64",
            "--batch-tokens", "256", "--ttt-steps", "2"]  # fmt: skip
    assert main(base + ["--out", str(tmp_path / "a"), "--generate-only"]) == 0
    earlier = tmp_path / "a" / "answers.jsonl"
    # an interrupted earlier run: its cut-short last line is skipped
    with earlier.open("a") as f:
        f.write('{"index": 9, "prompt_ids": [1, 2')
    assert main(base + ["--out", str(tmp_path / "b"), "--extra-answers", str(earlier)]) == 0
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert summary["answers"] == 6 and summary["extra_answers"] == 3

    vocab = target.config.vocab_size
    bad_cases = {
        "missing.jsonl": None,
        "shape.jsonl": json.dumps({"prompt_ids": [1, 2]}) + "\n",
        "vocab.jsonl": json.dumps({"prompt_ids": [1], "answer_ids": [vocab]}) + "\n",
    }
    for name, text in bad_cases.items():
        path = tmp_path / name
        if text is not None:
            path.write_text(text + json.dumps({"prompt_ids": [1], "answer_ids": [2]}) + "\n")
        out = tmp_path / f"out-{name}"
        assert main(base + ["--out", str(out), "--extra-answers", str(path)]) == 2
        assert not (out / "answers.jsonl").exists()


def test_train_head_learns_alike_in_either_compute_dtype(setup, tmp_path):
    """Mixed precision (bf16 matmuls, fp32 weights and AdamW) learns like fp32: 60 steps on
    one sequence lower the loss and raise the step-0 agreement in both, to within 2 % of the
    same final loss; the weights stay fp32; an unknown dtype is refused."""
    from polyspec.train.trainer import TrainConfig, train_head

    _, _, target, _, head0, feats, draft_ids = setup
    final = {}
    for dtype in ("float32", "bfloat16"):
        head = copy.deepcopy(head0)
        cfg = TrainConfig(steps=60, lr=3e-3, ttt_steps=2, batch_tokens=64, warmup=5,
                          log_every=10, compute_dtype=dtype)  # fmt: skip
        (tmp_path / dtype).mkdir()
        logs = train_head(head, target, [feats], draft_ids, cfg, tmp_path / dtype,
                          torch.device("cpu"))  # fmt: skip
        assert logs[-1]["loss"] < 0.7 * logs[0]["loss"]
        assert logs[-1]["acc_per_step"][0] > logs[0]["acc_per_step"][0]
        assert all(p.dtype == torch.float32 for p in head.parameters())
        final[dtype] = logs[-1]["loss"]
    assert final["bfloat16"] == pytest.approx(final["float32"], rel=0.02)
    with pytest.raises(ValueError, match="compute_dtype"):
        train_head(head, target, [feats], draft_ids,
                   dataclasses.replace(cfg, compute_dtype="fp8"), tmp_path / "x",
                   torch.device("cpu"))  # fmt: skip


def test_content_prompts_wrap_answers_in_tasks():
    """content_prompts: answers within the token bounds, each inside a task (code answers in a
    code task), tasks in turn, the same draw for the same seed, at most one prompt per answer;
    no usable answer or num < 1 is a clear error."""
    from polyspec.errors import ConfigError
    from polyspec.train.content_prompts import CODE_TASKS, TEXT_TASKS, content_prompts

    def decode(ids):
        return "```py\nx = 1\n```" if ids[0] == 7 else " ".join(f"w{i}" for i in ids)

    recs = [{"prompt_ids": [1], "answer_ids": [i] * n} for i, n in
            ((1, 60), (2, 10), (3, 300), (4, 100), (7, 50), (5, 80))]  # fmt: skip
    out = content_prompts(recs, decode, num=10, seed=3)
    assert len(out) == 4  # the 10- and 300-token answers are out of bounds
    assert out == content_prompts(recs, decode, num=10, seed=3)
    code = [p for p in out if "```py" in p]
    assert code == [CODE_TASKS[0].format(text="```py\nx = 1\n```")]
    texts = [p for p in out if "```" not in p]
    in_bounds = {decode(r["answer_ids"]) for r in recs if r["answer_ids"][0] in (1, 4, 5)}
    embedded = []
    for i, p in enumerate(texts):  # tasks in turn, each around one answer
        head, tail = TEXT_TASKS[i].split("{text}")
        assert p.startswith(head) and p.endswith(tail)
        embedded.append(p[len(head) : len(p) - len(tail)])
    assert sorted(embedded) == sorted(in_bounds)
    assert len(content_prompts(recs, decode, num=2, seed=3)) == 2
    with pytest.raises(ConfigError, match="no answer of"):
        content_prompts(recs[1:2], decode, num=3)
    with pytest.raises(ConfigError, match=">= 1"):
        content_prompts(recs, decode, num=0)


def test_train_draft_content_prompts_from_answers(setup, tmp_path):
    """--content-prompts-from: an earlier run's answers become prompts with a task on them,
    answered after the file prompts and counted apart; a missing file and --content-prompts
    without a source are clear errors before any generation."""
    from polyspec.cli import main
    from polyspec.model.loader import load_tokenizer
    from polyspec.train.content_prompts import CODE_TASKS, TEXT_TASKS
    from polyspec.train.data import read_answers

    _, _, target, target_path, *_ = setup
    vocab = target.config.vocab_size
    earlier = tmp_path / "earlier.jsonl"
    earlier.write_text("".join(
        json.dumps({"index": i, "prompt_ids": [5, 6], "answer_ids": [(i * 7 + k) % vocab
                    for k in range(50 + i)]}) + "\n" for i in range(5)))  # fmt: skip
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "question"}) + "\n")
    out = tmp_path / "h"
    argv = ["train-draft", "--target", str(target_path), "--prompts", str(prompts),
            "--content-prompts-from", str(earlier), "--content-prompts", "3",
            "--max-new-tokens", "4", "--gen-batch-size", "4", "--out", str(out),
            "--steps", "2", "--draft-vocab-size", "64", "--batch-tokens", "512",
            "--ttt-steps", "2"]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["file_prompts"], summary["content_prompts"], summary["answers"]) == (1, 3, 4)
    tok = load_tokenizer(target_path)
    recs = [json.loads(x) for x in (out / "answers.jsonl").read_text().splitlines()]
    heads = [t.split("{text}")[0] for t in TEXT_TASKS + CODE_TASKS if t.split("{text}")[0]]
    tails = [t.split("{text}")[1] for t in TEXT_TASKS + CODE_TASKS if t.split("{text}")[1]]
    for rec in recs[1:]:
        shown = tok.decode(rec["prompt_ids"])
        assert any(h.strip() in shown for h in heads) or any(t.strip() in shown for t in tails)
    # a compressed answers file is read as it is (the device scripts bring them home as .xz)
    packed = tmp_path / "earlier.jsonl.xz"
    packed.write_bytes(lzma.compress(earlier.read_bytes()))
    assert read_answers(packed, vocab, "--content-prompts-from") == read_answers(earlier, vocab)
    assert main(argv[:5] + ["--content-prompts-from", str(tmp_path / "nowhere.jsonl"),
                            "--out", str(tmp_path / "x")]) == 2  # fmt: skip
    assert main(argv[:5] + ["--content-prompts", "3", "--out", str(tmp_path / "y")]) == 2
