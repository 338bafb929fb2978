"""Decode throughput of `grpo_jax.algo.decoder` (a static batch) against the memory-bandwidth bound, JSON out.

    python benchmarks/decode.py --size qwen0.5b --rows 64 --prompt-length 64 --new-tokens 256 --dtype bfloat16

Times the jitted sampler at `--new-tokens` and at 1 new token (prefill + one token) with EOS disabled, so
decode time per step = (t_full - t_prefill) / (new_tokens - 1). Bound: every decode step reads the weights
once plus the KV cache filled so far, so tokens/s <= rows * bandwidth / bytes per step, with the bandwidth
measured by a large on-device copy (bytes read + written).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_models  # noqa: E402


def copy_bandwidth(num_bytes: int = 2 ** 30, repeats: int = 5) -> float:
    """Measured bytes/s of a device copy (x + 1 over `num_bytes` of float32; read + written bytes counted)."""
    x = jnp.zeros((num_bytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a + 1)
    copy(x).block_until_ready()
    best = min(_timed(lambda: copy(x).block_until_ready()) for _ in range(repeats))
    return 2 * num_bytes / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def model_config_for(size: str, dtype: str, param_dtype: str | None):
    """grpo_jax ModelConfig of a make_models size (param_dtype only where the model has that field)."""
    import dataclasses

    from grpo_jax.models import ModelConfig

    arch = make_models.qwen2_config(size).to_dict()
    theta = arch.get("rope_theta") or (arch.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    kwargs = dict(dtype=dtype)
    if param_dtype is not None and "param_dtype" in {f.name for f in dataclasses.fields(ModelConfig)}:
        kwargs["param_dtype"] = param_dtype
    return ModelConfig(vocab_size=arch["vocab_size"], hidden_size=arch["hidden_size"],
                       intermediate_size=arch["intermediate_size"], num_hidden_layers=arch["num_hidden_layers"],
                       num_attention_heads=arch["num_attention_heads"],
                       num_key_value_heads=arch["num_key_value_heads"], rope_theta=float(theta),
                       tie_word_embeddings=True, **kwargs)


def measure(size: str, rows: int, prompt_length: int, new_tokens: int, dtype: str, param_dtype: str | None,
            repeats: int = 3) -> dict:
    """Decode tokens/s of `decoder` and its fraction of the bandwidth bound (see the module docstring)."""
    from grpo_jax.algo import decoder
    from grpo_jax.algo.sampling import SamplingConfig
    from grpo_jax.device import cpu
    from grpo_jax.models import init_model

    config = model_config_for(size, dtype, param_dtype)
    graphdef, params = init_model(config, seed=0)
    ids = jax.random.randint(jax.random.PRNGKey(0), (rows, prompt_length), 3, min(config.vocab_size, 128))
    mask = jnp.ones((rows, prompt_length), jnp.int32)

    def timed(T):
        options = decoder.DecodeOptions(SamplingConfig(max_completion_length=T), (-1,), 1)
        if cpu.enabled(None):  # as a training run samples
            options = cpu.decode_options(options, rows, config.vocab_size)

        @jax.jit
        def fn(p, i, m, k):
            return decoder.advance(graphdef, p, decoder.start(graphdef, p, i, m, k, options), options).steps

        start = time.perf_counter()
        int(fn(params, ids, mask, jax.random.PRNGKey(1)))
        compile_s = time.perf_counter() - start
        times = []
        for r in range(repeats):
            start = time.perf_counter()
            int(fn(params, ids, mask, jax.random.PRNGKey(2 + r)))
            times.append(time.perf_counter() - start)
        return statistics.median(times), compile_s

    full_s, compile_s = timed(new_tokens)
    prefill_s, _ = timed(1)
    step_s = (full_s - prefill_s) / (new_tokens - 1)
    weight_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(params))
    head_dim = config.resolved_head_dim
    kv_bytes_per_slot = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * \
        jnp.dtype(config.jnp_dtype).itemsize
    mean_slots = prompt_length + new_tokens / 2
    bytes_per_step = weight_bytes + rows * mean_slots * kv_bytes_per_slot
    bandwidth = copy_bandwidth(2 ** 30 if jax.devices()[0].platform != "cpu" else 2 ** 27)
    bound = rows * bandwidth / bytes_per_step
    tokens_per_s = rows / step_s
    return {"size": size, "rows": rows, "prompt_length": prompt_length, "new_tokens": new_tokens, "dtype": dtype,
            "param_dtype": param_dtype or dtype, "device": str(jax.devices()[0]), "jax_version": jax.__version__,
            "generate_s": full_s, "prefill_plus_one_token_s": prefill_s, "compile_s": compile_s,
            "decode_step_s": step_s, "decode_tokens_per_s": tokens_per_s, "weight_bytes": weight_bytes,
            "bytes_per_decode_step": bytes_per_step, "copy_bandwidth_bytes_per_s": bandwidth,
            "bandwidth_bound_tokens_per_s": bound, "fraction_of_bandwidth_bound": tokens_per_s / bound}


def write_result(result: dict, out: str | None) -> dict:
    """Prints a benchmark's result as JSON and, with ``out``, writes it there too; returns it."""
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny", choices=sorted(make_models.SIZES))
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--prompt-length", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--param-dtype", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--host-allocator", choices=("retain", "system"), default="retain",
                        help="malloc policy (grpo_jax.device.cpu), as a training run sets it")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.new_tokens < 2:
        parser.error("--new-tokens must be >= 2")
    from grpo_jax.device.cpu import configure_host_allocator

    configure_host_allocator(args.host_allocator)
    result = measure(args.size, args.rows, args.prompt_length, args.new_tokens, args.dtype, args.param_dtype,
                     args.repeats)
    return write_result(result, args.out)


if __name__ == "__main__":
    main()
