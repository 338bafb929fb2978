"""Sampling that hands finished groups to the host while the devices decode the others.

`Sampler` is a jitted sampling program (`programs.jit_generate`): call it for a `SampleOutput`, or `stream` it
for a `Stream`, which yields each `Piece` (whole groups of finished rows, on the host) as soon as a segment of the
continuously batched loop (`continuous.advance`) has finished them. Segments are dispatched from a thread of their
own, each queued before the previous one's rows are read, so the devices keep decoding while the host scores
(`grpo_jax.rollout`). A static batch (slots for every row) finishes all its rows at once: one piece.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np

from grpo_jax import sharding
from grpo_jax.sampling import SampleOutput


class Piece(NamedTuple):
    """Finished rows of a sampling call: whole groups, on the host."""

    rows: np.ndarray  # [n] the rows' indices in the call
    completion_ids: np.ndarray  # [n, T]
    completion_mask: np.ndarray  # [n, T]


class Stream:
    """Iterating yields the call's `Piece`s, every row once; ``output`` (the call's `SampleOutput`, on the devices)
    is set as soon as the last row is decoded, before the last piece is yielded."""

    def __init__(self, events: Iterator):
        self._events = events  # Pieces, and the SampleOutput once decoding is over
        self.output: SampleOutput | None = None

    def __iter__(self) -> Iterator[Piece]:
        for event in self._events:
            if isinstance(event, SampleOutput):
                self.output = event
            else:
                yield event


def segments(start: Callable, advance: Callable, group_size: int, row_offset: int = 0) -> Iterator:
    """One continuously batched call run segment by segment: ``start() -> decoding``, ``advance(decoding) ->
    (decoding, SampleOutput, ended_B)`` (the decoding donated). Yields `Piece`s (rows from ``row_offset``) and,
    once every row has ended, the `SampleOutput`."""
    decoding, *view = advance(start())
    seen_R = None
    while True:
        ahead = advance(decoding)  # queued before this segment is read: the devices do not wait for the host
        out, ended_B = view
        done_R = np.asarray(sharding.to_host(ended_B)).reshape(-1, group_size).all(axis=1)
        seen_R = np.zeros_like(done_R) if seen_R is None else seen_R
        if done_R.all():
            yield out
        if (done_R & ~seen_R).any():
            rows = np.flatnonzero(np.repeat(done_R & ~seen_R, group_size))
            ids, mask = sharding.to_host((out.completion_ids, out.completion_mask))
            yield Piece(rows + row_offset, ids[rows], mask[rows])
            seen_R = done_R
        if done_R.all():
            return
        decoding, *view = ahead


def whole(out: SampleOutput, row_offset: int = 0) -> Iterator:
    """A static batch's call as a stream: its output, then all its rows (from ``row_offset``) as one piece."""
    yield out
    ids, mask = sharding.to_host((out.completion_ids, out.completion_mask))
    yield Piece(np.arange(len(ids)) + row_offset, ids, mask)


def merged(calls: list[Callable[[], Iterator]], concat: Callable, pool) -> Iterator:
    """Several calls' streams (row chunks, each already offset) run in ``pool``'s threads, as one stream: pieces
    as they come, and ``concat(outputs)`` in chunk order once every chunk has ended."""
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
    outputs, running = [None] * len(calls), len(calls)
    while running:
        i, event = events.get()
        if event is None:
            running -= 1
        elif isinstance(event, BaseException):
            raise event
        elif isinstance(event, SampleOutput):
            outputs[i] = event
            if all(o is not None for o in outputs):
                yield concat(outputs)
        else:
            yield event


class Sampler:
    """A sampling program: ``fn(params, prompt_ids, prompt_mask, key, greedy) -> SampleOutput`` and
    ``fn.stream(params, prompt_ids, prompt_mask, key) -> Stream`` (sampling, not greedy).

    ``call``: the jitted sampler; ``start(params, ids, mask, key, row_offset, total_rows)`` and ``advance(params,
    decoding, mask, key, row_offset, total_rows)``: its continuously batched loop in segments, used when
    ``slots(rows, total_rows)`` is fewer than the call's rows.
    """

    def __init__(self, call: Callable, start: Callable, advance: Callable, slots: Callable[[int, int], int],
                 group_size: int):
        self._call, self._start, self._advance, self._slots = call, start, advance, slots
        self._group = group_size
        self._pool = None  # the thread that dispatches the segments, made on the first streamed call

    def __call__(self, params, prompt_ids_BxP, prompt_mask_BxP, key, greedy):
        return self._call(params, prompt_ids_BxP, prompt_mask_BxP, key, greedy)

    def _cache_size(self) -> int:
        return self._call._cache_size()

    def stream(self, params, prompt_ids_BxP, prompt_mask_BxP, key) -> Stream:
        B = prompt_ids_BxP.shape[0]
        if self._slots(B, B) >= B:
            return Stream(whole(self(params, prompt_ids_BxP, prompt_mask_BxP, key, False)))
        offset = np.int32(0)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grpo_jax-stream")

        def call():
            return segments(lambda: self._start(params, prompt_ids_BxP, prompt_mask_BxP, key, offset, B),
                            lambda d: self._advance(params, d, prompt_mask_BxP, key, offset, B), self._group)
        # segments are dispatched from their own thread: a segment shorter than the host's scoring of the previous
        # one does not leave the devices waiting for the next
        return Stream(merged([call], lambda outputs: outputs[0], self._pool))
