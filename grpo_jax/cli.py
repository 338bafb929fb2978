"""Command line: `grpo-jax [train] [--config FILE] [section.key=value ...]`. Parses a config and calls `train`."""

from __future__ import annotations

import argparse
import sys


def _train_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grpo-jax train", description="Train a policy with GRPO. With no arguments: the embedded default "
        "task (a tiny model learns to reverse digit strings on CPU in a few minutes).")
    parser.add_argument("--config", help="YAML config file (see configs/); keys not given keep their defaults")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="override any config key, e.g. train.learning_rate=1e-4 loss.beta=0")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "train":
        argv = argv[1:]  # `grpo-jax` alone trains, like `grpo-jax train`
    parser = _train_parser()
    args = parser.parse_intermixed_args(argv)

    from grpo_jax.config import load_config  # imports jax: keep `--help` fast

    try:
        config = load_config(args.config, args.overrides)
    except ValueError as e:
        parser.exit(2, f"grpo-jax: config error: {e}\n")
    from grpo_jax.trainer import train

    train(config, show_progress=not args.no_progress)
    return 0
