"""Multi-turn rollouts with a slow tool: grpo_jax's `rollout.prepare_round` against TRL 1.16's tool loop, one run.

    python benchmarks/tool_rounds.py --size tiny --warmup 2 --rounds 5
    python benchmarks/tool_rounds.py --size small --warmup 1 --rounds 3
    python benchmarks/tool_rounds.py --size tiny --async-tool

Both libraries load one model folder made here (a random-init Qwen2 over `tool_task`'s 16-token vocabulary, its
generation_config.json ending a turn at <eos> or at CALL: `tool_task.stop_token_ids`), call one environment
(`SlowLookupEnv`: `tool_task.LookupEnv` whose `lookup` sleeps ``--latency`` seconds; ``--async-tool``: awaits
`asyncio.sleep`) and see the same 8 prompts x 8 generations every round. A random model ends about half its turns
with CALL, so rollouts take a random number of turns, drawn alike by both.

A round is what happens before the update: grpo_jax `rollout.prepare_round` (decode with tools, rewards, advantages,
log-probs; its `seconds`: sample, score, logps and tool_wait, the time a decoding chunk had nothing to decode until a
tool returned), TRL `GRPOTrainer._generate_and_score_completions` on the 64 rows (sample = `_generate`, the tool
loop included; decode = its `_generate_single_turn` calls). TRL calls the tools of a turn row after row from its
main thread (an async tool is awaited row by row as well), so it decodes nothing during `calls x latency` seconds.
The libraries' rounds alternate (warm-up rounds first, discarded), so both see a shared machine's load alike.

Prints JSON: per library the median round and phases, tool calls a round and their summed seconds, turns a rollout,
the idle fraction (grpo_jax: tool_wait / round, a chunk's mean; TRL: tool seconds / round), the load average
before and after; grpo_jax / TRL; `lscpu`'s model.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cli_step  # noqa: E402
import grpo_step  # noqa: E402

from grpo_jax.tools import tool_task  # noqa: E402

SIZES = {"tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=256),
         "small": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                       intermediate_size=1408)}
PROMPTS, GENERATIONS = 8, 8


class SlowLookupEnv(tool_task.LookupEnv):
    """`tool_task.LookupEnv` whose tool takes ``latency`` seconds; counts its calls and their seconds (class-wide)."""

    latency = 0.1
    calls = 0
    call_seconds = 0.0
    _lock = threading.Lock()

    @classmethod
    def _count(cls, start: float) -> None:
        with cls._lock:  # grpo_jax calls tools from a thread pool
            SlowLookupEnv.calls += 1
            SlowLookupEnv.call_seconds += time.perf_counter() - start

    def lookup(self) -> str:
        """Look up the value stored under the key in the question.

        Returns:
            The value, a string of digits.
        """
        start = time.perf_counter()
        time.sleep(self.latency)
        self._count(start)
        return self._answer


class AsyncSlowLookupEnv(SlowLookupEnv):
    """`SlowLookupEnv` with an async tool."""

    async def lookup(self) -> str:
        start = time.perf_counter()
        await asyncio.sleep(self.latency)
        self._count(start)
        return self._answer

    lookup.__doc__ = SlowLookupEnv.lookup.__doc__  # the tool's schema (description, returns) comes from it


def build_model(size: str, path: str | os.PathLike, seed: int = 0) -> Path:
    """A random-init Qwen2ForCausalLM of ``size`` over `tool_task`'s tokenizer, saved into ``path`` (safetensors),
    the tokenizer into ``path``/tokenizer; both the config's and generation_config.json's eos_token_id are
    `tool_task.stop_token_ids` (grpo_jax reads generation_config.json, `models.eos_token_ids`; TRL the model's
    generation_config, its `eos_token_ids`). The tokenizer has a folder of its own: transformers 5's AutoTokenizer
    next to a qwen2 config.json loads any tokenizer as a Qwen2Tokenizer (byte-level BPE, one more token)."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    path = Path(path)
    tokenizer = tool_task.build_tokenizer(path / "tokenizer")
    stops = list(tool_task.stop_token_ids(tokenizer))
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(tokenizer), tie_word_embeddings=True, max_position_embeddings=2048,
                         rms_norm_eps=1e-6, eos_token_id=stops, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=None, use_sliding_window=False, **SIZES[size])
    model = Qwen2ForCausalLM(config).float()
    model.generation_config = GenerationConfig(eos_token_id=stops, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(path)  # safetensors
    return path


def grpo_jax_side(folder: Path, rows: list, env: type, args) -> tuple[Callable[[int], dict], dict, Callable]:
    """(a function running round ``i``'s `rollout.prepare_round`, what the run is, its close); each round index
    once: its tool journal is new, every call runs."""
    from grpo_jax.api.run import build
    from grpo_jax.config import load_config
    from grpo_jax.data import prompts as data
    from grpo_jax.device import cpu
    from grpo_jax.rollout import round as rollout
    from grpo_jax.tools.calls import open_toolbox

    overrides = [f"model.path={folder}", f"data.tokenizer_path={folder / 'tokenizer'}",
                 "reward.functions=[grpo_jax.tools.tool_task:answer_accuracy]",
                 f"train.num_generations={GENERATIONS}", f"train.train_batch_size={PROMPTS * GENERATIONS}",
                 f"sampling.max_completion_length={args.max_completion_length}",
                 f"sampling.max_tool_calling_iterations={args.max_tool_calling_iterations}", f"loss.beta={args.beta}",
                 "eval.num_examples=0", f"seed={args.seed}",
                 f"output_dir={tempfile.mkdtemp(prefix='tool_rounds_')}/run", *args.overrides]
    config = load_config(None, overrides)
    start = time.perf_counter()
    run, state, held = build(config, train_dataset=rows, environment_factory=env)
    toolbox = open_toolbox(run.tooling)  # the rounds' tool calls, closed by `close`
    build_s = time.perf_counter() - start
    position = data.DataState(epoch=0, index=0, seed=config.seed)

    def one_round(i: int) -> dict:
        nonlocal position
        round_batch, position = rollout.prepare_round(run, state, position, i, toolbox=toolbox)
        s, m = round_batch.seconds, round_batch.metrics
        return {**{f"{k}_s": s.get(k, 0.0) for k in ("sample", "score", "logps", "tool_wait")},
                "turns_per_rollout": m["tools/turns_per_rollout"],
                "completion_tokens": m["completions/mean_length"] * PROMPTS * GENERATIONS,
                "decode_steps": s.get("decode_steps", 0), "reward": m["reward"]}

    def close() -> None:
        toolbox.close()
        held.release()

    chunks = run.programs.decoder.chunks(PROMPTS * GENERATIONS, GENERATIONS)
    return one_round, {"chunks": chunks, "host_threads": cpu.host_threads(config.sampling.host_threads, run.mesh),
                       "build_s": build_s, "overrides": overrides}, close


def trl_side(folder: Path, rows: list, env: type, args) -> tuple[Callable[[int], dict], dict, Callable]:
    """(a function running `GRPOTrainer._generate_and_score_completions` on the round's 64 rows, what it is, its
    close). decode: its `_generate_single_turn` calls (one, then one per tool iteration, of the rows that called)."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import datasets
    import torch
    import trl
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    config = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="tool_rounds_trl_"), per_device_train_batch_size=PROMPTS * GENERATIONS,
        num_generations=GENERATIONS, max_completion_length=args.max_completion_length,
        max_tool_calling_iterations=args.max_tool_calling_iterations, beta=args.beta,
        use_cpu=not torch.cuda.is_available(),
        report_to="none", save_strategy="no", bf16=False, fp16=False, seed=args.seed, disable_tqdm=True,
        dataloader_num_workers=0, max_steps=1)
    trainer = trl.GRPOTrainer(model=str(folder), reward_funcs=tool_task.answer_accuracy, args=config,
                              train_dataset=datasets.Dataset.from_list(rows), environment_factory=env,
                              processing_class=AutoTokenizer.from_pretrained(folder / "tokenizer"))
    trainer.model.train()  # as in `train`: the "train" mode's num_generations and metrics
    totals: dict = {}
    turns: list[float] = []
    trainer._generate = grpo_step._PhaseTimer(totals, "sample", trainer._generate, on_result=lambda r: turns.append(
        statistics.mean(sum(m["role"] == "assistant" for m in c) for c in r[3])))
    generated: list[int] = []  # rows of each `_generate_single_turn` call
    trainer._generate_single_turn = grpo_step._PhaseTimer(totals, "decode", trainer._generate_single_turn,
                                                          on_result=lambda r: generated.append(len(r[0])))
    inputs = [row for row in rows[:PROMPTS] for _ in range(GENERATIONS)]  # the RepeatSampler's order

    def one_round(i: int) -> dict:
        totals.clear()
        generated.clear()
        start = time.perf_counter()
        trainer._generate_and_score_completions([dict(r) for r in inputs])
        wall = time.perf_counter() - start
        metrics = trainer._metrics["train"]  # completions/mean_length: the policy's tokens (TRL's tool_mask)
        return {"sample_s": totals["sample"], "decode_s": totals["decode"], "score_s": wall - totals["sample"],
                "generate_calls": len(generated), "generated_rows": sum(generated), "turns_per_rollout": turns[-1],
                "completion_tokens": metrics["completions/mean_length"][-1] * PROMPTS * GENERATIONS,
                "reward": metrics["reward"][-1]}

    return one_round, {"torch_threads": args.threads, "trl_version": trl.__version__,
                       "torch_version": torch.__version__}, lambda: None


def timed(one_round: Callable[[int], dict], i: int) -> dict:
    """One round: its wall time, the tool's calls and their seconds, and what ``one_round`` reports."""
    SlowLookupEnv.calls, SlowLookupEnv.call_seconds = 0, 0.0
    start = time.perf_counter()
    record = one_round(i)
    return {"round_s": time.perf_counter() - start, **record, "calls": SlowLookupEnv.calls,
            "tool_call_s": SlowLookupEnv.call_seconds}


def summary(records: list[dict], info: dict, warmup: int) -> dict:
    """Medians (each key on its own) of the rounds after ``warmup``, the idle fraction, and the rounds."""
    rounds = records[warmup:]
    out = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    if "tool_wait_s" in out:  # grpo_jax: a decoding chunk waiting on tools with nothing to decode (chunks' mean)
        out.update(idle_fraction=out["tool_wait_s"] / out["round_s"])
    else:  # TRL: its main thread runs the tools one after another, decoding nothing meanwhile
        out.update(idle_fraction=out["tool_call_s"] / out["round_s"])
    return {**out, **info, "first_rounds_s": [r["round_s"] for r in records[:warmup]], "rounds": rounds}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--model", help="reuse this folder (written by an earlier run) instead of a new one")
    parser.add_argument("--impl", choices=("both", "grpo_jax", "trl"), default="both")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds after warm-up")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--latency", type=float, default=0.1, help="seconds a tool call takes")
    parser.add_argument("--async-tool", action="store_true", help="an async lookup (asyncio.sleep)")
    parser.add_argument("--max-completion-length", type=int, default=64)
    parser.add_argument("--max-tool-calling-iterations", type=int, default=3)
    parser.add_argument("--beta", type=float, default=0.0, help="both libraries (TRL's default 0: no reference)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="another grpo_jax override, e.g. sampling.host_threads=1 (repeatable)")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    folder = Path(args.model) if args.model else build_model(
        args.size, Path(tempfile.mkdtemp(prefix="tool_rounds_model_")) / args.size, args.seed)
    env = AsyncSlowLookupEnv if args.async_tool else SlowLookupEnv
    env.latency = SlowLookupEnv.latency = args.latency
    rows = tool_task.make_examples(PROMPTS, args.seed)  # 8 rows, 8 prompts a round: the same prompts every round
    settings = {k: v for k, v in vars(args).items() if k not in ("model", "impl", "overrides", "out")}
    result = {"cpu": cli_step.cpu_model(), "load_average_before": os.getloadavg(), "model": str(folder),
              "settings": {**settings, "prompts": PROMPTS, "num_generations": GENERATIONS}}
    sides = {name: side(folder, rows, env, args) for name, side in (("grpo_jax", grpo_jax_side), ("trl", trl_side))
             if args.impl in ("both", name)}
    records: dict = {name: [] for name in sides}
    try:
        for i in range(args.warmup + args.rounds):  # interleaved: both libraries see the machine's load alike
            for name, (one_round, _, _) in sides.items():
                records[name].append(timed(one_round, i))
    finally:
        for _, _, close in sides.values():
            close()
    for name, (_, info, _) in sides.items():
        result[name] = summary(records[name], info, args.warmup)
    if args.impl == "both":
        ours, theirs = result["grpo_jax"], result["trl"]
        result["ratio_grpo_jax_over_trl"] = {
            "round": ours["round_s"] / theirs["round_s"], "sample": ours["sample_s"] / theirs["sample_s"],
            "round_per_call": (ours["round_s"] / max(ours["calls"], 1)) / (theirs["round_s"] / max(theirs["calls"], 1))}
    result["load_average_after"] = os.getloadavg()
    return grpo_step.emit(result, args.out)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
