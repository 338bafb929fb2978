"""Peak device memory per phase (sampling, log-probs, train step) of a Qwen2.5-0.5B-shaped random model, on CPU.

Compiles each phase for abstract inputs (nothing is allocated: `jax.jit(...).lower(...).compile()
.memory_analysis()`) and reports XLA's buffer assignment: arguments, outputs, temporaries and the peak
estimate arguments + outputs - donated aliases + temporaries, with and without chunked log-probs and remat.

    python benchmarks/memory.py            # Qwen2.5-0.5B shape, 8 rows x (128 prompt + 256 completion) tokens
    python benchmarks/memory.py --quick    # a tiny model, for a smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from grpo_jax import sharding  # noqa: E402
from grpo_jax.losses import LossConfig  # noqa: E402
from grpo_jax.models import ModelConfig, init_model  # noqa: E402
from grpo_jax.sampling import SamplingConfig  # noqa: E402
from grpo_jax.state import TrainState, as_float32, make_optimizer, model_graphdef  # noqa: E402
from grpo_jax.programs import jit_generate, jit_logps, jit_train_step  # noqa: E402
from grpo_jax.train_step import Batch, StepOptions  # noqa: E402

QWEN25_05B = ModelConfig(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                         max_position_embeddings=32768, rope_theta=1e6)
TINY = ModelConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2)
GIB = 2 ** 30


def _abstract(shape, dtype, s):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=s)


def abstract_state(config: ModelConfig, optimizer, mesh):
    """The TrainState's shapes and shardings (policy, float32 Adam moments, a reference), nothing allocated."""
    params = jax.eval_shape(lambda: init_model(config, 0)[1])
    state = TrainState(params=params, opt_state=jax.eval_shape(lambda p: optimizer.init(as_float32(p)), params),
                       ref_params=params, step=jax.ShapeDtypeStruct((), jnp.int32),
                       key=jax.eval_shape(lambda: jax.random.PRNGKey(0)))
    shardings = sharding.state_shardings(mesh, state)
    return jax.tree.map(lambda x, s: _abstract(x.shape, x.dtype, s), state, shardings), shardings


def stats(compiled) -> dict:
    """XLA's buffer sizes in bytes; peak = arguments + outputs - donated aliases + temporaries."""
    m = compiled.memory_analysis()
    peak = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    return {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
            "aliased": m.alias_size_in_bytes, "temporaries": m.temp_size_in_bytes, "peak": peak}


def measure(config: ModelConfig, *, rows: int, prompt: int, completion: int, chunk: int, remat: str) -> list[dict]:
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
        out.append({"phase": phase, "remat": remat, "logps_chunk_size": chunk, **extra, **stats(compiled),
                    "compile_s": round(time.perf_counter() - timer, 1)})

    if chunk == 0 and remat == "none":  # sampling does not depend on either
        sample = jit_generate(graphdef, mesh, config=SamplingConfig(max_completion_length=completion),
                              eos_token_ids=(0,), pad_token_id=0, params_sharding=shardings.params)
        record("sampling", sample.lower(state.params, ids(prompt), ids(prompt),
                                        jax.eval_shape(lambda: jax.random.PRNGKey(0)), False))
    if remat == "none":
        logps = jit_logps(graphdef, mesh, temperature=1.0, chunk_size=chunk, params_sharding=shardings.params)
        record("logps", logps.lower(state.params, ids(prompt), ids(prompt), ids(completion), ids(completion)))
    batch = Batch(ids(prompt), ids(prompt), ids(completion), ids(completion),
                  _abstract((rows,), jnp.float32, rs), ids(completion, jnp.float32), ids(completion, jnp.float32))
    step = jit_train_step(graphdef, optimizer, StepOptions(LossConfig(beta=0.04), 1.0, logps_chunk_size=chunk),
                          mesh, shardings)
    record("train_step", step.lower(state, batch))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model and batch (smoke test)")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--completion", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=1, help="train.logps_chunk_size of the chunked variant")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    config, rows, prompt, completion = QWEN25_05B, args.rows, args.prompt, args.completion
    if args.quick:
        config, rows, prompt, completion = TINY, 4, 8, 8
    table = []
    for chunk, remat in ((0, "none"), (args.chunk, "none"), (0, "full"), (args.chunk, "full")):
        table += measure(config, rows=rows, prompt=prompt, completion=completion, chunk=chunk, remat=remat)
    logits = rows * completion * config.vocab_size * 4 / GIB
    print(f"model: vocab {config.vocab_size}, hidden {config.hidden_size}, {config.num_hidden_layers} layers; "
          f"{rows} rows x ({prompt} prompt + {completion} completion) tokens; float32 [B, T, V] logits = "
          f"{logits:.2f} GiB; jax {jax.__version__} on {jax.devices()[0].platform}\n")
    unit, name = (2 ** 20, "MiB") if args.quick else (GIB, "GiB")
    sizes = ["arguments", "outputs", "aliased", "temporaries", "peak"]
    keys = ["phase", "remat", "logps_chunk_size"]
    print("| " + " | ".join(keys + [f"{k} ({name})" for k in sizes] + ["compile_s"]) + " |\n|"
          + "---|" * (len(keys) + len(sizes) + 1))
    for row in table:
        print("| " + " | ".join([str(row[k]) for k in keys] + [f"{row[k] / unit:.3f}" for k in sizes]
                                + [str(row["compile_s"])]) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
