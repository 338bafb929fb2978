"""A decoding call driven from the host: its rows reach the host group by group, as they finish.

`decode` runs a call with a run's `programs.Decoder` and yields `Piece`s: whole groups of finished rows, on the host,
each row once. The piece that completes the call also carries the call's `Trajectory` on the devices, so the
round can queue the log-prob passes on it before it scores those last rows. A static batch (a slot for every row)
finishes its rows in one program and one piece; continuously batched calls run in segments (`decoder.advance`
with ``segment``), each queued from a thread of its own before the previous segment's rows are read, so the devices
keep decoding while the host scores. On the CPU switch a call may also be split into host-thread chunks, each
decoding its rows from a thread of its own (`cpu.host_chunks`).
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np

from grpo_jax import sharding
from grpo_jax.trajectory import Trajectory


class Piece(NamedTuple):
    """Finished rows of a decoding call (whole groups), on the host."""

    rows: np.ndarray  # [n] the rows' indices in the call
    completion_ids: np.ndarray  # [n, T]
    completion_mask: np.ndarray  # [n, T]
    is_truncated: np.ndarray  # [n] bool
    trajectory: Trajectory | None = None  # the call's rows on the devices, with the piece that finishes the call
    decode_steps: int = 0  # with the piece that finishes the call: its decode steps (the longest chunk's)


def _piece(rows: np.ndarray, view, offset: int) -> Piece:
    ended_B, length_B, at_eos_B, tokens_BxT, steps = view
    mask = (np.arange(tokens_BxT.shape[1])[None] < length_B[rows, None]).astype(np.int32)
    return Piece(rows + offset, tokens_BxT[rows], mask, ~at_eos_B[rows], decode_steps=int(steps) * ended_B.all())


def _chunk(decoder, params, ids, mask, key, offset: int, options, group_size: int) -> Iterator:
    """One program's rows (from row ``offset`` of the call): its `Piece`s, then its `Trajectory`."""
    if not options.num_slots or options.num_slots >= len(ids):  # a static batch: every row at once, one program
        rows, view = decoder.generate(params, ids, mask, key, np.int32(offset), options)
        yield rows
        yield _piece(np.arange(len(ids)), sharding.to_host(view), offset)
        return
    decoding = decoder.start(params, ids, mask, key, np.int32(offset), options)
    decoding, view = decoder.advance(params, decoding, options, True)
    seen_R = np.zeros(len(ids) // group_size, bool)
    while True:
        ahead = decoder.advance(params, decoding, options, True)  # queued before this segment is read
        ended_B = np.asarray(sharding.to_host(view[0]))
        done_R = ended_B.reshape(-1, group_size).all(axis=1)
        if done_R.all():  # the segment queued ahead found nothing left to decode: its state is the final one
            yield decoder.trajectory(ahead[0])
        if (done_R & ~seen_R).any():
            yield _piece(np.flatnonzero(np.repeat(done_R & ~seen_R, group_size)), sharding.to_host(view), offset)
            seen_R = done_R
        if done_R.all():
            return
        decoding, view = ahead


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
           group_size: int = 1) -> Iterator[Piece]:
    """A decoding call of ``decoder`` (`programs.Decoder`) over host prompt rows (every process's, the same): its
    `Piece`s, whole groups of ``group_size`` rows as they finish; the last carries the call's `Trajectory`."""
    B = len(prompt_ids_BxP)
    k = decoder.chunks(B, group_size)
    rows = B // k
    options = decoder.options(rows, B, greedy)
    parts = [decoder.place((prompt_ids_BxP, prompt_mask_BxP))] if k == 1 else [
        (prompt_ids_BxP[i * rows:(i + 1) * rows], prompt_mask_BxP[i * rows:(i + 1) * rows]) for i in range(k)]
    calls = [lambda i=i: _chunk(decoder, params, *parts[i], key, i * rows, options, group_size) for i in range(k)]
    if k == 1 and (not options.num_slots or options.num_slots >= rows):  # one static batch: inline
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
