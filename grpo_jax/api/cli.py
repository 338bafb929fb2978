"""Command line: `grpo-jax [train] [--config FILE] [section.key=value | --key value ...]`, `grpo-jax export`,
`grpo-jax verify` and `grpo-jax plan`.

Parses a config and calls `train`, exports a checkpoint's policy, checks a run's checkpoints against their
checksums, or plans a run's memory and time on a topology (`grpo_jax.api.plan`); no maths here.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

OVERRIDE = re.compile(r"[A-Za-z_][\w.]*=")  # a `key=value` item, never a flag's value
OWN_FLAGS = ("--config", "--no-progress", "--debug", "--help")


def _train_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grpo-jax train", description="Train a policy with GRPO. With no arguments: the embedded default "
        "task (a tiny model learns to reverse digit strings on CPU in a few minutes). Run the same command with "
        "the same output_dir again to resume from its newest checkpoint.",
        epilog="other commands: `grpo-jax export --help` (a checkpoint's policy to a Hugging Face folder), "
        "`grpo-jax verify --help` (a run's checkpoints against their checksums), `grpo-jax plan --help` (a run's "
        "memory per chip and time on a TPU topology, compiled from here)")
    parser.add_argument("--config", help="YAML config file, or the name of a packaged recipe (see configs/: "
                        "cispo, dapo, dr_grpo, grpo_deepseekmath, gspo, ...); keys not given keep their defaults")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar: one line every logging_steps steps on stderr instead")
    parser.add_argument("--debug", action="store_true",
                        help="on an error, print Python's full traceback (with the chained causes) instead of one line")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="override any config key, e.g. train.learning_rate=1e-4 loss.beta=0; TRL's style works "
                        "too: --beta 0.0 --learning_rate=1e-6 --use_peft (a flag alone is true)")
    return parser


def flags_as_overrides(argv: list[str], own: tuple[str, ...] = ()) -> list[str]:
    """TRL's `--key value`, `--key=value`, `--key v1 v2` (a list) and `--flag` (true) as `key=value` overrides;
    `--config`, `--no-progress`, `--help` and the flags in ``own`` stay the parser's."""
    import yaml  # here: `grpo-jax --help` stays fast

    out, i = [], 0
    while i < len(argv):
        token, i = argv[i], i + 1
        if token == "--":  # argparse's end of options: the rest are overrides as written
            return out + argv[i - 1:]
        if not token.startswith("--") or token.split("=", 1)[0] in OWN_FLAGS + own:
            out.append(token)
            if token in own and i < len(argv):  # its value, whatever it looks like
                out.append(argv[i])
                i += 1
            continue
        key, eq, value = token[2:].partition("=")
        values = []
        while not eq and i < len(argv) and not argv[i].startswith("--") and not OVERRIDE.match(argv[i]):
            values.append(argv[i])
            i += 1
        if not eq:  # parsed as YAML when the override is, so each item keeps its type inside a list
            value = "true" if not values else values[0] if len(values) == 1 else yaml.safe_dump(
                [yaml.safe_load(v) for v in values], default_flow_style=True, width=2**31).strip()
        out.append(f"{key.replace('-', '_')}={value}")
    return out


def _export_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grpo-jax export", description="Write a checkpoint's policy in Hugging Face format.")
    parser.add_argument("--checkpoint", required=True,
                        help="a run's output_dir (its newest valid checkpoint) or one step folder checkpoints/<step>")
    parser.add_argument("--out", required=True, help="folder to write (config.json, weights, tokenizer): new or empty")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing non-empty --out (only once the new export is complete)")
    parser.add_argument("--merge", action="store_true",
                        help="LoRA runs: write the model with the adapters merged, not a PEFT adapter folder")
    parser.add_argument("--reference", action="store_true",
                        help="the reference model instead of the policy (kept with train.sync_ref_model)")
    return parser


def _verify_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grpo-jax verify", description="Check every checkpoint of a run against the checksums recorded when "
        "it was written; exits 1 when any file differs.")
    parser.add_argument("output_dir", help="a run's output_dir, or one checkpoint step folder checkpoints/<step>")
    return parser


def _plan_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grpo-jax plan", description="Compile a run's programs (prefill, a decode step, the log-prob forward, "
        "the train step) for a topology without allocating anything, and print each phase's memory per chip, "
        "FLOPs, bytes and roofline time; exits 1 when a phase does not fit in 90% of a chip's HBM.")
    parser.add_argument("--topology", required=True,
                        help="a TPU slice such as v5p:4x4x4, v6e:8x8, v5e:2x2 (compiled here with libtpu), or local "
                        "(the devices at hand)")
    parser.add_argument("--config", help="YAML config file or packaged recipe, as for train; model.path may hold "
                        "only config.json")
    parser.add_argument("--json", help="also write {fits, layout, chip, phases: {name: {peak_bytes, hbm_bytes, flops, "
                        "bytes_accessed, collective_bytes, collectives, loop_trips, rows_per_chip, est_seconds}}} to "
                        "this file")
    parser.add_argument("--hbm-gib", type=float, help="judge the fit against this much memory per chip instead of "
                        "the chip's (memory kept for something else, or a what-if)")
    parser.add_argument("--hbm-efficiency", type=float, default=None,
                        help="share of HBM bandwidth a memory-bound program reaches (default 0.85)")
    parser.add_argument("--mfu", type=float, default=None,
                        help="share of peak FLOP/s a compute-bound program reaches (default 0.55)")
    parser.add_argument("--mean-completion", type=int, default=0,
                        help="a row's real completion tokens on average, for the real tokens/s (default: half of "
                        "sampling.max_completion_length)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides, as for train")
    return parser


def plan_main(argv: list[str]) -> int:
    """`grpo-jax plan --topology T [--config FILE] [--json FILE] [overrides]`."""
    parser = _plan_parser()
    args = parser.parse_intermixed_args(flags_as_overrides(argv, own=("--topology", "--json", "--hbm-gib",
                                                                         "--hbm-efficiency", "--mfu",
                                                                         "--mean-completion")))
    from grpo_jax.config import load_config

    try:
        config = load_config(args.config, args.overrides)
    except ValueError as e:
        parser.exit(2, f"grpo-jax plan: config error: {_one_line(e)}\n")
    if args.hbm_gib is not None and args.hbm_gib <= 0:
        parser.exit(2, f"grpo-jax plan: --hbm-gib={args.hbm_gib} must be > 0 (GiB per chip)\n")
    for flag, value in (("--hbm-efficiency", args.hbm_efficiency), ("--mfu", args.mfu)):
        if value is not None and not 0 < value <= 1:
            parser.exit(2, f"grpo-jax plan: {flag}={value} must be in (0, 1] (a share of the chip's peak)\n")
    T = config.sampling.max_completion_length
    if not 0 <= args.mean_completion <= T:
        parser.exit(2, f"grpo-jax plan: --mean-completion={args.mean_completion} must be between 1 and "
                    f"sampling.max_completion_length={T} (0: {T // 2})\n")
    from grpo_jax.api import plan

    try:
        devices = plan.topology_devices(args.topology)
        hbm = None if args.hbm_gib is None else int(args.hbm_gib * 2 ** 30)
        result = plan.plan(config, devices, hbm_bytes=hbm, hbm_efficiency=args.hbm_efficiency or plan.HBM_EFFICIENCY,
                           mfu=args.mfu or plan.MFU, mean_completion=args.mean_completion)
    except ValueError as e:
        print(f"grpo-jax plan: {e}", file=sys.stderr)
        return 1
    print("\n".join(plan.report(result, args.topology)))
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(result.as_json(), f, indent=1)
    return 0 if result.fits else 1


def verify_main(argv: list[str]) -> int:
    """`grpo-jax verify OUTPUT_DIR`."""
    args = _verify_parser().parse_args(argv)
    from grpo_jax.io.checkpoint import verify_run

    try:
        ok, lines = verify_run(args.output_dir)
    except ValueError as e:
        print(f"grpo-jax verify: {e}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0 if ok else 1


def export_main(argv: list[str]) -> int:
    """`grpo-jax export --checkpoint DIR --out HF_DIR`."""
    args = _export_parser().parse_args(argv)
    from grpo_jax.io import export

    try:
        step, fmt = export.export(args.checkpoint, args.out, merge=args.merge, overwrite=args.overwrite,
                                  reference=args.reference)
    except (ValueError, RuntimeError, OSError) as e:  # OSError: a full or read-only disk; --out is left as it was
        print(f"grpo-jax export: {e}", file=sys.stderr)
        return 1
    kind = "native (params/ + model_config.json)" if fmt == "native" else export.FORMAT_NAMES[fmt]
    what = "reference model" if args.reference else "policy"
    print(f"grpo-jax export: step {step}'s {what} written to {args.out} in {kind} format")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # transformers' advice that PyTorch is missing: grpo_jax uses it for tokenizers and configs only
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    if argv and argv[0] == "export":
        return export_main(argv[1:])
    if argv and argv[0] == "verify":
        return verify_main(argv[1:])
    if argv and argv[0] == "plan":
        return plan_main(argv[1:])
    if argv and argv[0] == "train":
        argv = argv[1:]  # `grpo-jax` alone trains, like `grpo-jax train`
    parser = _train_parser()
    args = parser.parse_intermixed_args(flags_as_overrides(argv))

    from grpo_jax.config import load_config
    from grpo_jax.io import preemption

    preemption.Console.install()  # a console that goes away (Ctrl-C on `| tee`) must not stop the stop's save
    try:
        config = load_config(args.config, args.overrides)
    except ValueError as e:
        parser.exit(2, f"grpo-jax: config error: {_one_line(e)}\n")
    from grpo_jax.io.trackers import check_installed

    try:  # before jax loads: a missing tracker package is said at once (`run.check_inputs` says it for `train`)
        check_installed(config.report_to)
    except ValueError as e:
        print(f"grpo-jax: {e}", file=sys.stderr)
        return 1
    preemption.COMMAND = ["grpo-jax", *argv]  # what a message to rerun shows, while this command runs
    from grpo_jax.device import distributed
    from grpo_jax.io import supervisor

    try:
        if distributed.wanted(config.distributed) and not os.environ.get(supervisor.CHANNEL):
            # several processes: the training runs in a child, so that a host lost ends in one line (`supervisor`)
            return supervisor.supervise(argv, config.distributed,
                                        distributed.resolved_arguments(config.distributed)["num_processes"],
                                        named=config.output_dir is not None)
        return _train(config, args.no_progress, args.debug)
    except KeyboardInterrupt:  # outside the loop, whose steps a SIGINT saves: starting, or the final export
        print("grpo-jax: interrupted outside the training steps: none was lost (a stop during training saves "
              "them first); run the same command again to start or resume", file=sys.stderr)
        return 130
    finally:
        preemption.COMMAND = None


def _train(config, no_progress: bool, debug: bool = False) -> int:
    from grpo_jax.device.distributed import initialize
    from grpo_jax.io.preemption import Interrupted, Preempted, RunFailed, describe, quiet_storage_logs

    try:
        initialize(config.distributed)  # before any computation: every process of a multi-host run joins here
        from grpo_jax.api.trainer import train

        quiet_storage_logs()
        train(config, show_progress=not no_progress)
    except (Preempted, Interrupted) as e:
        print(f"grpo-jax: {e}", file=sys.stderr)
        return e.exit_code
    except (RunFailed, ValueError, OSError) as e:  # what failed and what to do, in one line (no traceback)
        if debug:
            raise
        print(f"grpo-jax: {_one_line(e)}", file=sys.stderr)
        return 1
    except Exception as e:  # user code or a library failing while the run is built: where, in one line
        if debug:
            raise
        print(f"grpo-jax: {_one_line(describe(e))} (--debug prints the traceback)", file=sys.stderr)
        return 1
    return 0


def _one_line(error) -> str:
    """An error's message on one line: a library's multi-line message folded."""
    return re.sub(r"\s*\n\s*", " ", str(error).strip())
