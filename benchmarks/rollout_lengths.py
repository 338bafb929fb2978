"""Useful completion tokens/s of the static sampler and of continuous batching at a real length spread, JSON out.

    python benchmarks/rollout_lengths.py --size small --prompts 8 --slots 0,16          # CPU, ~5 minutes

The sampler is the one a training run builds (`programs.jit_decoder` driven by `stream.decode`: CPU speed-ups
and host-thread chunks as configured by default), over `--prompts` prompts x `--generations` rows of random length
`--prompt-length` .. `--prompt-length-max` (left-padded) and completions of at most `--max-completion-length`
tokens.

Length spread: a random-init model's next-token distribution is close to uniform, so with EOS one id of a
`--vocab`-token vocabulary a completion's length is about geometric with mean `--vocab` (256 by default: a quarter
of 1,024, the spread of real runs). Every setting samples the same rows with the same keys, so they draw the same
tokens (checked) and differ only in how long that takes. Per setting: the first call (compile + run) and the
median of `--repeats` runs; useful tokens = completion tokens up to EOS; decoded slots = decode steps x rows in
flight (a static batch: every row until the longest ends); padding = 1 - useful / decoded.

``--score-ms`` adds a reward function costing that many milliseconds per completion (a sleep: a judge behind HTTP,
a code sandbox; ``--score-cpu``: a Python busy loop, as math-verify) and times sampling + scoring twice per
setting, median of ``--repeats``: sequential (sample every row, then score) and streamed (`stream.decode`: each
group scored as soon as it has finished, while the others decode); ``score_hidden_fraction`` is the part of
the scoring time the stream hid behind decoding.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode  # noqa: E402


def measure(args) -> dict:
    import dataclasses

    from grpo_jax.algo import decoder, programs
    from grpo_jax.algo.sampling import SamplingConfig
    from grpo_jax.device import cpu, sharding
    from grpo_jax.models import init_model
    from grpo_jax.rollout import stream

    config = dataclasses.replace(decode.model_config_for(args.size, "float32", None), vocab_size=args.vocab)
    graphdef, params = init_model(config, seed=0)
    graphdef = cpu.linear_layers(graphdef, params, cpu.enabled(None))
    mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    G, B, P = args.generations, args.prompts * args.generations, args.prompt_length_max
    rng = np.random.default_rng(0)
    lengths = np.repeat(rng.integers(args.prompt_length, P + 1, args.prompts), G)
    ids = rng.integers(2, args.vocab, (B, P)).astype(np.int32)
    mask = (np.arange(P)[None] >= (P - lengths)[:, None]).astype(np.int32)
    rows, first_mask = [], None

    def sample(fn, key):
        """The call's host rows (completion masks) and its decode steps, as a round decodes them."""
        mask_BxT, steps = np.zeros((B, args.max_completion_length), np.int32), 0
        for piece in stream.decode(fn, params, ids, mask, key, group_size=G):
            mask_BxT[piece.rows], steps = piece.completion_mask, max(steps, piece.decode_steps)
        return mask_BxT, steps

    for slots in args.slots:
        sampling = SamplingConfig(max_completion_length=args.max_completion_length, max_batch_rows=slots)
        fn = programs.jit_decoder(graphdef, mesh, config, config=sampling, eos_token_ids=(0,), pad_token_id=1,
                                  prompt_group_size=G, cpu_speedups=cpu.enabled(None))
        start = time.perf_counter()
        sample(fn, jax.random.key(0))
        first_s = time.perf_counter() - start
        times, outs = [], []
        for r in range(args.repeats):
            start = time.perf_counter()
            outs.append(sample(fn, jax.random.key(1 + r)))
            times.append(time.perf_counter() - start)
        if first_mask is None:
            first_mask = [m for m, _ in outs]
        elif not all(np.array_equal(a, m) for a, (m, _) in zip(first_mask, outs)):
            raise AssertionError(f"slots={slots} sampled other lengths than slots={args.slots[0]}")
        # host-thread chunks each take their share of the slots; steps: the longest chunk's
        chunks = fn.chunks(B, G)
        in_flight = chunks * decoder.continuous_slots(slots, B // chunks, B, 1)
        useful = float(np.mean([m.sum() for m, _ in outs]))
        decoded = float(np.mean([steps * in_flight for _, steps in outs]))
        run_s = statistics.median(times)
        rows.append({"max_batch_rows": slots, "rows_in_flight": in_flight, "first_call_s": first_s,
                     "compile_s": max(first_s - run_s, 0.0), "sample_s": run_s, "useful_tokens": useful,
                     "decode_steps": float(np.mean([steps for _, steps in outs])),
                     "padding_fraction": 1 - useful / decoded, "useful_tokens_per_s": useful / run_s})
        if args.score_ms:
            rows[-1].update(_score_times(args, fn, params, ids, mask))
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]["useful_tokens_per_s"]
    for row in rows:
        row["vs_first_setting"] = row["useful_tokens_per_s"] / base
    lengths = np.concatenate([m.sum(1) for m in first_mask])
    return {"size": args.size, "vocab": args.vocab, "rows": B, "generations": G,
            "prompt_lengths": [args.prompt_length, P], "max_completion_length": args.max_completion_length,
            "mean_completion_length": float(lengths.mean()), "max_completion_length_seen": int(lengths.max()),
            "device": str(jax.devices()[0]), "jax_version": jax.__version__, "settings": rows}


def _score_times(args, fn, params, ids, mask) -> dict:
    """Sampling + scoring, sequential and streamed (see the module's docstring)."""
    from grpo_jax.rollout import stream

    def score(num_rows: int) -> None:
        if not args.score_cpu:
            time.sleep(num_rows * args.score_ms / 1000)
            return
        end = time.perf_counter() + num_rows * args.score_ms / 1000
        while time.perf_counter() < end:
            sum(i * i for i in range(1000))

    for _ in stream.decode(fn, params, ids, mask, jax.random.key(0), group_size=args.generations):  # compiles it all
        pass
    sequential, streamed = [], []
    for r in range(args.repeats):
        start = time.perf_counter()
        pieces = list(stream.decode(fn, params, ids, mask, jax.random.key(1 + r), group_size=args.generations))
        score(sum(len(piece.rows) for piece in pieces))
        sequential.append(time.perf_counter() - start)
        start = time.perf_counter()
        for piece in stream.decode(fn, params, ids, mask, jax.random.key(1 + r), group_size=args.generations):
            score(len(piece.rows))
        streamed.append(time.perf_counter() - start)
    score_s = len(ids) * args.score_ms / 1000
    seq, streamed_s = statistics.median(sequential), statistics.median(streamed)
    return {"score_s": score_s, "sample_then_score_s": seq, "streamed_sample_and_score_s": streamed_s,
            "score_hidden_fraction": (seq - streamed_s) / score_s}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=sorted(decode.make_models.SIZES))
    parser.add_argument("--vocab", type=int, default=256, help="vocabulary size; EOS is id 0 (mean length ~ vocab)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--prompt-length-max", type=int, default=512)
    parser.add_argument("--max-completion-length", type=int, default=1024)
    parser.add_argument("--slots", default="0,16", help="sampling.max_batch_rows settings, the first the baseline")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--score-ms", type=float, default=0.0, help="reward cost per completion (0: no scoring)")
    parser.add_argument("--score-cpu", action="store_true", help="the reward cost is a busy loop, not a sleep")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    args.slots = [int(s) for s in args.slots.split(",")]
    from grpo_jax.device.cpu import configure_host_allocator

    configure_host_allocator("retain")
    return decode.write_result(measure(args), args.out)


if __name__ == "__main__":
    main()
