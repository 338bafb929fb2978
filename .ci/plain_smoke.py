"""CI stage 2 (.ci/plain_install): each README feature once, tiny, on a plain `pip install -e .` (no extras).

Run with the fresh venv's python: conversational data (jinja2), tools (the lookup recipe, and our tool-call parsers
of each family without TRL), eval, resume, verify, LoRA + export (adapter and merged). Each step prints its seconds;
a failing step stops with its command's output.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
TIMES: list[tuple[str, float]] = []


def step(name, what):
    """Decorator: run the function now, timed, and record it under ``name``."""
    def run(fn):
        start = time.perf_counter()
        fn()
        TIMES.append((name, time.perf_counter() - start))
        print(f"plain smoke: {name} ({what}): {TIMES[-1][1]:.1f} s", flush=True)
    return run


def grpo_jax(*args: str, expect: str | None = None) -> str:
    """`grpo-jax ARGS` from the venv; its output (stdout + stderr), which must contain ``expect``."""
    result = subprocess.run([str(BIN / "grpo-jax"), *args], capture_output=True, text=True, timeout=600)
    out = result.stdout + result.stderr
    if result.returncode != 0 or (expect is not None and expect not in out):
        sys.exit(f"plain smoke: `grpo-jax {' '.join(args)}` (exit {result.returncode}, expected {expect!r}):\n{out}")
    return out


def main() -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    tiny = ["--no-progress", "eval.num_examples=16", "save_steps=4"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)

        @step("clean venv", "a plain install: no torch, no trl, jinja2 present")
        def _():
            extras = [m for m in ("torch", "trl", "peft") if importlib.util.find_spec(m) is not None]
            assert not extras, f"the plain venv has {extras}: it must be a clean `pip install -e .`"
            assert importlib.util.find_spec("jinja2") is not None, "jinja2 is missing from the dependencies"

        @step("default+eval", "the default task: 8 steps, eval every 4, checkpoints, final/")
        def _():
            grpo_jax(f"output_dir={tmp / 'run'}", "max_steps=8", "eval.steps=4", *tiny,
                     expect="held-out eval at step 8")
            summary = json.loads((tmp / "run" / "summary.json").read_text())
            assert "greedy/exact_match" in str(summary), summary
            assert (tmp / "run" / "final" / "config.json").is_file() and (tmp / "run" / "reward.png").is_file()

        @step("resume+verify", "the same run resumed to step 12, then verified")
        def _():
            grpo_jax(f"output_dir={tmp / 'run'}", "max_steps=12", "eval.steps=4", *tiny,
                     expect="resuming from checkpoint")
            steps = [json.loads(line).get("step") for line in (tmp / "run" / "metrics.jsonl").open()]
            assert max(s for s in steps if s is not None) == 12, steps
            grpo_jax("verify", str(tmp / "run"))

        @step("lora+export", "LoRA on the run's final/ model, exported as an adapter and merged")
        def _():
            grpo_jax(f"output_dir={tmp / 'lora'}", f"model.path={tmp / 'run' / 'final'}", "model.lora.rank=4",
                     "max_steps=4", "train.learning_rate=1e-3", *tiny)
            grpo_jax("export", "--checkpoint", str(tmp / "lora"), "--out", str(tmp / "adapter"))
            assert (tmp / "adapter" / "adapter_config.json").is_file()
            grpo_jax("export", "--checkpoint", str(tmp / "lora"), "--out", str(tmp / "merged"), "--merge")
            assert (tmp / "merged" / "config.json").is_file()

        @step("chat data", "conversational data from a JSONL file (a chat template: jinja2)")
        def _():
            from grpo_jax.data import task
            from grpo_jax.tools import tool_task
            tool_task.build_tokenizer(tmp / "tok")
            task.write_jsonl(tmp / "chat.jsonl", tool_task.make_examples(64, seed=0, min_len=3, max_len=3))
            grpo_jax(f"output_dir={tmp / 'chat'}", f"data.path={tmp / 'chat.jsonl'}",
                     f"data.tokenizer_path={tmp / 'tok'}", "model.init=random",
                     "reward.functions=[grpo_jax.tools.tool_task:answer_accuracy]",
                     "sampling.max_completion_length=8", "max_steps=4", *tiny)

        @step("tools", "the lookup recipe (an environment called between turns), 6 steps")
        def _():
            grpo_jax("--config", "tools_lookup", f"output_dir={tmp / 'tools'}", "max_steps=6", *tiny)
            assert "tools/call_frequency" in (tmp / "tools" / "metrics.jsonl").read_text()

        @step("tool parsers", "tool calls of Qwen, Llama 3, Mistral, Gemma 4 and GLM-4-MoE read without TRL")
        def _():
            from grpo_jax.tools import tool_parsers
            texts = {"qwen": '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call><|im_end|>',
                     "llama3": '{"name": "f", "parameters": {"a": 1}}<|eot_id|>',
                     "mistral": '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}]</s>',
                     "gemma4": "<|tool_call>call:f{a:1}<tool_call|><turn|>",
                     "glm4moe": "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>"}
            schema = [{"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {"a": {"type": "integer"}}}}}]  # GLM's values are text till cast
            for fmt in tool_parsers.FORMATS:
                message = tool_parsers.parse_response(fmt, texts[fmt.name], schema)
                assert message["tool_calls"] == [{"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]

        @step("qwen3 tools", "Qwen3's chat template (not prefix-preserving) renders tool turns without TRL")
        def _():
            import transformers

            from grpo_jax.tools import calls, templates
            tok = transformers.AutoTokenizer.from_pretrained(tmp / "tok")  # the chat data step's tokenizer
            tok.chat_template = (templates.FOLDER / "qwen3.jinja").read_text()
            assert templates.training_chat_template(tok) == (templates.FOLDER / "qwen3_training.jinja").read_text()
            tool = [{"role": "tool", "name": "f", "content": "1"}]
            assert calls.suffix_ids(tok, tool, chat_template=templates.training_chat_template(tok))

    print("plain smoke: all passed: " + ", ".join(f"{name} {t:.0f} s" for name, t in TIMES)
          + f"; total {sum(t for _, t in TIMES):.0f} s")


if __name__ == "__main__":
    main()
