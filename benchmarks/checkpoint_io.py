"""Checkpoint save and restore time with and without checksums, for a Qwen2.5-0.5B-shaped train state on CPU.

The state is what a run saves: float32 params and AdamW moments (random values, as incompressible as trained
weights), no reference. "with" is `checkpoint.manager` (each step's files hashed, xxh3-128, before orbax renames
its folder; every file hashed again before a restore); "without" is the same orbax manager without that callback
(its steps have no checksums.json, so `restore_step` reads them unverified). Saves wait for the write to finish;
the files stay in the page cache between a save and its restore (a restore after a reboot reads them from disk
twice, once to check them).

    python benchmarks/checkpoint_io.py                 # the 0.5B shape: 24 layers, 494 M params, 5.9 GB saved
    python benchmarks/checkpoint_io.py --layers 4      # its width and vocabulary with 4 layers (2.4 GB saved)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

from grpo_jax.algo.state import abstract_state, make_optimizer  # noqa: E402
from grpo_jax.io import checkpoint  # noqa: E402

from memory import QWEN25_05B  # noqa: E402


def random_state(layers: int):
    """The train state of the 0.5B shape with `layers` decoder layers, filled with random normal floats."""
    config = dataclasses.replace(QWEN25_05B, num_hidden_layers=layers)
    optimizer = make_optimizer(optax.constant_schedule(1e-6), weight_decay=0.0, b1=0.9, b2=0.99, eps=1e-8,
                               max_grad_norm=1.0)
    shapes = abstract_state(config, optimizer, with_reference=False)
    leaves, treedef = jax.tree.flatten(shapes)
    keys = jax.random.split(jax.random.PRNGKey(0), len(leaves))
    filled = [jax.random.normal(k, x.shape, x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else jnp.zeros(
        x.shape, x.dtype) for k, x in zip(keys, leaves)]
    return jax.tree.unflatten(treedef, filled)._replace(step=jnp.asarray(1, jnp.int32))


def unchecked_manager(output_dir: Path) -> ocp.CheckpointManager:
    """`checkpoint.manager` without its checksum callback."""
    options = ocp.CheckpointManagerOptions(create=True, cleanup_tmp_directories=True)
    return ocp.CheckpointManager(output_dir.absolute() / checkpoint.CHECKPOINTS, options=options)


def one(state, root: Path, checked: bool) -> dict:
    out = root / ("with" if checked else "without")
    mngr = checkpoint.manager(out) if checked else unchecked_manager(out)
    timer = time.perf_counter()
    checkpoint.save(mngr, state, keep_ref=False, meta={}, wait=True)
    save_s = time.perf_counter() - timer
    step_dir = out / checkpoint.CHECKPOINTS / "1"
    timer = time.perf_counter()
    checkpoint.check_checksums(out / checkpoint.CHECKPOINTS, 1)
    verify_s = time.perf_counter() - timer
    timer = time.perf_counter()
    restored = checkpoint.restore_step(mngr, 1, state, keep_ref=False)[0]
    jax.block_until_ready(restored)
    restore_s = time.perf_counter() - timer
    size = sum(p.stat().st_size for p in step_dir.rglob("*") if p.is_file())
    mngr.close()
    del restored
    shutil.rmtree(out)
    return {"save_s": save_s, "restore_s": restore_s, "verify_s": verify_s, "bytes": size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=QWEN25_05B.num_hidden_layers)
    parser.add_argument("--repeats", type=int, default=3, help="save/restore pairs per variant, interleaved")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args()
    state = random_state(args.layers)
    params = sum(x.size for x in jax.tree.leaves(state.params))
    root = Path(tempfile.mkdtemp(prefix="ckpt_bench_", dir=args.dir))
    rows = {True: [], False: []}
    try:
        for i in range(args.repeats):
            for checked in ((True, False) if i % 2 == 0 else (False, True)):  # alternate the order
                rows[checked].append(one(state, root, checked))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"0.5B shape with {args.layers} layers: {params / 1e6:.0f} M params, "
          f"{rows[True][0]['bytes'] / 1e9:.2f} GB per checkpoint; jax {jax.__version__}, medians of {args.repeats}\n")
    print("| | save (s) | restore (s) | of which checksum check (s) |\n|---|---|---|---|")
    for checked in (False, True):
        med = {k: statistics.median(r[k] for r in rows[checked]) for k in ("save_s", "restore_s", "verify_s")}
        print(f"| {'with' if checked else 'without'} checksums | {med['save_s']:.2f} | {med['restore_s']:.2f} | "
              f"{med['verify_s']:.2f} |")


if __name__ == "__main__":
    main()
