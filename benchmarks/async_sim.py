"""Predicted wall time of asynchronous rounds (`train.max_staleness` k) against synchronous ones, 8-256 devices.

    python benchmarks/async_phases.py --out /tmp/phases.json     # measures the phase times on this machine
    python benchmarks/async_sim.py --phases /tmp/phases.json      # the speedup table, JSON out

A deterministic event simulation (seeded lengths, a fixed dispatch order, no timing noise) of `--rounds` rounds
driven by measured per-device phase times (`Phases`, fitted by async_phases.py):

- decode of a static batch of b rows per device: prefill_row_s * b + max_length * step(b), step(b) the measured
  decode step times `decode_step_s` at `decode_rows` rows, interpolated (linearly, and beyond the last two points
  along their line: the measured points are few and the machine's step cost is not a straight line; the
  context's growth over a completion is not modelled). One SPMD program runs its loop while any row of the mesh
  decodes, so every device of the sampling mesh waits for the longest completion of the whole round;
- reward: reward_row_s per completion, on the host of the sampling device (each host scores its own rows);
- update: update_fixed_s + update_token_s * tokens on the busiest device (rows split into contiguous shares; a
  group's prompt counted once, `train.share_prompt_prefix`), plus sync_s for the gradient all-reduce when more than
  one device trains; a split placement adds sync_s for the params broadcast to the rollout devices.

Weak scaling: `rows_per_device` rows a device a round, so a round of D devices has rows_per_device * D rows (the
longest of more rows is longer: the synchronous straggler). Per-device times do not depend on D (a ring all-reduce
moves ~2x the gradient bytes a device whatever D; sync_s is that time). Completion lengths are geometric with mean
`mean_completion`, cut at `max_completion` (the spread of `rollout_lengths.py`: a random model with EOS one id of
a 256-token vocabulary, mean 256 of 1,024); prompts uniform in `prompt_lengths`, one a group.

Placements (one optimizer step a round; round r is sampled with the params after update max(0, r - k)):
- synchronous (k = 0, colocated): sample -> reward -> update, one round after the other (the baseline);
- colocated: one mesh runs S_0 .. S_k, then U_0, S_(k+1), U_1, S_(k+2), ... (sampling of a later round dispatched
  between updates), the host scoring meanwhile: only host time is hidden;
- split: R devices sample round after round, D - R devices update, a bounded pipeline; the table keeps the best
  R among multiples of D/8 with at most `max_rows_per_device` rows a sampling device (its KV cache's memory).

Not modelled: continuous batching (within or across rounds), interruptible rollouts, memory beyond that cap.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np


@dataclasses.dataclass(frozen=True)
class Phases:
    """Per-device phase times in seconds (async_phases.py's fits)."""
    decode_rows: tuple[int, ...]  # rows in flight of the measured decode steps, increasing
    decode_step_s: tuple[float, ...]  # a decode step's time at those rows
    prefill_row_s: float  # a row's prompt and first token
    update_fixed_s: float
    update_token_s: float  # each real (packed) token of the update
    reward_row_s: float = 0.0  # host scoring per completion
    sync_s: float = 0.0  # a params all-reduce or broadcast
    max_rows_per_device: int = 512


@dataclasses.dataclass(frozen=True)
class Workload:
    """What a round holds; rows grow with the devices (weak scaling)."""
    rows_per_device: int = 64
    generations: int = 8
    prompt_lengths: tuple[int, int] = (64, 512)
    mean_completion: float = 256.0
    max_completion: int = 1024
    rounds: int = 32
    seed: int = 0


def draw_lengths(workload: Workload, devices: int) -> tuple[np.ndarray, np.ndarray]:
    """Completion lengths [rounds, N] and per-row prompt tokens [rounds, N] (a group's prompt split over its rows)."""
    rng = np.random.default_rng(workload.seed)
    rows, G = workload.rows_per_device * devices, workload.generations
    completion_RxN = np.minimum(rng.geometric(1 / workload.mean_completion, (workload.rounds, rows)),
                                workload.max_completion)
    low, high = workload.prompt_lengths
    prompt_RxP = rng.integers(low, high + 1, (workload.rounds, rows // G))
    return completion_RxN, np.repeat(prompt_RxP / G, G, axis=1)


def step_s(phases: Phases, rows: int) -> float:
    """A decode step's seconds at `rows` rows in flight: the measured points joined by lines, extended at both ends."""
    x, y = np.asarray(phases.decode_rows, float), np.asarray(phases.decode_step_s, float)
    i = int(np.clip(np.searchsorted(x, rows) - 1, 0, len(x) - 2))
    return float(y[i] + (y[i + 1] - y[i]) * (rows - x[i]) / (x[i + 1] - x[i]))


def decode_s(phases: Phases, completion_N: np.ndarray, devices: int) -> float:
    """One round's sampling on `devices` devices: the longest row of the round sets the steps."""
    rows = -(-len(completion_N) // devices)
    return phases.prefill_row_s * rows + int(completion_N.max()) * step_s(phases, rows)


def update_s(phases: Phases, completion_N: np.ndarray, prompt_N: np.ndarray, devices: int) -> float:
    """One round's update on `devices` devices: the busiest device's tokens, and the all-reduce if it has peers."""
    tokens = max(float(share.sum()) for share in np.array_split(completion_N + prompt_N, devices))
    return phases.update_fixed_s + phases.update_token_s * tokens + (phases.sync_s if devices > 1 else 0.0)


@dataclasses.dataclass(frozen=True)
class Timeline:
    """Start and end of every round's sample (S), reward (H) and update (U), and the params version it sampled."""
    sample: np.ndarray  # [rounds, 2]
    reward: np.ndarray
    update: np.ndarray
    version: np.ndarray  # [rounds]: updates done before the round's params

    @property
    def staleness(self) -> np.ndarray:
        return np.arange(len(self.version)) - self.version

    def round_s(self, warmup: int) -> float:
        """Steady-state seconds a round: the spacing of update ends, `warmup` rounds left out at either end (the
        pipeline's filling and draining); 0 keeps them all."""
        ends = np.concatenate([[0.0], self.update[:, 1]])
        return float((ends[len(ends) - 1 - warmup] - ends[warmup]) / (len(ends) - 1 - 2 * warmup))


def simulate(phases: Phases, workload: Workload, devices: int, max_staleness: int,
             rollout_devices: int = 0) -> Timeline:
    """The event simulation: colocated when `rollout_devices` is 0, else split (R sample, D - R train)."""
    completion_RxN, prompt_RxN = draw_lengths(workload, devices)
    split = rollout_devices > 0
    sampling, training = (rollout_devices, devices - rollout_devices) if split else (devices, devices)
    if split and not 0 < rollout_devices < devices:
        raise ValueError(f"rollout_devices={rollout_devices}: give 1 .. {devices - 1} (or 0: colocated)")
    R = workload.rounds
    S = [decode_s(phases, completion_RxN[r], sampling) for r in range(R)]
    U = [update_s(phases, completion_RxN[r], prompt_RxN[r], training) for r in range(R)]
    H = phases.reward_row_s * (-(-completion_RxN.shape[1] // sampling))
    broadcast = phases.sync_s if split else 0.0
    params_at = np.zeros(R + 1)  # params_at[v]: when version v (v updates done) is on the sampling devices
    sample, reward, update = np.zeros((R, 2)), np.zeros((R, 2)), np.zeros((R, 2))
    version = np.maximum(np.arange(R) - max_staleness, 0)
    free = {"sample": 0.0, "train": 0.0, "host": 0.0}

    def run(unit: str, r: int, ready: float, seconds: float, into: np.ndarray) -> None:
        start = max(free[unit], ready)
        into[r] = start, start + seconds
        free[unit] = start + seconds

    def sample_round(r: int) -> None:
        run("sample" if split else "train", r, params_at[version[r]], S[r], sample)
        run("host", r, sample[r, 1], H, reward)

    def update_round(r: int) -> None:
        run("train", r, max(reward[r, 1], update[r - 1, 1] if r else 0.0), U[r], update)
        params_at[r + 1] = update[r, 1] + broadcast

    # one device order from the config alone: S_0 .. S_k, then U_r before S_(r+k+1)
    for r in range(min(max_staleness + 1, R)):
        sample_round(r)
    for r in range(R):
        update_round(r)
        if r + max_staleness + 1 < R:
            sample_round(r + max_staleness + 1)
    return Timeline(sample, reward, update, version)


def speedups(phases: Phases, workload: Workload, devices: int, staleness: list[int]) -> dict:
    """Synchronous round time and, per k, colocated and the best split's speedup over it."""
    warmup = workload.rounds // 4
    if warmup <= max(staleness):
        raise ValueError(f"rounds={workload.rounds}: give more than 4 x the largest staleness {max(staleness)}")
    sync_s = simulate(phases, workload, devices, 0).round_s(warmup)
    rows = workload.rows_per_device * devices
    splits = [r for r in range(devices // 8 or 1, devices, devices // 8 or 1)
              if -(-rows // r) <= phases.max_rows_per_device]
    tokens = float(draw_lengths(workload, devices)[0].mean()) * rows
    out = {"devices": devices, "rows": rows, "sync_round_s": sync_s,
           "sync_tokens_per_s_per_device": tokens / sync_s / devices, "by_staleness": {}}
    for k in staleness:
        colocated = simulate(phases, workload, devices, k).round_s(warmup)
        split = {r: simulate(phases, workload, devices, k, r).round_s(warmup) for r in splits}
        best = min(split, key=split.get) if split else None
        out["by_staleness"][str(k)] = {"colocated_speedup": sync_s / colocated,
                                       "split_speedup": sync_s / split[best] if split else None,
                                       "split_rollout_devices": best}
    return out


def phases_from(path: str) -> Phases:
    """The `phases` object of async_phases.py's JSON."""
    fields = {f.name for f in dataclasses.fields(Phases)}
    data = json.loads(Path(path).read_text())["phases"]
    return Phases(**{name: tuple(value) if isinstance(value, list) else value for name, value in data.items()
                     if name in fields})


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phases", required=True, help="async_phases.py's JSON")
    parser.add_argument("--devices", default="8,16,32,64,128,256")
    parser.add_argument("--staleness", default="0,1,2,4")
    parser.add_argument("--rows-per-device", type=int, default=64)
    parser.add_argument("--mean-completion", type=float, default=256.0)
    parser.add_argument("--max-completion", type=int, default=1024)
    parser.add_argument("--reward-ms", type=float, help="reward per completion, ms (default: the measured one)")
    parser.add_argument("--sync-ms", type=float, help="a params all-reduce or broadcast, ms (default: measured)")
    parser.add_argument("--rounds", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    phases = phases_from(args.phases)
    if args.reward_ms is not None:
        phases = dataclasses.replace(phases, reward_row_s=args.reward_ms / 1000)
    if args.sync_ms is not None:
        phases = dataclasses.replace(phases, sync_s=args.sync_ms / 1000)
    workload = Workload(rows_per_device=args.rows_per_device, mean_completion=args.mean_completion,
                        max_completion=args.max_completion, rounds=args.rounds, seed=args.seed)
    staleness = [int(k) for k in args.staleness.split(",")]
    table = [speedups(phases, workload, int(d), staleness) for d in args.devices.split(",")]
    for row in table:
        cells = "  ".join(f"k={k}: {v['colocated_speedup']:.2f} / {v['split_speedup'] or 0:.2f} "
                          f"(R={v['split_rollout_devices']})" for k, v in row["by_staleness"].items())
        print(f"D={row['devices']:4d} sync {row['sync_round_s']:8.2f} s  colocated / split: {cells}", flush=True)
    result = {"phases": dataclasses.asdict(phases), "workload": dataclasses.asdict(workload), "table": table}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
