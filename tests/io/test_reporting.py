"""MetricsWriter on a few metric lines: jsonl, TensorBoard read back with TensorBoard's own reader, resume,
the console line and completion tables."""

import json

import numpy as np
import pytest

from grpo_jax.io.reporting import MetricsWriter, completion_rows, plot_rewards, print_completions, reward_figure


def _scalars(logdir) -> dict:
    """tag -> [(step, value)] of the newest data, as TensorBoard shows it (purged steps dropped)."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    events = accumulator.EventAccumulator(str(logdir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _line(step: int, reward: float) -> dict:
    return {"step": step, "reward": np.float32(reward), "kl": float("nan"), "completions/mean_length": 5,
            "step_time": 0.5}


def test_writer_reports_to_jsonl_and_tensorboard_and_resumes(tmp_path, capsys):
    pytest.importorskip("tensorboardX")
    writer = MetricsWriter(tmp_path, max_steps=4, logging_steps=2, show_progress=False, history=[],
                           report_to=("jsonl", "tensorboard"))
    writer.write_eval(0, {"eval/pass@1": 0.25, "eval/greedy/exact_match": 0.0})
    for step in (1, 2, 3):
        writer.write(_line(step, 0.1 * step))
    writer.write_eval(3, {"eval/pass@1": 0.5, "eval/greedy/exact_match": 0.5})
    writer.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2, 3, 3] and lines[1]["kl"] is None  # NaN written as null
    assert lines[-1] == {"step": 3, "eval/pass@1": 0.5, "eval/greedy/exact_match": 0.5}
    scalars = _scalars(tmp_path / "tensorboard")
    assert [s for s, _ in scalars["train/reward"]] == [1, 2, 3]
    np.testing.assert_allclose([v for _, v in scalars["train/reward"]], [0.1, 0.2, 0.3], rtol=1e-6)
    assert scalars["eval/pass@1"] == [(0, 0.25), (3, 0.5)] and "train/kl" not in scalars  # no NaN point
    out = capsys.readouterr()
    assert out.err.splitlines() == ["grpo step 2/4  reward=0.2  len=5  step_time=0.500s"]  # every logging_steps
    assert "held-out eval at step 3: pass@1=0.500  greedy/exact_match=0.500" in out.out

    # resumed from a checkpoint at step 1: what the first part logged after it is dropped everywhere
    writer = MetricsWriter(tmp_path, max_steps=4, initial_step=1, show_progress=False, history=lines[:2],
                           report_to=("jsonl", "tensorboard"))
    writer.write(_line(2, 0.7))
    writer.close()
    assert [json.loads(line)["reward"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()[1:]] \
        == pytest.approx([0.1, 0.7])
    scalars = _scalars(tmp_path / "tensorboard")
    assert [s for s, _ in scalars["train/reward"]] == [1, 2] and scalars["train/reward"][1][1] == pytest.approx(0.7)
    assert scalars["eval/pass@1"] == [(0, 0.25)]


def test_completion_tables(tmp_path, capsys):
    rewards = np.array([[1.0, 0.5], [np.nan, 0.0]], np.float32)
    advantages = np.array([[0.5, 0.5, 0.0], [-1.0, -2.0, -3.0]])  # per token: the mean over each row's mask
    mask = np.array([[1, 1, 0], [1, 1, 1]])
    rows = completion_rows(["1>", [{"role": "user", "content": "2>"}]], ["1", "x|y"], rewards,
                           ["a:exact", "b:length"], np.array([1.5, 0.0]), advantages, mask)
    assert rows[0] == {"prompt": "1>", "completion": "1", "exact": 1.0, "length": 0.5, "reward": 1.5,
                       "advantage": 0.5}
    assert rows[1]["exact"] is None and rows[1]["advantage"] == -2.0
    writer = MetricsWriter(tmp_path, max_steps=2, logging_steps=2, show_progress=False, report_to=(),
                           num_completions_to_print=1)
    writer.write(_line(1, 0.0), completions=rows)  # not a logging step
    writer.write(_line(2, 0.0), completions=rows)
    writer.close()
    logged = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert logged == [{"step": 2, **row} for row in rows] and not (tmp_path / "metrics.jsonl").exists()
    out = capsys.readouterr().out
    assert "Step 2" in out and out.count("│ 1") + out.count("│ 2>") == 1  # one row of the two printed
    print_completions(rows, 7, None)
    assert "x|y" in capsys.readouterr().out


def test_the_reward_plot_legend_covers_no_curve(tmp_path):
    """Every curve of a run with a long evaluation is named in a legend that lies outside the axes (so over no
    curve) and inside the figure; plot_rewards writes it as a PNG."""
    history = [{"step": s, "reward": s / 40} for s in range(1, 41)]
    names = ("greedy/exact_match", "greedy/char_accuracy", "pass@1", "pass@4", "pass@8", "maj@8",
             "sampled/rewards/exact_match/mean", "sampled/rewards/char_accuracy/mean")
    history += [{"step": s, **{f"eval/{k}": s / 50 for k in names}} for s in (0, 20, 40)]
    fig = reward_figure(history)
    fig.canvas.draw()
    ax = fig.axes[0]
    legend, axes_box = ax.get_legend().get_window_extent(), ax.get_window_extent()
    assert len(ax.get_legend().get_texts()) == len(ax.get_lines()) == 2 + len(names)
    assert legend.x0 > axes_box.x1 and not legend.overlaps(axes_box)
    assert fig.bbox.x0 <= legend.x0 and legend.x1 <= fig.bbox.x1
    assert fig.bbox.y0 <= legend.y0 <= legend.y1 <= fig.bbox.y1
    plot_rewards(history, tmp_path / "reward.png")
    assert (tmp_path / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
