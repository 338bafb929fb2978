"""Per-device busy time and the overlap of sampling and training, from a profiled run on a host mesh, JSON out.

    python benchmarks/async_timeline.py mesh.rollout=4 train.max_staleness=1     # split, 8 host devices, ~1 min
    python benchmarks/async_timeline.py mesh.rollout=4 train.max_staleness=0     # the synchronous control

Trains the embedded default task (`grpo-jax`'s defaults, `--steps` optimizer steps, held-out evaluation off) with the
given overrides on `--devices` XLA:CPU devices under `jax.profiler`, then reads the trace with
`trace_summary.timeline`: per device, the union of its XLA ops' intervals (busy), per phase (sample: the decoder's
programs; train: the train step's and the log-prob programs'), and the wall time in which some device sampled while
another trained; and `concurrency_probe`: whether the backend runs programs on two device groups at once at all
(XLA:CPU runs one multi-device program at a time, so a host mesh shows no overlap). The first `--skip` executions
of train programs (compilation, the pipeline filling; a round has a reference log-prob pass and its steps) are left
out: the window starts at the start of the next one and ends at the last op. `sample_wait_s`: the logged
`step_time/sample_wait` (the updates waiting for their round) summed over the steps after the first `--skip`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

PHASES = {"sample": ("generate", "start", "advance", "append", "retire", "trajectory", "concat"),
          "train": ("train_step", "jit_step", "split_step", "logps")}


def concurrency_probe(folder: Path) -> dict:
    """Whether this backend runs two programs at once on two disjoint device groups: a matmul loop on each half of
    the devices (programs `first` and `second`), each launched from its own thread, under the profiler."""
    import threading

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import trace_summary

    def first(x):
        return jax.lax.fori_loop(0, 20, lambda i, y: jnp.tanh((y @ y.T) @ y), x)

    def second(x):
        return first(x)

    devices = np.array(jax.devices())
    half = len(devices) // 2
    programs = [jax.jit(first), jax.jit(second)]
    inputs = [jax.device_put(jnp.full((128 * half, 256), 0.01), NamedSharding(Mesh(group, ("d",)), PartitionSpec("d")))
              for group in (devices[:half], devices[half:])]
    jax.block_until_ready([program(x) for program, x in zip(programs, inputs)])  # compiled
    threads = [threading.Thread(target=lambda p=p, x=x: p(x).block_until_ready()) for p, x in zip(programs, inputs)]
    with jax.profiler.trace(str(folder / "probe"), create_perfetto_trace=True):
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    result = trace_summary.timeline(folder / "probe", {"first": ("jit_first",), "second": ("jit_second",)})
    return {"phase_wall_ms": result["phase_wall_ms"], "overlap_ms": result["overlap_ms"]["first&second"]}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="dotted config overrides (mesh.rollout=4 ...)")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--skip", type=int, default=8, help="train steps left out at the start")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} " \
                              f"--xla_force_host_platform_device_count={args.devices}"
    import jax

    import trace_summary
    from grpo_jax.api import trainer
    from grpo_jax.config import load_config

    folder = Path(tempfile.mkdtemp(prefix="async_timeline_"))
    config = load_config(None, [f"output_dir={folder / 'run'}", f"max_steps={args.steps}", "eval.num_examples=0",
                                f"save_steps={args.steps}", *args.overrides])
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # Python calls would fill the trace's 1M events before the first step
    with jax.profiler.trace(str(folder / "trace"), create_perfetto_trace=True, profiler_options=options):
        summary = trainer.train(config, show_progress=False)
    result = trace_summary.timeline(folder / "trace", PHASES, start_after=("train", args.skip))
    result["concurrency_probe"] = concurrency_probe(folder)
    lines = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
    result.update(overrides=args.overrides, devices=args.devices, steps=args.steps, skip=args.skip,
                  sample_wait_s=sum(line.get("step_time/sample_wait", 0.0) for line in lines[args.skip:]),
                  reward_last=lines[-1].get("reward"), output_dir=summary.get("output_dir"), trace=str(folder))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
