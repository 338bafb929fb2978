"""The train command line: TRL's `--key value` style beside `key=value`, and config errors in one line."""

import subprocess
import sys

import pytest

from grpo_jax.api import cli
from grpo_jax.config import load_config


@pytest.fixture
def trained(monkeypatch):
    """cli.main's config and progress flag, with training itself replaced."""
    calls = []
    monkeypatch.setattr("grpo_jax.api.trainer.train", lambda config, show_progress: calls.append((config, show_progress)))
    return calls


def test_trl_style_flags_are_overrides(trained, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("loss:\n  epsilon: 0.3\n")
    argv = ["train", "--beta", "0.0", "--learning_rate=1e-6", "--use_peft", "--lora_target_modules", "q_proj",
            "v_proj", "--config", str(path), "sampling.top_k=5", "--no-progress", "--report_to", "tensorboard",
            "--num-generations", "4", "--output_dir", str(tmp_path / "run")]
    assert cli.main(argv) == 0
    ((config, show_progress),) = trained
    assert config == load_config(str(path), [
        "loss.beta=0", "train.learning_rate=1e-6", "model.lora.rank=16", "model.lora.alpha=32", "model.lora.dropout=0.05", "sampling.top_k=5",
        "model.lora.target_modules=[q_proj, v_proj]", "report_to=[tensorboard]", "train.num_generations=4",
        f"output_dir={tmp_path / 'run'}"])
    assert show_progress is False and config.loss.epsilon == 0.3  # --config and --no-progress keep their meaning


def test_a_flag_followed_by_an_override_is_true(trained):
    assert cli.main(["--use_peft", "loss.epsilon=0.1", "--mask_truncated_completions", "--beta", "0.5"]) == 0
    ((config, show_progress),) = trained
    assert (config.model.lora.rank, config.loss.epsilon, config.train.mask_truncated_completions,
            config.loss.beta) == (16, 0.1, True, 0.5)
    assert show_progress is True


def test_a_refused_flag_value_is_one_line_and_exit_2():
    result = subprocess.run([sys.executable, "-m", "grpo_jax", "--beta", "-1", "--learning_rate", "1e-6"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("grpo-jax: config error: loss.beta=-1.0 is negative"), result.stderr
