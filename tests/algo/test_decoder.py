"""The decoder (`grpo_jax.algo.decoder`): tokens against a no-cache forward and `jax.random.categorical` with each row's
key, EOS and truncation, the same rows whatever the slot count, and rows that pause for tokens from outside.

The reference of every token is a full forward pass over the prompt and the tokens so far (no KV cache): the
decoder's cache, refills and appended tokens must give its arg-max, its draws and its log-probabilities.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.algo import decoder, programs
from grpo_jax.algo.logprobs import completion_logps
from grpo_jax.algo.sampling import SamplingConfig, filter_logits
from grpo_jax.device import sharding
from grpo_jax.models import forward, positions_from_mask, unembed
from grpo_jax.rollout import stream

PROMPT_IDS = np.array([[0, 0, 0, 5, 7, 9], [0, 3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8], [0, 0, 0, 0, 0, 6]], np.int32)
PROMPT_MASK = (np.arange(6)[None] >= np.array([[3], [1], [0], [5]])).astype(np.int32)
PAD = 0
NO_EOS = (-1,)  # an id that never occurs


def one_device():
    return sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])


def make_decoder(model, mesh=None, *, eos=NO_EOS, group=1, speedups=False, **sampling):
    config, graphdef, _ = model
    return programs.jit_decoder(graphdef, mesh or one_device(), config, config=SamplingConfig(**sampling),
                                eos_token_ids=eos, pad_token_id=PAD, prompt_group_size=group, cpu_speedups=speedups)


def run(model, key=0, greedy=False, eos=NO_EOS, ids=PROMPT_IDS, mask=PROMPT_MASK, group=1, **sampling):
    """Every row decoded by a run's decoding programs on one device (CPU speed-ups off), on the host."""
    dec = make_decoder(model, eos=eos, group=group, **{"max_completion_length": 6, **sampling})
    return jax.device_get(stream.generate(dec, model[2], ids, mask, jax.random.key(key), greedy=greedy,
                                          group_size=group))


@jax.jit
def _last_logits(graphdef, params, ids, mask):
    hidden, _ = forward(graphdef, params, ids, positions_from_mask(mask), mask)
    return unembed(graphdef, params, hidden[:, -1])


def reference(graphdef, params, T, choose, ids=PROMPT_IDS, mask=PROMPT_MASK):
    """Tokens decoded by re-running the full (no-cache) forward on prompt ++ tokens so far; ``choose(t, logits)``."""
    out = []
    for t in range(T):
        tok = np.asarray(choose(t, _last_logits(graphdef, params, ids, mask)), np.int32)
        out.append(tok)
        ids = np.concatenate([ids, tok[:, None]], 1)
        mask = np.concatenate([mask, np.ones_like(tok)[:, None]], 1)
    return np.stack(out, 1)


def greedy_reference(model, T=6):
    return reference(model[1], model[2], T, lambda t, logits: jnp.argmax(logits, -1))


def expected_eos_logic(raw_BxT, eos):
    """(ids, mask, is_truncated) from un-stopped tokens: keep up to and including the first EOS, pad after."""
    is_eos = np.isin(raw_BxT, eos)
    before_first = np.cumsum(np.cumsum(is_eos, 1), 1) <= 1  # true up to and including the first EOS
    return np.where(before_first, raw_BxT, PAD), before_first.astype(np.int32), ~is_eos.any(1)


def test_greedy_matches_full_forward_argmax(tiny_model):
    raw = greedy_reference(tiny_model)
    out = run(tiny_model, greedy=True)
    np.testing.assert_array_equal(out.completion_ids, raw)
    np.testing.assert_array_equal(out.completion_mask, np.ones_like(raw))
    np.testing.assert_array_equal(out.loss_mask, np.ones_like(raw))  # every token sampled
    np.testing.assert_array_equal(out.turns, np.zeros_like(raw))  # one turn
    assert np.all(out.is_truncated)


def test_eos_mask_truncation_and_early_exit(tiny_model):
    _, graphdef, params = tiny_model
    raw = greedy_reference(tiny_model)
    # EOS = a token some row first emits mid-sequence, plus an id that never occurs
    row, t = next((r, t) for r in range(len(raw)) for t in range(1, 5) if raw[r, t] not in raw[r, :t])
    eos = (int(raw[row, t]), -1)
    out = run(tiny_model, greedy=True, eos=eos)
    ids, mask, truncated = expected_eos_logic(raw, eos)
    assert mask[row].sum() == t + 1 and not truncated[row]
    np.testing.assert_array_equal(out.completion_ids, ids)
    np.testing.assert_array_equal(out.completion_mask, mask)
    np.testing.assert_array_equal(out.loss_mask, mask)
    np.testing.assert_array_equal(out.turns, np.where(mask == 1, 0, -1))
    np.testing.assert_array_equal(out.is_truncated, truncated)
    assert np.all(out.sampler_per_token_logps[mask == 0] == 0)
    # every token any row emits at step 1 is an EOS: all rows stop by then and the loop exits after 2 steps
    eos = tuple(sorted(set(raw[:, :2].ravel().tolist())))
    options = make_decoder(tiny_model, eos=eos, max_completion_length=6).options(4, 4, True)
    d = jax.jit(decoder.start, static_argnums=5)(graphdef, params, PROMPT_IDS, PROMPT_MASK, jax.random.key(0), options)
    d = jax.jit(decoder.advance, static_argnums=3)(graphdef, params, d, options)
    ids, mask, truncated = expected_eos_logic(raw, eos)
    out = jax.device_get(decoder.trajectory(d))
    np.testing.assert_array_equal(out.completion_ids, ids)
    np.testing.assert_array_equal(out.completion_mask, mask)
    assert not np.any(out.is_truncated)
    assert int(d.steps) == mask.sum(1).max() - 1 <= 1  # the first token comes from the prefill


def test_all_eos_stops_after_one_token(tiny_model):
    out = run(tiny_model, eos=tuple(range(32)))
    np.testing.assert_array_equal(out.completion_mask, np.eye(1, 6, dtype=np.int32).repeat(4, 0))
    assert np.all(out.completion_ids[:, 1:] == PAD) and not np.any(out.is_truncated)


def test_keys(tiny_model):
    a, b, c = run(tiny_model, key=0), run(tiny_model, key=0), run(tiny_model, key=1)
    np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
    np.testing.assert_array_equal(a.sampler_per_token_logps, b.sampler_per_token_logps)
    assert not np.array_equal(a.completion_ids, c.completion_ids)


def sample_reference(model, key, T, config, ids=PROMPT_IDS, mask=PROMPT_MASK, row_offset=0):
    """Row b's token t is jax.random.categorical(fold_in(fold_in(key, b), t)) of its filtered, scaled logits."""
    def choose(t, logits):
        scaled = filter_logits(logits.astype(jnp.float32) / config.temperature, config)
        return jnp.stack([jax.random.categorical(jax.random.fold_in(jax.random.fold_in(key, row_offset + b), t),
                                                 scaled[b]) for b in range(len(scaled))])
    return reference(model[1], model[2], T, choose, ids, mask)


def test_sampling_draws_categorical_with_each_rows_own_key(tiny_model):
    config = SamplingConfig(max_completion_length=6, temperature=0.9, top_k=8)
    key = jax.random.key(7)
    out = run(tiny_model, key=7, temperature=0.9, top_k=8)
    np.testing.assert_array_equal(out.completion_ids, sample_reference(tiny_model, key, 6, config))


def test_top_k_one_is_greedy(tiny_model):
    greedy = run(tiny_model, greedy=True, temperature=0.7)
    top1 = run(tiny_model, key=3, top_k=1, temperature=0.7)
    np.testing.assert_array_equal(greedy.completion_ids, top1.completion_ids)
    np.testing.assert_allclose(greedy.sampler_per_token_logps, top1.sampler_per_token_logps, atol=1e-6)


@pytest.mark.parametrize("filters", [{}, {"top_k": 5, "top_p": 0.9}, {"min_p": 0.1}])
def test_sampler_per_token_logps_match_completion_logps(tiny_model, filters):
    _, graphdef, params = tiny_model
    raw = greedy_reference(tiny_model)
    eos = (int(raw[1, 3]),)  # make some rows stop so masked positions exist
    out = run(tiny_model, key=5, temperature=0.7, eos=eos, **filters)
    logps, _ = completion_logps(graphdef, params, PROMPT_IDS, PROMPT_MASK, out.completion_ids,
                                out.completion_mask, temperature=0.7)
    mask = out.completion_mask == 1
    np.testing.assert_allclose(out.sampler_per_token_logps[mask], np.asarray(logps)[mask], atol=1e-5)


def test_sampling_frequencies_follow_filtered_softmax(tiny_model):
    config, graphdef, params = tiny_model
    n = 4000
    ids, mask = np.repeat(PROMPT_IDS[2:3], n, 0), np.repeat(PROMPT_MASK[2:3], n, 0)
    out = run(tiny_model, ids=ids, mask=mask, max_completion_length=1, temperature=0.8, top_k=6, top_p=0.95)
    config_s = SamplingConfig(max_completion_length=1, temperature=0.8, top_k=6, top_p=0.95)
    logits = np.asarray(_last_logits(graphdef, params, ids[:1], mask[:1]), np.float64)[0] / 0.8
    keep = np.isfinite(np.asarray(filter_logits(jnp.asarray(logits[None], jnp.float32), config_s))[0])
    probs = np.where(keep, np.exp(logits - logits.max()), 0)
    probs /= probs.sum()
    freq = np.bincount(out.completion_ids[:, 0], minlength=config.vocab_size) / n
    np.testing.assert_allclose(freq, probs, atol=0.03)  # ~4 binomial standard errors at n=4000


def test_grouped_prefill_matches_per_row_prefill(tiny_model):
    G = 3
    ids, mask = np.repeat(PROMPT_IDS, G, axis=0), np.repeat(PROMPT_MASK, G, axis=0)
    outs = [run(tiny_model, key=4, eos=(3,), ids=ids, mask=mask, group=g) for g in (1, G)]
    np.testing.assert_array_equal(outs[0].completion_ids, outs[1].completion_ids)
    np.testing.assert_array_equal(outs[0].completion_mask, outs[1].completion_mask)
    np.testing.assert_allclose(outs[0].sampler_per_token_logps, outs[1].sampler_per_token_logps, rtol=1e-5,
                               atol=1e-5)
    assert len({tuple(r) for r in outs[1].completion_ids}) > len(PROMPT_IDS)  # rows of a group differ
    with pytest.raises(ValueError, match="group_size=5"):
        run(tiny_model, ids=ids, mask=mask, group=5)


def test_float32_weights_sample_as_their_compute_dtype_copy(tiny_model_config):
    """bf16 compute over float32 storage: the decoder's one cast of the weights (`compute_dtype_params`)
    gives the numbers of a model whose weights were stored in bf16 to begin with."""
    from grpo_jax.models import compute_dtype_params, init_model

    config = dataclasses.replace(tiny_model_config, dtype="bfloat16")
    graphdef, params = init_model(config, seed=0)
    stored_bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    assert {x.dtype for x in jax.tree.leaves(compute_dtype_params(graphdef, params))} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(compute_dtype_params(*init_model(tiny_model_config, 0)))} == {
        jnp.dtype(jnp.float32)}  # float32 compute: nothing cast
    outs = [run((config, graphdef, p), key=2) for p in (params, stored_bf16)]
    np.testing.assert_array_equal(outs[0].completion_ids, outs[1].completion_ids)
    np.testing.assert_array_equal(outs[0].sampler_per_token_logps, outs[1].sampler_per_token_logps)


# --- continuous batching: fewer slots than rows ------------------------------------------------------------

G = 3  # rows per prompt
rng = np.random.default_rng(0)
IDS = np.repeat(rng.integers(2, 32, (5, 7)), G, axis=0).astype(np.int32)
MASK = np.repeat(np.arange(7)[None] >= rng.integers(0, 7, (5, 1)), G, axis=0).astype(np.int32)
EOS = (1, 3, 4)  # EOS about 3 tokens in 32: lengths from 1 to T, some rows truncated


def decode_rows(model, *, slots=0, greedy=False, key=3, speedups=False, host_threads=1, mesh=None, ids=IDS, mask=MASK,
                group=G):
    dec = make_decoder(model, mesh, eos=EOS, group=group, speedups=speedups, max_completion_length=9, temperature=0.9,
                       top_k=12, max_batch_rows=slots, host_threads=host_threads)
    return jax.device_get(stream.generate(dec, model[2], ids, mask, jax.random.key(key), greedy=greedy,
                                          group_size=1 if greedy else group))


def assert_same_rows(got, want):
    for field in ("completion_ids", "completion_mask", "loss_mask", "turns", "is_truncated"):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)
    # a slot batch of another size may round XLA:CPU's reductions differently
    np.testing.assert_allclose(got.sampler_per_token_logps, want.sampler_per_token_logps, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("greedy", [False, True])
def test_every_row_gets_the_same_tokens_whatever_the_slot_count(tiny_model, greedy):
    _, graphdef, params = tiny_model
    want = decode_rows(tiny_model, greedy=greedy)
    lengths = want.completion_mask.sum(1)
    # the case this is for: rows end at different steps (sampling: some at EOS and some at T)
    assert len(set(lengths)) > 2 and (greedy or want.is_truncated.any() and not want.is_truncated.all())
    if not greedy:  # the static batch is itself the reference's draw, row by row
        config = SamplingConfig(max_completion_length=9, temperature=0.9, top_k=12)
        raw = sample_reference(tiny_model, jax.random.key(3), 9, config, IDS, MASK)
        ids, _, _ = expected_eos_logic(raw, EOS)
        np.testing.assert_array_equal(want.completion_ids, ids)
    dec = make_decoder(tiny_model, eos=EOS, group=G, max_completion_length=9, temperature=0.9, top_k=12)
    start, advance = jax.jit(decoder.start, static_argnums=5), jax.jit(decoder.advance, static_argnums=3)
    for slots in (1, 2, 4, 7, 14, len(IDS)):
        options = dataclasses.replace(dec.options(len(IDS), len(IDS), greedy), num_slots=slots)
        d = advance(graphdef, params, start(graphdef, params, IDS, MASK, jax.random.key(3), options), options)
        assert_same_rows(jax.device_get(decoder.trajectory(d)), want)
        # every row waited for a slot: the loop ran about sum(lengths) / slots steps, not max(lengths)
        assert int(d.steps) >= lengths.sum() / slots - 2
    assert int(d.steps) == lengths.max() - 1  # slots for every row: a static batch


def test_cpu_speedups_and_host_thread_chunks_keep_each_rows_tokens(tiny_model):
    # each chunk's rows draw their noise by their rows in the whole call (row offset)
    want = decode_rows(tiny_model)
    for threads in (1, 5):
        for slots in (0, 2, 5):
            assert_same_rows(decode_rows(tiny_model, speedups=True, host_threads=threads, slots=slots), want)


def test_noise_before_or_inside_the_loop_draws_the_same_tokens(tiny_model):
    _, graphdef, params = tiny_model
    options = make_decoder(tiny_model, eos=EOS, group=G, max_completion_length=9, top_k=12).options(15, 15, False)
    start, advance = jax.jit(decoder.start, static_argnums=5), jax.jit(decoder.advance, static_argnums=3)
    outs = []
    for ahead in (False, True):
        o = dataclasses.replace(options, noise_ahead=ahead, num_slots=4)
        d = start(graphdef, params, IDS, MASK, jax.random.key(1), o)
        assert (d.noise is None) != ahead
        outs.append(jax.device_get(decoder.trajectory(advance(graphdef, params, d, o))))
    assert_same_rows(*outs)


def test_rows_and_keys_change_tokens_only_through_their_own_noise(tiny_model):
    a, b = (decode_rows(tiny_model, key=k, slots=4) for k in (3, 4))
    assert not np.array_equal(a.completion_ids, b.completion_ids)
    # the rows of a group share a prompt but not their noise: they differ
    assert len({tuple(r) for r in a.completion_ids}) > 5


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (XLA_FLAGS in conftest)")
@pytest.mark.parametrize("shape", [(8, 1, 1), (2, 2, 2)])
def test_sharded_decoding_equals_single_device(tiny_model, shape):
    ids, mask = np.concatenate([IDS, IDS[:1]]), np.concatenate([MASK, MASK[:1]])  # 16 rows: whole row shards
    want = decode_rows(tiny_model, ids=ids, mask=mask, group=1)
    mesh = sharding.make_mesh(*shape)
    params = jax.device_put(tiny_model[2], sharding.param_shardings(mesh, tiny_model[2]))
    for slots in (0, 3, 8):  # 3 rounds up to a multiple of the row shards
        dec = make_decoder(tiny_model, mesh, eos=EOS, group=1, max_completion_length=9, temperature=0.9, top_k=12,
                           max_batch_rows=slots)
        got = stream.generate(dec, params, ids, mask, jax.random.key(3))
        assert_same_rows(jax.device_get(got), want)


def test_slot_counts_round_to_the_row_shards_and_a_chunks_share():
    assert decoder.continuous_slots(0, 16, 16, 1) == 16  # off: a static batch
    assert decoder.continuous_slots(4, 16, 16, 1) == 4
    assert decoder.continuous_slots(3, 16, 16, 2) == 4  # whole slots per row shard
    assert decoder.continuous_slots(5, 8, 16, 1) == 3  # a chunk of half the rows takes half the slots, rounded up
    assert decoder.continuous_slots(64, 16, 16, 1) == 16
    with pytest.raises(ValueError, match="sampling.max_batch_rows=-1"):
        SamplingConfig(max_batch_rows=-1)


# --- rows that pause: tokens from outside (tools, environments) ---------------------------------------------


def _multi_turn(model, slots, greedy, eos, appended, key=5):
    """Decode with pause_at_eos; each paused row gets ``appended`` (its tokens) once, then decodes to the end."""
    _, graphdef, params = model
    options = dataclasses.replace(
        make_decoder(model, eos=eos, max_completion_length=14, temperature=0.8).options(4, 4, greedy),
        pause_at_eos=True, num_slots=slots)
    start, advance = jax.jit(decoder.start, static_argnums=5), jax.jit(decoder.advance, static_argnums=3)
    append = jax.jit(decoder.append, static_argnums=6)
    d = advance(graphdef, params, start(graphdef, params, PROMPT_IDS, PROMPT_MASK, jax.random.key(key), options),
                options)
    given = set()
    for _ in range(8):
        paused = [int(r) for r in np.flatnonzero(np.asarray(d.paused)) if int(r) not in given]
        if not paused:
            break
        given.update(paused)
        rows = np.array(paused + [-1] * (4 - len(paused)), np.int32)
        tokens = np.tile(np.asarray(appended, np.int32), (4, 1))
        d = append(graphdef, params, d, rows, tokens, np.full(4, len(appended), np.int32), options)
        d = advance(graphdef, params, d, options)
    # rows that paused a second time are retired: their rollouts end there
    return jax.device_get(decoder.trajectory(jax.jit(decoder.retire)(d, np.arange(4, dtype=np.int32)))), given


@pytest.mark.parametrize("slots", [4, 2])
def test_appended_tokens_are_seen_not_sampled_and_the_row_decodes_on_as_if_they_were_its_prompt(tiny_model, slots):
    """A greedy row that pauses at EOS, gets [9, 10, 11] from outside, and decodes on: its tokens equal a no-cache
    forward's arg-max over prompt ++ turn 1 ++ [9, 10, 11]; the appended tokens have loss mask 0 and the turn of
    the turn before them; a paused row gives its slot to waiting rows (2 slots) and is admitted again after."""
    raw = greedy_reference(tiny_model, 14)
    row, t = next((r, t) for r in range(len(raw)) for t in range(2, 6) if raw[r, t] not in raw[r, :t])
    eos = (int(raw[row, t]),)
    out, paused = _multi_turn(tiny_model, slots, True, eos, [9, 10, 11])
    assert row in paused
    first = int(np.argmax(np.isin(raw[row], eos)))  # the row's first EOS: its first turn ends there
    n = first + 1
    assert out.completion_ids[row, :n].tolist() == raw[row, :n].tolist()
    assert out.completion_ids[row, n:n + 3].tolist() == [9, 10, 11]
    # the reference: the prompt, turn 1 and the outside tokens as one prompt, decoded greedily with no cache
    ids = np.concatenate([PROMPT_IDS[row:row + 1], raw[row:row + 1, :n], [[9, 10, 11]]], axis=1).astype(np.int32)
    mask = np.concatenate([PROMPT_MASK[row:row + 1], np.ones((1, n + 3), np.int32)], axis=1)
    rest = out.completion_mask[row].sum() - n - 3
    assert rest > 0
    want = reference(tiny_model[1], tiny_model[2], rest, lambda _, logits: jnp.argmax(logits, -1), ids, mask)[0]
    got = out.completion_ids[row, n + 3:n + 3 + rest]
    cut = np.flatnonzero(np.isin(want, eos))
    upto = rest if not len(cut) else cut[0] + 1  # a second EOS pauses again: the row was retired there
    np.testing.assert_array_equal(got[:upto], want[:upto])
    assert out.loss_mask[row, n:n + 3].tolist() == [0, 0, 0] and out.loss_mask[row, :n].all()
    assert out.loss_mask[row, n + 3:n + 3 + rest].all()
    assert out.turns[row, :n].tolist() == [0] * n and out.turns[row, n:n + 3].tolist() == [0, 0, 0]
    assert set(out.turns[row, n + 3:n + 3 + rest]) == {1}
    assert not out.is_truncated[row] or out.completion_mask[row].sum() == 14


def test_sampled_tokens_after_appended_ones_have_the_teacher_forced_log_probs(tiny_model):
    """Sampling across turns: every sampled token's log-prob equals a plain forward over the whole trajectory
    (a row admitted again after `append` holds exactly the prompt, the sampled and the appended tokens)."""
    _, graphdef, params = tiny_model
    out, paused = _multi_turn(tiny_model, 3, False, (2, 5, 6), [9, 10, 11, 12])
    assert paused and np.any(out.turns == 1)
    logps, _ = completion_logps(graphdef, params, PROMPT_IDS, PROMPT_MASK, out.completion_ids, out.completion_mask,
                                temperature=0.8)
    sampled = out.loss_mask == 1
    np.testing.assert_allclose(out.sampler_per_token_logps[sampled], np.asarray(logps)[sampled], atol=1e-5)
    assert np.all(out.sampler_per_token_logps[out.loss_mask == 0] == 0)


def test_appended_tokens_that_fill_the_completion_end_the_row_truncated(tiny_model):
    _, graphdef, params = tiny_model
    raw = greedy_reference(tiny_model, 6)
    eos = (int(raw[0, 1]),)
    options = dataclasses.replace(make_decoder(tiny_model, eos=eos, max_completion_length=6).options(4, 4, True),
                                  pause_at_eos=True)
    d = decoder.advance(graphdef, params, decoder.start(graphdef, params, PROMPT_IDS, PROMPT_MASK,
                                                        jax.random.key(0), options), options)
    assert bool(d.paused[0]) and int(d.length[0]) == 2
    d = decoder.append(graphdef, params, d, np.array([0, -1, -1, -1], np.int32), np.full((4, 8), 9, np.int32),
                       np.full(4, 8, np.int32), options)  # 8 tokens, room for 4
    out = jax.device_get(decoder.trajectory(d))
    assert out.completion_ids[0].tolist() == raw[0, :2].tolist() + [9] * 4
    assert bool(d.ended[0]) and not bool(d.paused[0]) and out.is_truncated[0]
    assert out.loss_mask[0].tolist() == [1, 1, 0, 0, 0, 0]


def _late_appends(model, slots, delay, **options):
    """`_multi_turn` with each paused row's tokens appended only after ``delay`` more decode segments, as a slow
    tool would return them (``options``: more `decoder.DecodeOptions`)."""
    _, graphdef, params = model
    options = dataclasses.replace(
        make_decoder(model, eos=(2, 5, 6), max_completion_length=14, temperature=0.8).options(4, 4, False),
        pause_at_eos=True, num_slots=slots, **options)
    start = jax.jit(decoder.start, static_argnums=5)
    advance = jax.jit(functools.partial(decoder.advance, segment=True), static_argnums=3)
    d = start(graphdef, params, PROMPT_IDS, PROMPT_MASK, jax.random.key(5), options)
    waiting, given = {}, set()
    for _ in range(64):
        d = advance(graphdef, params, d, options)
        for r in np.flatnonzero(np.asarray(d.paused)):
            if int(r) not in given and int(r) not in waiting:
                waiting[int(r)] = delay
        due = [r for r, left in waiting.items() if left == 0]
        waiting = {r: left - 1 for r, left in waiting.items() if left > 0}
        if due:
            given.update(due)
            rows = np.array(due + [-1] * (4 - len(due)), np.int32)
            d = decoder.append(graphdef, params, d, rows, np.tile(np.array([9, 10, 11], np.int32), (4, 1)),
                               np.full(4, 3, np.int32), options)
        retire = [int(r) for r in np.flatnonzero(np.asarray(d.paused)) if int(r) in given and int(r) not in due]
        if retire:
            d = decoder.retire(d, np.array(retire + [-1] * (4 - len(retire)), np.int32))
        if bool(np.all(np.asarray(d.ended))):
            break
    return jax.device_get(decoder.trajectory(d))


def test_multi_turn_rows_do_not_depend_on_when_their_tools_return(tiny_model):
    """A paused row's tokens and log-probs are the same bit for bit however late its tokens come (tool timing):
    with fewer slots than rows (2) it frees its slot and is run again in one pass when admitted again; with a slot
    each (4) it keeps its slot and the tokens run into it. Between the two, the same tokens."""
    runs = {}
    for slots in (2, 4):
        now = _late_appends(tiny_model, slots, 0)
        assert np.any(now.turns == 1)
        for late in (_late_appends(tiny_model, slots, 1), _late_appends(tiny_model, slots, 3)):
            np.testing.assert_array_equal(late.completion_ids, now.completion_ids)
            np.testing.assert_array_equal(late.sampler_per_token_logps, now.sampler_per_token_logps)
            np.testing.assert_array_equal(late.loss_mask, now.loss_mask)
        runs[slots] = now
    np.testing.assert_array_equal(runs[4].completion_ids, runs[2].completion_ids)
    np.testing.assert_allclose(runs[4].sampler_per_token_logps, runs[2].sampler_per_token_logps, atol=1e-6)
