"""grpo_jax's command-line step at two (or more) commits, interleaved in one run: the benchmark that finds a
step-time regression and bisects it (a ratio against TRL moves with TRL and the CPU kind; this one does not).

    python benchmarks/make_models.py --out /tmp/bm/models
    python benchmarks/step_ab.py --revs 055ac33 HEAD --model /tmp/bm/models/tiny --steps 40 --warmup 5 --runs 3
    python benchmarks/step_ab.py --revs 055ac33 HEAD --model /tmp/bm/models/small --steps 8 --warmup 3 --runs 3

Each commit is checked out in a `git worktree` of its own and runs ITS `benchmarks/cli_step.py --impl grpo_jax`
(so module paths and settings are that commit's), with that tree first on PYTHONPATH; the runs alternate between
commits, ``--runs`` times each. ``--cold`` turns the compilation cache off (``compilation_cache_dir=null``), so
``first_steps_s`` (start to the warm-up's last console line) counts every compile. Prints JSON: per commit the
median of the runs' median steps, their range, the phases, ``first_steps_s``, peak RSS; each commit's step over the
first's; `lscpu`'s model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cli_step  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
KEYS = ("step_s", "sample_s", "score_s", "update_s", "first_steps_s", "peak_rss_mib")


def worktree(rev: str, root: Path) -> tuple[str, Path]:
    """(rev's full hash, a detached worktree of it under ``root``)."""
    full = subprocess.run(["git", "-C", str(REPO), "rev-parse", rev], capture_output=True, text=True,
                          check=True).stdout.strip()
    tree = root / full[:12]
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-f", "--detach", str(tree), full], check=True,
                   capture_output=True)
    return full, tree


def one_run(tree: Path, args, out: Path) -> dict:
    command = [sys.executable, str(tree / "benchmarks" / "cli_step.py"), "--impl", "grpo_jax", "--model", args.model,
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--out", str(out),
               *(["--set", "compilation_cache_dir=null"] if args.cold else [])]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)})
    return json.loads(out.read_text())["grpo_jax"]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--revs", nargs="+", required=True, help="commits to compare (the first is the baseline)")
    parser.add_argument("--model", required=True, help="a folder written by make_models.py")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--runs", type=int, default=3, help="runs of each commit, interleaved")
    parser.add_argument("--cold", action="store_true", help="no compilation cache: first_steps_s compiles all")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="step_ab_"))
    trees = [worktree(rev, root) for rev in args.revs]
    runs = {full: [] for full, _ in trees}
    try:
        for i in range(args.runs):
            for full, tree in trees:
                runs[full].append(one_run(tree, args, root / f"{full[:12]}_{i}.json"))
    finally:
        for _, tree in trees:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], capture_output=True)
    result = {"cpu": cli_step.cpu_model(), "model": args.model, "steps": args.steps, "warmup": args.warmup,
              "runs": args.runs, "cold": args.cold, "commits": {}}
    for rev, (full, _) in zip(args.revs, trees):
        steps = [r["step_s"] for r in runs[full]]
        result["commits"][rev] = {"commit": full, **{k: statistics.median(r[k] for r in runs[full]) for k in KEYS},
                                  "step_s_range": [min(steps), max(steps)]}
    base = result["commits"][args.revs[0]]["step_s"]
    for rev in args.revs:
        result["commits"][rev]["step_over_first"] = result["commits"][rev]["step_s"] / base
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
