"""A short digest of benchmark JSON files (decode.py, grpo_step.py): the numbers RESULTS.md tables hold.

    python benchmarks/digest.py out/decode.json out/step_issue.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import trace_summary

STEP_KEYS = ("step_s", "sample_s", "score_s", "logps_s", "update_s", "compile_s", "completion_tokens_per_s",
             "fraction_of_matmul_peak", "update_fraction_of_matmul_peak", "peak_device_memory_mib", "overrides")


def digest(path: Path) -> str:
    if not path.is_file():
        return f"== {path.name}: missing (see its .log)"
    result = json.loads(path.read_text())
    if "grpo_jax" not in result:  # decode.py
        return f"== {path.name}\n" + json.dumps(result, indent=1)
    r = result["grpo_jax"]
    lines = [f"== {path.name}: {result['setting']}"]
    lines += [f"  {k}: {r[k]}" for k in STEP_KEYS if k in r]
    lines += [f"  flops: {result['flops']}", f"  executed_flops_per_step: {r.get('executed_flops_per_step')}"]
    if "profile" in r:
        lines.append(trace_summary.format_summary(r["profile"]))
    return "\n".join(lines)


if __name__ == "__main__":
    print("\n".join(digest(Path(p)) for p in sys.argv[1:]))
