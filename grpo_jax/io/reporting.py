"""Run outputs on the host: metrics to the `report_to` backends, the console, completion tables and the plots.

`MetricsWriter` takes one line per optimizer step (TRL's metric names) and one per evaluation (names under
`eval/`, `grpo_jax.rollout.evaluation`) and hands them to each backend of `report_to`:

- `jsonl`: `metrics.jsonl`, the names as they are (`reward`, `eval/pass@1`).
- `tensorboard`: event files in `output_dir/tensorboard`, written by tensorboardX (no TensorFlow).
- `wandb`: a Weights & Biases run (`WANDB_PROJECT`, default `grpo_jax`; `WANDB_MODE=offline` keeps it local; offline
  too when its server cannot be reached).

TensorBoard and W&B (`grpo_jax.io.trackers`) get the names that TRL's Trainer gives them there: `train/reward`,
`eval/pass@1`. With `log_completions` the round's completions go every `logging_steps` to `completions.jsonl`, the
console, a TensorBoard text and a W&B table. The two trackers are imported only when listed.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from grpo_jax.io.trackers import cell, open_tracker


def plain(value):
    """JSON-safe scalars: numpy/jax numbers to Python, NaN and inf to None."""
    value = value.item() if hasattr(value, "item") else value
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def is_eval(line: dict) -> bool:
    """An evaluation's line (its metrics are under `eval/`), not an optimizer step's."""
    return any(key.startswith("eval/") for key in line)


def completion_rows(prompts: list, completions: list[str], rewards_NxF: np.ndarray, names, reward_N: np.ndarray,
                    advantages: np.ndarray, mask_NxT: np.ndarray, extra: dict | None = None) -> list[dict]:
    """A round's completions as TRL logs them: prompt, completion, each reward function, total reward, advantage,
    and the columns reward functions logged with `log_extra` (one value per completion; a column with another
    count, e.g. from DAPO's discarded passes, is left out).

    Per-token advantages (process supervision, [N, T]) are shown as their mean over the completion's tokens.
    """
    advantages = np.asarray(advantages, np.float64)
    if advantages.ndim == 2:
        advantages = (advantages * mask_NxT).sum(axis=1) / np.maximum(mask_NxT.sum(axis=1), 1)
    short = [name.split(":")[-1] for name in names]
    columns = {k: v for k, v in (extra or {}).items() if len(v) == len(completions)}
    return [{"prompt": prompts[i], "completion": completions[i],
             **{name: plain(rewards_NxF[i, f]) for f, name in enumerate(short)},
             "reward": plain(reward_N[i]), "advantage": plain(advantages[i]),
             **{column: plain(values[i]) for column, values in columns.items()}} for i in range(len(completions))]


def print_completions(rows: list[dict], step: int, num: int | None, file=None) -> None:
    """TRL's console table of a round's completions (`num` rows picked by a seeded draw; None: all): with rich
    when installed, else as plain text."""
    if num is not None and num < len(rows):
        rows = [rows[i] for i in sorted(np.random.default_rng(step).choice(len(rows), num, replace=False))]
    if not rows:
        return
    file = file or sys.stdout
    if importlib.util.find_spec("rich") is not None:
        from rich.console import Console
        from rich.panel import Panel
        from rich.table import Table

        table = Table(show_header=True, header_style="bold white", expand=True)
        for key in rows[0]:
            table.add_column(key.capitalize() if key in ("prompt", "completion", "advantage") else key,
                             justify="left" if key in ("prompt", "completion") else "right")
        for row in rows:
            table.add_row(*(cell(v) for v in row.values()))
            table.add_section()
        Console(file=file).print(Panel(table, expand=False, title=f"Step {step}", border_style="bold white"))
    else:
        print(f"completions at step {step}:", file=file)
        for row in rows:
            print("  " + "  ".join(f"{k}={cell(v)!r}" if k in ("prompt", "completion") else f"{k}={cell(v)}"
                                   for k, v in row.items()), file=file)


def _replace(path: Path, text: str) -> None:
    """`path` holds `text`, written beside it and renamed over it: a failed write leaves the old file."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def _whole(row: str) -> bool:
    try:
        json.loads(row)
    except ValueError:  # a line torn by a crash
        return False
    return True


def _append_whole(path: Path, text: str) -> None:
    """Appends `text` or nothing: the file only ever ends in a whole line, also when the disk fills up."""
    data = text.encode()
    with path.open("ab", buffering=0) as f:
        end = f.seek(0, os.SEEK_END)
        try:
            written = 0
            while written < len(data):  # a short write happens when the disk fills up
                written += f.write(data[written:])
        except OSError:
            f.truncate(end)
            raise


class MetricsWriter:
    """Sends each line to the `report_to` backends, drives the progress bar (or, without it, a console line every
    `logging_steps` on stderr) and logs completion tables.

    `history` holds every line written (the checkpoint saves it); a resumed run passes its saved history, and
    what its previous part wrote after that point is dropped from metrics.jsonl, completions.jsonl and
    TensorBoard. With `write_file=False` (processes other than 0 of a multi-host run) nothing is written and no
    bar or line is shown.
    """

    def __init__(self, output_dir: Path, *, max_steps: int, initial_step: int = 0, logging_steps: int = 1,
                 show_progress: bool = True, history: list[dict] | None = None, write_file: bool = True,
                 report_to=("jsonl",), num_completions_to_print: int | None = None, run_config: dict | None = None):
        self.path = output_dir / "metrics.jsonl"
        self.completions_path = output_dir / "completions.jsonl"
        self.max_steps, self.logging_steps = max_steps, logging_steps
        self.show_progress, self.write_file = show_progress, write_file
        self.jsonl = "jsonl" in report_to
        self.num_completions_to_print = num_completions_to_print
        self.history: list[dict] = list(history or [])
        resumed = history is not None
        if write_file and resumed:  # a resumed run: drop lines written after the checkpoint (and a line torn by a
            # crash), replacing each file whole so that a failed rewrite leaves the old one
            if self.jsonl:
                _replace(self.path, "".join(json.dumps(line) + "\n" for line in self.history))
            if self.completions_path.is_file():
                rows = self.completions_path.read_text().splitlines()
                _replace(self.completions_path, "".join(r + "\n" for r in rows if _whole(r)
                                                        and json.loads(r)["step"] <= initial_step))
        self.backends = [open_tracker(name, output_dir, initial_step + 1 if resumed else None, run_config or {})
                         for name in report_to if name != "jsonl"] if write_file else []
        self.bar = tqdm(total=max_steps, initial=initial_step, desc="grpo", unit="step", dynamic_ncols=True,
                        disable=not (show_progress and write_file))

    def _append(self, line: dict, names: dict) -> None:
        self.history.append(line)
        if not self.write_file:
            return
        if self.jsonl:
            _append_whole(self.path, json.dumps(line) + "\n")
        for backend in self.backends:
            backend.scalars(names, line["step"])

    def write_steps(self, lines: list[dict], completions: list[dict] | None = None) -> None:
        """`write` for each of a round's finished steps; when writing one fails (a tracker), the history still gets
        every line, so the state after those steps can be saved with it (a resume rewrites the files from it)."""
        written = len(self.history)
        try:
            for line in lines:
                self.write(line, completions=completions)
        except BaseException:
            del self.history[written:]
            self.history.extend({k: plain(v) for k, v in line.items()} for line in lines)
            raise

    def write(self, line: dict, completions: list[dict] | None = None) -> None:
        """One optimizer step's metrics; `completions`: its round's table (`completion_rows`), logged when the
        step is a multiple of `logging_steps`."""
        line = {k: plain(v) for k, v in line.items()}
        self._append(line, {f"train/{k}": v for k, v in line.items() if k != "step"})  # TRL's names there
        self.bar.update(1)
        step = line["step"]
        if step % self.logging_steps:
            return
        postfix = {"reward": line.get("reward"), "kl": line.get("kl"), "len": line.get("completions/mean_length")}
        self.bar.set_postfix({k: f"{v:.3f}" for k, v in postfix.items() if v is not None}, refresh=False)
        if self.write_file and not self.show_progress:
            parts = [f"{k}={v:.4g}" for k, v in postfix.items() if v is not None]
            print(f"grpo step {step}/{self.max_steps}  " + "  ".join(parts)
                  + f"  step_time={line.get('step_time') or 0.0:.3f}s", file=sys.stderr, flush=True)
        if completions and self.write_file:
            self._completions(step, completions)

    def write_eval(self, step: int, metrics: dict) -> None:
        """An evaluation's metrics (names under `eval/`) after `step` optimizer steps, also shown on the console."""
        if not metrics:
            return
        line = {"step": step, **{k: plain(v) for k, v in metrics.items()}}
        self._append(line, {k: v for k, v in line.items() if k != "step"})
        if self.write_file:
            shown = "  ".join(f"{k.removeprefix('eval/')}={v:.3f}"
                              for k, v in line.items() if k != "step" and v is not None and "/std" not in k)
            tqdm.write(f"held-out eval at step {step}: {shown}")

    def _completions(self, step: int, rows: list[dict]) -> None:
        _append_whole(self.completions_path, "".join(json.dumps({"step": step, **row}) + "\n" for row in rows))
        with tqdm.external_write_mode():  # the bar steps aside for the table
            print_completions(rows, step, self.num_completions_to_print)
        for backend in self.backends:
            backend.completions(rows, step)

    def close(self) -> None:
        self.bar.close()
        for backend in self.backends:
            backend.close()
        self.backends = []


def _series(history: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the lines that have `key` (None: NaN)."""
    lines = [h for h in history if key in h]
    return (np.array([h["step"] for h in lines]),
            np.array([np.nan if h[key] is None else h[key] for h in lines], dtype=float))


def reward_figure(history: list[dict], title: str = "GRPO reward"):
    """Training reward per step and its moving average, with the held-out evaluation's curves; the legend right of
    the axes, where it covers none of them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, rewards = _series([h for h in history if not is_eval(h)], "reward")
    fig, ax = plt.subplots(figsize=(9.5, 4))
    ax.plot(steps, rewards, lw=0.8, alpha=0.5, label="reward (per step)")
    window = max(1, len(rewards) // 20)
    if len(rewards) >= window > 1:
        smooth = np.convolve(np.nan_to_num(rewards), np.ones(window) / window, mode="valid")
        ax.plot(steps[window - 1:], smooth, lw=2, label=f"moving average ({window} steps)")
    evals = [h for h in history if is_eval(h)]
    keys = dict.fromkeys(k for h in evals for k in h if k.startswith(("eval/greedy/", "eval/pass@", "eval/maj@"))
                         or (k.startswith("eval/sampled/rewards/") and k.endswith("/mean")))
    for key in keys:
        ax.plot(*_series(evals, key), marker="o", ms=3, lw=1.2, label=key.replace("/mean", "") + " (held-out)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean reward")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    fig.subplots_adjust(left=0.08, right=0.7, bottom=0.12, top=0.92)  # not tight_layout: a second render
    return fig


def plot_rewards(history: list[dict], path: Path, title: str = "GRPO reward") -> None:
    """`reward_figure` as a PNG."""
    import matplotlib.pyplot as plt

    fig = reward_figure(history, title)
    fig.savefig(path, dpi=120)
    plt.close(fig)


_PANELS = (("reward", ("reward",)), ("KL to the reference", ("kl",)), ("entropy", ("entropy",)),
           ("completion length (tokens)", ("completions/mean_length", "completions/min_length",
                                           "completions/max_length")),
           ("clip ratios", ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                            "cispo_clip_ratio")),
           ("grad norm (before clipping)", ("grad_norm",)))


def plot_training(history: list[dict], path: Path) -> None:
    """Reward, KL, entropy, completion length, clip ratios and gradient norm against the step, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [h for h in history if not is_eval(h)]
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5), sharex=True)
    fig.subplots_adjust(left=0.05, right=0.98, bottom=0.08, top=0.95, wspace=0.22, hspace=0.25)
    for ax, (title, keys) in zip(axes.flat, _PANELS):
        shown = [k for k in keys if any(k in h for h in lines)]
        for key in shown:
            ax.plot(*_series(lines, key), lw=1, label=key)
        if len(shown) > 1:
            ax.legend(fontsize=7)
        if not shown:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.locator_params(nbins=4)  # fewer tick labels: text is most of the drawing time
    for ax in axes[-1]:
        ax.set_xlabel("optimizer step")
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_run(history: list[dict], output_dir: Path) -> None:
    """`reward.png` and `training.png` of a run's history."""
    plot_rewards(history, output_dir / "reward.png")
    plot_training(history, output_dir / "training.png")
