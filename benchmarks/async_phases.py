"""Per-device phase times for async_sim.py, measured on this machine at real shapes scaled down, JSON out.

    python benchmarks/async_phases.py --out /tmp/phases.json     # CPU, small model: ~7 minutes

Scaled down from a 0.5B-7B model at 1,024-token completions: the `small` model (hidden 512, 8 layers, a random
Qwen2 of make_models.py), float32, one device. Each phase is timed at a few sizes:
- decode (`decode.measure`: the run's decoder, a static batch, EOS off): a step at each of `--decode-rows` rows
  with prompts of `--prompt-length` tokens (async_sim.py joins the points); prefill (prompt + first token) per row
  at the largest row count;
- update (`packed_update.measure`: one train step, `--layout` packed as a run picks, beta 0.04): each of
  `--update-groups` groups of 8 rows, prompts 64-512 tokens, completions geometric with mean `--update-mean` (at
  most 1,024) -> update_token_s = their seconds over their real tokens (update_fixed_s 0: a CPU's update is
  compute-bound);
- reward: `grpo_jax.rewards.math:accuracy` on `--reward-rows` completions of ~1,000 characters, per completion;
- sync: a params all-reduce or broadcast moving 2x the weight bytes over a link `--link-fraction` as fast as the
  device's measured memory bandwidth (NVLink 450 GB/s over HBM 3.35 TB/s ~ 0.13; TPU ICI over HBM ~ 0.2).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode  # noqa: E402
import packed_update  # noqa: E402


def reward_row_s(rows: int) -> float:
    """Seconds a completion of `grpo_jax.rewards.math:accuracy` on text like a math completion."""
    from grpo_jax.rewards import math as math_rewards

    rng = np.random.default_rng(0)
    words = ["so", "the", "sum", "is", "then", "we", "get", "=", "+", "x", "2", "3"]
    completions = [" ".join(rng.choice(words, 250)) + f" \\boxed{{{i}}}" for i in range(rows)]
    answers = [str(i if i % 2 else i + 1) for i in range(rows)]
    math_rewards.accuracy(["q"] * 2, completions[:2], answers[:2])  # imports and caches, as a run's first call
    start = time.perf_counter()
    math_rewards.accuracy(["q"] * rows, completions, answers)
    return (time.perf_counter() - start) / rows


def measure(args) -> dict:
    decodes = [decode.measure(args.size, rows, args.prompt_length, args.new_tokens, args.dtype, None, args.repeats)
               for rows in args.decode_rows]
    for row in decodes:
        print(json.dumps({k: row[k] for k in ("rows", "decode_step_s", "prefill_plus_one_token_s")}), flush=True)
    from grpo_jax.device import cpu

    cpu_speedups = cpu.enabled(None)  # as a run on this backend
    updates = []
    for groups in args.update_groups:
        update_args = argparse.Namespace(
            size=args.size, dtype=args.dtype, prompts=groups, generations=8, prompt_length=64, prompt_length_max=512,
            max_completion_length=1024, mean_completion=args.update_mean, remat=args.remat, scan_layers=False, layers=0,
            attention="blocked" if cpu_speedups else "dense", linear_layers=cpu_speedups,
            logps_chunk_size=args.logps_chunk_size, repeats=args.repeats, layouts=[args.layout], profile=None)
        result = packed_update.measure(update_args)
        updates.append({"groups": groups, "real_tokens": result["real_tokens"],
                        "step_s": result[args.layout]["step_s"]})
    # through the origin: a line's intercept came out negative (a longer group's attention costs more a token)
    update_token = sum(u["step_s"] for u in updates) / sum(u["real_tokens"] for u in updates)
    last = decodes[-1]
    sync = 2 * last["weight_bytes"] / (args.link_fraction * last["copy_bandwidth_bytes_per_s"])
    phases = {"decode_rows": args.decode_rows, "decode_step_s": [d["decode_step_s"] for d in decodes],
              "prefill_row_s": last["prefill_plus_one_token_s"] / last["rows"],
              "update_fixed_s": 0.0, "update_token_s": update_token,
              "reward_row_s": reward_row_s(args.reward_rows), "sync_s": sync,
              "max_rows_per_device": args.max_rows_per_device}
    return {"size": args.size, "dtype": args.dtype, "remat": args.remat, "layout": args.layout,
            "prompt_length": args.prompt_length, "phases": phases, "decode": decodes, "update": updates,
            "link_fraction": args.link_fraction, "device": last["device"], "jax_version": last["jax_version"]}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=sorted(decode.make_models.SIZES))
    parser.add_argument("--decode-rows", type=_ints, default=[16, 64, 128])
    parser.add_argument("--dtype", default="float32", help="compute dtype (an update's params stay float32)")
    parser.add_argument("--logps-chunk-size", type=int, default=0, help="train.logps_chunk_size of the updates")
    parser.add_argument("--remat", default="none", help="model.remat of the updates")
    parser.add_argument("--layout", choices=("packed", "groups"), default="packed", help="the updates' layout: "
                        "the buffers a run picks, or a buffer a group (one long buffer's dense attention overflows "
                        "an H100 at 16 rows)")
    parser.add_argument("--prompt-length", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--update-groups", type=_ints, default=[1, 2], help="groups of 8 rows a timed update")
    parser.add_argument("--update-mean", type=float, default=256.0, help="mean completion length of the updates")
    parser.add_argument("--reward-rows", type=int, default=256)
    parser.add_argument("--link-fraction", type=float, default=0.1)
    parser.add_argument("--max-rows-per-device", type=int, default=512, help="a sampling device's rows at most")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    from grpo_jax.device.cpu import configure_host_allocator

    configure_host_allocator("retain")
    return decode.write_result(measure(args), args.out)


if __name__ == "__main__":
    main()
