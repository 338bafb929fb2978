"""One GRPO configuration timed step by step: grpo_jax and TRL 1.16 GRPOTrainer side by side, JSON out.

    python benchmarks/make_models.py --out benchmarks/models
    python benchmarks/grpo_step.py --model benchmarks/models/tiny --steps 10 --warmup 2

Both trainers run the issue's setting in this process: P prompts x G generations per step (4 x 8), completions
up to T = 32 tokens, temperature 1, beta 0.04 (a reference model runs), lr 1e-5, TRL's "dapo" loss, one
optimizer step per round (on-policy: neither computes old log-probs), no gradient checkpointing (TRL's
default), fp32, torch threads = 2.

Printed per trainer: median step time and phases (sample; score = rewards + advantages + decoding; logps =
reference/old log-probs; update = forward + backward + optimizer), compile time apart (warm-up rounds minus
as many steady steps), completion tokens/s, model FLOPs per step (analytic, see `step_flops`), the fraction of
the measured matmul peak (each library's own 2048^3 product; with both trainers also the device's, the faster
of the two), peak memory (process RSS on CPU, so TRL's includes grpo_jax's, which runs first; peak device
bytes on a GPU); then grpo_jax / TRL per phase and overall.

`--size qwen0.5b --impl grpo_jax --dtype bfloat16` runs grpo_jax alone on a random Qwen2.5-0.5B-shaped model
(no folder needed: the architecture comes from `make_models.SIZES`), e.g. on a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_models  # noqa: E402
import trace_summary  # noqa: E402

PHASES = ("sample", "score", "logps", "update")
REWARD = "grpo_jax.data.task:char_accuracy"


@dataclasses.dataclass(frozen=True)
class Setting:
    """The benchmarked GRPO configuration (the issue's defaults)."""

    prompts_per_step: int = 4
    num_generations: int = 8
    max_completion_length: int = 32
    prompt_length: int = 16
    prompt_length_max: int | None = None  # prompts of uniformly random length in [prompt_length, this] tokens
    temperature: float = 1.0
    beta: float = 0.04
    learning_rate: float = 1e-5
    loss_type: str = "dapo"
    seed: int = 0

    @property
    def rows(self) -> int:
        return self.prompts_per_step * self.num_generations


# jax.monitoring's durations of tracing, lowering and compiling one program
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")
_COMPILED: list[float] | None = None  # their durations since the listener was registered (once a process)


def _compile_seconds() -> list[float]:
    """The durations of `COMPILE_EVENTS` so far, a list the one listener keeps appending to (clear it to start)."""
    global _COMPILED
    if _COMPILED is None:
        import jax

        _COMPILED = []
        jax.monitoring.register_event_duration_secs_listener(
            lambda event, secs, **kw: _COMPILED.append(secs) if event in COMPILE_EVENTS else None)
    return _COMPILED

def architecture(model_dir: str | None, size: str | None) -> dict:
    """config.json of the folder, or the Qwen2Config of a `make_models.SIZES` entry, as a dict."""
    if model_dir is not None:
        return json.loads((Path(model_dir) / "config.json").read_text())
    return make_models.qwen2_config(size).to_dict()


def _rope_theta(arch: dict) -> float:
    return float(arch.get("rope_theta") or (arch.get("rope_parameters") or {}).get("rope_theta", 10000.0))


def _mean_prompt(s: Setting) -> Setting:
    """`s` with its mean prompt length, for FLOP counts of a length spread."""
    if s.prompt_length_max is None:
        return s
    mean = round((s.prompt_length + s.prompt_length_max) / 2)
    return dataclasses.replace(s, prompt_length=mean, prompt_length_max=None)


def step_flops(arch: dict, s: Setting, prompt_group_size: int = 1) -> dict:
    """Analytic model FLOPs of one step: 2 per multiply-add of every matmul, attention over the real context.

    Forward FLOPs per token = 2 * (matmul weights, unembedding included) + 4 * L * H * Dh * context. Sampling:
    prefill of P prompt tokens + T decoded tokens (unembedding at T positions); reference log-probs: one
    forward over P + T; update: forward + backward = 3x forward over P + T. Attention context is averaged.
    `prompt_group_size` G > 1: the log-prob and update passes run each group's prompt once (grpo_jax's
    `train.share_prompt_prefix`), B / G prompt rows instead of B; G = 1 is the model FLOPs of the work as TRL does it.
    """
    D, L, F, V = arch["hidden_size"], arch["num_hidden_layers"], arch["intermediate_size"], arch["vocab_size"]
    H, K = arch["num_attention_heads"], arch["num_key_value_heads"]
    Dh = arch.get("head_dim") or D // H
    layer_weights = D * H * Dh * 2 + D * K * Dh * 2 + 3 * D * F
    body = L * layer_weights
    P, T, B = s.prompt_length, s.max_completion_length, s.rows

    def attention(q_from, q_to):  # sum over query positions of 4 * L * H * Dh * (position + 1)
        return 4 * L * H * Dh * sum(range(q_from + 1, q_to + 1))

    R = B // prompt_group_size
    full = R * (2 * body * P + attention(0, P)) + B * (2 * (body * T + D * V * T) + attention(P, P + T))
    sample = B * (2 * (body * (P + T) + D * V * (T + 1)) + attention(0, P + T))
    return {"sample": sample, "logps": full, "update": 3 * full, "total": sample + 4 * full,
            "params_matmul": body + D * V}


def matmul_peak(backend: str, dtype: str = "float32", n: int = 2048, repeats: int = 5) -> float:
    """Measured matmul FLOP/s: best of `repeats` timed n x n x n products (jax or torch)."""
    if backend == "torch":
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"  # where TRL trains (`use_cpu` below)
        a = torch.randn(n, n, dtype=getattr(torch, dtype), device=device)
        b = torch.randn(n, n, dtype=getattr(torch, dtype), device=device)
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        torch.mm(a, b)
        sync()
        best = min(_timed(lambda: (torch.mm(a, b), sync())) for _ in range(repeats))
    else:
        import jax
        import jax.numpy as jnp
        a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32).astype(dtype)
        b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.float32).astype(dtype)
        mm = jax.jit(lambda x, y: x @ y)
        mm(a, b).block_until_ready()
        best = min(_timed(lambda: mm(a, b).block_until_ready()) for _ in range(repeats))
    return 2 * n ** 3 / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _summary(steps: list[dict], first_rounds_s: float, flops: dict, peak: float, tokens: list[int]) -> dict:
    """Medians over the timed steps, FLOP rates against the measured matmul `peak`."""
    med = lambda key: statistics.median(st[key] for st in steps)  # noqa: E731
    step_s = med("step")
    out = {"step_s": step_s, **{f"{p}_s": med(p) for p in PHASES},
           "completion_tokens_per_s": statistics.median(t / st["step"] for t, st in zip(tokens, steps)),
           "mean_completion_tokens": float(np.mean(tokens)),
           "flops_per_step": flops["total"], "achieved_flops_per_s": flops["total"] / step_s,
           "fraction_of_matmul_peak": flops["total"] / step_s / peak,
           "update_fraction_of_matmul_peak": flops["update"] / med("update") / peak,
           "steps_timed": len(steps)}
    out["warmup_rounds_s"] = first_rounds_s
    return out


def run_grpo_jax(model_dir: str | None, size: str | None, prompts: Path, s: Setting, *, steps: int, warmup: int,
                 dtype: str = "float32", param_dtype: str | None = None, logps_chunk_size: int = 0,
                 host_allocator: str = "retain", overrides: tuple[str, ...] = (),
                 profile_dir: str | None = None) -> dict:
    """grpo_jax's public trainer (`build` + `run_round`), phases from its step_time/* metrics.

    ``overrides``: `dotted.key=value` config overrides applied last. ``profile_dir``: one more round after the
    timed ones runs under `jax.profiler.trace`; its per-op summary (`trace_summary`) joins the result."""
    import jax

    from grpo_jax.algo.sampling import SamplingConfig
    from grpo_jax.api import trainer
    from grpo_jax.config import Config, DataConfig, EvalConfig, RewardConfig, TrainConfig, apply_overrides
    from grpo_jax.data import prompts as data
    from grpo_jax.losses import LossConfig
    from grpo_jax.models import ModelConfig

    arch = architecture(model_dir, size)
    work = Path(tempfile.mkdtemp(prefix="grpo_jax_bench_"))
    tokenizer_dir = model_dir
    if tokenizer_dir is None:
        tokenizer_dir = str(work / "tokenizer")
        make_models.build_tokenizer(tokenizer_dir)
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    model_kwargs = dict(dtype=dtype)
    if param_dtype is not None and "param_dtype" in fields:
        model_kwargs["param_dtype"] = param_dtype
    if model_dir is not None:  # the folder's weights: both trainers start from the same policy
        model = ModelConfig(path=model_dir, **model_kwargs)
    else:
        if "init" in fields:  # random weights on the benchmark's prompts, asked for explicitly
            model_kwargs["init"] = "random"
        model = ModelConfig(vocab_size=arch["vocab_size"], hidden_size=arch["hidden_size"],
                            intermediate_size=arch["intermediate_size"],
                            num_hidden_layers=arch["num_hidden_layers"],
                            num_attention_heads=arch["num_attention_heads"],
                            num_key_value_heads=arch["num_key_value_heads"], head_dim=arch.get("head_dim"),
                            rope_theta=_rope_theta(arch), rms_norm_eps=arch["rms_norm_eps"],
                            tie_word_embeddings=arch["tie_word_embeddings"],
                            initializer_range=arch.get("initializer_range", 0.02), **model_kwargs)
    config = Config(
        seed=s.seed, output_dir=str(work / "run"), max_steps=warmup + steps + bool(profile_dir), model=model,
        host_allocator=host_allocator, compilation_cache_dir=None,  # compile_s: a cold compile, every time
        data=DataConfig(path=str(prompts), tokenizer_path=tokenizer_dir,
                        max_prompt_length=s.prompt_length_max or s.prompt_length),
        sampling=SamplingConfig(max_completion_length=s.max_completion_length, temperature=s.temperature),
        loss=LossConfig(loss_type=s.loss_type, beta=s.beta),
        train=TrainConfig(num_generations=s.num_generations, train_batch_size=s.rows, learning_rate=s.learning_rate,
                          adam_beta2=0.999, max_grad_norm=1.0,
                          logps_chunk_size=logps_chunk_size),  # TRL's (TrainingArguments') optimizer defaults
        reward=RewardConfig(functions=(REWARD,)), eval=EvalConfig(num_examples=0))
    config = apply_overrides(config, overrides)
    start = time.perf_counter()
    run, state, held = trainer.build(config)
    build_s = time.perf_counter() - start
    history, position = [], data.DataState(epoch=0, index=0, seed=config.seed)
    start = time.perf_counter()
    for i in range(warmup):
        state, position, _, lines = trainer.run_round(run, state, position, i)
        history += lines
    first_rounds_s = time.perf_counter() - start
    # compilations inside timed steps (a new packed length, `train.packing`): timed, reported, not subtracted
    compiled = _compile_seconds()
    compiled.clear()
    for i in range(warmup, warmup + steps):
        state, position, _, lines = trainer.run_round(run, state, position, i)
        history += lines
    timed_compile_s = sum(compiled)
    if profile_dir:
        with jax.profiler.trace(profile_dir, create_perfetto_trace=True):
            trainer.run_round(run, state, position, warmup + steps)
    timed = history[warmup:warmup + steps]
    records = [{"step": h["step_time"], **{p: h[f"step_time/{p}"] for p in PHASES}} for h in timed]
    tokens = [int(round(h["completions/mean_length"] * s.rows)) for h in timed]
    # the static sampler decodes every row until the longest ends; the update pads every row to P + T
    longest = [h["completions/max_length"] for h in timed]
    prompt_mean = (s.prompt_length + (s.prompt_length_max or s.prompt_length)) / 2
    device = jax.devices()[0]
    peak = matmul_peak("jax", "bfloat16" if dtype == "bfloat16" else "float32",
                       n=8192 if device.platform == "gpu" else 2048)
    from grpo_jax.api.run import prompt_group_sizes
    # the FLOPs grpo_jax executes (each group's prompt once in log-prob/update passes): its hardware use
    flops = step_flops(arch, _mean_prompt(s), prompt_group_size=prompt_group_sizes(config, run.mesh)[1])
    out = _summary(records, first_rounds_s, flops, peak, tokens)
    out["executed_flops_per_step"] = flops["total"]
    out["sample_padding_fraction"] = 1 - float(np.mean([t / (s.rows * m) for t, m in zip(tokens, longest)]))
    out["update_padding_fraction"] = 1 - float(np.mean(
        [(prompt_mean * s.rows + t) / (s.rows * ((s.prompt_length_max or s.prompt_length) + s.max_completion_length))
         for t in tokens]))
    out["compile_s"] = max(first_rounds_s - warmup * out["step_s"], 0.0)
    out["compile_in_timed_steps_s"] = timed_compile_s
    out.update(build_s=build_s, matmul_peak_flops_per_s=peak, device=str(device), dtype=dtype,
               param_dtype=param_dtype or dtype, jax_version=jax.__version__,
               weights="folder" if model_dir is not None else "random init (architecture only)")
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "peak_bytes_in_use" in stats:
        out["peak_device_memory_mib"] = stats["peak_bytes_in_use"] / 2 ** 20
    out["peak_rss_mib"] = _peak_rss_mib()
    if overrides:
        out["overrides"] = list(overrides)
    if profile_dir:
        out["profile"] = trace_summary.summarize(profile_dir, top=30)
        print(trace_summary.format_summary(out["profile"]), file=sys.stderr)
    return out


class _PhaseTimer:
    """Wraps a bound method so its wall time adds to `totals[name]` (and optional `result` hook)."""

    def __init__(self, totals: dict, name: str, fn, when=lambda: True, on_result=None):
        self.totals, self.name, self.fn, self.when, self.on_result = totals, name, fn, when, on_result

    def __call__(self, *args, **kwargs):
        if not self.when():
            return self.fn(*args, **kwargs)
        start = time.perf_counter()
        result = self.fn(*args, **kwargs)
        self.totals[self.name] = self.totals.get(self.name, 0.0) + time.perf_counter() - start
        if self.on_result is not None:
            self.on_result(result)
        return result


def run_trl(model_dir: str, prompts: Path, s: Setting, *, steps: int, warmup: int, threads: int = 2,
            lora_rank: int = 0, bf16: bool = False) -> dict:
    """TRL 1.16 GRPOTrainer with timers around generation, rewards, no-grad log-probs and the whole step, on the GPU
    when torch sees one. ``lora_rank`` > 0: TRL's `peft_config` with PEFT adapters of that rank on all linear layers
    (alpha 2r). ``bf16``: TRL's `bf16=True` (bfloat16 autocast over float32 weights, as `model.dtype=bfloat16`).

    sample = `_generate`; score = the rest of `_generate_and_score_completions` (rewards, advantages, decoding)
    minus logps; logps = `_get_per_token_logps_and_entropies` under no_grad (reference; old when needed);
    update = step (callback on_step_begin -> on_step_end) minus all of `_generate_and_score_completions`.
    """
    import datasets
    import torch
    import trl
    from transformers import AutoTokenizer, TrainerCallback

    from grpo_jax.data.task import char_accuracy

    torch.set_num_threads(threads)
    rows = [json.loads(line) for line in prompts.read_text().splitlines() if line.strip()]
    args = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_bench_"), per_device_train_batch_size=s.rows,
        num_generations=s.num_generations, max_completion_length=s.max_completion_length,
        temperature=s.temperature, beta=s.beta, learning_rate=s.learning_rate, loss_type=s.loss_type,
        max_steps=warmup + steps, logging_steps=1, report_to="none",
        use_cpu=not torch.cuda.is_available(), bf16=bf16, fp16=False, save_strategy="no", seed=s.seed,
        disable_tqdm=True, dataloader_num_workers=0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    peft_config = None
    if lora_rank:
        import peft
        peft_config = peft.LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0,
                                      target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = trl.GRPOTrainer(model=model_dir, reward_funcs=char_accuracy, args=args, peft_config=peft_config,
                              train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer)
    totals: dict = {}
    tokens: list[int] = []
    trainer._generate = _PhaseTimer(totals, "sample", trainer._generate,
                                    on_result=lambda r: tokens.append(sum(len(ids) for ids in r[1])))
    trainer._generate_and_score_completions = _PhaseTimer(totals, "generate_and_score",
                                                          trainer._generate_and_score_completions)
    trainer._get_per_token_logps_and_entropies = _PhaseTimer(totals, "logps",
                                                             trainer._get_per_token_logps_and_entropies,
                                                             when=lambda: not torch.is_grad_enabled())
    records: list[dict] = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            totals.clear()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            step = time.perf_counter() - self.start
            gen = totals.get("generate_and_score", 0.0)
            records.append({"step": step, "sample": totals.get("sample", 0.0), "logps": totals.get("logps", 0.0),
                            "score": gen - totals.get("sample", 0.0) - totals.get("logps", 0.0),
                            "update": step - gen})

    trainer.add_callback(StepTimes())
    start = time.perf_counter()
    trainer.train()
    total_s = time.perf_counter() - start
    timed = records[warmup:]
    arch = architecture(model_dir, None)
    peak = matmul_peak("torch", "bfloat16" if bf16 else "float32")
    out = _summary(timed, sum(r["step"] for r in records[:warmup]), step_flops(arch, _mean_prompt(s)), peak,
                   tokens[warmup:])
    out["compile_s"] = 0.0  # eager PyTorch: nothing is compiled
    out.update(train_total_s=total_s, matmul_peak_flops_per_s=peak, torch_threads=threads,
               torch_version=torch.__version__, trl_version=trl.__version__, peak_rss_mib=_peak_rss_mib(),
               torch_device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", bf16=bf16)
    return out


def emit(result: dict, out: str | None) -> dict:
    """A benchmark's result printed as JSON (and written to `out` when given); returned."""
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
    return result


def ratios(ours: dict, theirs: dict) -> dict:
    """grpo_jax / TRL per phase and for the whole step (lower is better); ``step_per_completion_token``: the step
    over the completion tokens it drew (each trainer samples its own lengths; at a wide length spread a few steps
    draw different totals)."""
    keys = ("step_s", *(f"{p}_s" for p in PHASES))
    out = {k.removesuffix("_s"): ours[k] / theirs[k] if theirs[k] > 0 else None for k in keys}
    out["step_per_completion_token"] = (ours["step_s"] / ours["mean_completion_tokens"]
                                        / (theirs["step_s"] / theirs["mean_completion_tokens"]))
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", help="a folder written by make_models.py")
    where.add_argument("--size", choices=sorted(make_models.SIZES), help="architecture only (grpo_jax alone)")
    parser.add_argument("--prompts", help="prompt JSONL (default: <model>/../prompts.jsonl, or generated)")
    parser.add_argument("--impl", choices=("both", "grpo_jax", "trl"), default="both")
    parser.add_argument("--steps", type=int, default=10, help="timed steps after warm-up")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dtype", default="float32", help="grpo_jax model.dtype (compute)")
    parser.add_argument("--param-dtype", default=None, help="grpo_jax model.param_dtype (storage)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--trl-bf16", action="store_true", help="TRL's bf16=True (with --dtype bfloat16 for grpo_jax)")
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=32)
    parser.add_argument("--prompt-length", type=int, default=16)
    parser.add_argument("--prompt-length-max", type=int, default=None,
                        help="prompts of random length in [--prompt-length, this] tokens (a realistic spread)")
    parser.add_argument("--prompt-pool", type=int, default=512,
                        help="prompts generated for the run (no --prompts file); --prompt-pool equal to "
                        "--prompts-per-step gives both trainers the same prompts every step (with "
                        "--prompt-length-max, the same prompt lengths)")
    parser.add_argument("--logps-chunk-size", type=int, default=0, help="grpo_jax train.logps_chunk_size")
    parser.add_argument("--host-allocator", choices=("retain", "system"), default="retain",
                        help="the process's malloc policy (grpo_jax.device.cpu), set once for both libraries")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="grpo_jax config override, e.g. model.remat=dots (repeatable)")
    parser.add_argument("--profile", metavar="DIR",
                        help="trace one more grpo_jax round into DIR and add its per-op summary")
    parser.add_argument("--lora", type=int, default=0, metavar="R",
                        help="LoRA adapters of rank R (alpha 2R) on all linear layers, for both libraries (TRL: peft)")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.size is not None and args.impl != "grpo_jax":
        parser.error("--size runs grpo_jax alone: add --impl grpo_jax (TRL needs a --model folder)")
    s = Setting(prompts_per_step=args.prompts_per_step, num_generations=args.num_generations,
                max_completion_length=args.max_completion_length, prompt_length=args.prompt_length,
                prompt_length_max=args.prompt_length_max)
    prompts = Path(args.prompts) if args.prompts else None
    if prompts is None and args.model and (Path(args.model).parent / "prompts.jsonl").is_file() \
            and s.prompt_length == 16 and s.prompt_length_max is None:
        prompts = Path(args.model).parent / "prompts.jsonl"
    generated = prompts is None
    if generated:
        prompts = Path(tempfile.mkdtemp(prefix="bench_prompts_")) / "prompts.jsonl"
        prompts.write_text("".join(json.dumps(r) + "\n" for r in make_models.make_prompts(
            args.prompt_pool, length=s.prompt_length - 1,
            max_length=s.prompt_length_max and s.prompt_length_max - 1)))
    from grpo_jax.device.cpu import configure_host_allocator

    # one process, one malloc: set before either library allocates, so both run under the same policy
    result = {"setting": dataclasses.asdict(s), "model": args.model or args.size, "steps": args.steps,
              "warmup": args.warmup, "flops": step_flops(architecture(args.model, args.size), _mean_prompt(s)),
              "host_allocator": args.host_allocator,
              "host_allocator_applied": configure_host_allocator(args.host_allocator),
              "prompt_pool": args.prompt_pool if generated else None}
    lora = (f"model.lora.rank={args.lora}", f"model.lora.alpha={2 * args.lora}") if args.lora else ()
    if args.lora:
        result["lora_rank"] = args.lora
    if args.impl in ("both", "grpo_jax"):
        result["grpo_jax"] = run_grpo_jax(args.model, args.size, prompts, s, steps=args.steps, warmup=args.warmup,
                                          dtype=args.dtype, param_dtype=args.param_dtype,
                                          logps_chunk_size=args.logps_chunk_size,
                                          host_allocator=args.host_allocator,
                                          overrides=lora + tuple(args.overrides), profile_dir=args.profile)
    if args.impl in ("both", "trl"):
        result["trl"] = run_trl(args.model, prompts, s, steps=args.steps, warmup=args.warmup, threads=args.threads,
                                lora_rank=args.lora, bf16=args.trl_bf16)
    if args.impl == "both":
        result["ratio_grpo_jax_over_trl"] = ratios(result["grpo_jax"], result["trl"])
        # the device's peak: the faster library's measured matmul; both fractions against it
        peak = max(result[k]["matmul_peak_flops_per_s"] for k in ("grpo_jax", "trl"))
        result["device_matmul_peak_flops_per_s"] = peak
        for k in ("grpo_jax", "trl"):
            result[k]["fraction_of_device_matmul_peak"] = result[k]["achieved_flops_per_s"] / peak
    return emit(result, args.out)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
