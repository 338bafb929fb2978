"""The shapes a run's programs take, fixed before its first round, and their compilation ahead of it.

`run_shapes` lists them from the config and the tokenized prompts (`grpo-jax plan` prints them): the packed layouts
of the round's log-prob passes and of the optimizer step (`trajectory.packing_shapes`, within which
`trajectory.choose_packing` picks), the decoding calls' slot counts (`stream.slot_choices`, within which
`stream.plan_slots` picks) and the rows of a round and of a step. `compile_ahead` lowers each program of the rounds at
each of those shapes with the run's real shardings and compiles it before the first step, several at once on threads
(`compile_threads`) while the next are lowered: `jit`'s own caches then
hold every executable, so no round or step compiles (`tests/rollout/test_compile_once.py` counts), and the compile time is a
phase of its own, not hidden in the first steps. A persistent compilation cache (`compilation_cache_dir`) turns a
second start's compilations into loads.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any, NamedTuple

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


PHASES = {"generate": "decode", "start": "decode", "advance": "decode", "ref_logps": "logps", "logps": "logps",
          "train_step": "train_step"}  # the programs whose peaks `Warmup.peaks` reports, by phase


class _Compiler:
    """Compiles lowered programs on a pool of threads while the caller lowers the next ones: XLA compiles outside
    the GIL, so independent programs (a step per packing, a log-prob pass per packing, decoding) compile side by
    side. Each program is the one a serial compile makes (the same HLO and options), and `jit`'s caches keep it
    alike: the run's calls find it."""

    def __init__(self, workers: int):
        self.pool = concurrent.futures.ThreadPoolExecutor(max(workers, 1), thread_name_prefix="grpo_jax-compile")
        self.jobs: list[tuple[str, float, concurrent.futures.Future]] = []

    def compile(self, name: str, lower: Callable, pick: Callable = lambda outputs: outputs) -> Any:
        """Lowers (``lower()``) and starts compiling program ``name``; returns ``pick`` of its outputs' stand-ins,
        for the programs after it: the lowering's own where each has its sharding (the program fixes them), else
        the compiled program's (XLA chooses them), waited for."""
        timer = time.perf_counter()
        lowered = lower()
        job = self.pool.submit(_timed_compile, lowered)
        self.jobs.append((name, time.perf_counter() - timer, job))
        info = pick(lowered.out_info)
        if any(getattr(x, "sharding", None) is None for x in jax.tree.leaves(info)):
            info = pick(job.result()[0].out_info)
        return info

    def finish(self) -> tuple[tuple, dict]:
        """Waits for every job (the first failure raised); returns ((name, lowering seconds, compile seconds) of
        each program, each phase's largest peak)."""
        peaks, done = {"decode": 0, "logps": 0, "train_step": 0}, []
        try:
            for name, lower_s, job in self.jobs:
                compiled, compile_s = job.result()
                done.append((name, round(lower_s, 3), round(compile_s, 3)))
                phase = PHASES.get(name.split()[0])
                if phase is not None:
                    peaks[phase] = max(peaks[phase], _peak(compiled))
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)
        return tuple(done), peaks


def _timed_compile(lowered):
    timer = time.perf_counter()
    return lowered.compile(), time.perf_counter() - timer


def _decode_programs(run, compiler: _Compiler, params, key, slots: int):
    """Lowers one round's decoding call at ``slots`` and starts compiling it; returns the call's trajectory
    stand-in."""
    decoder, tc = run.programs.decoder, run.config.train
    N, P = tc.generation_batch_size, run.config.data.max_prompt_length
    k = decoder.chunks(N, tc.num_generations)
    options = decoder.options(N // k, N, False, slots)
    if run.tooling is not None:  # multi-turn rows pause at EOS for their tools (`stream.decode`), never one program
        options = dataclasses.replace(options, pause_at_eos=True)
    ids = _host((N // k, P), np.int32)
    offset = _host((), np.int32)
    if run.tooling is None and (not options.num_slots or options.num_slots >= N // k):
        rows = compiler.compile(f"generate {slots or 'all'}",
                                lambda: decoder.generate.lower(params, ids, ids, key, offset, options),
                                lambda outputs: outputs[0])
    else:
        start = compiler.compile(f"start {slots}", lambda: decoder.start.lower(params, ids, ids, key, offset, options))
        decoding = compiler.compile(f"advance {slots}", lambda: decoder.advance.lower(params, start, options, True),
                                    lambda outputs: outputs[0])
        rows = compiler.compile(f"trajectory {slots}", lambda: decoder.trajectory.lower(decoding))
    if k > 1:
        rows = compiler.compile("concat", lambda: decoder.concat.lower([rows] * k))
    return rows


class Warmup(NamedTuple):
    """What `compile_ahead` did: programs compiled, seconds, and each phase's largest peak bytes per device."""

    count: int
    seconds: float
    peaks: dict  # "decode", "logps", "train_step" -> bytes (XLA's buffer assignment of the real devices' programs)
    programs: tuple = ()  # (name, lowering seconds, compile seconds) of each program, in the order lowered


def _peak(compiled) -> int:
    """A compiled program's peak bytes per device: arguments + outputs - donated aliases + temporaries (0 where the
    backend reports no memory analysis)."""
    m = compiled.memory_analysis()
    if m is None:
        return 0
    return m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes


def compile_workers(setting: int | None) -> int:
    """Threads compiling at once (`compile_threads`). None: half the host's CPUs, at most 4 (one XLA:CPU compile keeps
    about 1.4 threads busy: on 2 CPUs two at once took ~10 % more CPU time for no measured gain; each compile holds
    its own XLA buffers in host memory)."""
    return setting if setting else min(max((os.cpu_count() or 1) // 2, 1), 4)


def compile_ahead(run, state, shapes: RunShapes, *, workers: int = 1) -> Warmup:
    """Compiles the programs of ``run``'s rounds and steps at every one of ``shapes`` before the first round, for
    ``state`` (its shardings): decoding (each slot count), reference / old log-probs and the step (each packing),
    and the small programs between them, on ``workers`` threads (`compile_workers`) while the next are lowered.
    Returns a `Warmup` (the phases' peaks are `grpo-jax plan`'s numbers for the devices at hand); records
    `COMPILE_EVENT`.

    Not covered (they still compile on first use): multi-turn rows' appends, DAPO dynamic sampling's merges,
    asynchronous rounds' sampler, process supervision's step arrays, evaluation (before the first step anyway)."""
    timer = time.perf_counter()
    programs, tc = run.programs, run.config.train
    N, T = tc.generation_batch_size, run.config.sampling.max_completion_length
    params, key = _abstract(state.params), _abstract(state.key)
    compiler = _Compiler(workers)
    try:
        sample_key = compiler.compile("sample_key", lambda: programs.sample_key.lower(key, 0, 0))
        rows, decode_params = None, params
        if hasattr(programs.decoder.layout, "lower"):  # the rollout layout's reshard (`programs.jit_decoder`)
            decode_params = compiler.compile("layout", lambda: programs.decoder.layout.lower(params))
        for slots in shapes.decode_slots:
            rows = _decode_programs(run, compiler, decode_params, sample_key, slots)
        args = (rows.prompt_ids, rows.prompt_mask, rows.completion_ids, rows.completion_mask, rows.routed_experts)
        old = rows.sampler_per_token_logps if tc.needs_old_logps else None
        ref = None
        for L, K in shapes.round_packings:
            layout = f"{K}x{L}" if L else "static"
            if programs.ref_logps is not None:
                ref = compiler.compile(f"ref_logps {layout}", lambda: programs.ref_logps.lower(
                    _abstract(state.reference_params), *args, L, K))
            if tc.needs_old_logps and run.config.model.dtype != "float32":  # float32: the sampler's (`dispatch_logps`)
                old = compiler.compile(f"logps {layout}", lambda: programs.logps.lower(params, *args, L, K))
        advantages = _host((N, T) if tc.advantage_estimator == "process" else (N,), np.float32)
        batch = compiler.compile("rows", lambda: programs.rows.lower(rows, advantages, old, ref))
        extra = 0
        if tc.advantage_estimator != "process":  # process supervision's step arrays vary in width: compiled per width
            F = len(run.reward_fns)
            programs.advantages(np.zeros((N, F), np.float32), np.ones(F, np.float32), np.ones((N, T), np.int32), None,
                                None)
            extra += 1
        if run.step_prompt_group_size == 1 or tc.steps_per_generation > 1:  # steps gather their rows (`run_steps`)
            rows_B = _host((tc.train_batch_size,), np.int64)
            batch = compiler.compile("take", lambda: programs.take.lower(batch, rows_B))
        abstract_state = _abstract(state)
        for L, K in shapes.step_packings:
            compiler.compile(f"train_step {K}x{L}" if L else "train_step static",
                             lambda: programs.step.lower(abstract_state, batch, L, K))
        float(run.schedule(0))  # the step metrics' learning rate (`run_steps`): eager ops, compiled once
    except BaseException:  # the error in flight (a lowering's, or a compile waited on), not a queued compile's
        compiler.pool.shutdown(wait=False, cancel_futures=True)
        raise
    compiled, peaks = compiler.finish()
    seconds = time.perf_counter() - timer
    jax.monitoring.record_event_duration_secs(COMPILE_EVENT, seconds)
    return Warmup(len(compiled) + extra, seconds, peaks, compiled)


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
