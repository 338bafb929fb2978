"""Run outputs on the host: metrics.jsonl, the terminal progress bar and the reward plot."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm


def plain(value):
    """JSON-safe scalars: numpy/jax numbers to Python, NaN and inf to None."""
    value = value.item() if hasattr(value, "item") else value
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    """Appends one JSON line per optimizer step and drives the progress bar; the file only ever ends in a whole line.

    `history` holds every line written (the checkpoint saves it); with `write_file=False` (processes other than
    0 of a multi-host run) nothing is written to disk and no bar is shown.
    """

    def __init__(self, output_dir: Path, *, max_steps: int, initial_step: int = 0, logging_steps: int = 1,
                 show_progress: bool = True, history: list[dict] | None = None, write_file: bool = True):
        self.path = output_dir / "metrics.jsonl"
        self.logging_steps = logging_steps
        self.write_file = write_file
        self.history: list[dict] = list(history or [])
        if write_file and history is not None:  # a resumed run: drop lines written after the checkpoint (and a
            # line torn by a crash), replacing the file whole so that a failed rewrite leaves the old one
            partial = self.path.with_name(self.path.name + ".partial")
            partial.write_text("".join(json.dumps(line) + "\n" for line in self.history))
            os.replace(partial, self.path)
        self.bar = tqdm(total=max_steps, initial=initial_step, desc="grpo", unit="step", dynamic_ncols=True,
                        disable=not (show_progress and write_file))

    def write(self, line: dict) -> None:
        line = {k: plain(v) for k, v in line.items()}
        self.history.append(line)
        if self.write_file:
            data = (json.dumps(line) + "\n").encode()
            with self.path.open("ab", buffering=0) as f:
                end = f.seek(0, os.SEEK_END)
                try:
                    written = 0
                    while written < len(data):  # a short write happens when the disk fills up
                        written += f.write(data[written:])
                except OSError:  # then the file keeps whole lines only
                    f.truncate(end)
                    raise
        self.bar.update(1)
        if line["step"] % self.logging_steps == 0:
            postfix = {"reward": line.get("reward"), "kl": line.get("kl"), "len": line.get("completions/mean_length")}
            self.bar.set_postfix({k: f"{v:.3f}" for k, v in postfix.items() if v is not None}, refresh=False)

    def close(self) -> None:
        self.bar.close()


def plot_rewards(history: list[dict], path: Path, title: str = "GRPO reward") -> None:
    """Reward per step and its moving average, saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.array([h["step"] for h in history])
    rewards = np.array([np.nan if h.get("reward") is None else h["reward"] for h in history], dtype=float)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, rewards, lw=0.8, alpha=0.5, label="reward (per step)")
    window = max(1, len(rewards) // 20)
    if len(rewards) >= window > 1:
        smooth = np.convolve(np.nan_to_num(rewards), np.ones(window) / window, mode="valid")
        ax.plot(steps[window - 1:], smooth, lw=2, label=f"moving average ({window} steps)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean reward")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
