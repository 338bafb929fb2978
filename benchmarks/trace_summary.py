"""Where the device time goes: XLA ops of a `jax.profiler` trace, summed per program, op and kind.

    python benchmarks/grpo_step.py --size tiny --impl grpo_jax --profile /tmp/prof ...
    python benchmarks/trace_summary.py /tmp/prof --top 25

Reads the Perfetto trace (`perfetto_trace.json.gz`, written by ``jax.profiler.trace(...,
create_perfetto_trace=True)``). Counted: complete events that name an XLA op (`hlo_op`), on the device's
streams when the trace has a device process (a GPU's kernels), else on the host's XLA threads (XLA:CPU).
Ops on parallel streams or threads overlap, so the sum can exceed wall time. Kinds come from op and kernel
names: matmul (dots, GEMMs, cuBLAS/cuDNN kernels), attention (fused attention kernels), copy (copies,
transposes, memcpy, dynamic slices/updates), collective, other (elementwise and reduction fusions).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
from pathlib import Path

KINDS = (  # first match wins; matched against "<hlo_op> <event name>", lower case
    ("attention", ("fmha", "flash", "cudnn", "dot_product_attention")),
    ("matmul", ("dot", "gemm", "nvjet", "cublas", "cutlass", "sm90_xmma", "ynn_fusion", "triton_gemm", "convolution")),
    ("collective", ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective", "nccl")),
    ("copy", ("copy", "transpose", "memcpy", "memset", "dynamic-update-slice", "dynamic_update_slice",
              "dynamic-slice", "dynamic_slice", "concatenate")),
)


# the most complete events jax.profiler keeps in a trace: one that holds this many lost its later ops
TRACE_EVENT_CAP = 1_000_000


def find_trace(path: str | Path) -> Path:
    """The newest perfetto_trace.json.gz under ``path`` (or ``path`` itself)."""
    path = Path(path)
    if path.is_file():
        return path
    found = sorted(path.rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {path}: trace with "
                                "jax.profiler.trace(dir, create_perfetto_trace=True)")
    return found[-1]


def kind(op: str, name: str) -> str:
    text = f"{op} {name}".lower()
    for label, needles in KINDS:
        if any(n in text for n in needles):
            return label
    return "other"


def _self_times(ops: list[dict]):
    """(event, its duration less its nested ops') per event: a ``while`` op's body ops are not counted twice."""
    out = []
    lanes = collections.defaultdict(list)
    for e in ops:
        lanes[(e["pid"], e["tid"])].append(e)
    for lane in lanes.values():
        lane.sort(key=lambda e: (e["ts"], -e.get("dur", 0.0)))
        stack: list[list] = []  # [event, end, self time]
        for e in lane:
            dur = e.get("dur", 0.0)
            while stack and e["ts"] >= stack[-1][1]:
                out.append(tuple(stack.pop()[::2]))
            if stack:
                stack[-1][2] -= min(dur, stack[-1][1] - e["ts"])
            stack.append([e, e["ts"] + dur, dur])
        out.extend(tuple(item[::2]) for item in reversed(stack))
    return out


def summarize(path: str | Path, top: int = 15) -> dict:
    """Totals (ms) per program (`hlo_module`) and kind, and each program's ``top`` ops, of one trace; see the
    module docstring."""
    data = json.loads(gzip.decompress(find_trace(path).read_bytes()))
    events = data["traceEvents"] if isinstance(data, dict) else data
    process = {e["pid"]: e["args"].get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "process_name"}
    complete = [e for e in events if e.get("ph") == "X"]
    ops = [e for e in complete if "hlo_op" in e.get("args", {})]
    device = [e for e in ops if process.get(e["pid"], "").startswith("/device:")]
    ops = device or ops
    per_module, per_kind = collections.Counter(), collections.Counter()
    per_op, count = collections.Counter(), collections.Counter()
    per_module_kind = collections.defaultdict(collections.Counter)
    for e, self_us in _self_times(ops):
        ms = self_us / 1e3
        module, op = e["args"].get("hlo_module", "?"), e["args"]["hlo_op"]
        per_module[module] += ms
        per_kind[kind(op, e["name"])] += ms
        per_module_kind[module][kind(op, e["name"])] += ms
        key = (module, op, e["name"][:60])
        per_op[key] += ms
        count[key] += 1
    return {
        "events": len(ops), "where": "device streams" if device else "host XLA threads",
        "truncated": len(complete) >= TRACE_EVENT_CAP,
        "total_ms": sum(per_module.values()),
        "per_module_ms": dict(per_module.most_common()),
        "per_kind_ms": dict(per_kind.most_common()),
        "per_module_kind_ms": {m: dict(c.most_common()) for m, c in per_module_kind.items()},
        "top_ops": {m: [{"op": op, "name": name, "ms": ms, "count": count[(m, op, name)], "kind": kind(op, name)}
                        for (_, op, name), ms in per_op.most_common() if _ == m][:top]
                    for m, _ in per_module.most_common()},
    }


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted disjoint intervals covering the same time as ``intervals``."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _intersect(xs, ys) -> list[tuple[float, float]]:
    """The time both sorted disjoint interval lists cover."""
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        start, end = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if start < end:
            out.append((start, end))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def timeline(path: str | Path, phases: dict[str, tuple[str, ...]], start_after: tuple[str, int] | None = None) -> dict:
    """Per-device busy time (ms, the union of its XLA ops' intervals) of one trace, per phase too, and the wall
    time in which two phases ran at once. A phase is the programs (`hlo_module`) whose name holds one of its
    substrings; ops carry their device in ``device_ordinal`` (XLA:CPU) or run on a ``/device:N`` process.
    ``start_after=(phase, n)``: only the time from the start of that phase's execution n + 1 (an execution: one
    ``run_id`` of one program; the first n leave out compilation and warm-up)."""
    data = json.loads(gzip.decompress(find_trace(path).read_bytes()))
    events = data["traceEvents"] if isinstance(data, dict) else data
    process = {e["pid"]: e["args"].get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "process_name"}
    ops = [e for e in events if e.get("ph") == "X" and "hlo_op" in e.get("args", {})]
    start = 0.0
    if start_after is not None:
        phase, n = start_after
        runs: dict = {}
        for e in ops:
            module = e["args"].get("hlo_module", "")
            if any(needle in module for needle in phases[phase]):
                key = (module, e["args"].get("run_id"))
                runs[key] = min(runs.get(key, e["ts"]), e["ts"])
        starts = sorted(runs.values())
        if len(starts) <= n:
            raise ValueError(f"start_after={start_after}: the trace has {len(starts)} executions of {phase}")
        start = starts[n]
    per_device = collections.defaultdict(list)
    per_phase = collections.defaultdict(lambda: collections.defaultdict(list))
    for e in ops:
        if e["ts"] + e.get("dur", 0.0) <= start:
            continue
        name = process.get(e["pid"], "")
        device = e["args"].get("device_ordinal", name.split(":")[-1] if name.startswith("/device:") else "?")
        span = (max(e["ts"], start), e["ts"] + e.get("dur", 0.0))
        per_device[device].append(span)
        module = e["args"].get("hlo_module", "")
        for phase, needles in phases.items():
            if any(n in module for n in needles):
                per_phase[phase][device].append(span)
                break
    everything = _union([s for spans in per_device.values() for s in spans])
    wall = (everything[-1][1] - everything[0][0]) / 1e3 if everything else 0.0
    walls = {phase: _union([s for spans in devices.values() for s in spans]) for phase, devices in per_phase.items()}
    names = sorted(walls)
    return {"wall_ms": wall,
            "busy_ms": {d: _length(_union(spans)) / 1e3 for d, spans in sorted(per_device.items())},
            "phase_busy_ms": {phase: {d: _length(_union(spans)) / 1e3 for d, spans in sorted(devices.items())}
                              for phase, devices in per_phase.items()},
            "phase_wall_ms": {phase: _length(spans) / 1e3 for phase, spans in walls.items()},
            "overlap_ms": {f"{a}&{b}": _length(_intersect(walls[a], walls[b])) / 1e3
                           for i, a in enumerate(names) for b in names[i + 1:]}}


def format_summary(summary: dict) -> str:
    lines = [f"{summary['events']} XLA op events on {summary['where']}, {summary['total_ms']:.1f} ms in all"]
    if summary["truncated"]:
        lines.append(f"TRUNCATED: the trace holds {TRACE_EVENT_CAP:,} events, the profiler's most: later ops are "
                     "missing (trace fewer steps)")
    lines += ["per program:"] + [f"  {ms:9.2f} ms  {m}" for m, ms in summary["per_module_ms"].items()]
    lines += ["per kind:"] + [f"  {ms:9.2f} ms  {k}" for k, ms in summary["per_kind_ms"].items()]
    for module, ops in summary["top_ops"].items():
        if summary["per_module_ms"][module] < 0.01 * summary["total_ms"]:
            continue
        kinds = ", ".join(f"{k} {ms:.2f}" for k, ms in summary["per_module_kind_ms"][module].items())
        lines.append(f"top ops of {module} (ms: {kinds}):")
        lines += [f"  {o['ms']:9.2f} ms  x{o['count']:<5d} {o['kind']:<10s} {o['op'][:32]:<32s} {o['name'][:60]}"
                  for o in ops]
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="a jax.profiler trace folder or perfetto_trace.json.gz")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--phase", action="append", metavar="NAME=SUB,SUB", help="a timeline phase: the programs "
                        "whose name holds a SUB (repeat it); prints per-device busy time and the phases' overlap")
    args = parser.parse_args(argv)
    if args.phase:
        phases = {p.split("=")[0]: tuple(p.split("=", 1)[1].split(",")) for p in args.phase}
        result = timeline(args.trace, phases)
        print(json.dumps(result, indent=2))
        return result
    summary = summarize(args.trace, args.top)
    print(format_summary(summary))
    return summary


if __name__ == "__main__":
    main()
