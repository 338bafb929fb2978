"""Routing replay's effect on the sampler/trainer log-prob gap of a mixture-of-experts model (Qwen3-MoE layout).

The sampler decodes with a KV cache, one token a step; the trainer scores the same rows in one full forward. In
bfloat16 the two differ by rounding, and in a MoE model a router that rounds differently can send a token to
another expert, which moves its log-prob far more than rounding does. Routing replay (`model.routing_replay`)
records the sampler's experts and the trainer's forward reuses them. For float32 and bfloat16, with and without
replay, this prints over the sampled tokens: mean and max |sampler_logp - trainer_logp|, and the share of
(token, layer) pairs whose experts the trainer's own routers would choose differently.

Random weights (no checkpoint is needed); a wider router init than HF's 0.02 gives the routers a preference, as
trained ones have.

    python benchmarks/moe_replay.py                 # 4 layers, 32 experts (top 4), 16 rows x (32 + 64) tokens
    python benchmarks/moe_replay.py --quick         # a tiny model, for a smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from grpo_jax.algo import decoder  # noqa: E402
from grpo_jax.algo.logprobs import completion_logps  # noqa: E402
from grpo_jax.config.sections import SamplingConfig  # noqa: E402
from grpo_jax.models import ModelConfig, forward, init_model  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from grpo_step import emit  # noqa: E402

SHAPES = {
    "default": dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=2, head_dim=32, num_experts=32, num_experts_per_tok=4,
                    moe_intermediate_size=128),
    "quick": dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16),
}


def fresh_routing(graphdef, params, rows) -> np.ndarray:
    """The experts the trainer's own full forward chooses for each prompt ++ completion token: [B, P + T, L, K]."""
    mask = np.concatenate([rows.prompt_mask, rows.completion_mask], 1)
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
    ids = np.concatenate([rows.prompt_ids, rows.completion_ids], 1)
    _, _, routing = jax.jit(lambda p, ids, positions, mask: forward(graphdef, p, ids, positions, mask,
                                                                    return_routing=True))(params, ids, positions, mask)
    return np.asarray(routing.experts).transpose(1, 2, 0, 3)


def measure(config: ModelConfig, *, rows: int, prompt: int, completion: int, seed: int) -> dict:
    """One dtype: sample with routing recorded, then score with and without replay."""
    graphdef, params = init_model(config, seed)
    rng = np.random.default_rng(seed)
    prompt_ids = rng.integers(2, config.vocab_size, (rows, prompt)).astype(np.int32)
    prompt_mask = np.ones_like(prompt_ids)
    options = decoder.DecodeOptions(sampling=SamplingConfig(max_completion_length=completion), eos_token_ids=(0,),
                                    pad_token_id=1, record_routing=True)
    sample = jax.jit(lambda p, ids, mask, key: decoder.generate(graphdef, p, ids, mask, key, options))
    traj = jax.device_get(sample(params, prompt_ids, prompt_mask, jax.random.key(seed)))
    args = (traj.prompt_ids, traj.prompt_mask, traj.completion_ids, traj.completion_mask)
    score = jax.jit(lambda p, args, routing: completion_logps(graphdef, p, *args, temperature=1.0,
                                                              routing=routing)[0])
    sampled = np.asarray(traj.loss_mask) == 1
    out = {"sampled_tokens": int(sampled.sum())}
    for name, routing in (("no_replay", None), ("replay", traj.routed_experts)):
        gap = np.abs(np.asarray(score(params, args, routing)) - np.asarray(traj.sampler_per_token_logps))[sampled]
        out[name] = {"mean_abs_gap": float(gap.mean()), "max_abs_gap": float(gap.max()),
                     "tokens_gap_over_0.1": float((gap > 0.1).mean())}
    # where the trainer's routers disagree with the sampler's (the tokens fed back in: all but each row's last)
    fed = np.concatenate([prompt_mask, np.asarray(traj.completion_mask)], 1) == 1
    fed[np.arange(rows), prompt + np.asarray(traj.completion_mask).sum(1) - 1] = False
    recorded = np.sort(np.asarray(traj.routed_experts).astype(np.int32), -1)
    differs = np.any(recorded != np.sort(fresh_routing(graphdef, params, traj), -1), -1)  # [B, S, L]
    out["routing_differs_per_token_layer"] = float(differs[fed].mean())
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny model and few tokens (smoke test)")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--completion", type=int, default=64)
    parser.add_argument("--router-init", type=float, default=0.1, help="initializer_range of every weight")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    shape = SHAPES["quick" if args.quick else "default"]
    rows, prompt, completion = (4, 6, 8) if args.quick else (args.rows, args.prompt, args.completion)
    base = ModelConfig(model_type="qwen3_moe", qk_norm=True, norm_topk_prob=True, tie_word_embeddings=False,
                       initializer_range=args.router_init, **shape)
    result = {"device": jax.devices()[0].device_kind, "model": shape, "rows": rows, "prompt": prompt,
              "completion": completion}
    for dtype in ("float32", "bfloat16"):
        config = dataclasses.replace(base, dtype=dtype, param_dtype=dtype)
        result[dtype] = measure(config, rows=rows, prompt=prompt, completion=completion, seed=args.seed)
    return emit(result, args.out)


if __name__ == "__main__":
    main()
