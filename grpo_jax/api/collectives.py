"""The collectives of a compiled program, read from its HLO: kind, bytes, group size and how often each runs.

XLA's cost analysis counts a collective as memory bytes only, and a loop's body once. Here each collective op of the
optimized HLO text (`compiled.as_text()`) is listed with the bytes it moves per chip (an all-reduce's operand, an
all-gather's result, a reduce-scatter's operand), the devices of its replica group, and where it sits: inside a loop
whose trip count XLA knows (a scan over the layers: counted that many times) or inside one it does not (the decode
loop: once a step).
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
             "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1}
_OP = re.compile(r"^\s*(?:ROOT )?%\S+ = (.+?) (" + "|".join(KINDS) + r")(-start)?\(")
_CALLS = re.compile(r"(?:body|condition|to_apply|calls|branch_computations|async_execution_thread)=\{?%?([\w.\-]+)")
_WHILE = re.compile(r" while\(.*body=%?([\w.\-]+)")


class Collective(NamedTuple):
    kind: str
    bytes: int  # per chip, one run
    group: int  # devices in its replica group
    trips: int  # runs per run of the program, known loops counted (the decode loop's steps are not)
    per_step: bool  # inside a loop of unknown trip count (the decode loop): once a step


def _bytes(result_type: str, kind: str, start: bool, group: int) -> int:
    sizes = [math.prod(int(d) for d in dims.split(",") if d) * _ITEMSIZE.get(dtype, 4)
             for dtype, dims in re.findall(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]", result_type)]
    if not sizes:
        return 0
    if start and kind in ("all-gather", "collective-permute"):  # (operand, result, ...) tuples: the result
        size = max(sizes)
    else:
        size = sum(sizes)
    return size * group if kind == "reduce-scatter" else size


def group_size(line: str, devices: int) -> int:
    """The devices of one replica group of the collective on ``line`` (all ``devices`` when it names none)."""
    if " collective-permute" in line:
        return 2
    found = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if found:
        return len(found.group(1).split(","))
    found = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
    if found:
        return int(found.group(2))
    found = re.search(r"replica_groups=mesh\[([^\]]*)\]", line)
    if found:
        axes = dict((k.strip("'"), int(v)) for k, v in re.findall(r"('[\w]+')=(\d+)", found.group(1)))
        chosen = re.search(r"\{('[\w]+'(?:,\s*'[\w]+')*)\}", line[found.end():])
        names = [n.strip(" '") for n in chosen.group(1).split(",")] if chosen else list(axes)
        return math.prod(axes.get(n, 1) for n in names)
    return devices


def collectives(hlo_text: str, devices: int) -> list[Collective]:
    """Every collective of an optimized HLO module's text over ``devices`` chips."""
    computations: dict[str, list[str]] = {}
    name = None
    for line in hlo_text.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if header and not line.startswith(" "):
            name = header.group(1)
            computations[name] = []
        elif name is not None:
            computations[name].append(line)
    entry = next((m.group(1) for m in re.finditer(r"^ENTRY %?([\w.\-]+)", hlo_text, re.M)), None)
    out: list[Collective] = []

    def walk(comp: str, trips: int, per_step: bool, seen: tuple) -> None:
        for line in computations.get(comp, ()):
            op = _OP.match(line)
            if op:
                kind, group = op.group(2), group_size(line, devices)
                out.append(Collective(kind, _bytes(op.group(1), kind, bool(op.group(3)), group), group, trips,
                                      per_step))
            loop = _WHILE.search(line)
            if loop:
                known = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                body = loop.group(1)
                if body not in seen:
                    walk(body, trips * (int(known.group(1)) if known else 1), per_step or not known,
                         seen + (body,))
                continue
            for callee in _CALLS.findall(line):
                if callee in computations and callee not in seen:
                    walk(callee, trips, per_step, seen + (callee,))

    if entry is not None:
        walk(entry, 1, False, (entry,))
    return out
