"""Drawing one token (`grpo_jax.algo.sampling`): the filters against Hugging Face's logits warpers, each row's own noise,
and the token and log-prob a draw gives. The decode loop around them is tested in test_decoder.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.algo.sampling import SamplingConfig, draw, filter_logits, penalize, row_noise


def test_config_validation():
    for field, value in [("temperature", 0.0), ("top_k", -1), ("top_p", 0.0), ("top_p", 1.5), ("min_p", 1.0),
                         ("max_completion_length", 0)]:
        with pytest.raises(ValueError, match=rf"^sampling\.{field}="):
            SamplingConfig(**{field: value})


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


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_transformers(penalty):
    """transformers' RepetitionPenaltyLogitsProcessor on the raw logits, then the temperature: our penalty on the
    scaled logits gives the same scores (a positive scale keeps each logit's sign)."""
    torch = pytest.importorskip("torch")
    from transformers.generation import logits_process as lp

    logits = np.asarray(jax.random.normal(jax.random.key(1), (3, 40)) * 2, np.float32)
    ids = np.asarray(jax.random.randint(jax.random.key(2), (3, 9), 0, 40))  # repeats within a row
    expected = lp.RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor(ids), torch.tensor(logits))
    seen = np.zeros((3, 40), bool)
    seen[np.arange(3)[:, None], ids] = True
    got = penalize(jnp.asarray(logits) / 0.7, jnp.asarray(seen), penalty)
    np.testing.assert_allclose(np.asarray(got), expected.numpy() / 0.7, rtol=1e-6)
    assert not np.allclose(np.asarray(got), logits / 0.7)


def test_a_rows_noise_is_the_gumbel_draw_of_its_own_key():
    key = jax.random.key(3)
    noise = jax.jit(row_noise, static_argnums=3)(key, 5, 2, 37)
    want = jax.random.gumbel(jax.random.fold_in(jax.random.fold_in(key, 5), 2), (37,))
    np.testing.assert_array_equal(noise, want)
    assert not np.array_equal(noise, row_noise(key, 5, 3, 37)) and not np.array_equal(noise, row_noise(key, 4, 2, 37))


def test_draw_is_categorical_of_the_filtered_scores_and_reports_the_unfiltered_log_prob():
    config = SamplingConfig(temperature=0.7, top_k=3)
    logits = jax.random.normal(jax.random.key(0), (6, 11)) * 3
    keys = [jax.random.key(i) for i in range(6)]
    noise = jnp.stack([jax.random.gumbel(k, (11,)) for k in keys])
    tokens, logps = draw(logits, noise, config, greedy=False)
    scaled = logits / 0.7
    want = [jax.random.categorical(k, filter_logits(scaled[i:i + 1], config)[0]) for i, k in enumerate(keys)]
    np.testing.assert_array_equal(tokens, want)
    np.testing.assert_allclose(logps, jax.nn.log_softmax(scaled)[np.arange(6), tokens], rtol=1e-6)
    greedy, _ = draw(logits, None, config, greedy=True)
    np.testing.assert_array_equal(greedy, jnp.argmax(logits, -1))
