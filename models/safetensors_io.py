"""Memory-mapped reading of HF safetensors checkpoints (single file or sharded with an index).

Tensors are numpy views into an `np.memmap` of each file, so nothing is read until a slice is
used; a loader can place one layer at a time on its devices. The format is validated up front (header
size, JSON, every tensor's byte range inside the file) so a truncated download fails with a message
naming the file instead of producing garbage weights.
"""
from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint file or directory that cannot be read as described."""


class SafetensorsFile:
    """One .safetensors file: header parsed eagerly, data memory-mapped lazily."""

    def __init__(self, path: str):
        self.path = path
        size = os.path.getsize(path)
        if size < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes)")
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                raise CheckpointError(f"{path}: truncated safetensors file (header of {header_len} bytes "
                                      f"but only {size - 8} follow)")
            try:
                header = json.loads(f.read(header_len))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{path}: corrupt safetensors header: {e}") from e
        self.metadata = header.pop("__metadata__", None) or {}
        self._data_start = 8 + header_len
        data_size = size - self._data_start
        self.entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        for name, e in header.items():
            if e.get("dtype") not in DTYPES:
                raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {e.get('dtype')!r}")
            dtype, shape = DTYPES[e["dtype"]], tuple(e["shape"])
            begin, end = e["data_offsets"]
            if end > data_size:
                raise CheckpointError(f"{path}: truncated safetensors file: tensor {name!r} ends at byte "
                                      f"{end} of data but the file holds {data_size}")
            if end - begin != dtype.itemsize * int(np.prod(shape, dtype=np.int64)):
                raise CheckpointError(f"{path}: tensor {name!r} byte range does not match shape {shape}")
            self.entries[name] = (dtype, shape, begin, end)
        self._mmap = None

    def get(self, name: str) -> np.ndarray:
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        dtype, shape, begin, end = self.entries[name]
        raw = self._mmap[self._data_start + begin:self._data_start + end]
        return raw.view(dtype).reshape(shape)


class TensorSource:
    """All tensors of an HF model directory, by name."""

    def __init__(self, directory: str):
        self.directory = directory
        index_path = os.path.join(directory, INDEX_FILE)
        single = os.path.join(directory, SINGLE_FILE)
        if os.path.isfile(index_path):
            try:
                with open(index_path) as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index_path}: not a valid safetensors index ({e})") from e
            files = {fn: None for fn in weight_map.values()}
        elif os.path.isfile(single):
            files, weight_map = {SINGLE_FILE: None}, None
        else:
            raise CheckpointError(f"{directory}: no {SINGLE_FILE} or {INDEX_FILE}")
        self._files: dict[str, SafetensorsFile] = {}
        for fn in files:
            p = os.path.join(directory, fn)
            if not os.path.isfile(p):
                raise CheckpointError(f"{directory}: shard {fn} named in {INDEX_FILE} is missing")
            self._files[fn] = SafetensorsFile(p)
        self._where: dict[str, SafetensorsFile] = {}
        for fn, sf in self._files.items():
            for name in sf.entries:
                self._where[name] = sf
        if weight_map is not None:
            missing = [k for k, fn in weight_map.items() if k not in self._files[fn].entries]
            if missing:
                raise CheckpointError(f"{directory}: tensors listed in the index are absent from their "
                                      f"shards: {missing[:5]}")

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return self._where[name].entries[name][1]

    def dtype(self, name: str) -> np.dtype:
        return self._where[name].entries[name][0]

    def get(self, name: str) -> np.ndarray:
        """A read-only memory-mapped view of tensor `name`."""
        if name not in self._where:
            raise CheckpointError(f"{self.directory}: tensor {name!r} is missing")
        return self._where[name].get(name)
