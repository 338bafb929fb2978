"""A decoding call driven from the host (`grpo_jax.rollout.stream`): whole groups reach the host as they finish, every row
once, the call's trajectory with the last of them; decoding runs ahead of a host that is still scoring."""

import threading

import jax
import numpy as np
import pytest

from grpo_jax.algo.trajectory import Trajectory
from grpo_jax.rollout import stream
from tests.algo.test_decoder import EOS, G, IDS, MASK, assert_same_rows, decode_rows, make_decoder


@pytest.mark.parametrize("speedups, host_threads, slots", [(False, 1, 4), (True, 1, 2), (True, 5, 5), (False, 1, 0),
                                                           (True, 5, 0)])
def test_groups_reach_the_host_as_they_finish_with_the_calls_rows(tiny_model, speedups, host_threads, slots):
    want = decode_rows(tiny_model)
    dec = make_decoder(tiny_model, eos=EOS, group=G, speedups=speedups, max_completion_length=9, temperature=0.9,
                       top_k=12, max_batch_rows=slots, host_threads=host_threads)
    pieces = list(stream.decode(dec, tiny_model[2], IDS, MASK, jax.random.key(3), group_size=G))
    rows = np.concatenate([p.rows for p in pieces])
    np.testing.assert_array_equal(np.sort(rows), np.arange(len(IDS)))  # every row once
    for piece in pieces:
        assert len(piece.rows) % G == 0 and np.all(piece.rows.reshape(-1, G) % G == np.arange(G))  # whole groups
        np.testing.assert_array_equal(piece.completion_ids, want.completion_ids[piece.rows])
        np.testing.assert_array_equal(piece.completion_mask, want.completion_mask[piece.rows])
        np.testing.assert_array_equal(piece.is_truncated, want.is_truncated[piece.rows])
    # the call's rows on the devices come with the piece that completes them, and only then
    assert [p.trajectory is not None for p in pieces] == [False] * (len(pieces) - 1) + [True]
    assert_same_rows(jax.device_get(pieces[-1].trajectory), want)
    if slots and host_threads == 1:  # groups came while others still decoded
        assert len(pieces) > 1
    if not slots and host_threads == 1:  # a static batch: every row at once
        assert len(pieces) == 1


class _FakeDecoder:
    """A decoder whose segments each end one group of 2 rows, recording when each is queued."""

    def __init__(self, rows, segments):
        self.rows, self.segments, self.advanced, self.all_queued = rows, segments, [], threading.Event()

    def options(self, rows, total, greedy, slots=0):
        from grpo_jax.algo.decoder import DecodeOptions
        from grpo_jax.algo.sampling import SamplingConfig
        return DecodeOptions(SamplingConfig(max_completion_length=4), (1,), 0, num_slots=2)

    def chunks(self, rows, group):
        return 1

    def layout(self, params):
        return params

    def place(self, rows):
        return rows

    def start(self, params, ids, mask, key, offset, options):
        return 0

    def advance(self, params, step, options, segment):
        self.advanced.append(step)
        if step + 1 == self.segments:
            self.all_queued.set()
        ended = np.arange(self.rows) < 2 * (step + 1)
        tokens = np.where(ended[:, None], np.arange(self.rows)[:, None], 0).astype(np.int32) * np.ones((1, 4), np.int32)
        return step + 1, (ended, np.where(ended, 4, 0).astype(np.int32), ended, tokens, np.int32(4 * (step + 1)))

    def trajectory(self, step):
        return Trajectory(*(np.zeros((self.rows, 4)),) * 7, is_truncated=np.zeros(self.rows, bool))


def test_segments_are_queued_while_the_host_still_holds_the_first_piece():
    """Decoding runs ahead of a consumer busy with a piece (a slow reward function): every segment is queued before
    the first piece is released. Without the call's own dispatch thread only one segment is ever queued ahead of
    the consumer, and the wait below times out."""
    fake = _FakeDecoder(rows=6, segments=3)  # one group of 2 rows ends per segment
    pieces = stream.decode(fake, None, np.zeros((6, 3), np.int32), np.ones((6, 3), np.int32), None, group_size=2)
    first = next(pieces)
    assert fake.all_queued.wait(timeout=30), f"only {len(fake.advanced)} of 3 segments queued"
    rest = list(pieces)
    np.testing.assert_array_equal(np.concatenate([first.rows, *[p.rows for p in rest]]), np.arange(6))
    np.testing.assert_array_equal(first.completion_ids[:, 0], [0, 1])
    assert rest[-1].trajectory is not None and rest[-1].decode_steps == 12  # the steps of the segment that ended it


def test_the_decode_step_count_of_any_slot_count_is_the_decoders_own(tiny_model):
    """`stream.decode_steps` from the rows' lengths alone == the steps `decoder.advance` ran, for every slot count."""
    import dataclasses

    from grpo_jax.algo import decoder
    _, graphdef, params = tiny_model
    want = decode_rows(tiny_model)
    lengths = want.completion_mask.sum(1)
    assert len(set(lengths)) > 2
    dec = make_decoder(tiny_model, eos=EOS, group=G, max_completion_length=9, temperature=0.9, top_k=12)
    start, advance = jax.jit(decoder.start, static_argnums=5), jax.jit(decoder.advance, static_argnums=3)
    for slots in (1, 2, 5, 9, len(IDS)):
        options = dataclasses.replace(dec.options(len(IDS), len(IDS), False), num_slots=slots)
        d = advance(graphdef, params, start(graphdef, params, IDS, MASK, jax.random.key(3), options), options)
        assert int(d.steps) == stream.decode_steps(lengths, slots), slots
    assert stream.call_steps(lengths, 0, chunks=3) == max(stream.decode_steps(lengths[i * 5:(i + 1) * 5], 5)
                                                         for i in range(3))


def test_slots_are_planned_from_measured_step_times():
    lengths = np.array([30, 4, 2, 1, 3, 2, 5, 1] * 4)  # 32 rows, a long tail: a static batch runs 29 steps for them
    plan = stream.plan_slots(stream.SlotPlan(), lengths, slots=0, steps=29, seconds=0.29)
    assert plan.slots == 16 and plan.measured == ((32, 0.29 / 29),)  # the lengths spread: measure half the slots
    # a step's cost is nearly all fixed (the CPU's): the static batch wins
    steps = stream.decode_steps(lengths, 16)
    fixed = stream.plan_slots(plan, lengths, slots=16, steps=steps, seconds=steps * 0.0098)
    assert fixed.slots == 0 and dict(fixed.measured) == {16: pytest.approx(0.0098), 32: pytest.approx(0.010)}
    # a step's cost grows with its slots (long rows on an accelerator): the cheapest of 32, 16, 8, 4 slots
    a, b = 0.001, 0.001
    grows = stream.plan_slots(plan, lengths, slots=16, steps=10, seconds=10 * (a + 16 * b))
    grows = grows._replace(measured=((16, a + 16 * b), (32, a + 32 * b)))
    grows = stream.plan_slots(grows, lengths, slots=0, steps=29, seconds=29 * (a + 32 * b))
    costs = {n: stream.decode_steps(lengths, n) * (a + b * n) for n in (32, 16, 8, 4)}
    assert grows.slots == min(costs, key=costs.get) < 32
    # lengths that hardly spread: a static batch wastes nothing, nothing to measure
    assert stream.plan_slots(stream.SlotPlan(), np.full(32, 7), slots=0, steps=6, seconds=0.06).slots == 0
