"""The Hugging Face ``transformers`` baseline: ``model.generate`` on the same model, dtype and
prompt token ids, KV cache on, batch 1 or left-padded batches."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from polyspec.bench.runner import SystemResult, progress_bar
from polyspec.config import SamplingParams
from polyspec.errors import ModelLoadError


def transformers_missing_reason() -> str | None:
    """Why the baseline cannot run here (None when ``transformers`` imports)."""
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        return f"transformers is not installed ({exc}); `pip install transformers` to compare"
    return None


def load_hf_model(target: str | Path, dtype: torch.dtype, device: torch.device):
    """``AutoModelForCausalLM`` for a Hugging Face directory or a .gguf file (dequantised to
    dense ``dtype`` weights by transformers, which needs the ``gguf`` package) on ``device``."""
    import transformers
    from transformers import AutoModelForCausalLM

    path = Path(target)
    # transformers 4.56 renamed torch_dtype to dtype (the old name warns from then on)
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    kw = {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": dtype}
    try:
        if path.suffix == ".gguf":
            kw["gguf_file"] = path.name
            path_arg = str(path.parent)
            # Newer transformers keep GGUF blocks packed and matmul through fp32 kernels
            # (when the `kernels` package is installed): another model and dtype than
            # polyspec's. Unpack to dense weights in ``dtype``, as older releases always did.
            gguf_config = getattr(transformers, "GgufConfig", None)
            if gguf_config is not None:
                kw["quantization_config"] = gguf_config(gguf_file=path.name, dequantize=True)
        else:
            path_arg = str(path)
        model = AutoModelForCausalLM.from_pretrained(path_arg, **kw)
    except (OSError, ValueError, ImportError) as exc:
        raise ModelLoadError(
            f"transformers cannot load {path} for the baseline: {exc} (pass --no-transformers "
            "to skip the baseline)"
        ) from exc
    return model.to(device).eval()


def _generation_config(sampling: SamplingParams, eos_ids: Sequence[int], pad_id: int):
    """Greedy (temperature 0) or the same temperature / top-k / top-p as polyspec."""
    from transformers import GenerationConfig

    sample = sampling.temperature > 0
    # A fresh config so that the checkpoint's generation_config.json (repetition penalty,
    # top_k=50, ...) cannot make the baseline do different work from polyspec.
    kw = dict(
        max_new_tokens=sampling.max_new_tokens,
        min_new_tokens=sampling.max_new_tokens if sampling.ignore_eos else 0,
        do_sample=sample,
        use_cache=True,
        eos_token_id=list(eos_ids),
        pad_token_id=pad_id,
        num_beams=1,
    )
    if sample:
        kw.update(temperature=sampling.temperature, top_k=sampling.top_k or None,
                  top_p=sampling.top_p)  # fmt: skip
    else:
        kw.update(temperature=None, top_k=None, top_p=None)
    return GenerationConfig(**kw)


def _trim(row: list[int], eos_ids: frozenset[int]) -> list[int]:
    """Generated ids up to and including the first EOS (what polyspec returns); the padding
    transformers appends after a finished row of a batch is dropped."""
    for i, t in enumerate(row):
        if t in eos_ids:
            return row[: i + 1]
    return row


def _left_pad(
    prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [bs, L], attention_mask [bs, L]) with prompts right-aligned."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


def run_transformers(
    model,
    prompt_ids: Sequence[Sequence[int]],
    sampling: SamplingParams,
    eos_ids: Sequence[int],
    pad_id: int,
    batch_size: int = 1,
    synchronize: Callable[[], None] = lambda: None,
    progress: bool = True,
    warmup: bool = True,
) -> SystemResult:
    """Warm up on the first batch (untimed), then time ``model.generate`` over all prompts in
    batches of ``batch_size`` (left padding when > 1). ``synchronize`` waits for the device
    (the polyspec backend's, so that core never names a vendor API)."""
    device = next(model.parameters()).device
    gen_cfg = _generation_config(sampling, eos_ids, pad_id)
    eos = frozenset(eos_ids)
    if sampling.seed is not None:
        torch.manual_seed(sampling.seed)

    def generate(batch: Sequence[Sequence[int]]) -> list[list[int]]:
        ids, mask = _left_pad(batch, pad_id, device)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_cfg)
        return [_trim(row, eos) for row in out[:, ids.shape[1] :].tolist()]

    if warmup:
        generate(prompt_ids[:batch_size])
    bar = progress_bar("transformers", len(prompt_ids), progress)
    outputs: list[list[int]] = []
    try:
        synchronize()
        t0 = time.perf_counter()
        for start in range(0, len(prompt_ids), batch_size):
            batch = prompt_ids[start : start + batch_size]
            outputs += generate(batch)
            bar.update(len(batch))
        synchronize()
        wall = time.perf_counter() - t0
    finally:
        bar.close()
    return SystemResult(
        name="transformers",
        num_tokens=sum(len(o) for o in outputs),
        wall_s=wall,
        outputs=outputs,
    )
