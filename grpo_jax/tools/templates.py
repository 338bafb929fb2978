"""Prefix-preserving training chat templates for the tool-calling families whose released templates are not: Qwen3
(TRL 1.16's, shipped in `chat_templates/` so that multi-turn rollouts need no `trl`; see its README). The other
families grpo_jax parses tool calls of (Qwen2.5, Qwen3-2507, Llama 3.1/3.2, Gemma 4, Mistral, GLM-4-MoE) render
prefix-preserving as released; TRL's `get_training_chat_template` stays the fallback for templates beyond these."""

from __future__ import annotations

import functools
from pathlib import Path

FOLDER = Path(__file__).parent / "chat_templates"
NAMES = ("qwen3",)  # released templates that render an earlier turn differently once a tool message follows


@functools.cache
def _pairs() -> dict[str, str]:
    """Released template -> its training template."""
    return {(FOLDER / f"{name}.jinja").read_text(): (FOLDER / f"{name}_training.jinja").read_text() for name in NAMES}


def training_chat_template(tokenizer) -> str | None:
    """The training template for a tokenizer whose chat template is one of the released ones above; None for any
    other (TRL's `get_training_chat_template` matches templates the same way: as text)."""
    return _pairs().get(getattr(tokenizer, "chat_template", None))
