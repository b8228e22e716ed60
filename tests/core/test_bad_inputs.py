"""Inputs a user can type get a one-line error naming the value and the fix (exit status 2 on
the command line), before any work or write: limits, config layers, files, train-draft, bench."""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import pytest
import torch

from polyspec import LLM, SamplingParams, SpeculativeConfig
from polyspec.cli import main
from polyspec.config import ConfigWarning, EngineConfig, load_config
from polyspec.engine.limits import check_kv_memory
from polyspec.errors import ConfigError, ModelLoadError, RequestError
from polyspec.testing.builders import build_tiny_eagle3, build_tiny_target


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_target(tmp_path_factory.mktemp("bad") / "t", seed=1)


def _one_line_error(capsys, *words: str) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(lines)
    err = lines[-1]  # notes may come first; the error is one line, the last
    assert err.startswith("polyspec: error: "), lines
    assert not any(x.startswith("polyspec: error") for x in lines[:-1])
    for w in words:
        assert w in err, err
    return err


# -- limits ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "value", "words"),
    [
        ("--page-size", "100000", "page_size = 100000 is invalid: must be an integer from 1 to"),
        ("--max-batch-size", "100000", "max_batch_size = 100000 is invalid"),
        ("--seed", str(2**63), "seed = 9223372036854775808 is invalid"),
    ],
)
def test_cli_refuses_sizes_beyond_bounds(tiny, capsys, flag, value, words):
    args = ["generate", "x", "--target", str(tiny), "--backend", "cpu", flag, value]
    assert main(args) == 2
    _one_line_error(capsys, words, f"(set by command line {flag})")


def test_kv_pool_too_large_for_memory_is_refused_before_allocation(tiny):
    with pytest.raises(ConfigError, match=r"num_kv_slots = 1073741824\).*free of.*lower num_kv"):
        LLM(target=str(tiny), backend="cpu", dtype="float32", num_kv_slots=2**30)
    cfg = EngineConfig(max_batch_size=4096, max_context=1 << 20)
    fp = torch.float32
    with pytest.raises(ConfigError, match=r"max_batch_size = 4096, max_context = 1048576") as info:
        check_kv_memory(cfg, 2**32, [_cfg(tiny)], fp, torch.int64, (2**30, 2**31), "cpu")
    assert "1.0 GiB free of 2.0 GiB" in str(info.value)
    check_kv_memory(cfg, 2**10, [_cfg(tiny)], fp, torch.int64, (2**40, 2**41), "cpu")  # fits
    check_kv_memory(cfg, 2**32, [_cfg(tiny)], fp, torch.int64, (0, 0), "cpu")  # unknown: no check


def _cfg(path: Path):
    from polyspec.model.config import config_from_hf

    return config_from_hf(json.loads((path / "config.json").read_text()))


def test_max_context_is_capped_by_the_model(tiny):
    llm = LLM(target=str(tiny), backend="cpu", dtype="float32", max_context=4096)
    assert llm.config.max_context == 512  # the tiny model's max_position_embeddings
    assert "capped to 512" in llm.notes[0]
    with pytest.raises(RequestError, match=r"^request 0: .* exceeds max_context = 512"):
        llm.generate(prompt_token_ids=[[5] * 600], sampling_params=SamplingParams(max_new_tokens=4))
    out = llm.generate(
        prompt_token_ids=[[5] * 400], sampling_params=SamplingParams(max_new_tokens=4)
    )
    assert len(out[0].token_ids) <= 4 and out[0].finish_reason in ("stop", "length")
    llm.shutdown()


def test_cli_prompt_longer_than_the_model(tiny, capsys):
    args = ["generate", "word " * 600, "--target", str(tiny), "--backend", "cpu",
            "--no-chat-template", "--max-new-tokens", "4"]  # fmt: skip
    assert main(args) == 2
    _one_line_error(capsys, "request 0: prompt (", "max_context = 512")


def test_topk_beyond_the_draft_vocabulary(tiny, tmp_path):
    head = build_tiny_eagle3(tmp_path / "h", tiny, draft_vocab_size=4)
    spec = SpeculativeConfig(algorithm="eagle3", num_steps=2, topk=6)
    with pytest.raises(ConfigError, match="topk = 6 is more than the draft can propose.*4 tok"):
        LLM(target=str(tiny), draft=str(head), speculative=spec, backend="cpu", dtype="float32")


# -- configuration layers ------------------------------------------------------------------------


def _bench_args(**kw) -> argparse.Namespace:
    from polyspec.commands.generate import _ENGINE_KEYS

    base = {k: None for k in _ENGINE_KEYS}
    return argparse.Namespace(**{**base, "config_file": None, "batch_size": None, **kw})


def test_algorithm_none_from_file_or_env_turns_speculation_off(tmp_path, monkeypatch):
    from polyspec.commands.bench import bench_configs
    from polyspec.config import speculation_off

    monkeypatch.chdir(tmp_path)
    for name in [n for n in __import__("os").environ if n.startswith("POLYSPEC_")]:
        monkeypatch.delenv(name)
    assert not speculation_off({})
    monkeypatch.setenv("POLYSPEC_SPECULATIVE_ALGORITHM", "none")
    assert speculation_off({})
    _, spec, _, skip = bench_configs(_bench_args())
    assert spec is None and skip == "algorithm none"
    monkeypatch.delenv("POLYSPEC_SPECULATIVE_ALGORITHM")
    (tmp_path / "polyspec.toml").write_text('[speculative]\nalgorithm = "none"\n')
    assert speculation_off({})
    _, spec, _, skip = bench_configs(_bench_args())
    assert spec is None
    assert not speculation_off({"algorithm": "eagle3"})  # the flag still wins


def test_misspelled_env_variable_is_warned():
    with pytest.warns(ConfigWarning, match="POLYSPEC_MAX_BACH_SIZE .* POLYSPEC_MAX_BATCH_SIZE"):
        load_config(env={"POLYSPEC_MAX_BACH_SIZE": "4"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(env={"POLYSPEC_PLUGINS": "cpu", "POLYSPEC_SOMETHING_ELSE": "1"})


def test_bad_head_settings_value_names_the_file(tiny, tmp_path):
    head = build_tiny_eagle3(tmp_path / "h", tiny)
    (head / "polyspec.json").write_text(json.dumps({"speculative": {"num_steps": 99, "topk": 1}}))
    with pytest.raises(ConfigError, match=r"num_steps = 99 is invalid.*polyspec\.json"):
        EngineConfig(target=str(tiny), draft=str(head), speculative={"algorithm": "eagle3"})


# -- checkpoint files ------------------------------------------------------------------------------


def _copy_target(tiny: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in tiny.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_shard_index_paths_stay_inside_the_model(tiny, tmp_path):
    from polyspec.model.hf import load_hf_weights

    root = _copy_target(tiny, tmp_path / "m")
    (root / "model.safetensors").rename(tmp_path / "outside.safetensors")
    for name in ("../outside.safetensors", str(tmp_path / "outside.safetensors")):
        index = {"weight_map": {"model.norm.weight": name}}
        (root / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(ModelLoadError, match="not a file inside"):
            load_hf_weights(root)


class _NotATensor:
    pass


def test_a_refused_pickle_says_unsafe(tiny, tmp_path):
    from polyspec.model.hf import load_hf_weights

    root = _copy_target(tiny, tmp_path / "m")
    (root / "model.safetensors").unlink()
    torch.save({"w": torch.zeros(2), "x": _NotATensor()}, root / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="refused as unsafe") as info:
        load_hf_weights(root)
    assert "weights_only" not in str(info.value) and "\n" not in str(info.value)
    (root / "pytorch_model.bin").write_bytes(b"\x80\x02garbage")  # corrupt, not unsafe
    with pytest.raises(ModelLoadError, match="truncated or corrupt") as info:
        load_hf_weights(root)
    assert "weights_only" not in str(info.value) and "\n" not in str(info.value)


def test_an_eagle3_head_with_algorithm_eagle_names_the_algorithm(tiny, tmp_path, capsys):
    head = build_tiny_eagle3(tmp_path / "h", tiny)
    args = ["generate", "x", "--target", str(tiny), "--backend", "cpu", "--draft", str(head),
            "--algorithm", "eagle", "--num-steps", "2", "--topk", "1"]  # fmt: skip
    assert main(args) == 2
    _one_line_error(capsys, "is an EAGLE-3 head", "--algorithm eagle3")


# -- train-draft and bench -------------------------------------------------------------------------


def _train(tiny: Path, prompts: Path, out: Path, *extra: str) -> list[str]:
    return ["train-draft", "--target", str(tiny), "--prompts", str(prompts), "--out", str(out),
            "--steps", "3", "--num-prompts", "4", "--max-new-tokens", "4",
            "--draft-vocab-size", "32", "--batch-tokens", "64", "--ttt-steps", "1", *extra]  # fmt: skip


@pytest.fixture
def prompts(tmp_path) -> Path:
    p = tmp_path / "p.jsonl"
    p.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(4)))
    return p


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--steps", "0"], "--steps = 0 is invalid: must be an integer >= 1"),
        (["--steps", "-5"], "--steps = -5 is invalid"),
        (["--lr", "0"], "--lr = 0.0 is invalid"),
        (["--gen-batch-size", "0"], "--gen-batch-size = 0 is invalid"),
    ],
)
def test_train_draft_bad_arguments_write_nothing(tiny, prompts, tmp_path, capsys, extra, words):
    out = tmp_path / "head"
    assert main(_train(tiny, prompts, out, *extra)) == 2
    _one_line_error(capsys, words)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.jsonl"]


def test_train_draft_out_paths(tiny, prompts, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main(_train(tiny, prompts, afile)) == 2
    _one_line_error(capsys, "is a file, not a folder")
    assert main(_train(tiny, prompts, afile / "sub")) == 2
    _one_line_error(capsys, "is a file, not a folder")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if not __import__("os").access(locked, __import__("os").W_OK):  # root may write anyway
            assert main(_train(tiny, prompts, locked / "head")) == 2
            _one_line_error(capsys, "is not writable")
    finally:
        locked.chmod(0o700)


def test_train_draft_refuses_then_replaces_a_head(tiny, prompts, tmp_path, capsys):
    out = tmp_path / "head"
    assert main(_train(tiny, prompts, out)) == 0
    capsys.readouterr()
    (out / "polyspec.json").write_text('{"speculative": {"num_steps": 3, "topk": 1}}')
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert main(_train(tiny, prompts, out, "--seed", "1")) == 2
    _one_line_error(capsys, "already holds a trained head", "--overwrite")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert main(_train(tiny, prompts, out, "--seed", "1", "--overwrite")) == 0
    assert not (out / "polyspec.json").exists()  # the old head's settings went with it
    assert (out / "model.safetensors").read_bytes() != before["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head", "p.jsonl"]  # nothing aside
    # a corrupt checkpoint is refused before any work
    (out / "checkpoint.pt").write_bytes(b"not a checkpoint")
    capsys.readouterr()
    assert main(_train(tiny, prompts, out, "--resume")) == 2
    _one_line_error(capsys, "cannot resume", "checkpoint.pt does not load")


def test_bench_checks_its_output_paths_first(tiny, tmp_path, capsys):
    args = ["bench", "--target", str(tiny), "--backend", "cpu", "--algorithm", "none",
            "--json", str(tmp_path)]  # fmt: skip
    assert main(args) == 2
    _one_line_error(capsys, "--json", "is a directory")
