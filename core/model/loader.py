"""Loading targets, draft heads and tokenizers from disk onto a backend.

``path`` is a Hugging Face checkpoint directory (config.json + weights) or a ``.gguf`` file
(llama architecture, dequantised on load).

dtype: a torch dtype or its name ("float32", "bfloat16", "float16", also "fp32"/"bf16"/"fp16"),
or "auto". For a target, "auto" means the checkpoint's ``torch_dtype`` when config.json gives
one, else float32. A GGUF file names no dtype (its weights are quantized blocks, dequantised on
load): "auto" loads it in bfloat16 where the backend supports bfloat16 and claims row-invariant
bfloat16 forwards (:meth:`Backend.row_invariant`: fast, and speculative output equal to plain),
else float32. For a draft, "auto" means the target's dtype (the head consumes the target's
hidden states).

EAGLE-3 aux layers: checkpoints (SpecForge ``eagle_config.eagle_aux_hidden_state_layer_ids``)
count "the output of layer i"; polyspec captures the INPUT of layer i + 1 (the same tensor), so
``DraftHead.aux_layer_ids`` holds ``i + 1`` (``CausalLM.capture_layers`` convention, where
``num_layers`` means the final pre-norm output). Without that field the default is the inputs of
layers ``(2, L // 2, L - 3)`` (SGLang's default), clamped to ``0..L``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from polyspec.backend import Backend
from polyspec.errors import ModelLoadError
from polyspec.model.config import ModelConfig, config_from_hf
from polyspec.model.eagle import DraftHead
from polyspec.model.hf import load_hf_weights, read_hf_checkpoint, read_json
from polyspec.model.llama import CausalLM, _copy, make_getter, shard_slice
from polyspec.model.tokenizer import Tokenizer
from polyspec.parallel.group import TPGroup

_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
                  "float": "float32"}  # fmt: skip
DRAFT_ALGORITHMS = ("eagle", "eagle3", "standalone")


def resolve_dtype(
    dtype: str | torch.dtype, checkpoint_dtype: str | None, backend: Backend
) -> torch.dtype:
    """The torch dtype to load in (see the module docstring for "auto"); checked against the
    backend's supported dtypes."""
    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
    elif dtype == "auto":
        name = checkpoint_dtype or "float32"
    else:
        name = _DTYPE_ALIASES.get(dtype, dtype)
    if name not in ("float32", "bfloat16", "float16"):
        raise ModelLoadError(f"unsupported dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    supported = getattr(backend.capabilities, "dtypes", None)
    if supported and name not in supported:
        raise ModelLoadError(
            f"backend {backend.name!r} does not support dtype {name}; it supports {', '.join(supported)}"
        )
    return getattr(torch, name)


def _gguf_auto_dtype(backend: Backend) -> str | None:
    """bfloat16 where the backend runs it fast and exactly (module doc), else None (float32)."""
    if "bfloat16" in backend.capabilities.dtypes and backend.row_invariant(torch.bfloat16):
        return "bfloat16"
    return None


def _is_gguf(path: Path) -> bool:
    return path.suffix.lower() == ".gguf"


def _check_path(path: Path) -> None:
    if _is_gguf(path) and path.is_file():
        return
    if path.is_dir() and (path / "config.json").is_file():
        return
    hint = ""
    if path.is_dir():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = (
            f" (it holds {', '.join(ggufs)}: pass that file's path)"
            if ggufs
            else " (it has no config.json)"
        )
    elif not path.exists():
        hint = " (it does not exist)"
    raise ModelLoadError(
        f"cannot load {path}: expected a directory with config.json and weights, or a .gguf file{hint}"
    )


def read_model_config(path: str | Path) -> ModelConfig:
    """The shape of the model at ``path`` (config.json, or a GGUF file's header), without
    reading a weight: what a tensor-parallel size is checked against before loading."""
    path = Path(path)
    _check_path(path)
    if _is_gguf(path):
        from polyspec.model.gguf_loader import read_gguf

        return read_gguf(path).config
    return config_from_hf(read_json(path / "config.json"))


class ShardedTensors(Mapping[str, torch.Tensor]):
    """A checkpoint as one tensor-parallel rank reads it: each tensor cut to the rank's part
    (:func:`~polyspec.model.llama.shard_slice`). A safetensors checkpoint reads only those
    bytes; a GGUF tensor is dequantised alone and cut, so no rank ever holds the whole model."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], model: CausalLM) -> None:
        self._tensors = tensors
        self._config = model.config
        self._layout = model.layout

    def __getitem__(self, name: str) -> torch.Tensor:
        cut = shard_slice(name, self._config, self._layout)
        if cut is None:
            return self._tensors[name]
        dim, start, stop = cut
        read_slice = getattr(self._tensors, "read_slice", None)
        if read_slice is not None:
            return read_slice(name, dim, start, stop)
        return self._tensors[name].narrow(dim, start, stop - start)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def load_target(
    path: str | Path,
    backend: Backend,
    dtype: str | torch.dtype = "auto",
    tp: TPGroup | None = None,
) -> CausalLM:
    """Load a target model (HF directory or llama GGUF) onto ``backend``'s device; with
    ``tp`` of more than one rank, only this rank's part of it (:class:`ShardedTensors`)."""
    path = Path(path)
    _check_path(path)
    if _is_gguf(path):
        from polyspec.model.gguf_loader import read_gguf

        g = read_gguf(path)
        config, tensors = g.config, g.tensors
        checkpoint_dtype = _gguf_auto_dtype(backend) if dtype == "auto" else None
    else:
        raw, tensors = read_hf_checkpoint(path)
        config = config_from_hf(raw)
        checkpoint_dtype = config.torch_dtype
    model = CausalLM(
        config,
        backend.kernels,
        backend.device(),
        resolve_dtype(dtype, checkpoint_dtype, backend),
        tp=tp,
    )
    if model.layout is not None:
        tensors = ShardedTensors(tensors, model)
    model.load_weights(tensors)
    apply_weight_layout(model, backend)
    return model.eval()


def apply_weight_layout(model: torch.nn.Module, backend: Backend) -> None:
    """Give every matrix ``F.linear`` reads the layout the backend prefers
    (:meth:`Backend.prepare_linear_weight`); a tied lm_head gets its own copy so that the
    embedding lookup keeps its row-major table."""
    names = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "fc", "lm_head")
    with torch.no_grad():
        for module in model.modules():
            for name in names:
                w = getattr(module, name, None)
                if isinstance(w, torch.nn.Parameter) and w.dim() == 2:
                    new = backend.prepare_linear_weight(w.data)
                    if new is not w.data:
                        w = torch.nn.Parameter(new, requires_grad=False)
                        setattr(module, name, w)
                    attach_linear_fn(w, backend)
        if isinstance(model, CausalLM) and model.lm_head is None:
            embed = model.embed_tokens.data
            tied = backend.prepare_linear_weight(embed)
            fn = backend.linear_fn(tied)
            if tied is not embed or fn is not None:
                if tied is embed:
                    tied = tied.clone()  # the embedding must not carry the lm_head's kernel
                model.lm_head = torch.nn.Parameter(tied, requires_grad=False)
                if fn is not None:
                    model.lm_head.polyspec_linear = fn


def attach_linear_fn(weight: torch.Tensor, backend: Backend) -> None:
    """Store the backend's :meth:`Backend.linear_fn` for ``weight`` on it, where
    :func:`polyspec.model.linear.linear` finds it."""
    fn = backend.linear_fn(weight.data)
    if fn is not None:
        weight.polyspec_linear = fn


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a checkpoint directory (tokenizer.json) or a GGUF file (its metadata)."""
    path = Path(path)
    _check_path(path)
    if _is_gguf(path):
        from polyspec.model.gguf_loader import read_gguf

        return Tokenizer.from_gguf_metadata(read_gguf(path).metadata)
    return Tokenizer.from_dir(path)


def load_draft(
    path: str | Path,
    target: CausalLM,
    algorithm: str,
    backend: Backend,
    dtype: str | torch.dtype = "auto",
    token_map: str | Path | None = None,
) -> DraftHead | CausalLM:
    """Load a draft for ``target``: an EAGLE-1/2 head ("eagle"), an EAGLE-3 head ("eagle3"),
    or a small model of the same vocabulary ("standalone"). A head that does not fit the target
    (hidden size, vocabulary, aux layer ids) is refused with ModelLoadError saying which.
    ``token_map``: optional ``.pt`` file of hot token ids trimming an EAGLE head's vocabulary."""
    if algorithm not in DRAFT_ALGORITHMS:
        raise ModelLoadError(
            f"unknown draft algorithm {algorithm!r}; choose one of {', '.join(DRAFT_ALGORITHMS)}"
        )
    path = Path(path)
    tdtype = target.embed_tokens.dtype
    if algorithm == "standalone":
        _check_path(path)
        draft = load_target(path, backend, tdtype if dtype == "auto" else dtype)
        if draft.config.vocab_size != target.config.vocab_size:
            raise ModelLoadError(
                f"standalone draft {path} has vocabulary size {draft.config.vocab_size}, the target "
                f"has {target.config.vocab_size}: a standalone draft must share the target's tokenizer"
            )
        return draft
    if not path.is_dir() or not (path / "config.json").is_file():
        raise ModelLoadError(
            f"cannot load draft head {path}: expected a directory with config.json and "
            "pytorch_model.bin or model.safetensors"
        )
    raw = read_json(path / "config.json")
    tensors = _strip_prefix(load_hf_weights(path))
    kind = _head_kind(tensors, target.config.hidden_size)
    if kind is not None and kind != algorithm:
        names = {"eagle": "EAGLE-1/2", "eagle3": "EAGLE-3"}
        raise ModelLoadError(
            f"draft head {path} is an {names[kind]} head, but the speculative algorithm is "
            f"{algorithm!r}; pass --algorithm {kind} (algorithm = {kind!r})"
        )
    head = _build_head(
        raw,
        tensors,
        target,
        algorithm,
        backend,
        resolve_dtype(tdtype if dtype == "auto" else dtype, None, backend),
        path,
    )
    if token_map is not None:
        try:
            m = torch.load(token_map, map_location="cpu", weights_only=True)
        except Exception as e:
            from polyspec.model.hf import load_error, unsafe_pickle, unsafe_pickle_message

            if unsafe_pickle(e):
                raise ModelLoadError(unsafe_pickle_message(token_map)) from None
            raise ModelLoadError(f"cannot read token map {token_map}: {load_error(e)}") from None
        _set_map(head, torch.as_tensor(m, dtype=torch.int64), target, f"token map {token_map}")
    apply_weight_layout(head, backend)
    return head.eval()


def _head_kind(tensors: Mapping[str, torch.Tensor], hidden: int) -> str | None:
    """ "eagle3" or "eagle" from a head's tensors (bare names), None when they do not say."""
    if "d2t" in tensors or "t2d" in tensors or "layers.0.hidden_norm.weight" in tensors:
        return "eagle3"
    fc = tensors.get("fc.weight")
    if fc is not None and fc.dim() == 2 and fc.shape[1] == 2 * hidden:
        return "eagle"
    if fc is not None and fc.dim() == 2 and fc.shape[1] == 3 * hidden:
        return "eagle3"
    return None


def _strip_prefix(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Head tensors by bare name (``model.`` dropped; ``midlayer.`` -> ``layers.0.``)."""
    out = {}
    for name in tensors:
        bare = name.removeprefix("model.")
        if bare.startswith("midlayer."):
            bare = "layers.0." + bare[len("midlayer.") :]
        out[bare] = tensors[name]
    return out


def _head_config(raw: dict[str, Any], path: Path) -> ModelConfig:
    # Heads are Llama decoder layers whatever their `architectures` says (LlamaForCausalLMEagle3..)
    cfg = {**raw, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    cfg.setdefault("num_hidden_layers", 1)
    try:
        return config_from_hf(cfg)
    except ModelLoadError as e:
        raise ModelLoadError(f"draft head {path}/config.json: {e}") from None


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """SGLang's default EAGLE-3 capture points (inputs of layers 2, L//2, L-3), clamped to 0..L."""
    return tuple(min(max(i, 0), num_layers) for i in (2, num_layers // 2, num_layers - 3))


def _build_head(
    raw: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    target: CausalLM,
    algorithm: str,
    backend: Backend,
    dtype: torch.dtype,
    path: Path,
) -> DraftHead:
    cfg = _head_config(raw, path)
    tc = target.config
    th = int(raw.get("target_hidden_size") or cfg.hidden_size)
    if cfg.hidden_size != tc.hidden_size or th != tc.hidden_size:
        raise ModelLoadError(
            f"draft head {path} has hidden size {cfg.hidden_size} (target_hidden_size {th}), the "
            f"target has {tc.hidden_size}: this head was trained for another model"
        )
    if cfg.vocab_size != tc.vocab_size:
        raise ModelLoadError(
            f"draft head {path} has vocabulary size {cfg.vocab_size}, the target has "
            f"{tc.vocab_size}: this head was trained for another model"
        )
    aux: tuple[int, ...] = ()
    draft_vocab = None
    if algorithm == "eagle3":
        draft_vocab = int(raw.get("draft_vocab_size") or cfg.vocab_size)
        if not 0 < draft_vocab <= tc.vocab_size:
            raise ModelLoadError(
                f"draft head {path}: draft_vocab_size {draft_vocab} must be in 1..{tc.vocab_size} "
                "(the target's vocabulary)"
            )
        ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if ids is None:
            aux = default_aux_layers(tc.num_layers)
        else:
            bad = [i for i in ids if not 0 <= int(i) < tc.num_layers]
            if bad:
                raise ModelLoadError(
                    f"draft head {path}: eagle_aux_hidden_state_layer_ids {list(ids)} has {bad} "
                    f"outside the target's layers 0..{tc.num_layers - 1}"
                )
            aux = tuple(int(i) + 1 for i in ids)
        if len(aux) != 3:
            raise ModelLoadError(
                f"draft head {path}: EAGLE-3 needs exactly 3 aux layers, got {len(aux)}"
            )
    if "fc.weight" not in tensors:
        raise ModelLoadError(
            f"draft head {path} is missing tensor fc.weight (is it an EAGLE head?)"
        )
    head = DraftHead(
        algorithm, cfg, target, backend.kernels, backend.device(), dtype,
        target_hidden_size=th,
        fc_bias="fc.bias" in tensors,
        own_embed="embed_tokens.weight" in tensors,
        draft_vocab_size=draft_vocab,
        aux_layer_ids=aux,
        max_positions=target.cos_sin_cache.shape[0],
    )  # fmt: skip
    get = make_getter(tensors)
    try:
        _copy(head.fc, get("fc.weight"), "fc.weight")
        if head.fc_bias is not None:
            _copy(head.fc_bias, get("fc.bias"), "fc.bias")
        if head.embed_tokens is not None:
            _copy(head.embed_tokens, get("embed_tokens.weight"), "embed_tokens.weight")
        head.layer.load_weights(get, "layers.0.", skip_input_norm=algorithm == "eagle")
        if algorithm == "eagle3":
            _copy(
                head.hidden_norm, get("layers.0.hidden_norm.weight"), "midlayer.hidden_norm.weight"
            )
            _copy(head.norm, get("norm.weight"), "norm.weight")
            if "lm_head.weight" in tensors:
                _copy(head.lm_head, tensors["lm_head.weight"], "lm_head.weight")
            elif draft_vocab == tc.vocab_size:
                head.lm_head = None  # no own lm_head and the full vocabulary: use the target's
            else:
                raise ModelLoadError("missing tensor lm_head.weight")
    except ModelLoadError as e:
        raise ModelLoadError(f"draft head {path}: {e}") from None
    if algorithm == "eagle3" and "d2t" in tensors:
        d2t = tensors["d2t"].to(torch.int64)
        if d2t.shape != (draft_vocab,):
            raise ModelLoadError(
                f"draft head {path}: d2t has shape {tuple(d2t.shape)}, expected ({draft_vocab},)"
            )
        _set_map(head, d2t + torch.arange(draft_vocab), target, f"draft head {path}: d2t")
    elif algorithm == "eagle3" and draft_vocab != tc.vocab_size:
        raise ModelLoadError(
            f"draft head {path}: draft_vocab_size {draft_vocab} < target vocabulary "
            f"{tc.vocab_size} but the checkpoint has no d2t map"
        )
    elif algorithm == "eagle" and "hot_token_id" in tensors:
        _set_map(
            head,
            tensors["hot_token_id"].to(torch.int64),
            target,
            f"draft head {path}: hot_token_id",
        )
    return head


def _set_map(head: DraftHead, m: torch.Tensor, target: CausalLM, what: str) -> None:
    if (
        m.dim() != 1
        or m.numel() == 0
        or int(m.min()) < 0
        or int(m.max()) >= target.config.vocab_size
    ):
        raise ModelLoadError(
            f"{what} must map to target ids in 0..{target.config.vocab_size - 1} (1-D int tensor)"
        )
    if head.algorithm == "eagle3" and m.numel() != head.draft_vocab_size:
        raise ModelLoadError(
            f"{what} has {m.numel()} entries, the head's lm_head has {head.draft_vocab_size}"
        )
    head.set_token_map(m)
