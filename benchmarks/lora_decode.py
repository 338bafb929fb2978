"""LoRA sampling: adapters merged into the kernels once per sampling call (what grpo_jax does) vs applied on the fly
in every decode step. Same tokens either way; prints the medians of interleaved calls, compile apart.

    python benchmarks/lora_decode.py --size small --rank 16 --rows 32 --prompt-length 64 --new-tokens 256
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import make_models
from grpo_jax.algo import decoder
from grpo_jax.algo.sampling import SamplingConfig
from grpo_jax.config.model import LoRAConfig
from grpo_jax.models import ModelConfig, init_model, lora


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(make_models.SIZES), default="small")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args(argv)
    arch = {k: v for k, v in make_models.SIZES[args.size].items() if k in ModelConfig.__dataclass_fields__}
    config = ModelConfig(vocab_size=128, **arch, lora=LoRAConfig(rank=args.rank, alpha=2.0 * args.rank))
    graphdef, params = init_model(config, 0)
    # B = 0 at init would make the adapters a no-op: give them weight so both paths do their real work
    params = jax.tree.map(lambda x: x + 0.01 if x.ndim == 3 and x.shape[-2] == args.rank else x, params)
    ids = jnp.asarray(np.random.default_rng(0).integers(2, 128, (args.rows, args.prompt_length)), jnp.int32)
    mask = jnp.ones_like(ids)
    options = decoder.DecodeOptions(SamplingConfig(max_completion_length=args.new_tokens), (-1,), 0)

    def sample(graphdef, params, key):  # no EOS: every call decodes all new tokens
        return decoder.generate(graphdef, params, ids, mask, key, options)

    fns = {"on_the_fly": jax.jit(lambda p, k: sample(graphdef, p, k)),
           "merged_per_call": jax.jit(lambda p, k: sample(*lora.merged(graphdef, p), k))}
    result, outs = {}, {}
    for name, fn in fns.items():
        t = time.perf_counter()
        outs[name] = jax.block_until_ready(fn(params, jax.random.PRNGKey(0)))
        result[f"{name}_compile_and_first_s"] = time.perf_counter() - t
    times = {name: [] for name in fns}
    for r in range(args.repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(fn(params, jax.random.PRNGKey(r + 1)))
            times[name].append(time.perf_counter() - t)
    for name in fns:
        result[f"{name}_s"] = float(np.median(times[name]))
        result[f"{name}_tokens_per_s"] = args.rows * args.new_tokens / result[f"{name}_s"]
    a, b = (np.asarray(o.completion_ids) for o in outs.values())
    result["same_tokens_fraction"] = float((a == b).mean())
    for k, v in result.items():
        print(f"{k}: {v:.4g}")
    return result


if __name__ == "__main__":
    main()
