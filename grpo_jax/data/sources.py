"""Where prompt rows come from: a JSONL file (read here, errors by line, up to `LARGE_JSONL_BYTES`), or anything
Hugging Face `datasets` reads.

`data.path` may be a `.jsonl` file; a `.json`, `.parquet` or `.csv` file, or a glob of them; a folder written by
`Dataset.save_to_disk` (a `DatasetDict`: `data.split`); or a dataset id already in the local Hugging Face cache
(`data.split`, `data.config_name`; never downloaded). Python callers pass a `datasets.Dataset`
or a list of dicts. Everything but JSONL stays a memory-mapped Arrow table: rows are read one batch at a time by
index, so a dataset larger than memory trains, and resumes exactly (the iterator's position is an index).
"""

from __future__ import annotations

import contextlib
import glob
import io
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grpo_jax.data.prompts import message_problem, read_jsonl

FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
LARGE_JSONL_BYTES = 256 << 20  # larger JSONL files go through datasets too: memory-mapped, not a Python list


def load_rows(path: str, *, split: str = "train", config_name: str | None = None,
              key: str = "data.path") -> tuple[Sequence[dict[str, Any]], list[int] | None]:
    """(rows, their line numbers in a JSONL file or None) from `path` as `key` names it; a ValueError says what is
    wrong with it and how to fix it."""
    path = os.fspath(path)
    if path.endswith(".jsonl") and os.path.isfile(path) and os.path.getsize(path) <= LARGE_JSONL_BYTES:
        return read_jsonl(path)
    if os.path.isdir(path):
        return _checked(_from_disk(path, split, key), path), None
    files = sorted(glob.glob(path)) if glob.has_magic(path) else [path] if os.path.isfile(path) else []
    if files:
        suffixes = {Path(f).suffix.lower() for f in files}
        formats = {FORMATS.get(s) for s in suffixes}
        if None in formats or len(formats) > 1:
            raise ValueError(f"{key}={path!r}: files of type {sorted(suffixes)}: use .jsonl, .json, .parquet or .csv "
                             "files, all of one type")
        import datasets

        try:
            dataset = datasets.load_dataset(formats.pop(), data_files=files, split="train")
        except Exception as e:  # noqa: BLE001 - datasets' parse errors come in many types
            raise ValueError(f"{key}={path!r} could not be read ({type(e).__name__}: {_first_line(e)}): check the "
                             "file is valid for its extension") from e
        return _checked(dataset, path), None
    if glob.has_magic(path) or path.startswith((".", "/", "~")) or path.endswith(tuple(FORMATS)):
        raise ValueError(f"{key}={path!r} matches no file: point it at a JSONL/JSON/Parquet/CSV file, a glob of them, "
                         "a save_to_disk folder or a dataset id in the local Hugging Face cache")
    return _checked(_from_cache(path, split, config_name, key), path), None


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _from_disk(path: str, split: str, key: str):
    import datasets

    try:
        dataset = datasets.load_from_disk(path)
    except Exception as e:  # noqa: BLE001 - not a saved dataset, or one datasets cannot read (an empty one)
        raise ValueError(f"{key}={path!r} is a folder but not a dataset written by Dataset.save_to_disk that can be "
                         f"read ({type(e).__name__}: {_first_line(e)}): point it at such a folder or at a data "
                         "file") from e
    if isinstance(dataset, datasets.DatasetDict):
        if split not in dataset:
            raise ValueError(f"{key}={path!r} has splits {sorted(dataset)}, not data.split={split!r}: set data.split")
        dataset = dataset[split]
    return dataset


def _from_cache(name: str, split: str, config_name: str | None, key: str):
    """A dataset id from the local Hugging Face cache, offline: its hub snapshot (`hf download --repo-type dataset`),
    else what `datasets.load_dataset` cached of it."""
    import datasets
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(repo_id=name, repo_type="dataset", local_files_only=True)
    except Exception:  # noqa: BLE001 - not in the hub cache (or not a repo id): try datasets' own cache
        folder = None
    try:
        if folder is not None:
            return datasets.load_dataset(folder, config_name, split=split)
        with _offline():
            return datasets.load_dataset(name, config_name, split=split)
    except Exception as e:  # noqa: BLE001 - not cached, wrong split or config: all the same advice
        raise ValueError(f"{key}={name!r} is not a file or folder, and the dataset id could not be loaded from the "
                         f"local Hugging Face cache (split {split!r}, config {config_name!r}; {type(e).__name__}: "
                         f"{_first_line(e)}): download it first (`hf download --repo-type dataset {name}`), or check "
                         "data.split / data.config_name") from e


@contextlib.contextmanager
def _offline():
    """Nothing downloaded, whatever the environment says: datasets' cache only."""
    import datasets

    saved = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = saved


def from_python(rows, what: str) -> Sequence[dict[str, Any]]:
    """`train(train_dataset=...)`: a `datasets.Dataset` or a list of dicts, checked like a file's rows."""
    if isinstance(rows, list) and all(isinstance(r, dict) for r in rows):
        return _checked(rows, what)
    try:
        import datasets
    except ImportError:  # pragma: no cover - a dependency
        datasets = None
    if datasets is not None and isinstance(rows, datasets.DatasetDict):
        raise ValueError(f"{what} is a DatasetDict of splits {sorted(rows)}: pass one split, e.g. dataset['train']")
    if datasets is None or not isinstance(rows, datasets.Dataset):
        raise ValueError(f"{what} is a {type(rows).__name__}: pass a datasets.Dataset or a list of dicts")
    return _checked(rows, what)


def _checked(rows, where: str):
    """`rows` after checking every row has a 'prompt' (a string or chat messages), the errors naming the row."""
    if len(rows) == 0:
        raise ValueError(f"{where} holds no rows: it needs at least one row with a 'prompt'")
    columns = rows.column_names if hasattr(rows, "column_names") else None
    if columns is not None and "prompt" not in columns:
        raise ValueError(f"{where} has no 'prompt' column (has {columns}): rename the prompt column to 'prompt'")
    if columns is not None and "completion_ids" in columns:
        raise ValueError(f"{where} has a 'completion_ids' column: rename it (reward functions receive the "
                         "completions' token ids under that name, as in TRL)")
    prompts = rows["prompt"] if columns is not None else [row.get("prompt") for row in rows]
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, list):
            problem = message_problem(prompt)
            if problem:
                raise ValueError(f"{where}: row {i}: 'prompt' is a list but not chat messages ({problem}): use a "
                                 "string or a list of {\"role\": ..., \"content\": ...} objects")
        elif not isinstance(prompt, str):
            raise ValueError(f"{where}: row {i}: 'prompt' is a {type(prompt).__name__}: each row needs a 'prompt' "
                             "(a string or a list of chat messages)")
    return rows


WHOLE_FILE_BYTES = 64 << 20  # files up to this are hashed whole; larger ones by SAMPLES blocks (and their size)
SAMPLES, SAMPLE_BYTES = 64, 64 << 10


def fingerprint(rows, where: str, *, path: str | None = None) -> dict:
    """What a checkpoint records of the training data it indexes (`rows`, read from `where`): {"source", "rows",
    "bytes", "hash", "of"}. The files of `path` (data.path: a file, glob or save_to_disk folder) are hashed
    (xxh3-128) whole up to `WHOLE_FILE_BYTES` each, else by evenly spaced blocks; other rows (a cached dataset id,
    `train_dataset`, the embedded task) by content (a list) or by `datasets`' own fingerprint (a Dataset)."""
    import xxhash

    files = [] if path is None else _data_files(path)
    h = xxhash.xxh3_128()
    if files:
        sizes = [os.path.getsize(f) for f in files]
        for name, size in zip(files, sizes):
            h.update(size.to_bytes(8, "little"))  # a block sample alone would miss bytes added between blocks
            with open(name, "rb") as f:
                if size <= WHOLE_FILE_BYTES:
                    h.update(f.read())
                    continue
                for k in range(SAMPLES):  # mtime-independent: the same bytes give the same hash
                    f.seek((size - SAMPLE_BYTES) * k // (SAMPLES - 1))
                    h.update(f.read(SAMPLE_BYTES))
        whole = max(sizes) <= WHOLE_FILE_BYTES
        return {"source": where, "rows": len(rows), "bytes": sum(sizes), "hash": h.hexdigest(),
                "of": "the files' bytes" if whole else f"{SAMPLES} blocks of each file over {WHOLE_FILE_BYTES:,} bytes"}
    if hasattr(rows, "_indices") and hasattr(rows, "data"):  # a datasets.Dataset: its Arrow table's bytes (its own
        # _fingerprint hashes how it was made: a lambda given to .map gives another one each run)
        import pyarrow as pa

        table = (rows.flatten_indices() if rows._indices is not None else rows).data.table
        with pa.ipc.new_stream(pa.PythonFile(_HashSink(h), mode="w"), table.schema) as stream:
            stream.write_table(table)
        return {"source": where, "rows": len(rows), "bytes": None, "hash": h.hexdigest(), "of": "the rows' content"}
    h.update(json.dumps(list(rows), sort_keys=True, default=repr).encode())
    return {"source": where, "rows": len(rows), "bytes": None, "hash": h.hexdigest(), "of": "the rows' content"}


class _HashSink(io.RawIOBase):
    """A writable file that feeds what is written to a hash (an Arrow stream hashed without a copy in memory)."""

    def __init__(self, h):
        self.h = h

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.h.update(b)
        return len(b)


def _data_files(path: str) -> list[str]:
    """The files `path` reads (a file, a glob's, a folder's), or none (a cached dataset id, rows from Python)."""
    if glob.has_magic(path):
        return sorted(glob.glob(path))
    if os.path.isdir(path):
        return sorted(str(p) for p in Path(path).rglob("*") if p.is_file())
    return [path] if os.path.isfile(path) else []


def check_fingerprint(saved: dict | None, now: dict, *, step: int, allow_changed: bool) -> str | None:
    """None when the data are those checkpoint `step` indexes (or it recorded none: written before fingerprints);
    else a ValueError naming both fingerprints, or with `allow_changed` (data.allow_changed) the warning to print."""
    same = ("rows", "bytes", "hash")  # not the source's name: the same file named another way is the same data
    if saved is None or all(saved.get(k) == now[k] for k in same):
        return None

    def text(f: dict) -> str:
        size = "" if f["bytes"] is None else f"{f['bytes']:,} bytes, "
        return f"{f['rows']:,} rows, {size}xxh3 {f['hash']} of {f['of']}"

    what = f"the training data ({now['source']}) differ from those checkpoint {step} indexes (now: {text(now)}; " \
           f"then: {saved.get('source')}, {text(saved)})"
    if allow_changed:
        return f"{what}: continuing from the saved position over these data (data.allow_changed=true)"
    raise ValueError(f"cannot resume: {what}, so the saved position would pick other rows: put the data back, "
                     "choose a new output_dir, or set data.allow_changed=true to continue over these data")
