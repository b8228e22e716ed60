"""LLM.from_modules: an engine over models built in memory (no checkpoint, no tokenizer)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from polyspec import LLM, SamplingParams, SpeculativeConfig
from polyspec.engine.tree_choice import tree_note
from polyspec.errors import ConfigError
from polyspec.model.config import ModelConfig
from polyspec.model.eagle import DraftHead
from polyspec.model.llama import CausalLM
from polyspec.model.loader import default_aux_layers

CONFIG = ModelConfig(
    architecture="llama",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    eos_token_ids=(2,),
).validate()


@torch.no_grad()
def _randomize(module: torch.nn.Module, seed: int) -> None:
    """Gaussian weights keeping activations O(1) and logits peaked (std about 3): no greedy ties."""
    g = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if p.dim() == 1:
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
        elif leaf in ("embed_tokens", "lm_head"):
            p.copy_(0.4 * torch.randn(p.shape, generator=g))
        else:
            scale = 0.5 if leaf in ("o_proj", "down_proj") else 1.0
            p.copy_(scale * p.shape[1] ** -0.5 * torch.randn(p.shape, generator=g))


def _target(backend) -> CausalLM:
    model = CausalLM(CONFIG, backend.kernels, backend.device(), torch.float32)
    _randomize(model, 0)
    return model


def _eagle3(target: CausalLM, backend) -> DraftHead:
    head = DraftHead(
        "eagle3",
        dataclasses.replace(CONFIG, num_layers=1),
        target,
        backend.kernels,
        backend.device(),
        torch.float32,
        draft_vocab_size=64,
        aux_layer_ids=default_aux_layers(CONFIG.num_layers),
    )
    _randomize(head, 1)
    head.set_token_map(torch.arange(0, 256, 4))
    return head


@pytest.mark.parametrize("graphs", ["off", "on"])
@pytest.mark.parametrize("algorithm", ["eagle3", "standalone"])
def test_greedy_spec_matches_plain(reference_backend, graphs: str, algorithm: str) -> None:
    be = reference_backend
    target = _target(be)
    if algorithm == "eagle3":
        draft = _eagle3(target, be)
    else:  # the target's twin: every draft token is accepted, which exercises the long paths
        draft = _target(be)
    kw = dict(backend=be, max_batch_size=3, max_context=128, graphs=graphs)
    plain = LLM.from_modules(target, **kw)
    spec = LLM.from_modules(
        target, draft, SpeculativeConfig(algorithm=algorithm, num_steps=3, topk=1), **kw
    )
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(3, 256, (3, 9), generator=g).tolist()
    sp = SamplingParams(max_new_tokens=20, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=sp)]
    outs = spec.generate(prompt_token_ids=prompts, sampling_params=sp)
    assert [o.token_ids for o in outs] == want
    assert all(len(t) == 20 for t in want)
    assert all(o.text == "" for o in outs)
    if algorithm == "standalone":
        assert all(o.stats.mean_acceptance_length > 3 for o in outs)
    assert plain.tokenizer is None and plain.target_path is None


def test_refusals(reference_backend) -> None:
    be = reference_backend
    target = _target(be)
    llm = LLM.from_modules(target, backend=be, max_context=64)
    with pytest.raises(ConfigError, match="tokenizer"):
        llm.generate(["hello"])
    with pytest.raises(ConfigError, match="tokenizer"):
        llm.generate(prompt_token_ids=[[5, 6]], sampling_params=SamplingParams(stop=("x",)))
    with pytest.raises(ConfigError, match="both draft and speculative"):
        LLM.from_modules(target, _eagle3(target, be), backend=be)
    with pytest.raises(ConfigError, match="DraftHead"):
        LLM.from_modules(
            target, target, SpeculativeConfig(algorithm="eagle3"), backend=be, max_context=64
        )
    with pytest.raises(ConfigError, match="from the modules"):
        LLM.from_modules(target, backend=be, dtype="float32")


@pytest.mark.parametrize("graphs", ["off", "on", "chains"])
def test_tree_candidates_settle_into_one_tree(reference_backend, graphs: str) -> None:
    """Eager rounds: the engine times the candidates' forwards, then the rounds of the
    predicted fastest, keeps one of them and decodes with it, losslessly; captured rounds: it times whole rounds of the recommended trees
    and plain rounds at batch 1 and 2 and runs its choice per batch size; a backend that verifies
    chains only chooses among the chains."""
    import copy

    from polyspec.config import TreeCandidate

    be = reference_backend
    if graphs == "chains":
        be = copy.copy(be)
        be.capabilities = dataclasses.replace(be.capabilities, tree_attention=False)
        graphs = "off"
    target = _target(be)
    cands = (TreeCandidate(2, 1, 3, 1.5), TreeCandidate(3, 2, 6, 2.5), TreeCandidate(4, 1, 5, 2.0))
    spec = SpeculativeConfig("eagle3", num_steps=3, topk=2, num_draft_tokens=6,
                             tree_candidates=cands, batch_trees="2:2-1-3")  # fmt: skip
    kw = dict(backend=be, max_batch_size=2, max_context=128, graphs=graphs)
    llm = LLM.from_modules(target, _eagle3(target, be), spec, **kw)
    got = llm.config.speculative
    tree = (got.num_steps, got.topk, got.num_draft_tokens)
    assert tree in {(c.num_steps, c.topk, c.num_draft_tokens) for c in cands}
    assert (llm.worker.num_steps, llm.worker.topk, llm.worker.num_draft_tokens) == tree
    choice = llm.tree_choice
    if graphs == "on":  # by batch size, timed on the worker: plain rounds are an option
        assert choice["timed_batch_sizes"][0] == 1 and set(choice["timed_batch_sizes"]) <= {1, 2}
        labels = [label for _, label in choice["by_batch_size"]]
        assert labels[0] in {c.label for c in cands}
        assert [t.label for t in got.batch_trees] == labels[1:]
        assert [t.label for _, t in llm.worker.trees] == labels
        # the recommended trees (the main one and batch_trees') against plain rounds
        assert set(choice["round_ms"]["1"]) == {"plain", "S=3 K=2 N=6", "S=2 K=1 N=3"}
    else:  # one tree, timed at batch 1, for every batch size
        assert got.batch_trees == () and len(llm.worker.trees) == 1
    if graphs != "on" and not be.capabilities.tree_attention:
        assert got.topk == 1 and set(choice["predicted_speedup"]) == {"S=2 K=1 N=3", "S=4 K=1 N=5"}
    elif graphs != "on":
        assert set(choice["predicted_speedup"]) == {c.label for c in cands}
        assert set(choice["target_ms"]) == {"1", "3", "5", "6"}
        assert set(choice["draft_ms"]) == {"1", "2", "3", "4", "5"}
        assert all(ms > 0 for ms in choice["target_ms"].values())
        # the rounds of the predicted fastest (all three here) and a plain round were timed,
        # and the tree of the most tokens per second measured runs
        measured = choice["measured_speedup"]
        assert set(measured) == {c.label for c in cands}
        assert set(choice["round_ms"]) == {"plain", *measured}
        assert measured[choice["chosen"]] == max(measured.values())
        assert "then the rounds of the 3 predicted fastest" in tree_note(choice)
    plain = LLM.from_modules(target, **kw)
    prompts = torch.randint(3, 256, (2, 7), generator=torch.Generator().manual_seed(5)).tolist()
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=sp)]
    assert [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp)] == want
