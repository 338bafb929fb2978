"""Continuous batching (`grpo_jax.continuous`): every row gets the static sampler's tokens whatever the slot count.

The static sampler (`sampling.generate`'s default path) is itself checked against a no-cache forward and
``jax.random.categorical`` in test_sampling.py; here the continuous sampler must give each row those tokens, EOS
mask and truncation flags exactly, with its log-probs equal up to the rounding of a batch of another size.
"""

import dataclasses

import jax
import numpy as np
import pytest

from grpo_jax import programs, sharding
from grpo_jax.sampling import SamplingConfig

rng = np.random.default_rng(0)
G = 3  # rows per prompt
PROMPTS = 5
P = 7
IDS = np.repeat(rng.integers(2, 32, (PROMPTS, P)), G, axis=0).astype(np.int32)
MASK = np.repeat(np.arange(P)[None] >= rng.integers(0, P, (PROMPTS, 1)), G, axis=0).astype(np.int32)
EOS = (1, 3, 4)  # EOS about 3 tokens in 32: lengths from 1 to T, some rows truncated


def _sample(graphdef, params, mesh, *, greedy=False, speedups=False, host_threads=1, key=3, params_sharding=None,
            **config):
    config = SamplingConfig(**{"max_completion_length": 9, "temperature": 0.9, "top_k": 12,
                               "host_threads": host_threads, **config})
    fn = programs.jit_generate(graphdef, mesh, config=config, eos_token_ids=EOS, pad_token_id=0,
                               prompt_group_size=G, cpu_speedups=speedups, params_sharding=params_sharding)
    return jax.device_get(fn(params, IDS, MASK, jax.random.key(key), greedy))


def _one_device():
    return sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])


def _assert_same_rows(got, want):
    np.testing.assert_array_equal(got.completion_ids, want.completion_ids)
    np.testing.assert_array_equal(got.completion_mask, want.completion_mask)
    np.testing.assert_array_equal(got.is_truncated, want.is_truncated)
    # a slot batch of another size may round XLA:CPU's reductions differently
    np.testing.assert_allclose(got.sampler_per_token_logps, want.sampler_per_token_logps, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("greedy", [False, True])
def test_every_row_gets_the_static_samplers_tokens_whatever_the_slot_count(tiny_model, greedy):
    _, graphdef, params = tiny_model
    want = _sample(graphdef, params, _one_device(), greedy=greedy)
    lengths = want.completion_mask.sum(1)
    # the case this is for: rows end at different steps (sampling: some at EOS and some at T)
    assert len(set(lengths)) > 2 and (greedy or want.is_truncated.any() and not want.is_truncated.all())
    for slots in (1, 2, 4, 7, 14):
        got = _sample(graphdef, params, _one_device(), greedy=greedy, max_batch_rows=slots)
        _assert_same_rows(got, want)
        # every row waited for a slot: the loop ran about sum(lengths) / slots steps, not max(lengths)
        assert int(got.num_decode_steps) >= lengths.sum() / slots - 1
    # slots for every row: today's static batch, bit for bit
    got = _sample(graphdef, params, _one_device(), greedy=greedy, max_batch_rows=len(IDS))
    np.testing.assert_array_equal(got.sampler_per_token_logps, want.sampler_per_token_logps)
    assert int(got.num_decode_steps) == lengths.max()


def test_cpu_speedups_and_host_thread_chunks_keep_each_rows_tokens(tiny_model):
    # each chunk's slots draw their rows' noise from the whole call's draw (row offset into total rows)
    _, graphdef, params = tiny_model
    want = _sample(graphdef, params, _one_device())
    for threads in (1, 5):
        for slots in (2, 5):
            _assert_same_rows(_sample(graphdef, params, _one_device(), speedups=True, host_threads=threads,
                                      max_batch_rows=slots), want)


def test_rows_and_keys_change_tokens_only_through_their_own_noise(tiny_model):
    _, graphdef, params = tiny_model
    a, b = (_sample(graphdef, params, _one_device(), key=k, max_batch_rows=4) for k in (3, 4))
    assert not np.array_equal(a.completion_ids, b.completion_ids)
    # the rows of a group share a prompt but not their noise: they differ
    assert len({tuple(r) for r in a.completion_ids}) > PROMPTS


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (XLA_FLAGS in conftest)")
@pytest.mark.parametrize("shape", [(8, 1, 1), (2, 2, 2)])
def test_sharded_continuous_batching_equals_single_device(tiny_model, shape):
    _, graphdef, params = tiny_model
    ids, mask = np.concatenate([IDS, IDS[:1]]), np.concatenate([MASK, MASK[:1]])  # 16 rows: whole row shards
    mesh = sharding.make_mesh(*shape)
    shardings = sharding.param_shardings(mesh, params)
    config = SamplingConfig(max_completion_length=9, temperature=0.9, top_k=12)

    def run(mesh, slots, p):
        fn = programs.jit_generate(graphdef, mesh, config=dataclasses.replace(config, max_batch_rows=slots),
                                   eos_token_ids=EOS, pad_token_id=0,
                                   params_sharding=None if p is params else shardings)
        return jax.device_get(fn(p, ids, mask, jax.random.key(3), False))

    want = run(_one_device(), 0, params)
    for slots in (3, 8):  # 3 rounds up to a multiple of the row shards
        _assert_same_rows(run(mesh, slots, jax.device_put(params, shardings)), want)
    # streamed over the mesh: the same rows, group by group
    fn = programs.jit_generate(graphdef, mesh, config=dataclasses.replace(config, max_batch_rows=8),
                               eos_token_ids=EOS, pad_token_id=0, params_sharding=shardings)
    stream = fn.stream(jax.device_put(params, shardings), ids, mask, jax.random.key(3))
    pieces = list(stream)
    assert len(pieces) > 1
    _assert_same_rows(jax.device_get(stream.output), want)
    for piece in pieces:
        np.testing.assert_array_equal(piece.completion_ids, want.completion_ids[piece.rows])


def test_slot_counts_round_to_the_row_shards_and_a_chunks_share():
    assert programs.continuous_slots(0, 16, 16, 1) == 16  # off: a static batch
    assert programs.continuous_slots(4, 16, 16, 1) == 4
    assert programs.continuous_slots(3, 16, 16, 2) == 4  # whole slots per row shard
    assert programs.continuous_slots(5, 8, 16, 1) == 3  # a chunk of half the rows takes half the slots, rounded up
    assert programs.continuous_slots(64, 16, 16, 1) == 16
    with pytest.raises(ValueError, match="sampling.max_batch_rows=-1"):
        SamplingConfig(max_batch_rows=-1)


def _stream(graphdef, params, mesh, *, speedups=False, host_threads=1, **config):
    config = SamplingConfig(**{"max_completion_length": 9, "temperature": 0.9, "top_k": 12,
                               "host_threads": host_threads, **config})
    fn = programs.jit_generate(graphdef, mesh, config=config, eos_token_ids=EOS, pad_token_id=0,
                               prompt_group_size=G, cpu_speedups=speedups)
    stream = fn.stream(params, IDS, MASK, jax.random.key(3))
    pieces, outputs_before = [], []
    for piece in stream:
        outputs_before.append(stream.output is not None)
        pieces.append(piece)
    return pieces, outputs_before, jax.device_get(stream.output)


@pytest.mark.parametrize("speedups, host_threads, slots", [(False, 1, 4), (True, 1, 2), (True, 5, 5), (False, 1, 0)])
def test_streamed_groups_reach_the_host_as_they_finish_with_the_calls_rows(tiny_model, speedups, host_threads, slots):
    _, graphdef, params = tiny_model
    want = _sample(graphdef, params, _one_device())
    pieces, outputs_before, out = _stream(graphdef, params, _one_device(), speedups=speedups,
                                          host_threads=host_threads, max_batch_rows=slots)
    _assert_same_rows(out, want)
    rows = np.concatenate([p.rows for p in pieces])
    np.testing.assert_array_equal(np.sort(rows), np.arange(len(IDS)))  # every row once
    for piece in pieces:
        assert len(piece.rows) % G == 0 and np.all(piece.rows.reshape(-1, G) % G == np.arange(G))  # whole groups
        np.testing.assert_array_equal(piece.completion_ids, want.completion_ids[piece.rows])
        np.testing.assert_array_equal(piece.completion_mask, want.completion_mask[piece.rows])
    if slots:  # groups came while others still decoded: the call's output was not there yet
        assert len(pieces) > 1 and not outputs_before[0]
    else:  # a static batch: every row at once
        assert len(pieces) == 1
    assert outputs_before[-1]  # the output is there before the last piece (its log-probs can start)


def test_segments_are_dispatched_while_the_host_still_holds_the_first_piece():
    """Decoding runs ahead of a consumer busy with a piece (a slow reward function): every segment is dispatched
    before the first piece is released. Without the stream's own dispatch thread only one segment is ever queued
    ahead of the consumer, and the wait below times out."""
    import threading

    from grpo_jax import stream
    from grpo_jax.sampling import SampleOutput

    rows, segments_total = 6, 3  # one group of 2 rows ends per segment
    advanced, all_dispatched = [], threading.Event()

    def advance(params, step, mask, key, offset, total):
        advanced.append(step)
        if step + 1 == segments_total:
            all_dispatched.set()
        ended = np.arange(rows) < 2 * (step + 1)
        ids = np.where(ended[:, None], np.arange(rows)[:, None], 0).astype(np.int32) * np.ones((1, 4), np.int32)
        out = SampleOutput(ids, ended[:, None] * np.ones((1, 4), np.int32), ~ended, np.zeros((rows, 4), np.float32),
                           np.int32(4))
        return step + 1, out, ended

    sampler = stream.Sampler(None, lambda *a: 0, advance, lambda b, total: 2, group_size=2)
    pieces = iter(sampler.stream(None, np.zeros((rows, 3), np.int32), np.ones((rows, 3), np.int32), None))
    first = next(pieces)
    assert all_dispatched.wait(timeout=30), f"only {len(advanced)} of {segments_total} segments dispatched"
    rest = list(pieces)
    np.testing.assert_array_equal(np.concatenate([first.rows, *[p.rows for p in rest]]), np.arange(rows))
    np.testing.assert_array_equal(first.completion_ids[:, 0], [0, 1])
