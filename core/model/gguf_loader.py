"""Reading a llama-architecture GGUF file (llama.cpp export) with the ``gguf`` package.

Tensors are dequantised with ``gguf.quants.dequantize`` (to float32, then cast to the model
dtype by the loader), renamed to Hugging Face names, and llama.cpp's Q/K row permutation is
undone: its converter reorders each head's rows from HF's rotate-halves layout to interleaved
pairs, ``(heads, 2, D/2) -> (heads, D/2, 2)``. Tensors are dequantised lazily, one at a time,
so peak memory stays near one float32 copy of the model.
"""

from __future__ import annotations

import dataclasses
import math
import re
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from polyspec.errors import ModelLoadError
from polyspec.model.config import ModelConfig, config_from_gguf

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a llama.cpp tensor name, or None for tensors we do not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:  # [n_head * D, ...] -> same
    """Undo llama.cpp's q/k row permutation (interleaved pairs back to rotate-halves)."""
    d = w.shape[0] // n_head
    return w.reshape(n_head, d // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# GGUF metadata value types -> struct format (scalars); 8 = string, 9 = array.
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
           11: "<q", 12: "<d"}  # fmt: skip


class _Cursor:
    """Sequential little-endian reader over the file's bytes (the header is parsed in Python:
    the gguf package's reader builds a numpy view per string and takes seconds on a 49k vocab)."""

    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ModelLoadError(
                f"{self.path} is truncated: its header ends at byte {len(self.buf)}"
            )
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise ModelLoadError(f"{self.path} is truncated or corrupt (string past the end)")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        if vtype == 8:
            return self.string()
        if vtype == 9:
            itype, n = self.take("<I"), self.take("<Q")
            if itype == 8:
                return [self.string() for _ in range(n)]
            if itype not in _SCALAR:
                raise ModelLoadError(f"{self.path}: unsupported GGUF array element type {itype}")
            fmt = _SCALAR[itype]
            size = struct.calcsize(fmt)
            if self.pos + n * size > len(self.buf):
                raise ModelLoadError(f"{self.path} is truncated or corrupt (array past the end)")
            out = list(struct.unpack_from(f"<{n}{fmt[1]}", self.buf, self.pos))
            self.pos += n * size
            return out
        if vtype not in _SCALAR:
            raise ModelLoadError(f"{self.path}: unknown GGUF metadata type {vtype} (corrupt file?)")
        return self.take(_SCALAR[vtype])


@dataclasses.dataclass(frozen=True)
class _TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (rows first): GGUF stores dims innermost first
    qtype: Any  # gguf.GGMLQuantizationType
    start: int  # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """A parsed GGUF file: metadata dict, ModelConfig, and lazily dequantised HF-named tensors."""

    def __init__(self, path: Path) -> None:
        try:
            import gguf
        except ImportError:
            raise ModelLoadError(
                "reading a .gguf file needs the gguf package: pip install 'polyspec[gguf]'"
            ) from None
        self.path = path
        self._gguf = gguf
        try:
            self._data = np.memmap(path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read {path}: {e}") from None
        self.metadata, self._infos = self._parse(memoryview(self._data))
        self._tensors = {t.name: t for t in self._infos}
        config = config_from_gguf(self.metadata, frozenset(self._tensors))
        if "rope_freqs.weight" in self._tensors:
            factors = self._dequantize("rope_freqs.weight").flatten().tolist()
            config = dataclasses.replace(
                config, rope_scaling={"rope_type": "freq_factors", "factors": tuple(factors)}
            )
        self.config: ModelConfig = config
        self.tensors = _GGUFTensors(self)

    def _parse(self, buf: memoryview) -> tuple[dict[str, Any], list[_TensorInfo]]:
        c = _Cursor(buf, self.path)
        if bytes(buf[:4]) != b"GGUF":
            raise ModelLoadError(f"{self.path} is not a GGUF file (no GGUF magic bytes)")
        c.pos = 4
        version = c.take("<I")
        if version not in (2, 3):
            raise ModelLoadError(f"{self.path}: GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = c.take("<Q"), c.take("<Q")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = c.string()
            meta[key] = c.value(c.take("<I"))
        raw = []
        for _ in range(n_tensors):
            name = c.string()
            dims = [c.take("<Q") for _ in range(c.take("<I"))]
            raw.append((name, dims, c.take("<I"), c.take("<Q")))
        align = int(meta.get("general.alignment", 32))
        base = (c.pos + align - 1) // align * align
        infos = []
        for name, dims, qt, offset in raw:
            try:
                qtype = self._gguf.GGMLQuantizationType(qt)
                block, type_size = self._gguf.GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise ModelLoadError(f"{self.path}: tensor {name} has unknown type {qt}") from None
            n = math.prod(dims)
            nbytes = n // block * type_size
            start = base + offset
            if start + nbytes > len(buf):
                raise ModelLoadError(
                    f"{self.path} is truncated or corrupt: tensor {name} needs bytes "
                    f"{start}..{start + nbytes}, the file has {len(buf)}"
                )
            infos.append(
                _TensorInfo(name, tuple(int(d) for d in reversed(dims)), qtype, start, nbytes)
            )
        return meta, infos

    def _dequantize(self, name: str) -> torch.Tensor:
        t = self._tensors[name]
        raw = self._data[t.start : t.start + t.nbytes]
        # dequantize() takes rows of bytes: [rows, bytes per row]
        rows = math.prod(t.shape[:-1]) if len(t.shape) > 1 else 1
        try:
            arr = self._gguf.quants.dequantize(np.asarray(raw).reshape(rows, -1), t.qtype)
            arr = arr.astype(np.float32, copy=False).reshape(t.shape)
            if not arr.flags.writeable:  # F32 tensors come back as views of the read-only map
                arr = arr.copy()
        except NotImplementedError:
            raise ModelLoadError(
                f"{self.path}: tensor {name} uses quantisation {t.qtype.name}, which the "
                "installed gguf package cannot dequantise; upgrade gguf or re-quantise the model"
            ) from None
        except Exception as e:
            raise ModelLoadError(f"{self.path}: tensor {name} is corrupt: {e}") from None
        return torch.from_numpy(arr)

    def tensor(self, hf: str, gguf_name: str) -> torch.Tensor:
        """Dequantised tensor ``gguf_name`` under its HF layout (q/k rows un-permuted)."""
        w = self._dequantize(gguf_name)
        if hf.endswith(("q_proj.weight", "q_proj.bias")):
            w = _unpermute(w, self.config.num_heads)
        elif hf.endswith(("k_proj.weight", "k_proj.bias")):
            w = _unpermute(w, self.config.num_kv_heads)
        return w


class _GGUFTensors(Mapping[str, torch.Tensor]):
    """HF name -> dequantised tensor, computed on access."""

    def __init__(self, f: GGUFFile) -> None:
        self._file = f
        self._names = {h: g for g in f._tensors if (h := hf_name(g)) is not None}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._file.tensor(name, self._names[name])

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def read_gguf(path: Path) -> GGUFFile:
    """Open and validate a GGUF file (raises ModelLoadError with the reason)."""
    if not path.is_file():
        raise ModelLoadError(
            f"{path} does not exist: expected a .gguf file or a checkpoint directory"
        )
    return GGUFFile(path)
