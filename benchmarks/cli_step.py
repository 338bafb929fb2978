"""The step time a user sees: `grpo-jax` run from the command line, against TRL 1.16 on the same folders.

    python benchmarks/make_models.py --out /tmp/bm/models
    python benchmarks/cli_step.py --model /tmp/bm/models/tiny --steps 40 --warmup 5
    python benchmarks/cli_step.py --model /tmp/bm/models/small --max-completion-length 256 --steps 4 --warmup 2

grpo_jax runs as a user runs it: `python -m grpo_jax` in a process of its own, with its defaults (checkpoints,
metrics.jsonl, the console line of every step), only the setting below given as overrides. Its step time is the
wall time between two consecutive console lines ("grpo step k/N", written when a step's metrics reach the host),
median over the steps after ``--warmup``: everything the loop does per step is in it, compiles of the first steps
are not. TRL runs in another process through `grpo_step.run_trl` (its step: callback to callback), same prompts,
model folder and setting as `grpo_step.Setting` (4 prompts x 8 completions, temperature 1, beta 0.04, lr 1e-5,
loss dapo, fp32, torch threads 2).

Prints JSON: each library's median step (and phases, from metrics.jsonl for grpo_jax), its process's peak RSS, the
ratios, `lscpu`'s model.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import grpo_step  # noqa: E402
import make_models  # noqa: E402

LINE = re.compile(r"^grpo step (\d+)/(\d+)")


def cpu_model() -> str:
    """`lscpu`'s model name and its AVX flags (the CPU kind decides ratios)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Model name")), "?")
    flags = sorted(set(re.findall(r"\b(avx512f|avx512_bf16|avx2)\b", text)))
    return f"{name} ({', '.join(flags)})"


def overrides(model: str, prompts: Path, s: grpo_step.Setting, steps: int, out: Path) -> list[str]:
    """The command line's `key=value` overrides for the benchmarked setting (everything else: defaults)."""
    return [f"model.path={model}", f"data.path={prompts}",
            f"data.max_prompt_length={s.prompt_length_max or s.prompt_length}",
            f"reward.functions=[{grpo_step.REWARD}]", f"sampling.max_completion_length={s.max_completion_length}",
            f"sampling.temperature={s.temperature}", f"loss.loss_type={s.loss_type}", f"loss.beta={s.beta}",
            f"train.num_generations={s.num_generations}", f"train.train_batch_size={s.rows}",
            f"train.learning_rate={s.learning_rate}", "train.adam_beta2=0.999", "eval.num_examples=0",
            f"max_steps={steps}", f"seed={s.seed}", f"output_dir={out}"]


def run_cli(model: str, prompts: Path, s: grpo_step.Setting, *, steps: int, warmup: int,
            extra: list[str]) -> dict:
    """`python -m grpo_jax` in a child process: per-step wall times from its console lines."""
    out = Path(tempfile.mkdtemp(prefix="grpo_jax_cli_")) / "run"
    command = [sys.executable, "-m", "grpo_jax", "--no-progress",
               *overrides(model, prompts, s, warmup + steps, out), *extra]
    start = time.perf_counter()
    child = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                             env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    stamps, tail = {}, []
    for line in child.stderr:
        match = LINE.match(line)
        if match:
            stamps[int(match.group(1))] = time.perf_counter()
        tail = (tail + [line])[-20:]
    _, status, usage = os.wait4(child.pid, 0)  # this child's own peak RSS (the parent's getrusage mixes children)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise RuntimeError("grpo-jax failed:\n" + "".join(tail))
    total = time.perf_counter() - start
    history = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    history = [h for h in history if "step_time" in h]
    timed = range(warmup + 1, warmup + steps + 1)
    walls = [stamps[k] - stamps[k - 1] for k in timed]
    phases = {p: statistics.median(h[f"step_time/{p}"] for h in history if h["step"] in timed)
              for p in grpo_step.PHASES}
    tokens = [h["completions/mean_length"] * s.rows for h in history if h["step"] in timed]
    return {"step_s": statistics.median(walls), "step_s_min": min(walls), "step_s_max": max(walls), "steps_s": walls,
            "update_steps_s": [h["step_time/update"] for h in history if h["step"] in timed],
            "packed_lengths": [h.get("packed_length") for h in history],
            "first_steps_s": stamps[warmup] - start, "total_s": total, "peak_rss_mib": usage.ru_maxrss / 1024,
            **{f"{p}_s": v for p, v in phases.items()}, "mean_completion_tokens": statistics.mean(tokens),
            "command": " ".join(command)}


def run_trl(model: str, prompts: Path, s: grpo_step.Setting, *, steps: int, warmup: int, bf16: bool = False) -> dict:
    """TRL 1.16 in a child process (`grpo_step.py --impl trl`), the same setting and prompts."""
    out = Path(tempfile.mkdtemp(prefix="trl_cli_")) / "trl.json"
    command = [sys.executable, str(Path(__file__).parent / "grpo_step.py"), "--impl", "trl", "--model", model,
               "--prompts", str(prompts), "--steps", str(steps), "--warmup", str(warmup),
               "--max-completion-length", str(s.max_completion_length), "--prompt-length", str(s.prompt_length),
               "--out", str(out)]
    if s.prompt_length_max:
        command += ["--prompt-length-max", str(s.prompt_length_max)]
    if bf16:
        command += ["--trl-bf16"]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL,
                   env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    trl = json.loads(out.read_text())["trl"]
    return {k: trl[k] for k in ("step_s", *(f"{p}_s" for p in grpo_step.PHASES), "mean_completion_tokens",
                                "torch_device", "bf16", "peak_rss_mib")}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a folder written by make_models.py")
    parser.add_argument("--impl", choices=("both", "grpo_jax", "trl"), default="both")
    parser.add_argument("--steps", type=int, default=20, help="timed steps after warm-up")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--max-completion-length", type=int, default=32)
    parser.add_argument("--prompt-length", type=int, default=16)
    parser.add_argument("--prompt-length-max", type=int, default=None)
    parser.add_argument("--prompt-pool", type=int, default=512,
                        help="prompts written for the run; 4 gives both libraries the same prompts every step")
    parser.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                        help="another grpo-jax override (repeatable)")
    parser.add_argument("--bf16", action="store_true",
                        help="bfloat16 compute over float32 weights: model.dtype=bfloat16 here, bf16=True in TRL")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.bf16:
        args.extra = ["model.dtype=bfloat16", *args.extra]
    s = grpo_step.Setting(max_completion_length=args.max_completion_length, prompt_length=args.prompt_length,
                          prompt_length_max=args.prompt_length_max)
    prompts = Path(tempfile.mkdtemp(prefix="cli_prompts_")) / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in make_models.make_prompts(
        args.prompt_pool, length=s.prompt_length - 1, max_length=s.prompt_length_max and s.prompt_length_max - 1)))
    result = {"cpu": cpu_model(), "setting": {**s.__dict__}, "model": args.model, "steps": args.steps,
              "warmup": args.warmup, "prompt_pool": args.prompt_pool, "overrides": args.extra}
    if args.impl in ("both", "grpo_jax"):
        result["grpo_jax"] = run_cli(args.model, prompts, s, steps=args.steps, warmup=args.warmup, extra=args.extra)
    if args.impl in ("both", "trl"):
        result["trl"] = run_trl(args.model, prompts, s, steps=args.steps, warmup=args.warmup, bf16=args.bf16)
    if args.impl == "both":
        result["ratio"] = result["grpo_jax"]["step_s"] / result["trl"]["step_s"]
        result["ratio_per_completion_token"] = (result["ratio"] * result["trl"]["mean_completion_tokens"]
                                                / result["grpo_jax"]["mean_completion_tokens"])
        result["peak_rss_ratio"] = result["grpo_jax"]["peak_rss_mib"] / result["trl"]["peak_rss_mib"]
    return grpo_step.emit(result, args.out)


if __name__ == "__main__":
    main()
