"""Safetensors without a host copy: memory-mapped reads of single-file or sharded folders, streamed writes.

The format (huggingface/safetensors): an 8-byte little-endian header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then the raw
little-endian tensor bytes, offsets relative to the end of the header. bfloat16 maps to ``ml_dtypes``.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable
from typing import NamedTuple

import ml_dtypes
import numpy as np

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
           "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


class TensorRef(NamedTuple):
    """Where one tensor lives: its file, safetensors dtype name, shape and absolute byte range."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def read_header(file: str) -> dict[str, TensorRef]:
    """Tensor name -> TensorRef from one safetensors file's header (reads only the header)."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        raw = f.read(8)
        n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
        if not 0 < n <= size - 8:
            raise ValueError(f"{file}: not a safetensors file (header length {n}, file size {size})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{file}: not a safetensors file (header is not JSON: {e})") from e
    refs = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = (8 + n + o for o in info["data_offsets"])
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{file}: tensor {name} has dtype {info['dtype']}, not one of {sorted(_DTYPES)}")
        nbytes = int(np.prod(info["shape"], dtype=np.int64)) * np.dtype(_DTYPES[info["dtype"]]).itemsize
        if end > size or end - begin != nbytes:
            raise ValueError(f"{file}: tensor {name} bytes [{begin}, {end}) do not fit its shape {info['shape']} "
                             f"or the file size {size}: the file is truncated or corrupt")
        refs[name] = TensorRef(file, info["dtype"], tuple(info["shape"]), begin, end)
    return refs


def open_folder(folder: str) -> dict[str, TensorRef]:
    """Every tensor of ``model.safetensors`` or of the shards listed in ``model.safetensors.index.json``."""
    index = os.path.join(folder, INDEX_FILE)
    single = os.path.join(folder, SINGLE_FILE)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: has no 'weight_map' object mapping tensor names to files")
        refs: dict[str, TensorRef] = {}
        headers = {}
        for name, shard in weight_map.items():
            file = os.path.join(folder, shard)
            if file not in headers:
                if not os.path.isfile(file):
                    raise ValueError(f"{index}: tensor {name} is in {shard}, which does not exist in {folder}")
                headers[file] = read_header(file)
            if name not in headers[file]:
                raise ValueError(f"{index}: tensor {name} is listed in {shard}, but {file} does not contain it")
            refs[name] = headers[file][name]
        return refs
    if os.path.isfile(single):
        return read_header(single)
    raise ValueError(f"{folder}: no weights: expected {SINGLE_FILE} or {INDEX_FILE} (only safetensors is read; "
                     "convert .bin checkpoints with transformers' save_pretrained(safe_serialization=True))")


def view(ref: TensorRef, maps: dict[str, np.memmap]) -> np.ndarray:
    """A read-only memory-mapped array of the tensor (no copy; pages load when sliced); ``maps`` caches files."""
    if ref.file not in maps:
        maps[ref.file] = np.memmap(ref.file, dtype=np.uint8, mode="r")
    raw = maps[ref.file][ref.begin:ref.end]
    return raw.view(_DTYPES[ref.dtype]).reshape(ref.shape)


def dtype_name(dtype) -> str:
    """The safetensors dtype name of a numpy / jnp dtype."""
    return _NAMES[np.dtype(dtype)]


class Entry(NamedTuple):
    """One tensor to write: name, shape, numpy dtype, and a function returning its host array."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    fetch: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def parse_size(size: int | str) -> int:
    """Bytes from an int or a transformers-style string ("5GB" = 5e9, "500MiB" = 500 * 2**20)."""
    if isinstance(size, int):
        return size
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    text = str(size).strip().upper()
    for unit, scale in units.items():
        if text.endswith(unit) and text[:-len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(text[:-len(unit)]) * scale)
    raise ValueError(f"max_shard_size={size!r} is not a size: use bytes (int) or e.g. '5GB', '500MB', '2GiB'")


def plan_shards(entries: list[Entry], max_bytes: int) -> list[list[Entry]]:
    """Greedy split in order: a new shard starts when the next tensor would exceed ``max_bytes``."""
    shards: list[list[Entry]] = [[]]
    used = 0
    for entry in entries:
        if shards[-1] and used + entry.nbytes > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(entry)
        used += entry.nbytes
    return shards


def write_file(file: str | None, entries: Iterable[Entry]) -> None:
    """Write one safetensors file, fetching one tensor at a time; ``file=None`` only fetches (other hosts)."""
    entries = list(entries)
    header, offset = {}, 0
    for e in entries:
        header[e.name] = {"dtype": dtype_name(e.dtype), "shape": list(e.shape),
                          "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep the data 8-byte aligned, as the reference writer does
    f = open(file, "wb") if file is not None else None
    try:
        if f is not None:
            f.write(struct.pack("<Q", len(blob)) + blob)
        for e in entries:
            array = np.asarray(e.fetch())
            if array.shape != tuple(e.shape) or array.dtype != np.dtype(e.dtype):
                raise ValueError(f"tensor {e.name}: fetched {array.shape} {array.dtype}, expected {e.shape} {e.dtype}")
            if f is not None:
                f.write(np.ascontiguousarray(array).tobytes())
    finally:
        if f is not None:
            f.close()


def write_folder(folder: str, entries: list[Entry], max_shard_size: int | str, *, write: bool = True) -> list[str]:
    """Write ``model.safetensors`` or ``model-0000k-of-0000n.safetensors`` + index; returns the file names.

    Existing weight files in ``folder`` are removed first so stale shards cannot be mixed in. With
    ``write=False`` every tensor is still fetched (collective gathers on other hosts) but nothing is written.
    """
    shards = plan_shards(entries, parse_size(max_shard_size))
    names = ([SINGLE_FILE] if len(shards) == 1 else
             [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    if write:
        for old in os.listdir(folder):
            if old.endswith(".safetensors") or old == INDEX_FILE:
                os.remove(os.path.join(folder, old))
    for name, shard in zip(names, shards):
        write_file(os.path.join(folder, name) if write else None, shard)
    if write and len(shards) > 1:
        index = {"metadata": {"total_size": sum(e.nbytes for e in entries)},
                 "weight_map": {e.name: name for name, shard in zip(names, shards) for e in shard}}
        with open(os.path.join(folder, INDEX_FILE), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    return names
