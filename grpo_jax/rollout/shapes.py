"""The shapes a run's programs take, fixed before its first round, and their compilation ahead of it.

`run_shapes` lists them from the config and the tokenized prompts (`grpo-jax plan` prints them): the packed layouts
of the round's log-prob passes and of the optimizer step (`trajectory.packing_shapes`, within which
`trajectory.choose_packing` picks), the decoding calls' slot counts (`stream.slot_choices`, within which
`stream.plan_slots` picks) and the rows of a round and of a step. `compile_ahead` lowers each program of the rounds at
each of those shapes with the run's real shardings and compiles it before the first step: `jit`'s own caches then
hold every executable, so no round or step compiles (`tests/rollout/test_compile_once.py` counts), and the compile time is a
phase of its own, not hidden in the first steps. A persistent compilation cache (`compilation_cache_dir`) turns a
second start's compilations into loads.
"""

from __future__ import annotations

import dataclasses
import time
from typing import NamedTuple

import jax
import numpy as np

from grpo_jax.algo import trajectory
from grpo_jax.algo.decoder import continuous_slots
from grpo_jax.algo.program_types import RunShapes  # noqa: F401  (re-exported)
from grpo_jax.device import cpu, sharding
from grpo_jax.rollout import stream

COMPILE_EVENT = "/grpo_jax/compile_ahead"  # a `jax.monitoring` duration event: the warm-up's seconds, at its end


def prompt_range(dataset) -> tuple[int, int]:
    """(fewest, most) real tokens of the dataset's prompts as batches hold them (left-truncated to its length)."""
    lengths = np.minimum(np.diff(dataset.offsets), dataset.max_prompt_length)
    return max(int(lengths.min()), 1), int(lengths.max())


def run_shapes(config, mesh, prompts: tuple[int, int] | None = None, *, round_group_size: int = 1,
               step_group_size: int = 1, decode_chunks: int = 1) -> RunShapes:
    """The shapes of a run of `config` (its prompt length resolved) over `mesh`: ``prompts`` (`prompt_range`; None:
    any length up to `data.max_prompt_length`, for a plan made before the data is read), the G of the round's and
    of the step's log-prob forwards (`context.prompt_group_sizes`) and the host-thread chunks of a round's decoding call
    (`programs.Decoder.chunks`)."""
    tc, P, T = config.train, config.data.max_prompt_length, config.sampling.max_completion_length
    prompts = (1, P) if prompts is None else prompts
    on_cpu = cpu.enabled(config.cpu_speedups)
    cost = dict(dense_pair_cost=cpu.DENSE_PAIR_COST if on_cpu else 1.0,
                blocked_pairs=cpu.blocked_pairs if on_cpu else None, shards=sharding.num_row_shards(mesh),
                max_lengths=tc.packed_lengths)
    flops = trajectory.forward_flops(config.model)
    round_packings = trajectory.packing_shapes(prompts, round_group_size, tc.generation_batch_size, P, T, flops,
                                               packing=tc.packing, **cost)
    step_packings = trajectory.packing_shapes(prompts, step_group_size, tc.train_batch_size, P, T, flops,
                                              packing=tc.packing, micro_batches=tc.gradient_accumulation_steps, **cost)
    # sampling.max_batch_rows set, rows from several calls (no plan, `trainer._plan`), or the CPU switch: a decode
    # step's fixed cost dominates there, so the plan's answer is the static batch (`stream.plan_slots`), and its other
    # slot counts are programs compiled for nothing
    slots = (0,)
    if config.sampling.max_batch_rows is None and not tc.dynamic_sampling and not on_cpu:
        N, rows = tc.generation_batch_size, tc.generation_batch_size // decode_chunks
        programs_by_slots = {continuous_slots(n, rows, N, sharding.num_row_shards(mesh)): n
                             for n in reversed(stream.slot_choices(N, decode_chunks))}  # the same program: once
        slots = tuple(sorted(programs_by_slots.values()))
    return RunShapes(tc.generation_batch_size, tc.train_batch_size, P, T, prompts, round_packings, step_packings,
                     slots, tc.gradient_accumulation_steps)


def _abstract(tree):
    """Arrays as `jax.ShapeDtypeStruct`s with their shardings (None leaves stay None)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
                        tree)


def _host(shape, dtype):
    """A host array's stand-in: no sharding, as numpy arguments reach a program."""
    return jax.ShapeDtypeStruct(shape, dtype)


def _decode_programs(run, params, key, slots: int):
    """Compiles one round's decoding call at ``slots``; returns (the call's trajectory stand-in, programs, the
    largest peak bytes of one)."""
    decoder, tc = run.programs.decoder, run.config.train
    N, P = tc.generation_batch_size, run.config.data.max_prompt_length
    k = decoder.chunks(N, tc.num_generations)
    options = decoder.options(N // k, N, False, slots)
    if run.tooling is not None:  # multi-turn rows pause at EOS for their tools (`stream.decode`), never one program
        options = dataclasses.replace(options, pause_at_eos=True)
    ids = _host((N // k, P), np.int32)
    offset = _host((), np.int32)
    if run.tooling is None and (not options.num_slots or options.num_slots >= N // k):
        compiled = decoder.generate.lower(params, ids, ids, key, offset, options).compile()
        rows, count, peak = compiled.out_info[0], 1, _peak(compiled)
    else:
        start = decoder.start.lower(params, ids, ids, key, offset, options).compile()
        advance = decoder.advance.lower(params, start.out_info, options, True).compile()
        rows = decoder.trajectory.lower(advance.out_info[0]).compile().out_info
        count, peak = 3, max(_peak(start), _peak(advance))
    if k > 1:
        rows = decoder.concat.lower([rows] * k).compile().out_info
        count += 1
    return rows, count, peak


class Warmup(NamedTuple):
    """What `compile_ahead` did: programs compiled, seconds, and each phase's largest peak bytes per device."""

    count: int
    seconds: float
    peaks: dict  # "decode", "logps", "train_step" -> bytes (XLA's buffer assignment of the real devices' programs)


def _peak(compiled) -> int:
    """A compiled program's peak bytes per device: arguments + outputs - donated aliases + temporaries (0 where the
    backend reports no memory analysis)."""
    m = compiled.memory_analysis()
    if m is None:
        return 0
    return m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes


def compile_ahead(run, state, shapes: RunShapes) -> Warmup:
    """Compiles the programs of ``run``'s rounds and steps at every one of ``shapes`` before the first round, for
    ``state`` (its shardings): decoding (each slot count), reference / old log-probs and the step (each packing),
    and the small programs between them. Returns a `Warmup` (the phases' peaks are `grpo-jax plan`'s numbers for
    the devices at hand); records `COMPILE_EVENT`.

    Not covered (they still compile on first use): multi-turn rows' appends, DAPO dynamic sampling's merges,
    asynchronous rounds' sampler, process supervision's step arrays, evaluation (before the first step anyway)."""
    timer = time.perf_counter()
    programs, tc = run.programs, run.config.train
    N, T = tc.generation_batch_size, run.config.sampling.max_completion_length
    params, key = _abstract(state.params), _abstract(state.key)
    count, peaks = 0, {"decode": 0, "logps": 0, "train_step": 0}
    sample_key = programs.sample_key.lower(key, 0, 0).compile()
    count += 1
    rows = None
    for slots in shapes.decode_slots:
        rows, n, peak = _decode_programs(run, params, sample_key.out_info, slots)
        count, peaks["decode"] = count + n, max(peaks["decode"], peak)
    args = (rows.prompt_ids, rows.prompt_mask, rows.completion_ids, rows.completion_mask, rows.routed_experts)
    old = rows.sampler_per_token_logps if tc.needs_old_logps else None
    ref = None
    for L, K in shapes.round_packings:
        if programs.ref_logps is not None:
            compiled = programs.ref_logps.lower(_abstract(state.reference_params), *args, L, K).compile()
            ref, count, peaks["logps"] = compiled.out_info, count + 1, max(peaks["logps"], _peak(compiled))
        if tc.needs_old_logps and run.config.model.dtype != "float32":  # float32: the sampler's (`dispatch_logps`)
            compiled = programs.logps.lower(params, *args, L, K).compile()
            old, count, peaks["logps"] = compiled.out_info, count + 1, max(peaks["logps"], _peak(compiled))
    advantages = _host((N, T) if tc.advantage_estimator == "process" else (N,), np.float32)
    batch = programs.rows.lower(rows, advantages, old, ref).compile().out_info
    count += 1
    if tc.advantage_estimator != "process":  # process supervision's step arrays vary in width: compiled per width
        F = len(run.reward_fns)
        programs.advantages(np.zeros((N, F), np.float32), np.ones(F, np.float32), np.ones((N, T), np.int32), None,
                            None)
        count += 1
    if run.step_prompt_group_size == 1 or tc.steps_per_generation > 1:  # steps gather their rows (`run_steps`)
        batch = programs.take.lower(batch, _host((tc.train_batch_size,), np.int64)).compile().out_info
        count += 1
    abstract_state = _abstract(state)
    for L, K in shapes.step_packings:
        peaks["train_step"] = max(peaks["train_step"], _peak(programs.step.lower(abstract_state, batch, L, K).compile()))
        count += 1
    float(run.schedule(0))  # the step metrics' learning rate (`run_steps`): eager ops, compiled once
    seconds = time.perf_counter() - timer
    jax.monitoring.record_event_duration_secs(COMPILE_EVENT, seconds)
    return Warmup(count, seconds, peaks)


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def describe_peaks(peaks: dict, device) -> str:
    """The phases' peaks per device as one line (phases that do not run left out), against the device's memory
    limit where it reports one (an accelerator's HBM), e.g. ``decode 1.20 GiB, logps 3.40 GiB, train_step 9.80 GiB
    of 95.7 GiB``."""
    stats = (device.memory_stats() if hasattr(device, "memory_stats") else None) or {}
    limit = stats.get("bytes_limit")
    text = ", ".join(f"{name} {_size(peak)}" for name, peak in peaks.items() if peak)
    return text + (f" of {limit / 2**30:.1f} GiB" if limit else "")
