"""A compiled program read from its optimized HLO text (`compiled.as_text()`): its collectives, and the bytes it moves
through HBM, instruction by instruction, once per run and once per step of its decode loop.

XLA's cost analysis counts a loop's body once, its collectives as memory bytes only, an in-place update (a token's
keys written into the KV pool, a ring slot) as a read and a write of the whole buffer, and a Mosaic kernel's
operands as the kernel declares them. A decode program is mostly one loop of unknown trip count (a step a trip)
after one-time work (the loop state's set-up, layer slices); `traffic` counts the two apart, with these rules:

- an instruction moves its operands and its result, except where XLA's own buffers say otherwise: an array placed
  in a TPU's on-chip memory (a layout's ``S(n)``, n >= 1: VMEM, SMEM, sync flags) moves nothing through HBM; a
  slice, dynamic slice or gather reads what it returns, not its whole operand (in a fusion too, where those are an
  operand's only users); an in-place update (dynamic-update-slice, scatter, unfused or a fusion's root) reads and
  writes its update, not the buffer it updates;
- ``parameter``, ``get-tuple-element``, ``tuple``, ``bitcast``, constants and an async op's ``-done`` move nothing;
  an async ``-start`` moves its operands and its result less the operands its result tuple repeats, but an async
  slice (``slice-start``: XLA:TPU streaming a weight into VMEM in pieces) reads only its piece;
- a loop of known trip count (a scan) counts its body that many times; one of unknown trip count (the decode loop)
  counts its body once, as one step; a conditional counts its largest branch;
- a custom call (a Pallas kernel) moves its operands and results, except operands of the shapes in ``skip``
  (the KV pages a paged-attention kernel reads where its page table points, counted by hand by the caller).
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
             "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1}
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\](\{[^}]*\})?")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([\w\-]+)\((.*)$")
_CALLS = re.compile(r"(?:body|condition|to_apply|calls|branch_computations|async_execution_thread|true_computation|"
                    r"false_computation)=\{?%?([\w.\-]+)")
_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "partition-id", "replica-id",
         "opt-barrier", "add-dependency"}
_SLICES = {"slice", "dynamic-slice", "gather"}


class Instruction(NamedTuple):
    name: str
    type: str  # its result's type, layouts included
    opcode: str
    operands: tuple[str, ...]
    line: str

    def attribute(self, key: str) -> list[str]:
        """The computations named by ``key=`` (``branch_computations={%a, %b}``: both)."""
        found = re.search(key + r"=(\{[^}]*\}|%?[\w.\-]+)", self.line)
        return re.findall(r"%?([\w.\-]+)", found.group(1).strip("{}")) if found else []


class Collective(NamedTuple):
    kind: str
    bytes: int  # per chip, one run
    group: int  # devices in its replica group
    trips: int  # runs per run of the program, known loops counted (the decode loop's steps are not)
    per_step: bool  # inside a loop of unknown trip count (the decode loop): once a step


class Traffic(NamedTuple):
    """HBM bytes per chip: ``once`` a run outside any loop of unknown trip count, ``per_step`` a trip of it."""

    once: float
    per_step: float


def array_bytes(type_text: str, hbm_only: bool = False) -> int:
    """Bytes of the arrays a type names (a tuple's elements summed); ``hbm_only``: those laid out in HBM."""
    total = 0
    for dtype, dims, layout in _ARRAY.findall(type_text):
        space = re.search(r"S\((\d+)\)", layout or "")
        if hbm_only and space and int(space.group(1)) > 0:
            continue
        total += math.prod(int(d) for d in dims.split(",") if d) * _ITEMSIZE.get(dtype, 4)
    return total


def computations(hlo_text: str) -> tuple[dict[str, list[Instruction]], str | None]:
    """({computation: its instructions}, the entry computation's name) of an HLO module's text."""
    out: dict[str, list[Instruction]] = {}
    name = entry = None
    for line in hlo_text.splitlines():
        header = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if header and not line.startswith(" "):
            name = header.group(2)
            entry = name if header.group(1) else entry
            out[name] = []
            continue
        found = _INSTRUCTION.match(line) if name is not None else None
        if found:
            args = found.group(4)
            operands = tuple(re.findall(r"%([\w.\-]+)", args[:args.find(")")] if ")" in args else args))
            out[name].append(Instruction(found.group(1), found.group(2), found.group(3), operands, line))
    return out, entry


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


def _collective_bytes(result_type: str, kind: str, start: bool, group: int) -> int:
    sizes = [array_bytes(f"{dtype}[{dims}]") for dtype, dims, _ in _ARRAY.findall(result_type)]
    if not sizes:
        return 0
    if start and kind in ("all-gather", "collective-permute"):  # (operand, result, ...) tuples: the result
        size = max(sizes)
    else:
        size = sum(sizes)
    return size * group if kind == "reduce-scatter" else size


def _loop_trips(instruction: Instruction) -> int | None:
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', instruction.line)
    return int(known.group(1)) if known else None


def collectives(hlo_text: str, devices: int) -> list[Collective]:
    """Every collective of an optimized HLO module's text over ``devices`` chips: the bytes it moves per chip (an
    all-reduce's operand, an all-gather's result, a reduce-scatter's operand), its replica group, and where it sits
    (inside a loop whose trip count XLA knows: counted that many times; inside one it does not: once a step)."""
    comps, entry = computations(hlo_text)
    out: list[Collective] = []

    def walk(comp: str, trips: int, per_step: bool, seen: tuple) -> None:
        for ins in comps.get(comp, ()):
            kind = ins.opcode.removesuffix("-start")
            if kind in KINDS:
                group = group_size(ins.line, devices)
                out.append(Collective(kind, _collective_bytes(ins.type, kind, ins.opcode.endswith("-start"), group),
                                      group, trips, per_step))
            if ins.opcode == "while":
                known = _loop_trips(ins)
                for body in ins.attribute("body"):
                    if body not in seen:
                        walk(body, trips * (known or 1), per_step or known is None, seen + (body,))
                continue
            for callee in _CALLS.findall(ins.line):
                if callee in comps and callee not in seen:
                    walk(callee, trips, per_step, seen + (callee,))

    if entry is not None:
        walk(entry, 1, False, (entry,))
    return out


def _dims(type_text: str) -> tuple[int, ...] | None:
    arrays = _ARRAY.findall(type_text)
    return tuple(int(d) for d in arrays[0][1].split(",") if d) if len(arrays) == 1 else None


def _fusion_bytes(ins: Instruction, fused: list[Instruction], operand_types: list[str]) -> int:
    """A fusion's HBM bytes: each operand as its fused parameter is used (only sliced: what the slices return; the
    buffer an in-place root updates: nothing), and its result (an in-place root's: the update it writes)."""
    by_name = {f.name: f for f in fused}
    params = {int(re.search(r"parameter\((\d+)\)", f.line).group(1)): f.name for f in fused if f.opcode == "parameter"}
    users: dict[str, list[Instruction]] = {}
    for f in fused:
        for o in f.operands:
            users.setdefault(o, []).append(f)

    def source(name: str) -> str:  # through bitcasts and copies, to what a fused value is a view of
        while by_name[name].opcode in ("bitcast", "copy") and by_name[name].operands:
            name = by_name[name].operands[0]
        return name

    root = next((f for f in fused if f.line.lstrip().startswith("ROOT")), fused[-1])
    roots = [by_name[o] for o in root.operands] if root.opcode == "tuple" else [root]
    in_place, written = set(), 0
    for r in roots:
        r = by_name[source(r.name)]
        if r.opcode in ("dynamic-update-slice", "scatter") and by_name[source(r.operands[0])].opcode == "parameter":
            in_place.add(source(r.operands[0]))
            update = r.operands[1] if r.opcode == "dynamic-update-slice" else r.operands[2]
            written += array_bytes(by_name[update].type, hbm_only=True)
        else:
            written += array_bytes(r.type)
    if not in_place:
        written = array_bytes(ins.type, hbm_only=True)
    read = 0
    for index, type_text in enumerate(operand_types):
        param = params.get(index)
        if param is None or param in in_place or not array_bytes(type_text, hbm_only=True):
            continue
        uses = users.get(param, [])
        if uses and all(u.opcode in _SLICES and u.operands[0] == param for u in uses):
            read += sum(array_bytes(u.type) for u in uses)
        else:
            read += array_bytes(type_text, hbm_only=True)
    return read + written


def _instruction_bytes(ins: Instruction, types: dict[str, str], comps: dict, skip: frozenset) -> int:
    operand_types = [types.get(o, "") for o in ins.operands]

    def hbm(type_text: str) -> int:
        return array_bytes(type_text, hbm_only=True)

    op = ins.opcode
    if op in _FREE or op.endswith("-done"):
        return 0
    if op == "slice-start":  # XLA:TPU streams a weight into VMEM piece by piece: each reads its piece only
        piece = "{}[{}]{}".format(*_ARRAY.findall(ins.type)[len(_ARRAY.findall(operand_types[0]))])
        return (array_bytes(piece) if hbm(operand_types[0]) else 0) + hbm(piece)
    if op.endswith("-start"):
        read = sum(hbm(t) for t in operand_types)
        result = hbm(ins.type)
        return read + (result - read if ins.type.startswith("(") and result >= read else result)
    if op == "dynamic-update-slice":
        return 2 * hbm(operand_types[1]) + sum(hbm(t) for t in operand_types[2:])
    if op == "scatter":
        return 2 * hbm(operand_types[2]) + hbm(operand_types[1])
    if op in _SLICES:
        return 2 * hbm(ins.type) + sum(hbm(t) for t in operand_types[1:])
    if op == "fusion":
        fused = comps.get((ins.attribute("calls") or [""])[0])
        if fused:
            return _fusion_bytes(ins, fused, operand_types)
    if op == "custom-call":
        return hbm(ins.type) + sum(hbm(t) for t in operand_types if _dims(t) not in skip)
    return hbm(ins.type) + sum(hbm(t) for t in operand_types)


def traffic(hlo_text: str, skip: frozenset = frozenset()) -> Traffic:
    """The HBM bytes per chip of one run of an optimized HLO module (module docstring's rules): outside any loop of
    unknown trip count, and in one trip of it. ``skip``: dims of custom-call operands counted by the caller."""
    comps, entry = computations(hlo_text)

    def walk(comp: str, seen: tuple) -> Traffic:
        once = step = 0.0
        instructions = comps.get(comp, ())
        types = {i.name: i.type for i in instructions}
        for ins in instructions:
            if ins.opcode == "while":
                known = _loop_trips(ins)
                body = [walk(c, seen + (c,)) for c in ins.attribute("body") + ins.attribute("condition")
                        if c not in seen]
                if known is None:  # a step a trip: everything in it, once
                    step += sum(t.once + t.per_step for t in body)
                else:
                    once += known * sum(t.once for t in body)
                    step += known * sum(t.per_step for t in body)
            elif ins.opcode == "conditional":
                branches = [walk(c, seen + (c,)) for c in ins.attribute("branch_computations")
                            + ins.attribute("true_computation") + ins.attribute("false_computation") if c not in seen]
                if branches:
                    once += max(t.once for t in branches)
                    step += max(t.per_step for t in branches)
            elif ins.opcode in ("call", "async-start"):
                for callee in ins.attribute("to_apply") + ins.attribute("calls"):
                    if callee not in seen:
                        inner = walk(callee, seen + (callee,))
                        once, step = once + inner.once, step + inner.per_step
            else:
                once += _instruction_bytes(ins, types, comps, skip)
        return Traffic(once, step)

    return walk(entry, (entry,)) if entry is not None else Traffic(0.0, 0.0)
