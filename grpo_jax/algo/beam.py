"""Beam search: each row the best of ``sampling.num_beams`` beams, as transformers' ``generate(num_beams=n)`` finds it
(greedy: its beam search; sampling: its beam sampling), in one ``lax.while_loop``.

Dimension letters: B rows, n beams a row, C = max(2, 1 + EOS ids) * n candidates a step, P prompt tokens, T
completion tokens, V vocab.

Each row keeps n running beams and its n best finished hypotheses, as transformers' vectorised beam search does
(`GenerationMixin._beam_search`, 5.x). A step scores every beam's next tokens: the log-softmax of its logits, the
repetition penalty, and (sampling) the temperature and filters, as its logits processors do, plus the beam's score.
Of the n * V continuations it keeps the C best (sampling: C drawn without replacement from their softmax, by
Gumbel top-k with the row's own noise, `sampling.row_noise`). A continuation that ends (an EOS id, or the T-th token)
and ranks among the first n is a finished hypothesis scored (sum of log-probs) / length ** ``length_penalty``; the n
best of the rest run on, their keys and values taken from their parent beams. A row can stop improving
(``early_stopping``: transformers' heuristic, at n finished, or never); the loop ends when no row can. A row's
completion is its best finished hypothesis, EOS included, with the policy's log-probs of its tokens (full-vocabulary
log-softmax at the temperature, as the decoder records them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.algo.decoder import prefill, prompt_tokens
from grpo_jax.algo.decoding import DecodeOptions, constrain_cache
from grpo_jax.algo.sampling import filter_logits, penalize, row_noise
from grpo_jax.algo.trajectory import Trajectory
from grpo_jax.models.transformer import (compute_dtype_params, forward, layer_params, model_config, rotary_tables,
                                         unembed)

NEG = -1.0e9  # transformers' score of a beam or hypothesis that must not be chosen


def _take(x_BxMx, index_BxN):
    """x[b, index[b, i]] along axis 1, for any trailing axes."""
    return jnp.take_along_axis(x_BxMx, index_BxN.reshape(*index_BxN.shape, *([1] * (x_BxMx.ndim - 2))), axis=1)


def generate(graphdef, params, prompt_ids_BxP, prompt_mask_BxP, key, options: DecodeOptions, row_offset=0):
    """Every row's best hypothesis: (its `Trajectory`, the decode steps run). ``options.greedy``: transformers'
    beam search (no temperature or filters); else its beam sampling. Row b draws with the noise of row
    ``row_offset + b``, so its tokens do not depend on the other rows of the call."""
    config = options.sampling
    n, T = config.num_beams, config.max_completion_length
    B, P = prompt_ids_BxP.shape
    sample = not options.greedy
    params = compute_dtype_params(graphdef, params)
    layers = layer_params(graphdef, params)
    rope = rotary_tables(model_config(graphdef, params), P + T)
    prompt_kv, logits_RxV = prefill(graphdef, params, prompt_ids_BxP, prompt_mask_BxP, options.group_size)
    V = logits_RxV.shape[-1]
    C = max(2, 1 + len(options.eos_token_ids)) * n
    eos = jnp.asarray(options.eos_token_ids, jnp.int32)
    row_offset = jnp.asarray(row_offset, jnp.int32)
    # [l - 1]: length l ** length_penalty for l = 1 .. T, rounded once from float64 as transformers' Python scalars are
    length_pow = jnp.asarray(np.arange(1, T + 1, dtype=np.float64) ** float(config.length_penalty), jnp.float32)
    prompt_len_Bn = jnp.repeat(jnp.sum(prompt_mask_BxP, axis=1, dtype=jnp.int32), n)
    cache = constrain_cache(jax.tree.map(lambda x_RxKxPxDh: jnp.zeros(
        (B * n, x_RxKxPxDh.shape[1], P + T, x_RxKxPxDh.shape[3]), x_RxKxPxDh.dtype).at[:, :, :P].set(
            jnp.repeat(x_RxKxPxDh, options.group_size * n, axis=0)), prompt_kv), options)
    prompt_mask_BnxP = jnp.repeat(prompt_mask_BxP, n, axis=0).astype(jnp.int32)
    seen = prompt_tokens(jnp.repeat(prompt_ids_BxP, n, axis=0), jnp.repeat(prompt_mask_BxP, n, axis=0), V, options)
    tokens = jnp.full((B, n, T), options.pad_token_id, jnp.int32)
    logps = jnp.zeros((B, n, T), jnp.float32)
    state = dict(
        t=jnp.zeros((), jnp.int32), cache=cache, seen=seen,
        logits=jnp.repeat(logits_RxV, options.group_size * n, axis=0),
        # the first beam alone at 0: the others would only repeat its continuations
        running=(tokens, logps, jnp.zeros((B, n), jnp.float32).at[:, 1:].set(NEG)),
        finished=(tokens, logps, jnp.full((B, n), NEG, jnp.float32), jnp.zeros((B, n), jnp.int32),
                  jnp.zeros((B, n), bool), jnp.zeros((B, n), bool)),
        improvable=jnp.ones((B,), bool), done=jnp.zeros((), bool))

    def body(s):
        t = s["t"]
        logits_BnxV = s["logits"].astype(jnp.float32)
        policy_BnxV = jax.nn.log_softmax(logits_BnxV / config.temperature, axis=-1)  # the policy's, recorded
        scores_BnxV = jax.nn.log_softmax(logits_BnxV, axis=-1)
        if s["seen"] is not None:
            scores_BnxV = penalize(scores_BnxV, s["seen"], config.repetition_penalty)
        if sample:
            scores_BnxV = filter_logits(scores_BnxV / config.temperature, config, keep=C // n)  # HF keeps 1 + EOS ids
        run_tokens, run_logps, run_scores = s["running"]
        total_BxnV = (scores_BnxV.reshape(B, n, V) + run_scores[:, :, None]).reshape(B, n * V)
        if sample:  # C continuations without replacement from softmax(total), best first
            noise_BxnV = jax.vmap(lambda b: row_noise(key, row_offset + b, t, n * V))(jnp.arange(B))
            index_BxC = jax.lax.top_k(total_BxnV + noise_BxnV, C)[1]
            total_BxC = jnp.take_along_axis(total_BxnV, index_BxC, axis=1)
            order_BxC = jnp.argsort(-total_BxC, axis=1, stable=True)
            total_BxC, index_BxC = (jnp.take_along_axis(x, order_BxC, axis=1) for x in (total_BxC, index_BxC))
        else:
            total_BxC, index_BxC = jax.lax.top_k(total_BxnV, C)
        parent_BxC, token_BxC = index_BxC // V, index_BxC % V
        token_logp_BxC = jnp.take_along_axis(policy_BnxV.reshape(B, n * V), index_BxC, axis=1)
        cand_tokens = _take(run_tokens, parent_BxC).at[:, :, t].set(token_BxC)
        cand_logps = _take(run_logps, parent_BxC).at[:, :, t].set(token_logp_BxC)
        at_eos_BxC = jnp.isin(token_BxC, eos)
        ends_BxC = at_eos_BxC | (t == T - 1)

        # the n best that go on: their tokens, scores and parents
        going_BxC = total_BxC + ends_BxC.astype(jnp.float32) * NEG
        next_Bxn = jax.lax.top_k(going_BxC, n)[1]
        running = (_take(cand_tokens, next_Bxn), _take(cand_logps, next_Bxn), _take(going_BxC, next_Bxn))
        parent_Bxn = _take(parent_BxC, next_Bxn)

        # the hypotheses that ended among the first n join the finished ones if they score higher
        fin_tokens, fin_logps, fin_scores, fin_len, fin_eos, is_fin = s["finished"]
        just_BxC = ends_BxC & (jnp.arange(C) < n)[None]
        score_BxC = total_BxC / length_pow[t]
        if config.early_stopping is True:
            score_BxC += jnp.all(is_fin, axis=1, keepdims=True).astype(jnp.float32) * NEG
        score_BxC += (~s["improvable"])[:, None].astype(jnp.float32) * NEG
        score_BxC += (~just_BxC).astype(jnp.float32) * NEG
        merged = tuple(jnp.concatenate(x, axis=1) for x in (
            (fin_tokens, cand_tokens), (fin_logps, cand_logps), (fin_scores, score_BxC),
            (fin_len, jnp.broadcast_to(t + 1, (B, C))), (fin_eos, at_eos_BxC), (is_fin, just_BxC)))
        keep_Bxn = jax.lax.top_k(merged[2], n)[1]
        finished = tuple(_take(x, keep_Bxn) for x in merged)

        # can a running beam still beat the worst finished hypothesis? (transformers' heuristic; "never" with a
        # positive penalty assumes the longest completion)
        best_len = T if (config.early_stopping == "never" and config.length_penalty > 0) else t + 1
        best_B = running[2][:, 0] / length_pow[best_len - 1]
        is_fin = finished[5]
        worst_Bxn = jnp.where(is_fin, jnp.min(finished[2], axis=1, keepdims=True), NEG)
        improvable = s["improvable"] & jnp.any(best_B[:, None] > worst_Bxn, axis=1)
        done = ~jnp.any(improvable) | jnp.all(ends_BxC)  # the T-th token ends every candidate
        if config.early_stopping is True:
            done |= jnp.all(is_fin)

        # the beams that go on take their parents' keys, values and seen tokens, then feed their new token
        def regroup(x_Bnx):
            x_Bxnx = x_Bnx.reshape(B, n, *x_Bnx.shape[1:])
            return _take(x_Bxnx, parent_Bxn).reshape(x_Bnx.shape)
        token_Bn = running[0][:, :, t].reshape(B * n)
        seen = None if s["seen"] is None else regroup(s["seen"]).at[jnp.arange(B * n), token_Bn].set(True)
        # every beam of a row holds its prompt and t + 1 completion tokens: the same mask, nothing to regroup
        cache_mask = jnp.concatenate([prompt_mask_BnxP, jnp.broadcast_to(
            (jnp.arange(T) <= t).astype(jnp.int32), (B * n, T))], axis=1)

        def feed(cache):
            hidden_Bnx1xD, cache = forward(graphdef, params, token_Bn[:, None], (prompt_len_Bn + t)[:, None],
                                           cache_mask, jax.tree.map(regroup, cache), P + t, layers=layers, rope=rope)
            return unembed(graphdef, params, hidden_Bnx1xD)[:, 0].astype(s["logits"].dtype), cache

        # the last step's tokens are never fed back
        logits, cache = jax.lax.cond(done, lambda c: (s["logits"], c), feed, s["cache"])
        return dict(t=t + 1, cache=constrain_cache(cache, options), seen=seen, logits=logits,
                    running=running, finished=finished, improvable=improvable, done=done)

    s = jax.lax.while_loop(lambda s: ~s["done"], body, state)
    fin_tokens, fin_logps, _, fin_len, fin_eos, _ = s["finished"]
    length_B = fin_len[:, 0]
    mask_BxT = (jnp.arange(T)[None] < length_B[:, None]).astype(jnp.int32)
    rows = Trajectory(prompt_ids=prompt_ids_BxP, prompt_mask=prompt_mask_BxP,
                      completion_ids=jnp.where(mask_BxT == 1, fin_tokens[:, 0], options.pad_token_id),
                      completion_mask=mask_BxT, loss_mask=mask_BxT, sampler_per_token_logps=fin_logps[:, 0] * mask_BxT,
                      turns=jnp.where(mask_BxT == 1, 0, -1), is_truncated=~fin_eos[:, 0])
    return rows, s["t"]
