"""One train step over the same rows, padded and packed (`train.packing`): time and XLA's temporaries, JSON out.

    python benchmarks/packed_update.py --size small                      # CPU, ~4 minutes
    python benchmarks/packed_update.py --size qwen0.5b --layers 2 --prompts 2 --logps-chunk-size 1  # real vocab

`--prompts` groups of `--generations` rows: prompts of `--prompt-length` .. `--prompt-length-max` real tokens
(left-padded to the maximum), completions of geometric length with mean `--mean-completion` (at most
`--max-completion-length`), the spread of real runs. Each group's prompt runs once in both layouts
(`train.share_prompt_prefix`). Per layout: the first call (compile + run), the median of `--repeats` runs, and
XLA's buffer assignment (`memory_analysis().temp_size_in_bytes`); `--remat` / `--scan-layers` as in the config.
`--attention dense` runs a packed buffer's attention dense instead of block by block (`cpu.blocked_attention`,
what a run does with `cpu_speedups`); `--layers` keeps fewer of a size's layers (a real vocabulary's share of the
work at a CPU's pace); `--layouts` picks the layouts (``groups``: a packed buffer a group; ``packed``: the buffers a
run picks); `--profile DIR` traces each layout's timed repeats for
`trace_summary.py`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode  # noqa: E402


def measure(args) -> dict:
    from grpo_jax.algo import programs, trajectory
    from grpo_jax.algo.train_step import StepOptions
    from grpo_jax.algo.trajectory import Trajectory
    from grpo_jax.device import cpu, sharding
    from grpo_jax.losses import LossConfig

    config = decode.model_config_for(args.size, args.dtype, None)
    config = dataclasses.replace(config, remat=args.remat, scan_layers=args.scan_layers,
                                 num_hidden_layers=args.layers or config.num_hidden_layers)
    mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    optimizer = optax.adamw(1e-6)
    graphdef, state = programs.init_state(config, optimizer, seed=0, with_reference=True, mesh=mesh)
    graphdef = cpu.packed_attention(cpu.linear_layers(graphdef, state.params, args.linear_layers), state.params,
                                    args.attention == "blocked")
    G, P, T = args.generations, args.prompt_length_max, args.max_completion_length
    B = args.prompts * G
    rng = np.random.default_rng(0)
    prompt_lengths = np.repeat(rng.integers(args.prompt_length, P + 1, args.prompts), G)
    prompt_mask = (np.arange(P)[None] >= (P - prompt_lengths)[:, None]).astype(np.int32)
    lengths = np.minimum(rng.geometric(1 / args.mean_completion, B), T)
    completion_mask = (np.arange(T)[None] < lengths[:, None]).astype(np.int32)
    ids = lambda n: rng.integers(2, config.vocab_size, (B, n)).astype(np.int32)  # noqa: E731
    zeros = lambda *shape: np.zeros(shape, np.float32)  # noqa: E731
    batch = Trajectory(ids(P), prompt_mask, ids(T), completion_mask, completion_mask, zeros(B, T),
                       completion_mask - 1, np.zeros(B, bool), rng.normal(size=B).astype(np.float32), None, zeros(B, T))
    options = StepOptions(LossConfig(beta=0.04), 1.0, logps_chunk_size=args.logps_chunk_size, prompt_group_size=G)
    step = programs.jit_train_step(graphdef, optimizer, options, mesh, sharding.tree_shardings(state))
    rows, initial = {}, state
    counts = np.sum(prompt_mask, 1), np.sum(completion_mask, 1)
    packings = {"padded": (0, 0), "groups": (trajectory.packed_length(*counts, G), 0),  # a buffer a group
                "packed": trajectory.choose_packing(  # as a run packs them (`train.packing: true`)
                    *counts, G, P, T, trajectory.forward_flops(config), packing=True,
                    dense_pair_cost=cpu.DENSE_PAIR_COST if args.attention == "blocked" else 1.0,
                    blocked_pairs=cpu.blocked_pairs if args.attention == "blocked" else None)}
    for name in args.layouts:
        length, buffers = packings[name]
        state = jax.tree.map(lambda x: x.copy(), initial)  # each layout's first step from the same state (donated)
        temp = step.lower(state, batch, length, buffers).compile().memory_analysis().temp_size_in_bytes
        start = time.perf_counter()
        state, metrics = step(state, batch, length, buffers)
        loss = float(metrics["loss"])
        first_s = time.perf_counter() - start
        times = []
        with (jax.profiler.trace(f"{args.profile}/{name}", create_perfetto_trace=True) if args.profile
              else contextlib.nullcontext()):
            for _ in range(args.repeats):
                start = time.perf_counter()
                state, metrics = step(state, batch, length, buffers)
                jax.block_until_ready(metrics)
                times.append(time.perf_counter() - start)
        rows[name] = {"packed_length": length, "packed_buffers": buffers or B // G, "first_call_s": first_s,
                      "step_s": statistics.median(times), "temp_gib": temp / 2 ** 30, "first_loss": loss}
        print(json.dumps({name: rows[name]}), flush=True)
    real = int(prompt_lengths[::G].sum() + lengths.sum())
    return {"size": args.size, "dtype": args.dtype, "layers": config.num_hidden_layers, "vocab_size": config.vocab_size,
            "logps_chunk_size": args.logps_chunk_size, "attention": args.attention, "rows": B, "generations": G,
            "prompt_lengths": [args.prompt_length, P],
            "max_completion_length": T, "mean_completion_length": float(lengths.mean()), "remat": args.remat,
            "scan_layers": args.scan_layers, "real_tokens": real,
            "padded_tokens": int(args.prompts * P + B * T), **rows,
            "packed_over_padded_step": (rows["packed"]["step_s"] / rows["padded"]["step_s"]
                                        if {"padded", "packed"} <= rows.keys() else None),
            "device": str(jax.devices()[0]), "jax_version": jax.__version__}


def _layouts(text: str) -> list[str]:
    names = text.split(",")
    if not names or set(names) - {"padded", "groups", "packed"}:
        raise argparse.ArgumentTypeError(f"{text!r}: give some of padded, groups, packed, comma-separated")
    return names


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=sorted(decode.make_models.SIZES))
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--prompt-length-max", type=int, default=512)
    parser.add_argument("--max-completion-length", type=int, default=512)
    parser.add_argument("--mean-completion", type=float, default=125.0)
    parser.add_argument("--dtype", default="float32", help="compute dtype (params stay float32)")
    parser.add_argument("--remat", default="none")
    parser.add_argument("--scan-layers", action="store_true")
    parser.add_argument("--layers", type=int, default=0, help="decoder layers (0: the size's own; fewer keep a "
                        "real vocabulary's shape on a CPU, e.g. --size qwen0.5b --layers 2)")
    parser.add_argument("--attention", choices=("blocked", "dense"), default="blocked",
                        help="a packed buffer's attention: `cpu.blocked_attention` (a CPU run's) or dense")
    parser.add_argument("--linear-layers", action="store_true",
                        help="the Linear layers' weight gradient the CPU switch's way (`cpu.linear_layers`, a run's)")
    parser.add_argument("--logps-chunk-size", type=int, default=0, help="train.logps_chunk_size")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--layouts", default="padded,packed", type=_layouts, help="comma-separated: padded, groups (a "
                        "packed buffer a group), packed (the buffers a run picks, `trajectory.choose_packing`)")
    parser.add_argument("--profile", metavar="DIR", help="trace each layout's timed repeats into DIR/<layout> "
                        "(read with trace_summary.py)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    from grpo_jax.device.cpu import configure_host_allocator

    configure_host_allocator("retain")
    return decode.write_result(measure(args), args.out)


if __name__ == "__main__":
    main()
