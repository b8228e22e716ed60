"""Loaders: checkpoint formats, dtype, bad-input errors, EAGLE heads vs a plain-torch reference."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from polyspec.errors import ModelLoadError
from polyspec.model import CausalLM, DraftHead, load_draft, load_target
from polyspec.testing.builders import (
    build_tiny_eagle,
    build_tiny_eagle3,
    build_tiny_standalone,
    build_tiny_target,
)
from polyspec.testing.forward import SingleRequest, run_prefill


@pytest.fixture(scope="module")
def cpu():
    from polyspec.backends.cpu.backend import CPUBackend

    return CPUBackend()


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return build_tiny_target(tmp_path_factory.mktemp("target"), "llama", seed=0)


@pytest.fixture(scope="module")
def target(target_dir, cpu):
    return load_target(target_dir, cpu)


def _copy_dir(src, dst):
    shutil.copytree(src, dst, dirs_exist_ok=True)
    return dst


# ------------------------------------------------------------------------------ targets


def test_builder_output_is_peaked_and_loads_in_transformers(target_dir, target, cpu):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    ids = torch.arange(3, 40)
    _, logits = run_prefill(target, cpu, ids)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert float((logits - ref).abs().max() / ref.abs().max()) < 1e-4
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-3  # greedy is never a near-tie
    assert logits.softmax(-1).max(-1).values.mean() < 0.99  # and not one-hot


def test_pytorch_model_bin_and_dtype_auto(target_dir, target, cpu, tmp_path):
    d = _copy_dir(target_dir, tmp_path / "bin")
    torch.save(load_file(d / "model.safetensors"), d / "pytorch_model.bin")
    (d / "model.safetensors").unlink()
    ids = torch.arange(5, 15)
    assert torch.equal(
        run_prefill(load_target(d, cpu), cpu, ids)[1], run_prefill(target, cpu, ids)[1]
    )
    cfg = json.loads((d / "config.json").read_text())
    cfg["torch_dtype"] = "bfloat16"
    (d / "config.json").write_text(json.dumps(cfg))
    assert load_target(d, cpu).embed_tokens.dtype == torch.bfloat16  # auto = checkpoint dtype
    assert load_target(d, cpu, "float32").embed_tokens.dtype == torch.float32
    del cfg["torch_dtype"]
    (d / "config.json").write_text(json.dumps(cfg))
    assert load_target(d, cpu).embed_tokens.dtype == torch.float32  # auto without one = fp32
    with pytest.raises(ModelLoadError, match="unsupported dtype"):
        load_target(d, cpu, "int8")


def test_gguf_written_like_llama_cpp_matches_hf(target_dir, target, cpu, tmp_path, monkeypatch):
    gguf = pytest.importorskip("gguf")
    cfg = json.loads((target_dir / "config.json").read_text())
    sd = load_file(target_dir / "model.safetensors")
    w = gguf.GGUFWriter(str(tmp_path / "tiny.gguf"), "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_vocab_size(cfg["vocab_size"])

    def permute(t, n):  # llama.cpp convert_hf_to_gguf.py's q/k reordering
        return t.reshape(n, 2, t.shape[0] // n // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    names = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}
    per_layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                 "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}  # fmt: skip
    for name, t in sd.items():
        if name == "lm_head.weight":
            out = "output.weight"
        elif name.startswith("model.layers."):
            _, _, i, *rest = name.split(".")
            out = f"blk.{i}.{per_layer['.'.join(rest[:-1])]}.{rest[-1]}"
        else:
            out = names[name.removeprefix("model.")]
        if "q_proj" in name:
            t = permute(t, cfg["num_attention_heads"])
        elif "k_proj" in name:
            t = permute(t, cfg["num_key_value_heads"])
        arr = t.numpy().astype("float16" if "proj" in name else "float32")  # F16 and F32 paths
        w.add_tensor(out, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    model = load_target(tmp_path / "tiny.gguf", cpu, "float32")
    # "auto": a GGUF names no dtype; bf16 where the backend's bf16 forwards are exact
    auto = torch.bfloat16 if cpu.row_invariant(torch.bfloat16) else torch.float32
    assert load_target(tmp_path / "tiny.gguf", cpu).embed_tokens.dtype == auto
    monkeypatch.setenv("POLYSPEC_CPU_KERNELS", "torch")  # stock bf16 is not exact: float32
    stock = type(cpu)()
    assert load_target(tmp_path / "tiny.gguf", stock).embed_tokens.dtype == torch.float32
    monkeypatch.delenv("POLYSPEC_CPU_KERNELS")
    ids = torch.arange(7, 30)
    ours, ref = run_prefill(model, cpu, ids)[1], run_prefill(target, cpu, ids)[1]
    # weights went through float16: close, not equal; a q/k permutation bug would be far off
    assert float((ours - ref).abs().max() / ref.abs().max()) < 2e-2
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
    # truncated copy of the same file: named tensor, not a crash
    data = (tmp_path / "tiny.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelLoadError, match="truncated or corrupt: tensor"):
        load_target(tmp_path / "cut.gguf", cpu)


@pytest.mark.parametrize(
    "setup, match",
    [
        ("missing", "expected a directory with config.json and weights, or a .gguf file"),
        ("no_config", "it has no config.json"),
        ("gguf_in_dir", "pass that file's path"),
        ("not_gguf", "not a GGUF file"),
        ("arch", "unsupported architecture 'GPT2LMHeadModel'"),
        ("no_weights", "has no weights: expected model.safetensors"),
        ("truncated", r"model.safetensors is truncated or corrupt: tensor"),
        ("bad_header", "header claims"),
        ("missing_tensor", r"missing 1 tensor\(s\): model.layers.1.mlp.up_proj.weight"),
        ("shape", r"model.layers.0.self_attn.k_proj.weight has shape \(32, 64\)"),
        ("bad_bin", "pytorch_model.bin is truncated or corrupt"),
        ("missing_shard", "names shard\\(s\\) that do not exist: b.safetensors"),
    ],
)
def test_bad_inputs(setup, match, target_dir, cpu, tmp_path):
    d = tmp_path / "ckpt"
    path = d
    if setup == "missing":
        path = tmp_path / "nope"
    elif setup == "no_config":
        d.mkdir()
    elif setup == "gguf_in_dir":
        d.mkdir()
        (d / "m.gguf").write_bytes(b"GGUF")
    elif setup == "not_gguf":
        path = tmp_path / "x.gguf"
        path.write_bytes(b"not a gguf file at all")
    else:
        _copy_dir(target_dir, d)
        st = d / "model.safetensors"
        cfg = json.loads((d / "config.json").read_text())
        if setup == "arch":
            cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
        elif setup == "no_weights":
            st.unlink()
        elif setup == "truncated":
            st.write_bytes(st.read_bytes()[:-4096])
        elif setup == "bad_header":
            st.write_bytes((10**9).to_bytes(8, "little") + st.read_bytes()[8:])
        elif setup == "missing_tensor":
            sd = load_file(st)
            del sd["model.layers.1.mlp.up_proj.weight"]
            save_file(sd, str(st))
        elif setup == "shape":
            cfg["num_key_value_heads"] = 1  # the file's k_proj has 2 heads' rows
        elif setup == "bad_bin":
            st.unlink()
            (d / "pytorch_model.bin").write_bytes(b"\x80\x02garbage")
        elif setup == "missing_shard":
            sd = load_file(st)
            st.unlink()
            names = sorted(sd)
            save_file({k: sd[k] for k in names[:5]}, str(d / "a.safetensors"))
            index = {
                "weight_map": {
                    k: ("a.safetensors" if i < 5 else "b.safetensors") for i, k in enumerate(names)
                }
            }
            (d / "model.safetensors.index.json").write_text(json.dumps(index))
        (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=match):
        load_target(path, cpu)


# ------------------------------------------------------------------------------ draft heads
# A plain-torch reference of one Llama decoder layer's pieces, written from the papers' math,
# independent of polyspec.model.


def _rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta=10000.0):  # x [T, heads, D], rotate-halves layout
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    f = pos[:, None].float() * inv[None]
    cos, sin = (
        torch.cat([f.cos(), f.cos()], -1)[:, None],
        torch.cat([f.sin(), f.sin()], -1)[:, None],
    )
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _attn(x, sd, p, n_heads, n_kv, pos):
    t = x.shape[0]
    q = (x @ sd[p + "self_attn.q_proj.weight"].T).view(t, n_heads, -1)
    k = (x @ sd[p + "self_attn.k_proj.weight"].T).view(t, n_kv, -1)
    v = (x @ sd[p + "self_attn.v_proj.weight"].T).view(t, n_kv, -1)
    q, k = _rope(q, pos), _rope(k, pos)
    k, v = k.repeat_interleave(n_heads // n_kv, 1), v.repeat_interleave(n_heads // n_kv, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(t, -1)
    return o @ sd[p + "self_attn.o_proj.weight"].T


def _mlp(x, sd, p):
    g, u = x @ sd[p + "mlp.gate_proj.weight"].T, x @ sd[p + "mlp.up_proj.weight"].T
    return (torch.nn.functional.silu(g) * u) @ sd[p + "mlp.down_proj.weight"].T


def _run_head(head, cpu, ids, feats):
    req = SingleRequest(head, cpu, 64)
    batch, md = req.next_batch(ids)
    with torch.inference_mode():
        return head(ids, feats, batch.positions, req.attn, md)


def test_eagle1_head_matches_reference(target_dir, target, cpu, tmp_path):
    path = build_tiny_eagle(tmp_path / "eagle", target_dir)
    head = load_draft(path, target, "eagle", cpu)
    assert (
        isinstance(head, DraftHead) and head.aux_layer_ids == () and head.target_feature_size == 64
    )
    sd = torch.load(path / "pytorch_model.bin", weights_only=True)
    ids, pos = torch.arange(10, 22), torch.arange(12)
    feats = torch.randn(12, 64, generator=torch.Generator().manual_seed(0))
    logit_hidden, next_feature = _run_head(head, cpu, ids, feats)
    h = (
        torch.cat([target.embed_tokens.detach()[ids], feats], -1) @ sd["fc.weight"].T
        + sd["fc.bias"]
    )
    h = h + _attn(h, sd, "layers.0.", 4, 2, pos)  # no input norm on layer 0
    ref = h + _mlp(_rms(h, sd["layers.0.post_attention_layernorm.weight"]), sd, "layers.0.")
    assert torch.allclose(logit_hidden, ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(logit_hidden, next_feature)
    logits = ref @ target.lm_head_weight.detach().T
    p, idx = head.topk(logit_hidden, 3)
    assert torch.equal(idx, logits.topk(3, -1).indices)
    assert torch.allclose(head.probs(logit_hidden), logits.softmax(-1), atol=1e-5)


def test_eagle3_head_matches_reference(target_dir, target, cpu, tmp_path):
    path = build_tiny_eagle3(tmp_path / "eagle3", target_dir, draft_vocab_size=120)
    head = load_draft(path, target, "eagle3", cpu)
    cfg = json.loads((path / "config.json").read_text())
    ids_cfg = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert head.aux_layer_ids == tuple(i + 1 for i in ids_cfg)  # output of i == input of i + 1
    assert head.target_feature_size == 192 and head.draft_vocab_size == 120
    sd = load_file(path / "model.safetensors")
    ids, pos = torch.arange(30, 40), torch.arange(10)
    feats = torch.randn(10, 192, generator=torch.Generator().manual_seed(1))
    logit_hidden, next_feature = _run_head(head, cpu, ids, feats)
    p = "midlayer."
    x = feats @ sd["fc.weight"].T
    e = _rms(target.embed_tokens.detach()[ids], sd[p + "input_layernorm.weight"])
    a = _attn(torch.cat([e, _rms(x, sd[p + "hidden_norm.weight"])], -1), sd, p, 4, 2, pos)
    r = a + x
    r = r + _mlp(_rms(r, sd[p + "post_attention_layernorm.weight"]), sd, p)
    assert torch.allclose(next_feature, r, rtol=1e-4, atol=1e-4)
    assert torch.allclose(logit_hidden, _rms(r, sd["norm.weight"]), rtol=1e-4, atol=1e-4)
    # the head's own next_feature [T, H] skips fc (multi-step drafting)
    assert _run_head(head, cpu, ids, next_feature)[0].shape == (10, 64)
    # draft ids map to target ids through d2t; probs live on the target vocabulary
    allowed = torch.nonzero(sd["t2d"]).flatten()
    topk_p, topk_i = head.topk(logit_hidden, 4)
    draft_logits = logit_hidden @ sd["lm_head.weight"].T
    assert torch.equal(topk_i, allowed[draft_logits.topk(4, -1).indices])
    probs = head.probs(logit_hidden)
    assert probs.shape == (10, 300)
    assert torch.allclose(probs.sum(-1), torch.ones(10))
    assert float(probs[:, ~sd["t2d"]].abs().max()) == 0.0
    assert torch.allclose(probs.gather(1, topk_i), topk_p)


def test_eagle3_default_aux_layers_and_capture(target_dir, target, cpu, tmp_path):
    path = build_tiny_eagle3(tmp_path / "e3", target_dir)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["eagle_config"]
    (path / "config.json").write_text(json.dumps(cfg))
    head = load_draft(path, target, "eagle3", cpu)
    assert head.aux_layer_ids == (2, 2, 1)  # (2, L // 2, L - 3) with L = 4
    assert head.draft_to_target is not None and torch.equal(head.draft_to_target, torch.arange(300))
    _, _, aux = SingleRequest(target, cpu, 16).forward(
        torch.arange(5), capture_layers=head.aux_layer_ids
    )
    assert aux.shape == (5, head.target_feature_size)


@pytest.mark.parametrize(
    "edit, match",
    [
        ({"hidden_size": 32}, "hidden size 32"),
        ({"vocab_size": 400}, "vocabulary size 400"),
        (
            {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 9]}},
            r"\[9\] outside the target's layers 0..3",
        ),
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1]}}, "exactly 3 aux layers"),
        ({"draft_vocab_size": 1000}, "draft_vocab_size 1000"),
    ],
)
def test_head_that_does_not_fit_is_refused(edit, match, target_dir, target, cpu, tmp_path):
    path = build_tiny_eagle3(tmp_path / "e3", target_dir, draft_vocab_size=100)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(edit)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=match):
        load_draft(path, target, "eagle3", cpu)


def test_draft_errors(target_dir, target, cpu, tmp_path):
    path = build_tiny_eagle(tmp_path / "eagle", target_dir)
    sd = torch.load(path / "pytorch_model.bin", weights_only=True)
    del sd["layers.0.mlp.down_proj.weight"]
    torch.save(sd, path / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="missing tensor layers.0.mlp.down_proj.weight"):
        load_draft(path, target, "eagle", cpu)
    with pytest.raises(ModelLoadError, match="unknown draft algorithm 'medusa'"):
        load_draft(path, target, "medusa", cpu)
    with pytest.raises(ModelLoadError, match="expected a directory with config.json"):
        load_draft(tmp_path / "none", target, "eagle", cpu)


def test_standalone_draft(target_dir, target, cpu, tmp_path):
    path = build_tiny_standalone(tmp_path / "small", target_dir)
    draft = load_draft(path, target, "standalone", cpu)
    assert isinstance(draft, CausalLM) and draft.config.num_layers == 2
    assert (path / "tokenizer.json").read_bytes() == (target_dir / "tokenizer.json").read_bytes()
    other = build_tiny_target(tmp_path / "other", vocab_size=320)
    with pytest.raises(ModelLoadError, match="vocabulary size 320"):
        load_draft(other, target, "standalone", cpu)


def test_eagle1_hot_token_map(target_dir, target, cpu, tmp_path):
    path = build_tiny_eagle(tmp_path / "eagle", target_dir)
    hot = torch.tensor([2, 5, 7, 11, 50, 120, 299])
    torch.save(hot, tmp_path / "hot.pt")
    head = load_draft(path, target, "eagle", cpu, token_map=tmp_path / "hot.pt")
    assert head.draft_vocab_size == 7
    logit_hidden, _ = _run_head(head, cpu, torch.arange(4), torch.randn(4, 64))
    _, idx = head.topk(logit_hidden, 3)
    assert set(idx.flatten().tolist()) <= set(hot.tolist())
    probs = head.probs(logit_hidden)
    assert torch.allclose(probs[:, hot].sum(-1), torch.ones(4))
    torch.save(torch.tensor([1, 300]), tmp_path / "bad.pt")
    with pytest.raises(ModelLoadError, match="must map to target ids in 0..299"):
        load_draft(path, target, "eagle", cpu, token_map=tmp_path / "bad.pt")
