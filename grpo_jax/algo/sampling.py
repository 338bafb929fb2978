"""How one token is drawn from a row's logits: temperature, the repetition penalty and the filters (top-k, top-p,
min-p), as Hugging Face's logits processors and warpers, and the row's own Gumbel noise. The loop that draws them
is `grpo_jax.algo.decoder`.

Dimension letters: N rows drawing at once, V vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from grpo_jax.config.sections import SamplingConfig


def _top_k(scores_BxV, k: int):
    kth_Bx1 = jax.lax.top_k(scores_BxV, min(k, scores_BxV.shape[-1]))[0][..., -1:]
    return jnp.where(scores_BxV < kth_Bx1, -jnp.inf, scores_BxV)


def _top_p(scores_BxV, top_p: float, keep: int):
    # HF TopPLogitsWarper: drop the ascending-sorted tokens whose cumulative mass is <= 1 - top_p, but the last keep
    order_BxV = jnp.argsort(scores_BxV, axis=-1)
    sorted_BxV = jnp.take_along_axis(scores_BxV, order_BxV, axis=-1)
    cumulative_BxV = jnp.cumsum(jax.nn.softmax(sorted_BxV, axis=-1), axis=-1)
    remove_sorted_BxV = (cumulative_BxV <= 1 - top_p).at[..., -keep:].set(False)
    remove_BxV = jnp.put_along_axis(jnp.zeros_like(remove_sorted_BxV), order_BxV, remove_sorted_BxV,
                                    axis=-1, inplace=False)
    return jnp.where(remove_BxV, -jnp.inf, scores_BxV)


def _min_p(scores_BxV, min_p: float, keep: int):
    # HF MinPLogitsWarper: the arg-max token always survives since min_p < 1, and so do the keep most likely
    probs_BxV = jax.nn.softmax(scores_BxV, axis=-1)
    threshold_Bx1 = min_p * jnp.max(probs_BxV, axis=-1, keepdims=True)
    if keep > 1:
        threshold_Bx1 = jnp.minimum(threshold_Bx1, jax.lax.top_k(probs_BxV, keep)[0][..., -1:])
    return jnp.where(probs_BxV < threshold_Bx1, -jnp.inf, scores_BxV)


def penalize(scaled_logits_BxV, seen_BxV, penalty: float):
    """HF RepetitionPenaltyLogitsProcessor (vLLM's alike): each token the row holds (``seen_BxV``, its prompt and
    completion so far) has its score divided by ``penalty`` when positive, multiplied when negative. On logits
    divided by the temperature first: the same (a positive scale keeps the sign)."""
    penalized_BxV = jnp.where(scaled_logits_BxV < 0, scaled_logits_BxV * penalty, scaled_logits_BxV / penalty)
    return jnp.where(seen_BxV, penalized_BxV, scaled_logits_BxV)


def filter_logits(scaled_logits_BxV, config: SamplingConfig, keep: int = 1):
    """Apply top-k, then top-p, then min-p to temperature-scaled logits; removed tokens become -inf. Each keeps at
    least the ``keep`` best tokens (HF's ``min_tokens_to_keep``: a beam search keeps one more than its EOS ids)."""
    scores = scaled_logits_BxV
    if config.top_k > 0:
        scores = _top_k(scores, max(config.top_k, keep))
    if config.top_p < 1.0:
        scores = _top_p(scores, config.top_p, keep)
    if config.min_p > 0.0:
        scores = _min_p(scores, config.min_p, keep)
    return scores


def row_noise(key, row, step, vocab: int):
    """Row ``row``'s Gumbel noise [V] for its token ``step``: ``gumbel(fold_in(fold_in(key, row), step))``. A
    function of (key, row, step) alone, so a row draws the same tokens whichever rows share its decode step."""
    return jax.random.gumbel(jax.random.fold_in(jax.random.fold_in(key, row), step), (vocab,), jnp.float32)


def draw(logits_NxV, noise_NxV, config: SamplingConfig, *, greedy: bool, argmax=None, seen_NxV=None):
    """Each row's next token and its log-probability (full-vocabulary log-softmax of logits / temperature, before
    the penalty and the filters: the policy's own, as the trainer computes it): ([N] int32, [N] float32).
    Sampling takes argmax(filtered scores + noise), i.e. ``jax.random.categorical`` with the given noise;
    ``greedy`` the arg-max of the scores before the filters (``noise`` unused), both after the repetition penalty
    over ``seen_NxV`` (each row's tokens so far; None: no penalty), as transformers' generate applies it to both.
    ``argmax``: another arg-max of the last axis (`cpu.argmax_last_axis`), None: ``jnp.argmax``."""
    argmax = (lambda x: jnp.argmax(x, axis=-1)) if argmax is None else argmax  # noqa: E731
    scaled_NxV = logits_NxV.astype(jnp.float32) / config.temperature
    scores_NxV = scaled_NxV if seen_NxV is None else penalize(scaled_NxV, seen_NxV, config.repetition_penalty)
    tokens_N = argmax(scores_NxV if greedy else noise_NxV + filter_logits(scores_NxV, config)).astype(jnp.int32)
    logp_N = jnp.take_along_axis(jax.nn.log_softmax(scaled_NxV, axis=-1), tokens_N[:, None], axis=-1)[:, 0]
    return tokens_N, logp_N


__all__ = ["SamplingConfig", "draw", "filter_logits", "penalize", "row_noise"]
