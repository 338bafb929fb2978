"""Command line: `grpo-jax train [--config FILE] [section.key=value ...]`. Parses a config and calls `train`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="grpo-jax", description="GRPO reinforcement learning for language models in JAX.")
    commands = parser.add_subparsers(dest="command")
    train_parser = commands.add_parser("train", help="train a policy with GRPO (the default command)")
    train_parser.add_argument("--config", help="YAML config file (see configs/); keys not given keep their defaults")
    train_parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    train_parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                              help="override any config key, e.g. train.learning_rate=1e-4 loss.beta=0")
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("train", "-h", "--help"):
        argv = ["train", *argv]  # `grpo-jax` alone trains the embedded default task
    args = parser.parse_args(argv)

    from grpo_jax.config import load_config  # imports jax: keep `--help` fast

    try:
        config = load_config(args.config, args.overrides)
    except ValueError as e:
        parser.exit(2, f"grpo-jax: config error: {e}\n")
    from grpo_jax.trainer import train

    train(config, show_progress=not args.no_progress)
    return 0
