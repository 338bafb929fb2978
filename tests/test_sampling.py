"""Sampling tests: greedy vs no-cache arg-max, EOS/mask logic, keys, filters vs HF warpers, sampler logps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax import programs, sharding
from grpo_jax.logprobs import completion_logps
from grpo_jax.models import forward, positions_from_mask, unembed
from grpo_jax.sampling import SamplingConfig, filter_logits

PROMPT_IDS = np.array([[0, 0, 0, 5, 7, 9], [0, 3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8], [0, 0, 0, 0, 0, 6]], np.int32)
PROMPT_MASK = (np.arange(6)[None] >= np.array([[3], [1], [0], [5]])).astype(np.int32)
PAD = 0
NO_EOS = (-1,)  # an id that never occurs


@jax.jit
def _last_logits(graphdef, params, ids, mask):
    hidden, _ = forward(graphdef, params, ids, positions_from_mask(mask), mask)
    return unembed(graphdef, params, hidden[:, -1])


def generate_jit(graphdef, params, ids, mask, key, *, config, eos_token_ids, pad_token_id, greedy=False,
                 prompt_group_size=1):
    """One `programs.jit_generate` call on one device, CPU speed-ups off: `generate`'s default path."""
    mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    fn = programs.jit_generate(graphdef, mesh, config=config, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id,
                               prompt_group_size=prompt_group_size)
    return fn(params, ids, mask, key, greedy)


def reference_greedy(graphdef, params, T):
    """Arg-max decoding by re-running the full (no-cache) forward on prompt ++ generated each step."""
    ids, mask = PROMPT_IDS, PROMPT_MASK
    out = []
    for _ in range(T):
        tok = np.asarray(jnp.argmax(_last_logits(graphdef, params, ids, mask), -1), np.int32)
        out.append(tok)
        ids = np.concatenate([ids, tok[:, None]], 1)
        mask = np.concatenate([mask, np.ones_like(tok)[:, None]], 1)
    return np.stack(out, 1)


def expected_eos_logic(raw_BxT, eos):
    """(ids, mask, is_truncated) from un-stopped tokens: keep up to and including the first EOS, pad after."""
    is_eos = np.isin(raw_BxT, eos)
    before_first = np.cumsum(np.cumsum(is_eos, 1), 1) <= 1  # true up to and including the first EOS
    return np.where(before_first, raw_BxT, PAD), before_first.astype(np.int32), ~is_eos.any(1)


def run(model, key=0, greedy=False, eos=NO_EOS, **kwargs):
    _, graphdef, params = model
    config = SamplingConfig(**{"max_completion_length": 6, **kwargs})
    return generate_jit(graphdef, params, PROMPT_IDS, PROMPT_MASK, jax.random.key(key), config=config,
                        eos_token_ids=eos, pad_token_id=PAD, greedy=greedy)


def test_config_validation():
    for field, value in [("temperature", 0.0), ("top_k", -1), ("top_p", 0.0), ("top_p", 1.5), ("min_p", 1.0),
                         ("max_completion_length", 0)]:
        with pytest.raises(ValueError, match=rf"^sampling\.{field}="):
            SamplingConfig(**{field: value})


def test_greedy_matches_full_forward_argmax(tiny_model):
    _, graphdef, params = tiny_model
    raw = reference_greedy(graphdef, params, 6)
    out = run(tiny_model, greedy=True)
    np.testing.assert_array_equal(out.completion_ids, raw)
    np.testing.assert_array_equal(out.completion_mask, np.ones_like(raw))
    assert np.all(out.is_truncated) and int(out.num_decode_steps) == 6


def test_eos_mask_truncation_and_early_exit(tiny_model):
    _, graphdef, params = tiny_model
    raw = reference_greedy(graphdef, params, 6)
    # EOS = a token some row first emits mid-sequence, plus an id that never occurs
    row, t = next((r, t) for r in range(len(raw)) for t in range(1, 5) if raw[r, t] not in raw[r, :t])
    eos = (int(raw[row, t]), -1)
    out = run(tiny_model, greedy=True, eos=eos)
    ids, mask, truncated = expected_eos_logic(raw, eos)
    assert mask[row].sum() == t + 1 and not truncated[row]
    np.testing.assert_array_equal(out.completion_ids, ids)
    np.testing.assert_array_equal(out.completion_mask, mask)
    np.testing.assert_array_equal(out.is_truncated, truncated)
    assert np.all(np.asarray(out.sampler_per_token_logps)[mask == 0] == 0)
    # every token any row emits at step 1 is an EOS: all rows stop by then and the loop exits after 2 steps
    eos = tuple(sorted(set(raw[:, :2].ravel().tolist())))
    out = run(tiny_model, greedy=True, eos=eos)
    ids, mask, truncated = expected_eos_logic(raw, eos)
    np.testing.assert_array_equal(out.completion_ids, ids)
    np.testing.assert_array_equal(out.completion_mask, mask)
    assert not np.any(out.is_truncated)
    assert int(out.num_decode_steps) == mask.sum(1).max() <= 2


def test_all_eos_stops_after_one_token(tiny_model):
    out = run(tiny_model, eos=tuple(range(32)))
    assert int(out.num_decode_steps) == 1
    np.testing.assert_array_equal(out.completion_mask, np.eye(1, 6, dtype=np.int32).repeat(4, 0))
    assert np.all(np.asarray(out.completion_ids)[:, 1:] == PAD) and not np.any(out.is_truncated)


def test_keys(tiny_model):
    a, b, c = run(tiny_model, key=0), run(tiny_model, key=0), run(tiny_model, key=1)
    np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
    np.testing.assert_array_equal(a.sampler_per_token_logps, b.sampler_per_token_logps)
    assert not np.array_equal(a.completion_ids, c.completion_ids)


def reference_sample(graphdef, params, key, T, config):
    """Per step: full (no-cache) forward, then jax.random.categorical(fold_in(key, t)) of the filtered logits."""
    ids, mask = PROMPT_IDS, PROMPT_MASK
    out = []
    for t in range(T):
        scaled = _last_logits(graphdef, params, ids, mask).astype(jnp.float32) / config.temperature
        tok = np.asarray(jax.random.categorical(jax.random.fold_in(key, t), filter_logits(scaled, config)), np.int32)
        out.append(tok)
        ids = np.concatenate([ids, tok[:, None]], 1)
        mask = np.concatenate([mask, np.ones_like(tok)[:, None]], 1)
    return np.stack(out, 1)


def test_sampling_draws_categorical_of_fold_in_key_step(tiny_model):
    _, graphdef, params = tiny_model
    config = SamplingConfig(max_completion_length=6, temperature=0.9, top_k=8)
    key = jax.random.key(7)
    out = generate_jit(graphdef, params, PROMPT_IDS, PROMPT_MASK, key, config=config, eos_token_ids=NO_EOS,
                       pad_token_id=PAD)
    np.testing.assert_array_equal(out.completion_ids, reference_sample(graphdef, params, key, 6, config))


def test_top_k_one_is_greedy(tiny_model):
    greedy = run(tiny_model, greedy=True, temperature=0.7)
    top1 = run(tiny_model, key=3, top_k=1, temperature=0.7)
    np.testing.assert_array_equal(greedy.completion_ids, top1.completion_ids)
    np.testing.assert_allclose(greedy.sampler_per_token_logps, top1.sampler_per_token_logps, atol=1e-6)


@pytest.mark.parametrize("filters", [{}, {"top_k": 5, "top_p": 0.9}, {"min_p": 0.1}])
def test_sampler_per_token_logps_match_completion_logps(tiny_model, filters):
    _, graphdef, params = tiny_model
    raw = reference_greedy(graphdef, params, 6)
    eos = (int(raw[1, 3]),)  # make some rows stop so masked positions exist
    out = run(tiny_model, key=5, temperature=0.7, eos=eos, **filters)
    logps, _ = completion_logps(graphdef, params, PROMPT_IDS, PROMPT_MASK, out.completion_ids,
                                out.completion_mask, temperature=0.7)
    mask = np.asarray(out.completion_mask) == 1
    np.testing.assert_allclose(np.asarray(out.sampler_per_token_logps)[mask], np.asarray(logps)[mask], atol=1e-5)


def test_filter_logits_hand_computed():
    # probs of [2, 1, 0, -1, -inf]: about .644 .237 .087 .032 0
    logits = jnp.array([[1.0, 2.0, -1.0, 0.0, -jnp.inf]])
    ninf = -np.inf
    got = filter_logits(logits, SamplingConfig(top_k=2))
    np.testing.assert_array_equal(got, [[1.0, 2.0, ninf, ninf, ninf]])
    got = filter_logits(logits, SamplingConfig(top_p=0.85))  # .644 + .237 >= .85 keeps two
    np.testing.assert_array_equal(got, [[1.0, 2.0, ninf, ninf, ninf]])
    got = filter_logits(logits, SamplingConfig(top_p=0.9))  # needs the third
    np.testing.assert_array_equal(got, [[1.0, 2.0, ninf, 0.0, ninf]])
    got = filter_logits(logits, SamplingConfig(min_p=0.1))  # threshold .0644 keeps .237 and .087
    np.testing.assert_array_equal(got, [[1.0, 2.0, ninf, 0.0, ninf]])
    got = filter_logits(logits, SamplingConfig(top_p=0.01))  # always keeps the best token
    np.testing.assert_array_equal(got, [[ninf, 2.0, ninf, ninf, ninf]])


@pytest.mark.parametrize("filters", [{"top_k": 7}, {"top_p": 0.8}, {"min_p": 0.05},
                                     {"top_k": 10, "top_p": 0.7, "min_p": 0.02}])
def test_filter_logits_matches_transformers(filters):
    torch = pytest.importorskip("torch")
    from transformers.generation import logits_process as lp

    logits = np.asarray(jax.random.normal(jax.random.key(0), (4, 50)) * 2, np.float32)
    scores = torch.from_numpy(logits.copy())
    if "top_k" in filters:
        scores = lp.TopKLogitsWarper(filters["top_k"])(None, scores)
    if "top_p" in filters:
        scores = lp.TopPLogitsWarper(filters["top_p"])(None, scores)
    if "min_p" in filters:
        scores = lp.MinPLogitsWarper(filters["min_p"])(None, scores)
    got = filter_logits(jnp.asarray(logits), SamplingConfig(**filters))
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(scores.numpy()))


def test_sampling_frequencies_follow_filtered_softmax(tiny_model):
    config, graphdef, params = tiny_model
    config_s = SamplingConfig(max_completion_length=1, temperature=0.8, top_k=6, top_p=0.95)
    n = 4000
    ids, mask = np.repeat(PROMPT_IDS[2:3], n, 0), np.repeat(PROMPT_MASK[2:3], n, 0)
    out = generate_jit(graphdef, params, ids, mask, jax.random.key(0), config=config_s, eos_token_ids=NO_EOS,
                       pad_token_id=PAD)
    logits = np.asarray(_last_logits(graphdef, params, ids[:1], mask[:1]), np.float64)[0] / 0.8
    keep = np.isfinite(np.asarray(filter_logits(jnp.asarray(logits[None], jnp.float32), config_s))[0])
    probs = np.where(keep, np.exp(logits - logits.max()), 0)
    probs /= probs.sum()
    freq = np.bincount(np.asarray(out.completion_ids)[:, 0], minlength=config.vocab_size) / n
    np.testing.assert_allclose(freq, probs, atol=0.03)  # ~4 binomial standard errors at n=4000


def test_grouped_prefill_matches_per_row_prefill(tiny_model):
    _, graphdef, params = tiny_model
    G = 3
    ids, mask = np.repeat(PROMPT_IDS, G, axis=0), np.repeat(PROMPT_MASK, G, axis=0)
    config = SamplingConfig(max_completion_length=6)
    outs = [generate_jit(graphdef, params, ids, mask, jax.random.key(4), config=config, eos_token_ids=(3,),
                         pad_token_id=PAD, prompt_group_size=g) for g in (1, G)]
    np.testing.assert_array_equal(outs[0].completion_ids, outs[1].completion_ids)
    np.testing.assert_array_equal(outs[0].completion_mask, outs[1].completion_mask)
    np.testing.assert_allclose(outs[0].sampler_per_token_logps, outs[1].sampler_per_token_logps, rtol=1e-5,
                               atol=1e-5)
    assert len({tuple(r) for r in np.asarray(outs[1].completion_ids)}) > len(PROMPT_IDS)  # rows of a group differ
    with pytest.raises(ValueError, match="prompt_group_size=5"):
        generate_jit(graphdef, params, ids, mask, jax.random.key(4), config=config, eos_token_ids=(3,),
                     pad_token_id=PAD, prompt_group_size=5)


def test_float32_weights_sample_as_their_compute_dtype_copy(tiny_model_config):
    """bf16 compute over float32 storage: the sampler's one cast of the weights (`compute_dtype_params`)
    gives the numbers of a model whose weights were stored in bf16 to begin with."""
    import dataclasses

    from grpo_jax.models import compute_dtype_params, init_model

    config = dataclasses.replace(tiny_model_config, dtype="bfloat16")
    graphdef, params = init_model(config, seed=0)
    stored_bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    leaves = jax.tree.leaves(compute_dtype_params(graphdef, params))
    assert {x.dtype for x in leaves} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(compute_dtype_params(*init_model(tiny_model_config, 0)))} == {
        jnp.dtype(jnp.float32)}  # float32 compute: nothing cast
    sampling_config = SamplingConfig(max_completion_length=6)
    outs = [generate_jit(graphdef, p, PROMPT_IDS, PROMPT_MASK, jax.random.key(2), config=sampling_config,
                         eos_token_ids=NO_EOS, pad_token_id=PAD) for p in (params, stored_bf16)]
    np.testing.assert_array_equal(outs[0].completion_ids, outs[1].completion_ids)
    np.testing.assert_array_equal(outs[0].sampler_per_token_logps, outs[1].sampler_per_token_logps)
