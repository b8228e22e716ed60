"""Reading a Hugging Face checkpoint directory: config.json plus weights.

Weights: ``model.safetensors``, sharded safetensors (``model.safetensors.index.json``),
``pytorch_model.bin`` or its sharded index (loaded with ``torch.load(weights_only=True)``).
Safetensors headers are checked against the file size before any tensor is used, so a truncated
or corrupt file is reported with its name and the first tensor that does not fit.
"""

from __future__ import annotations

import json
import math
import pickle
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from polyspec.errors import ModelLoadError

_ST_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8,
}  # fmt: skip


def read_json(path: Path) -> dict[str, Any]:
    """Parse a JSON file, turning any failure into a ModelLoadError naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ModelLoadError(f"{path} does not exist") from None
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot parse {path}: {e}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return data


def check_safetensors(path: Path) -> dict[str, Any]:
    """Validate a safetensors file's header against its size; return the header's tensor table."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelLoadError(
                    f"{path} is truncated or not a safetensors file ({size} bytes)"
                )
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise ModelLoadError(
                    f"{path} is truncated or corrupt: its header claims {n} bytes, the file has {size}"
                )
            header = json.loads(f.read(n))
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from None
    except ValueError as e:
        raise ModelLoadError(f"{path} has a corrupt safetensors header: {e}") from None
    data_size = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = info["data_offsets"]
            nbytes = _ST_DTYPE_BYTES[info["dtype"]] * math.prod(info["shape"])
        except (KeyError, TypeError, ValueError):
            raise ModelLoadError(f"{path}: corrupt header entry for tensor {name}") from None
        if end - start != nbytes or end > data_size or start < 0:
            raise ModelLoadError(
                f"{path} is truncated or corrupt: tensor {name} needs bytes {start}..{end} of the "
                f"data section, which holds {data_size} bytes"
            )
    return header


class SafetensorsCheckpoint(Mapping[str, torch.Tensor]):
    """Lazy name -> tensor view over one or several validated safetensors files."""

    def __init__(self, files: list[Path]) -> None:
        from safetensors import safe_open

        self._where: dict[str, Any] = {}
        self._handles = []
        for file in files:
            header = check_safetensors(file)
            try:
                handle = safe_open(str(file), framework="pt")
            except Exception as e:  # safetensors raises its own error types
                raise ModelLoadError(f"cannot open {file}: {e}") from None
            self._handles.append((file, handle))
            for name in header:
                if name != "__metadata__":
                    self._where[name] = (file, handle)

    def __getitem__(self, name: str) -> torch.Tensor:
        file, handle = self._where[name]
        try:
            return handle.get_tensor(name)
        except Exception as e:
            raise ModelLoadError(f"cannot read tensor {name} from {file}: {e}") from None

    def read_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """``self[name].narrow(dim, start, stop - start)``, reading only those bytes (a
        tensor-parallel rank's part; ``dim`` 0 or 1)."""
        file, handle = self._where[name]
        try:
            part = handle.get_slice(name)
            return part[start:stop] if dim == 0 else part[:, start:stop]
        except Exception as e:
            raise ModelLoadError(f"cannot read tensor {name} from {file}: {e}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def unsafe_pickle(exc: BaseException) -> bool:
    """Whether ``torch.load(weights_only=True)`` refused a file for naming code to run (a
    class or function beyond tensors). Its message then advises ``weights_only=False``, which
    would run that code: never pass that advice on (:func:`load_error`)."""
    return isinstance(exc, pickle.UnpicklingError) and "Unsupported global" in str(exc)


def load_error(exc: BaseException) -> str:
    """The cause of a failed ``torch.load`` in one line, without torch's advice to load with
    ``weights_only=False``."""
    text = str(exc)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
    line = next((x.strip() for x in text.splitlines() if x.strip()), type(exc).__name__)
    return line


def unsafe_pickle_message(path: Path | str) -> str:
    return (
        f"{path} was refused as unsafe: it is a pickle that needs more than tensors to load, "
        "and loading it would run code it names; convert it to safetensors with a tool you "
        "trust, or use a checkpoint in safetensors format"
    )


def _torch_load(path: Path) -> dict[str, torch.Tensor]:
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ModelLoadError(f"{path} does not exist") from None
    except Exception as e:
        if unsafe_pickle(e):
            raise ModelLoadError(unsafe_pickle_message(path)) from None
        raise ModelLoadError(
            f"{path} is truncated or corrupt (torch.load failed: {load_error(e)})"
        ) from None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ModelLoadError(f"{path} does not hold a state dict of tensors")
    return sd


def _index_files(root: Path, index: Path) -> list[Path]:
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ModelLoadError(f"{index} has no weight_map")
    names = list(dict.fromkeys(weight_map.values()))
    top = root.resolve()
    for name in names:
        if not isinstance(name, str) or not (root / name).resolve().is_relative_to(top):
            raise ModelLoadError(
                f"{index} names shard {name!r}, which is not a file inside {root}; every shard "
                "must be a relative path inside the model directory"
            )
    files = [root / f for f in names]
    absent = [str(f.name) for f in files if not f.is_file()]
    if absent:
        raise ModelLoadError(f"{index} names shard(s) that do not exist: {', '.join(absent)}")
    return files


def load_hf_weights(root: Path) -> Mapping[str, torch.Tensor]:
    """The weights of the checkpoint directory ``root`` as a name -> tensor mapping."""
    if (root / "model.safetensors").is_file():
        return SafetensorsCheckpoint([root / "model.safetensors"])
    if (root / "model.safetensors.index.json").is_file():
        return SafetensorsCheckpoint(_index_files(root, root / "model.safetensors.index.json"))
    if (root / "pytorch_model.bin").is_file():
        return _torch_load(root / "pytorch_model.bin")
    if (root / "pytorch_model.bin.index.json").is_file():
        out: dict[str, torch.Tensor] = {}
        for f in _index_files(root, root / "pytorch_model.bin.index.json"):
            out.update(_torch_load(f))
        return out
    raise ModelLoadError(
        f"{root} has no weights: expected model.safetensors, model.safetensors.index.json, "
        "pytorch_model.bin or pytorch_model.bin.index.json"
    )


def read_hf_checkpoint(root: Path) -> tuple[dict[str, Any], Mapping[str, torch.Tensor]]:
    """(parsed config.json, weights) of a Hugging Face checkpoint directory."""
    if not root.is_dir() or not (root / "config.json").is_file():
        raise ModelLoadError(
            f"{root} is not a checkpoint: expected a directory with config.json and weights, "
            "or a .gguf file"
        )
    return read_json(root / "config.json"), load_hf_weights(root)
