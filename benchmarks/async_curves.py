"""Learning curves of one config at several `train.max_staleness` values, one run after the other, JSON out.

    python benchmarks/async_curves.py --staleness 0,1,2,4 --every 500          # the default task, ~10 minutes
    python benchmarks/async_curves.py --long --every 25 max_steps=200             # realistic lengths, ~1 hour

Each k runs `python -m grpo_jax --no-progress output_dir=<folder>/k<k> train.max_staleness=<k>` plus the given
overrides (same seed, so k = 0 is the synchronous default run) in its own process; the table holds, per k, the
mean training reward of every `--every` steps, the mean logged `async/staleness`, the median step time and the
completion tokens a second of step time (the first step, which compiles, left out), the mean completion length,
the held-out greedy metrics before and after (summary.json) and the wall time.

``--long`` trains on realistic lengths instead of the default task's 3-8 tokens: sort a random binary string of
128-384 digits ("0110...^" -> "0011..."), so prompts are 129-385 tokens and completions grow to hundreds of tokens
(at most 512) as the policy learns the answer's length, graded by `grpo_jax.data.task:char_accuracy`. The same random
model and character tokenizer as the default task (the JSONL files and the tokenizer folder are written into the
run folder); binary digits so that a policy gets partial credit early (a run of zeros of the right length scores
about 0.5) and full credit only by counting.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml


def curve(output_dir: Path, every: int) -> dict:
    """A finished run's reward per `every` steps, its mean staleness and summary.json's evaluation."""
    lines = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "reward" in line]
    rewards = np.array([line["reward"] for line in steps], float)
    summary = json.loads((output_dir / "summary.json").read_text())
    rows = yaml.safe_load((output_dir / "config.yaml").read_text())["train"]["train_batch_size"]
    timed = steps[1:]  # the first step compiles
    tokens_per_s = (rows * sum(line["completions/mean_length"] for line in timed)
                    / sum(line["step_time"] for line in timed)) if timed else None
    return {"reward_every": [float(np.mean(rewards[i:i + every])) for i in range(0, len(rewards), every)],
            "tokens_per_s": tokens_per_s,
            "staleness_mean": float(np.mean([line.get("async/staleness", 0) for line in steps])),
            "median_step_s": float(np.median([line["step_time"] for line in steps[1:]])) if len(steps) > 1 else None,
            "mean_completion_length": float(np.mean([line["completions/mean_length"] for line in steps])),
            "steps": len(steps), "eval_before": summary["eval_before"], "eval_after": summary["eval_after"],
            "reward_first_10pct": summary["reward_first_10pct"], "reward_last_10pct": summary["reward_last_10pct"]}


def long_task(folder: Path, seed: int = 0) -> list[str]:
    """Write the realistic-length binary sort task (train and held-out JSONL, the tokenizer) under `folder`; the
    overrides that train on it."""
    from grpo_jax.data import task

    folder.mkdir(parents=True, exist_ok=True)
    for split, rows, offset in (("train", 2000, 0), ("test", 200, 1)):
        rng = np.random.default_rng([seed, offset])
        with open(folder / f"sort_{split}.jsonl", "w") as f:
            for _ in range(rows):
                digits = "".join(rng.choice(["0", "1"], int(rng.integers(128, 385))))
                f.write(json.dumps({"prompt": digits + "^", "answer": "".join(sorted(digits))}) + "\n")
    task.build_tokenizer(folder / "tokenizer")
    return ["model.init=random", f"data.path={folder / 'sort_train.jsonl'}", f"eval.path={folder / 'sort_test.jsonl'}",
            f"data.tokenizer_path={folder / 'tokenizer'}", "sampling.max_completion_length=512",
            "eval.num_examples=50"]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="dotted config overrides for every run")
    parser.add_argument("--staleness", default="0,1,2,4")
    parser.add_argument("--every", type=int, default=500, help="steps a row of the reward table")
    parser.add_argument("--folder", help="where the runs go (default: a new temporary folder)")
    parser.add_argument("--long", action="store_true", help="the realistic-length task (module docstring)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    folder = Path(args.folder or tempfile.mkdtemp(prefix="async_curves_"))
    overrides = [*long_task(folder / "data"), *args.overrides] if args.long else args.overrides
    runs = {}
    for k in args.staleness.split(","):
        output_dir = folder / f"k{k}"
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "grpo_jax", "--no-progress", f"output_dir={output_dir}",
                        f"train.max_staleness={k}", *overrides], check=True, stdout=subprocess.DEVNULL)
        runs[k] = {"wall_s": time.perf_counter() - start, **curve(output_dir, args.every)}
        print(json.dumps({k: runs[k]}), flush=True)
    result = {"overrides": overrides, "every": args.every, "runs": runs, "folder": str(folder)}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
