"""A decoding call driven from the host: its rows reach the host group by group, as they finish.

`decode` runs a call with a run's `programs.Decoder` and yields `Piece`s: whole groups of finished rows, on the host,
each row once. The piece that completes the call also carries the call's `Trajectory` on the devices, so the
round can queue the log-prob passes on it before it scores the rows. A static batch (a slot for every row)
finishes its rows in one program and one piece; continuously batched calls run in segments (`decoder.advance`
with ``segment``), each queued from a thread of its own before the previous segment's rows are read, so the
devices keep decoding while the host reads rows and runs tool turns. On the CPU switch a call may also be split
into host-thread chunks, each decoding its rows from a thread of its own (`cpu.host_chunks`).
"""

from __future__ import annotations

import dataclasses
import heapq
import queue
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np

from grpo_jax.algo.trajectory import Trajectory
from grpo_jax.device import sharding
from grpo_jax.rollout import multiturn
from grpo_jax.rollout.piece import Piece


def _piece(rows: np.ndarray, view, offset: int) -> Piece:
    ended_B, length_B, at_eos_B, tokens_BxT, steps = view[:5]
    mask = (np.arange(tokens_BxT.shape[1])[None] < length_B[rows, None]).astype(np.int32)
    steps = int(steps) if ended_B.all() else 0  # the call's steps come with its last rows
    return Piece(rows + offset, tokens_BxT[rows], mask, ~at_eos_B[rows], decode_steps=steps)


def chunk(decoder, params, ids, mask, key, offset: int, options, group_size: int,
          turns: multiturn.Turns | None = None) -> Iterator:
    """One program's rows (from row ``offset`` of the call): its `Piece`s as whole groups end, then (before the
    last) its `Trajectory`. The one host driver of the decoder: with ``turns`` (``options`` with ``pause_at_eos``)
    the rows run their tool turns between segments (`multiturn.between`).

    Each segment is queued before the host reads the one before it, so the devices decode while the host reads
    rows, parses turns and renders results; what the host does (retire, append) goes after the queued segment."""
    if turns is None and (not options.num_slots or options.num_slots >= len(ids)):  # a static batch: one program
        rows, view = decoder.generate(params, ids, mask, key, np.int32(offset), options)
        yield rows
        yield _piece(np.arange(len(ids)), sharding.to_host(view), offset)
        return
    decoding, view = decoder.advance(params, decoder.start(params, ids, mask, key, np.int32(offset), options),
                                     options, True)
    waiting = None if turns is None else multiturn.Waiting()
    seen_R = np.zeros(len(ids) // group_size, bool)
    while True:
        decoding, ahead = decoder.advance(params, decoding, options, True)  # queued before this segment is read
        if turns is None:  # one turn a row: the rows' ends alone, the rest of the view only with a piece
            ended_B = np.asarray(sharding.to_host(view[0]))
        else:
            view = sharding.to_host(view)
            ended_B = view[0]
            decoding = multiturn.between(turns, waiting, decoder, params, decoding, options, view, offset)
        done_R = ended_B.reshape(-1, group_size).all(axis=1)
        if done_R.all():  # the segment queued since found nothing left to decode: its state is the final one
            yield decoder.trajectory(decoding)
        if (done_R & ~seen_R).any():
            rows = np.flatnonzero(np.repeat(done_R & ~seen_R, group_size))
            yield _piece(rows, sharding.to_host(view), offset) if turns is None else \
                multiturn.piece(turns, rows, offset, view)
            seen_R = done_R
        if done_R.all():
            return
        view = ahead


def _merged(calls: list[Callable[[], Iterator]], pool) -> Iterator:
    """Several chunks' events as (chunk index, event), each chunk run in one of ``pool``'s threads."""
    events: queue.Queue = queue.Queue()

    def run(i, call):
        try:
            for event in call():
                events.put((i, event))
        except BaseException as e:  # noqa: BLE001 (re-raised in the consuming thread)
            events.put((i, e))
        events.put((i, None))

    for i, call in enumerate(calls):
        pool.submit(run, i, call)
    running = len(calls)
    while running:
        i, event = events.get()
        if event is None:
            running -= 1
        elif isinstance(event, BaseException):
            raise event
        else:
            yield i, event


def decode(decoder, params, prompt_ids_BxP, prompt_mask_BxP, key, *, greedy: bool = False,
           group_size: int = 1, slots: int = 0, turns: multiturn.Turns | None = None) -> Iterator[Piece]:
    """A decoding call of ``decoder`` (`programs.Decoder`) over host prompt rows (every process's, the same): its
    `Piece`s, whole groups of ``group_size`` rows as they finish; the last carries the call's `Trajectory`.
    ``slots``: the call's decode slots (`plan_slots`; 0: `sampling.max_batch_rows`). With ``turns`` the rows call
    tools between turns (`chunk`, `multiturn.between`)."""
    B = len(prompt_ids_BxP)
    params = decoder.layout(params)  # once a call: the rollout layout's copy (`programs.jit_decoder`)
    k = decoder.chunks(B, group_size)
    rows = B // k
    options = decoder.options(rows, B, greedy, slots)
    parts = [decoder.place((prompt_ids_BxP, prompt_mask_BxP))] if k == 1 else [
        (prompt_ids_BxP[i * rows:(i + 1) * rows], prompt_mask_BxP[i * rows:(i + 1) * rows]) for i in range(k)]
    if turns is not None:
        options = dataclasses.replace(options, pause_at_eos=True)
    calls = [lambda i=i: chunk(decoder, params, *parts[i], key, i * rows, options, group_size, turns and (
        dataclasses.replace(turns, episodes=turns.episodes[i * rows:(i + 1) * rows], waits=turns.waits)))
        for i in range(k)]
    if k == 1 and turns is None and (not options.num_slots or options.num_slots >= rows):  # a static batch: inline
        yield from _events(((0, event) for event in calls[0]()), decoder, B, k)
        return
    # segments and chunks are queued from threads of their own, so the devices never wait for the host
    with ThreadPoolExecutor(k, thread_name_prefix="grpo_jax-decode") as pool:
        yield from _events(_merged(calls, pool), decoder, B, k)


def _events(events: Iterator, decoder, B: int, k: int) -> Iterator[Piece]:
    """The pieces of ``k`` chunks' (chunk, event) stream, the whole call's trajectory on the one that ends it."""
    trajectories, received, steps = [None] * k, 0, 0
    for i, event in events:
        if isinstance(event, Trajectory):
            trajectories[i] = event
            continue
        received += len(event.rows)
        steps = max(steps, event.decode_steps)  # a chunk's last piece has its steps
        if received == B:  # each chunk gives its trajectory before its last rows: all are here
            event = event._replace(trajectory=trajectories[0] if k == 1 else decoder.concat(trajectories),
                                   decode_steps=steps)
        else:
            event = event._replace(decode_steps=0)
        yield event


def generate(decoder, params, prompt_ids_BxP, prompt_mask_BxP, key, *, greedy: bool = False,
             group_size: int = 1) -> Trajectory:
    """Every row of a call decoded to its end (`decode`), as one `Trajectory` on the devices."""
    for piece in decode(decoder, params, prompt_ids_BxP, prompt_mask_BxP, key, greedy=greedy, group_size=group_size):
        if piece.trajectory is not None:
            return piece.trajectory
    raise ValueError("a decoding call of no rows")


def decode_steps(lengths, slots: int) -> int:
    """The decode steps `decoder.advance` runs for rows of these completion lengths (in order) over ``slots`` slots:
    the first rows' first tokens come with `decoder.start`; a row of n tokens then holds its slot n - 1 more steps,
    and the next row takes the slot in the step after the last of them."""
    free = [(-1, slot) for slot in range(min(slots, len(lengths)))]  # the step after which each slot is free
    end = 0
    for n in lengths:
        step, slot = heapq.heappop(free)
        end = max(end, step + max(int(n), 1))
        heapq.heappush(free, (step + max(int(n), 1), slot))
    return end


class SlotPlan(NamedTuple):
    """The decode slots of a run's next rounds and what they were chosen from: measured (slots, seconds per decode
    step) of earlier rounds. A choice of speed only: a row's tokens do not depend on the slots."""

    slots: int = 0  # the next round's slots per call; 0: a static batch (a slot for every row)
    measured: tuple = ()  # ((slots, seconds per decode step), ...), the latest per slot count tried


def call_steps(lengths, slots: int, chunks: int = 1) -> int:
    """`decode_steps` of a call of these rows split into ``chunks`` host-thread chunks, each with its share of the
    ``slots`` (0: a slot for every row): the longest chunk's, as the chunks decode side by side."""
    lengths = np.asarray(lengths)
    rows = len(lengths) // chunks
    share = -(-slots * rows // len(lengths)) if slots else rows
    return max(decode_steps(lengths[i * rows:(i + 1) * rows], share) for i in range(chunks))


def slot_choices(rows: int, chunks: int = 1) -> tuple[int, ...]:
    """Every slot count `plan_slots` may give a call of ``rows`` rows in ``chunks`` host-thread chunks, 0 (a static
    batch) first: known before the first round, so each decoding program is compiled ahead of it."""
    return tuple(dict.fromkeys((0, *(n for n in (rows // 2, rows // 4, rows // 8) if chunks <= n < rows))))


def plan_slots(plan: SlotPlan, lengths, *, slots: int, steps: int, seconds: float, chunks: int = 1) -> SlotPlan:
    """The next round's slots, from a round whose rows of completion ``lengths`` (in call order) decoded over
    ``slots`` slots (0: static) in ``steps`` steps and ``seconds``, ``chunks`` host-thread chunks side by side.

    A decode step of a chunk of N slots costs a + b N: the weights are read once a step, each slot adds its work.
    After a static round whose lengths spread (mean under 0.6 of the longest), a round of half the slots measures a
    second point; from then on a round takes whichever of rows, rows / 2, rows / 4, rows / 8 slots costs least by
    `call_steps` over the last round's lengths times a + b N (a, b fitted to every slot count measured). On a CPU,
    where a decode step's fixed cost dominates, that is the static batch; with many long rows on an accelerator,
    fewer slots than rows."""
    rows = len(lengths)
    measured = dict(plan.measured)
    measured[slots or rows] = seconds / max(steps, 1)
    plan = SlotPlan(plan.slots, tuple(sorted(measured.items())))
    lengths = np.asarray(lengths)
    if len(measured) == 1:
        spread = lengths.mean() < 0.6 * lengths.max()
        return plan._replace(slots=rows // 2 if spread and not slots and rows >= 4 * chunks else 0)
    n_M, t_M = (np.array(v, float) for v in zip(*measured.items()))
    b, a = np.polyfit(n_M / chunks, t_M, 1)  # per chunk: slots / chunks each
    a, b = max(a, 0.0), max(b, 0.0)
    candidates = [rows, *(n for n in slot_choices(rows, chunks) if n)]
    best = min(candidates, key=lambda n: call_steps(lengths, n, chunks) * (a + b * n / chunks))
    return plan._replace(slots=0 if best == rows else best)
