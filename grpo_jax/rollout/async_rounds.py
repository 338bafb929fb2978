"""Asynchronous rounds with bounded staleness (`train.max_staleness` k, `mesh.rollout` n), deterministic and resumable.

A round feeds K = `train.steps_per_round` optimizer steps (steps_per_generation x num_iterations): round r's updates
are steps r·K ... r·K + K - 1. The version rule: round r is sampled with the params after optimizer step

    v(r) = max(0, r·K - k)

(the params the state holds when ``state.step == v(r)``), so its first update is min(k, r·K) steps newer than the
params that sampled it (`async/staleness`, logged per step, counts from there). k = 0 is the synchronous loop, which
`grpo_jax.api.trainer` runs itself unless the placement is split. Which params sample which round follows from the config
alone, never from timing: two runs of one config are equal bit for bit, and so is a resumed run to the uninterrupted
one.

Colocated placement (n = 0, one mesh): when the state reaches step v(r) the loop copies its params and hands round r
to a sampler thread, which decodes, scores on the host and computes the advantages (`rollout.prepare_round`) while
the loop keeps dispatching update steps: JAX dispatches both programs asynchronously, the devices interleave them and
the host's reward scoring overlaps the updates. Split placement (n > 0): the first n devices sample and the others
train (`run.build`); the params of version v(r) are copied to the sampling devices when the state reaches it, and the
round's rows to the training devices when its first update comes.

When round r's first update comes (the state at step r·K), the loop adds what its updates need on the training
devices: the reference log-probs (of the reference at that step, as a synchronous round has them) and, with
`loss.off_policy_correction=decoupled` and several updates a round, the proximal log-probs (the params at that step).
The old log-probs the sampler gives are the behaviour policy's (the sampling params): with correction `none` the
ratio is clipped against them (TRL's AsyncGRPOTrainer); with `decoupled` the train step weights each token by
proximal / behaviour (`loss.vllm_importance_sampling_*`, against the sampler's log-probs).

Interruptible rollouts (`train.interruptible_rollouts`): decode segment j of round r samples with the params after
step `segment_version` = min(v(r) + j, max(v(r), r·K - 1)); the sampler waits for a version the updates have not
reached, the loop copies every such version for it, and each token's version is recorded (`RoundBatch.token_versions`).

A checkpoint holds the params versions the queued rounds (handed to the sampler, not yet trained) still need
(`Sampler.saved_versions`); the resumed run samples them again from those params, the saved data position and the
run's key: the same rows.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor

import jax
import numpy as np

from grpo_jax.algo.state import TrainState
from grpo_jax.config import Config, TrainConfig
from grpo_jax.data import prompts as data
from grpo_jax.device import sharding
from grpo_jax.rollout import round as rollout
from grpo_jax.rollout.context import Run, prompt_group_sizes
from grpo_jax.rollout.round import RoundBatch

VERSION_PREFIX = "params_version_"  # checkpoint arrays: params_version_<v>_<leaf index>


def enabled(config: Config) -> bool:
    """Whether the run's rounds go through a `Sampler` (staleness k > 0, or the split placement)."""
    return config.train.max_staleness > 0 or config.mesh.rollout > 0


def version(train_config: TrainConfig, round_index: int) -> int:
    """v(r) = max(0, r·K - k): the optimizer steps taken by the params that sample round r."""
    return max(0, round_index * train_config.steps_per_round - train_config.max_staleness)


def last_version(train_config: TrainConfig, round_index: int) -> int:
    """The newest params an interruptible rollout of round r switches to: max(v(r), r·K - 1), the params before the
    last update of round r - 1 (which the updates reach without round r)."""
    return max(version(train_config, round_index), round_index * train_config.steps_per_round - 1)


def segment_version(train_config: TrainConfig, round_index: int, segment: int) -> int:
    """Interruptible rollouts: decode segment j of round r samples with the params after step
    min(v(r) + j, `last_version`(r))."""
    return min(version(train_config, round_index) + segment, last_version(train_config, round_index))


def step_metrics(train_config: TrainConfig, step: int) -> dict:
    """`async/staleness` (optimizer steps between the sampling params and the params this update starts from) and
    `async/version` (v of the step's round) of the metrics line of step ``step`` (1-based, as logged)."""
    v = version(train_config, (step - 1) // train_config.steps_per_round)
    return {"async/staleness": step - 1 - v, "async/version": v}


def behaviour_old(config: Config) -> bool:
    """Whether the sampler gives the rows old log-probs (under the sampling params): when the round is stale and
    the loss clips against the behaviour policy, or, with k = 0, as a synchronous round has them."""
    tc = config.train
    if tc.max_staleness == 0:
        return tc.needs_old_logps
    return config.loss.off_policy_correction == "none"


def proximal_old(config: Config) -> bool:
    """Whether the old log-probs are the proximal policy's (decoupled PPO, computed at the round's first update);
    with one update a round the loss takes the current params' own (no forward pass)."""
    tc = config.train
    return tc.max_staleness > 0 and config.loss.off_policy_correction == "decoupled" and tc.needs_old_logps


def _sampler_run(run: Run) -> Run:
    """The run as the sampler thread sees it: no reference log-probs (the updates' side adds them), and with the
    split placement the sampling devices' mesh and programs."""
    if run.rollout_mesh is None:
        return dataclasses.replace(run, programs=run.programs._replace(ref_logps=None))
    return dataclasses.replace(run, mesh=run.rollout_mesh, programs=run.rollout_programs._replace(ref_logps=None),
                               round_prompt_group_size=prompt_group_sizes(run.config, run.rollout_mesh)[0])


class Sampler:
    """The rounds handed to one sampler thread ahead of the updates, in round order, each with its version's params.

    The loop calls `feed(state, step)` before each call of update steps (no further than `next_version`), `take`
    for the round whose updates come next and `saved_versions` for a checkpoint.
    """

    def __init__(self, run: Run, state: TrainState, *, next_round: int, data_state: data.DataState,
                 arrays: dict | None = None, warned: set | None = None, toolbox=None):
        self.run, self.sampler_run = run, _sampler_run(run)
        self.warned = set() if warned is None else warned  # the loop's warned-once keys (`prepare_round`)
        self.toolbox = toolbox  # the loop's, which closes it after `close` (`tools.calls.open_toolbox`)
        self.train_config = run.config.train
        self.next_round = next_round  # the first round not yet handed to the sampler
        self.data_state = data_state  # the data position after the last round taken (before `next_round`)
        self.queued: dict[int, Future] = {}  # round -> future (RoundBatch, data position after it)
        self.key = np.asarray(jax.device_get(state.key))  # the state's own is donated with it each step
        self.shardings = jax.tree.map(lambda x: x.sharding, state.params) if run.rollout_mesh is None \
            else sharding.param_shardings(run.rollout_mesh, state.params)
        self.versions = _restored_versions(arrays or {}, state.params, self.shardings)  # v -> params still needed
        self.interruptible = self.train_config.interruptible_rollouts
        if self.interruptible:
            _check_interruptible(self.sampler_run)
        self.ready = threading.Condition()  # guards `versions`: the loop adds them, interruptible rollouts await them
        self.closed = False
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="grpo-jax-sampler")

    def _span(self, round_index: int) -> range:
        """The params versions round ``round_index`` samples with."""
        tc = self.train_config
        last = last_version(tc, round_index) if self.interruptible else version(tc, round_index)
        return range(version(tc, round_index), last + 1)

    def _needed(self, v: int) -> bool:
        return any(v in self._span(r) for r in self.queued)

    def _add(self, v: int, params) -> None:
        with self.ready:
            self.versions[v] = params
            self.ready.notify_all()

    def next_version(self) -> int | None:
        """The step whose params sample the next round not handed over; None when no round is left to sample."""
        tc, r = self.train_config, self.next_round
        return version(tc, r) if r * tc.steps_per_round < self.run.config.max_steps else None

    def next_feed(self, step: int) -> int | None:
        """The next step after ``step`` whose params the sampler needs (a round to hand over, or a version an
        interruptible rollout awaits); None when there is none."""
        steps = [s for s in (self.next_version(),) if s is not None]
        if self._needed(step + 1):
            steps.append(step + 1)
        return min(steps, default=None)

    def feed(self, state: TrainState, step: int) -> None:
        """Hands the sampler every round whose version is ``step`` (the state's params, copied now, before the next
        update donates them) or older (a resumed run's, from its checkpoint), and gives interruptible rollouts the
        params of ``step``."""
        while (v := self.next_version()) is not None and v <= step:
            if v not in self.versions:
                if v != step:
                    raise ValueError(f"round {self.next_round} needs the params of step {v}, which the checkpoint "
                                     f"of step {step} does not hold: resume from a checkpoint this grpo_jax wrote")
                # a copy on the sampling devices: the next update donates the state's buffers
                self._add(v, jax.device_put(state.params, self.shardings, may_alias=False))
            r = self.next_round
            previous = self.queued.get(r - 1)
            self.queued[r] = self.pool.submit(self._prepare, r, v, self.versions[v], previous, self.data_state)
            self.next_round += 1
        if step not in self.versions and self._needed(step):
            self._add(step, jax.device_put(state.params, self.shardings, may_alias=False))

    def _params_at(self, v: int):
        """Version ``v``'s params, once the loop has given them (an interruptible rollout's next segment)."""
        with self.ready:
            self.ready.wait_for(lambda: v in self.versions or self.closed)
            if v not in self.versions:
                raise CancelledError(f"the run stopped before the params of step {v} existed")
            return self.versions[v]

    def _switching(self, decoder, round_index: int, lengths: list):
        """``decoder`` whose decode segment j runs with `segment_version` j's params; ``lengths`` gets each segment's
        (version, row lengths after it)."""
        segments, tc = itertools.count(), self.train_config

        def start(params, *args):
            return decoder.start(decoder.layout(self._params_at(segment_version(tc, round_index, 0))), *args)

        def advance(params, decoding, options, segment):
            v = segment_version(tc, round_index, next(segments))
            decoding, view = decoder.advance(decoder.layout(self._params_at(v)), decoding, options, segment)
            lengths.append((v, view[1]))
            return decoding, view

        return decoder._replace(start=start, advance=advance)

    def _prepare(self, round_index: int, v: int, params, previous: Future | None, data_state: data.DataState):
        """Round ``round_index`` sampled with ``params`` (version v), on the sampler thread."""
        if previous is not None:  # the thread runs rounds in order: the previous one is done
            data_state = previous.result()[1]
        at_version = TrainState(params=params, opt_state=None, ref_params=None, step=np.int32(v), key=self.key)
        run, lengths = self.sampler_run, []
        if self.interruptible:
            decoder = self._switching(run.programs.decoder, round_index, lengths)
            run = dataclasses.replace(run, programs=run.programs._replace(decoder=decoder))
        round_batch, data_state = rollout.prepare_round(run, at_version, data_state, round_index,
                                                        old=behaviour_old(self.run.config), warned=self.warned,
                                                        toolbox=self.toolbox)
        if self.interruptible:
            versions_NxT = _token_versions(lengths, round_batch.rows.completion_ids.shape)
            newer = np.sum(versions_NxT > v) / max(np.sum(versions_NxT >= 0), 1)
            round_batch = round_batch._replace(token_versions=versions_NxT,
                                               metrics={**round_batch.metrics, "async/newer_tokens": float(newer)})
        return round_batch, data_state

    def take(self, state: TrainState, round_index: int) -> tuple[RoundBatch, data.DataState]:
        """Round ``round_index`` for its updates (the state at its first step), waiting for the sampler if need be:
        its rows on the training devices, with the reference (and proximal) log-probs of this state."""
        run, tc = self.run, self.train_config
        timer = time.perf_counter()
        # a round that failed stays queued: a checkpoint then keeps the params version its rerun samples with
        round_batch, self.data_state = self.queued[round_index].result()
        del self.queued[round_index]
        wait = time.perf_counter() - timer
        with self.ready:
            self.versions = {v: p for v, p in self.versions.items() if self._needed(v) or v ==
                             version(tc, self.next_round)}
        rows = round_batch.rows
        if run.rollout_mesh is not None:
            rows = jax.device_put(rows, sharding.row_sharded(run.mesh))
        ref, _ = rollout.dispatch_logps(run.programs, rollout.logps_args(run, rows, round_batch.token_counts),
                                        state.reference_params, None, old=False)
        old = rows.old_per_token_logps
        if proximal_old(run.config):
            old = run.programs.logps(state.params, *rollout.logps_args(run, rows, round_batch.token_counts))
        rows = rows._replace(old_per_token_logps=old, ref_per_token_logps=ref)
        seconds = {**round_batch.seconds, "sample_wait": wait}
        return round_batch._replace(rows=rows, first_step=round_index * tc.steps_per_round, seconds=seconds), \
            self.data_state

    def saved_versions(self, step: int) -> dict:
        """The params versions older than ``step`` that queued rounds need, as a checkpoint's host arrays (the
        state holds version ``step`` itself)."""
        out = {}
        for v, params in sorted(self.versions.items()):
            if v < step and self._needed(v):
                for i, leaf in enumerate(jax.device_get(jax.tree.leaves(params))):
                    out[f"{VERSION_PREFIX}{v}_{i}"] = leaf
        return out

    def close(self) -> None:
        """Stops the thread once its current round ends, or an interruptible one awaits params that will not come;
        rounds not started are dropped (a resume samples them)."""
        with self.ready:
            self.closed = True
            self.ready.notify_all()
        self.pool.shutdown(wait=True, cancel_futures=True)


def _check_interruptible(run: Run) -> None:
    """Interruptible rollouts switch params between the segments of one continuously batched decoding call: a
    one-line ValueError for what has none or several."""
    tc = run.config.train
    rows = tc.generation_batch_size
    slots = run.programs.decoder.options(rows, rows, False).num_slots  # a multiple of the sampling devices
    if not slots or slots >= rows:
        raise ValueError(f"train.interruptible_rollouts switches params between decode segments, which only "
                         f"continuous batching has: set sampling.max_batch_rows so that fewer than the round's {rows} "
                         f"rows decode at once (slots are a multiple of the {sharding.num_row_shards(run.mesh)} "
                         "sampling devices)")
    if tc.dynamic_sampling or run.tooling is not None:
        raise ValueError("train.interruptible_rollouts decodes a round in one call: it does not go with "
                         "train.dynamic_sampling or tools; set it to false")
    if run.programs.decoder.chunks(rows, tc.num_generations) > 1:
        raise ValueError("train.interruptible_rollouts decodes a round in one call: set sampling.host_threads=1")


def _token_versions(lengths: list, shape: tuple) -> np.ndarray:
    """[N, T] the params version of each completion token (-1: padding) from each segment's (version, row lengths
    after it)."""
    N, T = shape
    out, done_N = np.full((N, T), -1, np.int32), np.zeros(N, np.int64)
    t_T = np.arange(T)
    for v, length in lengths:
        length_N = np.asarray(jax.device_get(length))
        out[(t_T[None] >= done_N[:, None]) & (t_T[None] < length_N[:, None])] = v
        done_N = np.maximum(done_N, length_N)
    return out


def _restored_versions(arrays: dict, params, shardings) -> dict:
    """A checkpoint's params versions ({v: params}), placed like ``shardings`` (`Sampler.saved_versions`)."""
    leaves, treedef = jax.tree.flatten(params)
    steps = sorted({int(k[len(VERSION_PREFIX):].split("_")[0]) for k in arrays if k.startswith(VERSION_PREFIX)})
    out = {}
    for v in steps:
        host = [arrays[f"{VERSION_PREFIX}{v}_{i}"] for i in range(len(leaves))]
        out[v] = jax.device_put(jax.tree.unflatten(treedef, host), shardings)
    return out
