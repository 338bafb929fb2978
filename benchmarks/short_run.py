"""A short run's wall time as a user meets it: the same 4-step TRL script through grpo_jax's and TRL 1.16's
GRPOTrainer, each in a fresh process, grpo_jax cold (an empty compilation cache) and warm (the same cache again).

    python benchmarks/make_models.py --out /tmp/bm/models --sizes tiny
    python benchmarks/short_run.py --model /tmp/bm/models/tiny --prompts /tmp/bm/models/prompts.jsonl

The script (`script`) builds `GRPOConfig(...)` with the same keywords for both libraries (8 rows a step, 4
completions a prompt, 16 completion tokens, beta 0.04, 4 steps, seed 0), a `datasets.Dataset` of the prompts and
`grpo_jax.data.task:char_accuracy` as the reward. Each run's wall and CPU seconds (all its threads) are split into:
the imports, the trainer's construction, and inside `train()`: build (model load, state, programs; TRL: up to its
first step), compile (grpo_jax's warm-up, `shapes.compile_ahead`: its programs named with their lowering and
compile seconds), steps (the first step to `train()`'s end: grpo_jax's final checkpoint, plot and export included).
Every executable jax makes is listed by function with its trace, lowering and XLA seconds, before/in or after the
warm-up (after it: only the final save's and export's small programs). The parent's ``wall`` adds the process start.
grpo_jax's cache is a fresh temp folder per cold run, never the user's ~/.cache. On a shared machine the CPU
seconds are the steadier number: wall time there depends on what else runs.

Prints JSON (and writes it with ``--out``): each run's phases and compile list, `lscpu`'s model.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

START = time.perf_counter()
SETTING = dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=16,
               beta=0.04, learning_rate=1e-5, temperature=1.0, max_steps=4, logging_steps=1, report_to="none",
               seed=0, disable_tqdm=True)
# jax's per-executable compile events (each with fun_name): trace to jaxpr, jaxpr to MLIR, XLA (or a cache load)
EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
          "/jax/core/compile/backend_compile_duration": "xla"}


def _now() -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds over all its threads)."""
    return time.perf_counter(), time.process_time()


def _compile_log(marks: dict) -> tuple[list, collections.Counter]:
    """Listens to jax's compile events: a list of (phase, function, kind, seconds), and the persistent cache's
    hit/miss counts; marks the warm-up's start and end (`shapes.compile_ahead`) and keeps its program list."""
    import jax

    from grpo_jax.rollout import shapes
    log, counts = [], collections.Counter()

    def heard(event, seconds, fun_name="?", **kwargs):
        if event in EVENTS:
            log.append(("after warm-up" if "compiled" in marks else "before/in warm-up", fun_name, EVENTS[event],
                        seconds))

    def counted(event, **kwargs):
        if event.startswith("/jax/compilation_cache/cache_"):
            counts[event.rsplit("/", 1)[1]] += 1

    jax.monitoring.register_event_duration_secs_listener(heard)
    jax.monitoring.register_event_listener(counted)
    warm_up = shapes.compile_ahead

    def marked(*args, **kwargs):
        marks["compiling"] = _now()
        warmup = warm_up(*args, **kwargs)
        marks["compiled"], marks["warmup_programs"] = _now(), warmup.programs
        return warmup

    shapes.compile_ahead = marked  # the trainer calls it through the module
    return log, counts


def script(library: str, model: str, prompts: str, output_dir: str, cache: str | None, overrides: dict) -> dict:
    """The TRL script, with `library`'s imports; returns its phases' wall and CPU seconds, and grpo_jax's compiles."""
    marks = {"script": _now()}
    if library == "trl":
        import torch
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
        torch.set_num_threads(os.cpu_count() or 1)
        extra = dict(use_cpu=True, save_strategy="no", dataloader_num_workers=0)
    else:
        import grpo_jax.api.trainer  # noqa: F401 - jax, flax and transformers: `train()` imports them otherwise
        from grpo_jax import GRPOConfig, GRPOTrainer
        extra = {"compilation_cache_dir": cache, **overrides}
    import datasets

    from grpo_jax.data.task import char_accuracy
    marks["imported"] = _now()
    log, counts = _compile_log(marks) if library == "grpo_jax" else ([], collections.Counter())
    rows = [json.loads(line) for line in Path(prompts).read_text().splitlines() if line.strip()]
    args = GRPOConfig(output_dir=output_dir, **SETTING, **extra)
    trainer = GRPOTrainer(model=model, reward_funcs=char_accuracy, args=args,
                          train_dataset=datasets.Dataset.from_list(rows))
    if library == "trl":
        class FirstStep(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                marks.setdefault("compiling", _now())
                marks.setdefault("compiled", marks["compiling"])  # eager PyTorch: nothing compiled
        trainer.add_callback(FirstStep())
    marks["train"] = _now()
    trainer.train()
    marks["end"] = _now()
    order = ("script", "imported", "train", "compiling", "compiled", "end")
    names = ("import", "construct", "build", "compile", "steps")
    phases = {kind: {name: round(marks[b][i] - marks[a][i], 2) for name, a, b in zip(names, order, order[1:])}
              for i, kind in enumerate(("wall", "cpu"))}
    programs = collections.defaultdict(lambda: collections.defaultdict(float))
    for phase, name, kind, seconds in log:
        programs[f"{phase}: {name}"][kind] += seconds
        programs[f"{phase}: {name}"]["count"] += kind == "xla"
    return {"phases": phases, "total": {"wall": round(marks["end"][0] - START, 2), "cpu": round(marks["end"][1], 2)},
            "warmup": [{"program": n, "lower_s": a, "compile_s": b} for n, a, b in marks.get("warmup_programs", ())],
            "after_warmup": {k.split(": ", 1)[1]: v["count"] for k, v in programs.items()
                             if k.startswith("after") and v["count"]},
            "compiles": {k: {kind: round(v, 3) for kind, v in d.items()} for k, d in sorted(
                programs.items(), key=lambda kv: -sum(v for k, v in kv[1].items() if k != "count"))},
            "cache": dict(counts)}


def child(library: str, model: str, prompts: str, cache: str | None, overrides: list[str] = ()) -> dict:
    """`script` in a fresh process (its output_dir a fresh temp folder); the parent's wall time added."""
    out = Path(tempfile.mkdtemp(prefix=f"short_{library}_")) / "run"
    command = [sys.executable, __file__, "--child", library, "--model", model, "--prompts", prompts,
               "--output-dir", str(out)] + (["--cache", cache] if cache else []) + [
                   x for kv in overrides for x in ("--set", kv)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the run's own cache folder, not one from the environment
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{library} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {"wall": round(wall, 2), **result}


def cpu_model() -> str:
    """`lscpu`'s model name and core count."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return f"{fields.get('Model name', '?').strip()}, {fields.get('CPU(s)', '?').strip()} CPUs"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a make_models.py folder (tiny)")
    parser.add_argument("--prompts", required=True, help="make_models.py's prompts.jsonl")
    parser.add_argument("--repeats", type=int, default=1, help="cold + warm pairs (TRL once per pair)")
    parser.add_argument("--no-trl", action="store_true")
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a grpo_jax GRPOConfig keyword (YAML value), e.g. compile_threads=1")
    parser.add_argument("--child", choices=("grpo_jax", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--output-dir", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        import yaml
        overrides = {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in args.set)}
        print(json.dumps(script(args.child, args.model, args.prompts, args.output_dir, args.cache, overrides)))
        return {}
    try:
        import trl  # noqa: F401
        with_trl = not args.no_trl
    except ImportError:
        with_trl = False
    runs = collections.defaultdict(list)
    for _ in range(args.repeats):
        cache = tempfile.mkdtemp(prefix="short_jax_cache_")  # empty: a cold start
        runs["grpo_jax_cold"].append(child("grpo_jax", args.model, args.prompts, cache, args.set))
        runs["grpo_jax_warm"].append(child("grpo_jax", args.model, args.prompts, cache, args.set))
        if with_trl:
            runs["trl"].append(child("trl", args.model, args.prompts, None))
    result = {"cpu": cpu_model(), "setting": SETTING, **runs}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return result


if __name__ == "__main__":
    main()
