"""The tool journal: one sampling pass's tool outcomes by (row, round), appended to a JSONL file as they arrive and
read back when the pass is sampled again after a stop, so a standalone tool with side effects runs once.

Each line carries the SHA-256 of its entry (`checksum`), verified like a checkpoint's: a line that does not parse,
is not an entry (its keys and their types), or fails its checksum is ignored with one warning naming the file and
its line numbers, and the calls it recorded run again; nothing is used unverified. A line without a checksum, as
journals written before them have, is taken when it parses with the expected keys (a run in progress resumes).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import warnings
from pathlib import Path

KEYS = {"row": int, "round": int, "calls": list, "outcomes": list}  # an entry's fields and their JSON types
CHECKSUM = "sha256"


def checksum(entry: dict) -> str:
    """The SHA-256 of ``entry`` (without its checksum field) as canonical JSON: sorted keys, fixed separators."""
    body = {k: v for k, v in entry.items() if k != CHECKSUM}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def read_entry(line: bytes) -> dict | None:
    """The entry a journal line records, or None when it does not parse, is not an entry or fails its checksum."""
    try:
        entry = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):  # cut by a stop, or not JSON at all
        return None
    if not isinstance(entry, dict) or set(entry) - {CHECKSUM} != set(KEYS):
        return None
    if any(not isinstance(entry[k], t) or isinstance(entry[k], bool) for k, t in KEYS.items()):
        return None
    if CHECKSUM in entry and entry[CHECKSUM] != checksum(entry):
        return None
    return {k: entry[k] for k in KEYS}  # legacy: no checksum, taken as the run in progress wrote it


def _names(line: bytes) -> tuple[int, int] | None:
    """The (row, round) a line that is not a valid entry still names, if it does (for the message only)."""
    try:
        entry = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):  # cut: its start as `put` writes it may be left
        match = re.match(rb'\{"row": (\d+), "round": (\d+),', line)
        return None if match is None else (int(match.group(1)), int(match.group(2)))
    if isinstance(entry, dict) and all(type(entry.get(k)) is int for k in ("row", "round")):
        return entry["row"], entry["round"]
    return None


class Journal:
    """Tool results of one sampling pass by (row, round), appended to a JSONL file as they arrive and read back
    when the pass is sampled again: a call whose turn asks the same again is not run twice."""

    def __init__(self, path: Path | None):
        self.path, self._lock, self._seen = path, threading.Lock(), {}
        self._damaged = {}  # (row, round) -> the number of a bad line that still names them: said when called again
        self._newline = False  # the file ends in a partial line: the next entry starts a line of its own
        if path is None or not path.exists():
            return
        content = path.read_bytes()
        self._newline = bool(content) and not content.endswith(b"\n")
        bad = []
        for number, line in enumerate(content.split(b"\n"), 1):
            if not line.strip():
                continue
            entry = read_entry(line)
            if entry is None:
                bad.append(number)
                key = _names(line)
                if key is not None:
                    self._damaged.setdefault(key, number)
            else:
                self._seen[(entry["row"], entry["round"])] = entry
        if bad:
            lines = ", ".join(map(str, bad[:10])) + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
            warnings.warn(f"tool journal {path}: line{'s' if len(bad) > 1 else ''} {lines} did not parse as an entry "
                          "or failed its checksum (cut by a stop, or changed since): ignored, so the tool calls they "
                          "recorded run again", RuntimeWarning, stacklevel=2)

    def get(self, row: int, round_: int, calls: list) -> list | None:
        """The recorded outcomes of row ``row``'s round ``round_`` of calls, if it asked for the same ``calls``."""
        entry = self._seen.get((row, round_))
        if entry is None and (row, round_) in self._damaged:
            names = ", ".join(sorted({str((c.get("function") or c).get("name", "?")) if isinstance(c, dict) else "?"
                                      for c in calls}))
            warnings.warn(f"tool journal {self.path}: line {self._damaged.pop((row, round_))} recorded row {row}'s "
                          f"tool round {round_} but failed its checksum or did not parse: calling {names} again",
                          RuntimeWarning, stacklevel=2)
        if entry is None or entry["calls"] != json.loads(json.dumps(calls, default=str)):
            return None
        return entry["outcomes"]

    def put(self, row: int, round_: int, calls: list, results) -> None:
        """Appends row ``row``'s round ``round_`` (its ``calls`` and their `toolbox.Results`), with its checksum, and
        syncs it to disk before the results are used."""
        if self.path is None:
            return
        entry = json.loads(json.dumps({"row": row, "round": round_, "calls": calls, "outcomes": results.outcomes},
                                      default=str))  # as read back: what the checksum covers
        line = json.dumps({**entry, CHECKSUM: checksum(entry)}) + "\n"
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write("\n" + line if self._newline else line)
                f.flush()
                os.fsync(f.fileno())  # on disk before the result is used: a stop after it never calls again
            self._newline = False
            self._seen[(row, round_)] = entry
