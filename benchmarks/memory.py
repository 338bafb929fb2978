"""Peak device memory per phase (sampling, log-probs, train step) of a Qwen2.5-0.5B-shaped random model, on CPU.

Compiles each phase for abstract inputs (nothing is allocated: `jax.jit(...).lower(...).compile()
.memory_analysis()`) and reports XLA's buffer assignment: arguments, outputs, temporaries and the peak
estimate arguments + outputs - donated aliases + temporaries, with and without chunked log-probs and remat.
`--lora R` adds the same phases with LoRA adapters of rank R on every projection (`model.lora`, the base frozen,
no reference copy); `--time-steps N` also times N train steps of each on real arrays (interleaved, median after a
warm-up), on `--time-layers` of the model's layers and `--time-rows` rows when the whole model is too slow.

    python benchmarks/memory.py            # Qwen2.5-0.5B shape, 8 rows x (128 prompt + 256 completion) tokens
    python benchmarks/memory.py --quick    # a tiny model, for a smoke test
    python benchmarks/memory.py --lora 16 --remat none --time-steps 5 --time-rows 1   # full FT vs LoRA r=16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402


from grpo_jax.algo import decoder  # noqa: E402
from grpo_jax.algo.programs import init_state, jit_logps, jit_train_step  # noqa: E402
from grpo_jax.algo.sampling import SamplingConfig  # noqa: E402
from grpo_jax.algo.state import abstract_state as library_abstract_state, make_optimizer, model_graphdef  # noqa: E402
from grpo_jax.algo.train_step import StepOptions  # noqa: E402
from grpo_jax.algo.trajectory import Trajectory  # noqa: E402
from grpo_jax.config.model import LoRAConfig, ModelConfig  # noqa: E402
from grpo_jax.device import cpu, sharding  # noqa: E402
from grpo_jax.losses import LossConfig  # noqa: E402

QWEN25_05B = ModelConfig(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                         max_position_embeddings=32768, rope_theta=1e6)
TINY = ModelConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2)
GIB = 2 ** 30


def _abstract(shape, dtype, s):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=s)


def abstract_state(config: ModelConfig, optimizer, mesh):
    """The TrainState's shapes and shardings (policy, float32 Adam moments of the trained params, a reference copy
    unless LoRA adapters make the base the reference), nothing allocated."""
    state = library_abstract_state(config, optimizer, with_reference=True)
    shardings = sharding.state_shardings(mesh, state)
    return jax.tree.map(lambda x, s: _abstract(x.shape, x.dtype, s), state, shardings), shardings


def stats(compiled) -> dict:
    """XLA's buffer sizes in bytes; peak = arguments + outputs - donated aliases + temporaries."""
    m = compiled.memory_analysis()
    peak = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    return {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
            "aliased": m.alias_size_in_bytes, "temporaries": m.temp_size_in_bytes, "peak": peak}


def measure(config: ModelConfig, *, rows: int, prompt: int, completion: int, chunk: int, remat: str,
            every_phase: bool = False) -> list[dict]:
    mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    config = dataclasses.replace(config, remat=remat)
    graphdef = model_graphdef(config)
    optimizer = make_optimizer(optax.constant_schedule(1e-6), weight_decay=0.0, b1=0.9, b2=0.99, eps=1e-8,
                               max_grad_norm=1.0)
    state, shardings = abstract_state(config, optimizer, mesh)
    rs = sharding.row_sharded(mesh)
    ids = lambda n, dt=jnp.int32: _abstract((rows, n), dt, rs)  # noqa: E731
    out = []

    def record(phase, lowered, **extra):
        timer = time.perf_counter()
        compiled = lowered.compile()
        out.append({"phase": phase, "lora": config.lora.rank, "remat": remat, "logps_chunk_size": chunk, **extra,
                    **stats(compiled), "compile_s": round(time.perf_counter() - timer, 1)})

    if every_phase or (chunk == 0 and remat == "none"):  # sampling does not depend on either
        options = decoder.DecodeOptions(SamplingConfig(max_completion_length=completion), (0,), 0)
        sample = jax.jit(lambda p, i, m, k: decoder.generate(graphdef, p, i, m, k, options),
                         in_shardings=(shardings.params, rs, rs, None))
        record("sampling", sample.lower(state.params, ids(prompt), ids(prompt),
                                        jax.eval_shape(lambda: jax.random.PRNGKey(0))))
    if every_phase or remat == "none":
        logps = jit_logps(graphdef, mesh, temperature=1.0, chunk_size=chunk, params_sharding=shardings.params)
        record("logps", logps.lower(state.params, ids(prompt), ids(prompt), ids(completion), ids(completion),
                                    None))
    batch = Trajectory(ids(prompt), ids(prompt), ids(completion), ids(completion), ids(completion),
                       ids(completion, jnp.float32), ids(completion), _abstract((rows,), jnp.bool_, rs),
                       _abstract((rows,), jnp.float32, rs), ids(completion, jnp.float32), ids(completion, jnp.float32))
    step = jit_train_step(graphdef, optimizer, StepOptions(LossConfig(beta=0.04), 1.0, logps_chunk_size=chunk),
                          mesh, shardings)
    record("train_step", step.lower(state, batch))
    return out


def time_steps(configs: list[ModelConfig], *, rows: int, prompt: int, completion: int, chunk: int,
               steps: int) -> list[float]:
    """Median seconds of a train step (beta 0.04) of each config on real random arrays, one device, with the
    run's CPU speed-ups (`cpu.linear_layers`, as `grpo_jax.api.run.build` applies them): after one warm-up step each,
    `steps` rounds that step every config once, in alternating order (a loaded machine slows them alike)."""
    mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    optimizer = make_optimizer(optax.constant_schedule(1e-6), weight_decay=0.0, b1=0.9, b2=0.99, eps=1e-8,
                               max_grad_norm=1.0)
    runs = []
    for config in configs:
        graphdef, state = init_state(config, optimizer, seed=0, with_reference=True, mesh=mesh)
        graphdef = cpu.linear_layers(graphdef, state.params, cpu.enabled(None))
        keys = jax.random.split(jax.random.PRNGKey(0), 4)
        prompt_ids, completion_ids = (jax.random.randint(k, (rows, n), 0, config.vocab_size)
                                      for k, n in zip(keys, (prompt, completion)))
        ones = jnp.ones((rows, completion), jnp.int32)
        batch = Trajectory(prompt_ids, jnp.ones((rows, prompt), jnp.int32), completion_ids, ones, ones,
                           jnp.zeros((rows, completion), jnp.float32), jnp.zeros_like(ones), jnp.zeros((rows,), bool),
                           jax.random.normal(keys[2], (rows,)), None,
                           -12.0 + 0.1 * jax.random.normal(keys[3], (rows, completion)))
        step = jit_train_step(graphdef, optimizer, StepOptions(LossConfig(beta=0.04), 1.0, logps_chunk_size=chunk),
                              mesh, sharding.tree_shardings(state))
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        runs.append({"step": step, "state": state, "batch": batch, "seconds": []})
    for i in range(steps):
        for run in runs if i % 2 == 0 else runs[::-1]:
            timer = time.perf_counter()
            run["state"], metrics = run["step"](run["state"], run["batch"])
            jax.block_until_ready(metrics)
            run["seconds"].append(time.perf_counter() - timer)
    return [statistics.median(run["seconds"]) for run in runs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model and batch (smoke test)")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--completion", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=1, help="train.logps_chunk_size of the chunked variant")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--remat", choices=("none", "full", "dots"),
                        help="measure every phase at this remat and --chunk only (default: four settings)")
    parser.add_argument("--scan-layers", action="store_true", help="model.scan_layers: true (remat acts through it)")
    parser.add_argument("--lora", type=int, default=0, help="also measure LoRA adapters of this rank (all-linear)")
    parser.add_argument("--time-steps", type=int, default=0, help="also time this many train steps of each model")
    parser.add_argument("--time-layers", type=int, default=0, help="decoder layers of the timed models (0: all)")
    parser.add_argument("--time-rows", type=int, default=0, help="rows of the timed steps (0: --rows)")
    args = parser.parse_args()
    config, rows, prompt, completion = QWEN25_05B, args.rows, args.prompt, args.completion
    if args.quick:
        config, rows, prompt, completion = TINY, 4, 8, 8
    config = dataclasses.replace(config, scan_layers=args.scan_layers)
    configs = [config] + ([dataclasses.replace(config, lora=LoRAConfig(rank=args.lora, alpha=2.0 * args.lora))]
                          if args.lora else [])
    table = []
    settings = (((0, "none"), (args.chunk, "none"), (0, "full"), (args.chunk, "full")) if args.remat is None
                else ((args.chunk, args.remat),))
    for chunk, remat in settings:
        for c in configs:
            table += measure(c, rows=rows, prompt=prompt, completion=completion, chunk=chunk, remat=remat,
                             every_phase=args.remat is not None)
    logits = rows * completion * config.vocab_size * 4 / GIB
    print(f"model: vocab {config.vocab_size}, hidden {config.hidden_size}, {config.num_hidden_layers} layers; "
          f"{rows} rows x ({prompt} prompt + {completion} completion) tokens; float32 [B, T, V] logits = "
          f"{logits:.2f} GiB; jax {jax.__version__} on {jax.devices()[0].platform}\n")
    unit, name = (2 ** 20, "MiB") if args.quick else (GIB, "GiB")
    sizes = ["arguments", "outputs", "aliased", "temporaries", "peak"]
    keys = ["phase", "lora", "remat", "logps_chunk_size"]
    print("| " + " | ".join(keys + [f"{k} ({name})" for k in sizes] + ["compile_s"]) + " |\n|"
          + "---|" * (len(keys) + len(sizes) + 1))
    for row in table:
        print("| " + " | ".join([str(row[k]) for k in keys] + [f"{row[k] / unit:.3f}" for k in sizes]
                                + [str(row["compile_s"])]) + " |")
    if args.time_steps:
        timed = [dataclasses.replace(c, num_hidden_layers=args.time_layers or c.num_hidden_layers, remat=args.remat
                                     or "none") for c in configs]
        medians = time_steps(timed, rows=args.time_rows or rows, prompt=prompt, completion=completion,
                             chunk=args.chunk, steps=args.time_steps)
        for c, seconds in zip(timed, medians):
            table.append({"phase": "train_step_time", "lora": c.lora.rank, "layers": c.num_hidden_layers,
                          "rows": args.time_rows or rows, "remat": c.remat, "logps_chunk_size": args.chunk,
                          "seconds": round(seconds, 3)})
            print(f"train step, lora rank {c.lora.rank}, {c.num_hidden_layers} layers, {args.time_rows or rows} rows, "
                  f"remat {c.remat}, logps_chunk_size {args.chunk}: {seconds:.3f} s (median of {args.time_steps})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
