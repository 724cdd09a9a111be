"""One entry point for model files: HF directories and GGUF files look the same from here.

Callers get an HF-style config dict, a generation config dict and `(hf_name, tensor)` pairs,
whatever the source format, so model code and the registry never branch on it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open

from pipeline.embedded import embedded_model_path
from pipeline.models.gguf_file import (
    gguf_hf_config,
    is_gguf_path,
    iter_gguf_weights,
    metadata_value,
    open_gguf,
)

SINGLE_SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def resolve_model_path(model: str | None) -> str:
    """An absolute path to an HF model directory or a .gguf file; None means the embedded model.

    A directory holding no config.json but exactly one .gguf resolves to that file.
    """
    if model is None:
        return embedded_model_path()
    path = os.path.abspath(os.path.expanduser(model))
    if not os.path.exists(path):
        raise FileNotFoundError(f"Model path {model!r} does not exist (model ids are not downloaded).")
    if os.path.isfile(path):
        if not is_gguf_path(path):
            raise ValueError(f"Model file {model!r} is not a .gguf file; pass a .gguf or an HF model directory.")
        return path
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    ggufs = sorted(name for name in os.listdir(path) if is_gguf_path(name))
    if len(ggufs) == 1:
        return os.path.join(path, ggufs[0])
    if ggufs:
        raise ValueError(f"Directory {model!r} holds several .gguf files {ggufs}; pass one of them.")
    raise ValueError(f"Directory {model!r} has no config.json and no .gguf file; it is not a model.")


def _read_json(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def load_hf_config(path: str) -> dict[str, Any]:
    """The model's config.json, or its equivalent synthesized from GGUF metadata."""
    if is_gguf_path(path):
        return gguf_hf_config(open_gguf(path))
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{path!r} has no config.json.")
    return _read_json(config_path)


def load_generation_config(path: str) -> dict[str, Any]:
    """generation_config.json ({} when absent); for GGUF only the special token ids are known."""
    if is_gguf_path(path):
        reader = open_gguf(path)
        generation: dict[str, Any] = {}
        for key in ("bos_token_id", "eos_token_id"):
            value = metadata_value(reader, f"tokenizer.ggml.{key}")
            if value is not None:
                generation[key] = int(value)
        return generation
    generation_path = os.path.join(path, "generation_config.json")
    return _read_json(generation_path) if os.path.isfile(generation_path) else {}


def safetensors_files(path: str) -> list[str]:
    """The safetensors shards of an HF directory, in index order."""
    index_path = os.path.join(path, SAFETENSORS_INDEX)
    if os.path.isfile(index_path):
        weight_map: dict[str, str] = _read_json(index_path)["weight_map"]
        shards = list(dict.fromkeys(weight_map.values()))
        return [os.path.join(path, shard) for shard in shards]
    single = os.path.join(path, SINGLE_SAFETENSORS)
    if os.path.isfile(single):
        return [single]
    raise FileNotFoundError(f"{path!r} has neither {SINGLE_SAFETENSORS} nor {SAFETENSORS_INDEX}.")


def iter_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs, read lazily one tensor at a time so memory stays flat."""
    if is_gguf_path(path):
        yield from iter_gguf_weights(path)
        return
    for shard in safetensors_files(path):
        with safe_open(shard, framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


class SafetensorsCheckpoint:
    """Random access by name to an HF directory's tensors: headers are read when it opens, a tensor's bytes only when
    ``get`` asks for it, so a weight can be read with its scale from whichever shard holds it."""

    def __init__(self, path: str) -> None:
        self.shard_of: dict[str, str] = {}  # tensor name -> shard file, in shard then file order
        self._handles: dict[str, Any] = {}
        for shard in safetensors_files(path):
            for name in self._handle(shard).keys():
                self.shard_of[name] = shard

    def _handle(self, shard: str) -> Any:
        if shard not in self._handles:
            self._handles[shard] = safe_open(shard, framework="pt")
        return self._handles[shard]

    def names(self) -> list[str]:
        return list(self.shard_of)

    def __contains__(self, name: str) -> bool:
        return name in self.shard_of

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self.shard_of[name]).get_slice(name).get_shape())

    def dtype_name(self, name: str) -> str:
        """The header's dtype: "BF16", "F32", "F8_E4M3", ..."""
        return self._handle(self.shard_of[name]).get_slice(name).get_dtype()

    def get(self, name: str) -> torch.Tensor:
        return self._handle(self.shard_of[name]).get_tensor(name)
