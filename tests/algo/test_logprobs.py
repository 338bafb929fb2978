"""completion_logps tests: naive per-row/per-position reference, temperature, entropy, chunking, gradients."""

import dataclasses
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.algo import logprobs
from grpo_jax.algo.logprobs import completion_logps
from grpo_jax.algo.trajectory import packed_length
from grpo_jax.models import forward, init_model, model_config, unembed

PROMPT_IDS = np.array([[0, 0, 0, 5, 7, 9], [0, 3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8], [0, 0, 0, 0, 0, 6]], np.int32)
PROMPT_MASK = (np.arange(6)[None] >= np.array([[3], [1], [0], [5]])).astype(np.int32)
COMPLETION_IDS = np.array([[4, 2, 9, 0, 0], [1, 1, 30, 2, 17], [3, 0, 0, 0, 0], [8, 31, 6, 6, 0]], np.int32)
COMPLETION_MASK = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]], np.int32)


@jax.jit
def _row_logits(graphdef, params, ids_1xL):
    positions = jnp.arange(ids_1xL.shape[1])[None]
    hidden, _ = forward(graphdef, params, ids_1xL, positions, jnp.ones_like(ids_1xL))
    return unembed(graphdef, params, hidden)[0]


def naive(graphdef, params, temperature, prompt_ids=PROMPT_IDS, prompt_mask=PROMPT_MASK,
          completion_ids=COMPLETION_IDS, completion_mask=COMPLETION_MASK):
    """Per row: unpadded forward of real prompt ++ real completion; float64 log-softmax per position."""
    logps, entropy = np.zeros(completion_ids.shape), np.zeros(completion_ids.shape)
    for b in range(len(prompt_ids)):
        prompt = prompt_ids[b][prompt_mask[b] == 1]
        completion = completion_ids[b][completion_mask[b] == 1]
        logits = np.asarray(_row_logits(graphdef, params, np.concatenate([prompt, completion])[None]), np.float64)
        for t, token in enumerate(completion):
            z = logits[len(prompt) - 1 + t] / temperature
            logp = z - z.max() - np.log(np.sum(np.exp(z - z.max())))
            logps[b, t] = logp[token]
            entropy[b, t] = -np.sum(np.exp(logp) * logp)
    return logps, entropy


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_matches_naive_reference(tiny_model, temperature):
    _, graphdef, params = tiny_model
    logps, entropy = completion_logps(graphdef, params, PROMPT_IDS, PROMPT_MASK, COMPLETION_IDS, COMPLETION_MASK,
                                      temperature=temperature, with_entropy=True)
    assert logps.dtype == entropy.dtype == jnp.float32
    assert np.all(np.isfinite(logps)) and np.all(np.isfinite(entropy))
    ref_logps, ref_entropy = naive(graphdef, params, temperature)
    mask = COMPLETION_MASK == 1
    np.testing.assert_allclose(np.asarray(logps)[mask], ref_logps[mask], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(entropy)[mask], ref_entropy[mask], atol=1e-5, rtol=1e-5)


def test_temperature_sharpens(tiny_model):
    # exact values per temperature are checked against the naive reference above; here: lower tau, lower entropy
    _, graphdef, params = tiny_model
    args = (graphdef, params, PROMPT_IDS, PROMPT_MASK, COMPLETION_IDS, COMPLETION_MASK)
    one, ent_one = completion_logps(*args, temperature=1.0, with_entropy=True)
    half, ent_half = completion_logps(*args, temperature=0.5, with_entropy=True)
    mask = COMPLETION_MASK == 1
    assert not np.allclose(np.asarray(one)[mask], np.asarray(half)[mask])
    assert np.all(np.asarray(ent_half)[mask] < np.asarray(ent_one)[mask])


def test_without_entropy_returns_none(tiny_model):
    _, graphdef, params = tiny_model
    _, entropy = completion_logps(graphdef, params, PROMPT_IDS, PROMPT_MASK, COMPLETION_IDS, COMPLETION_MASK,
                                  temperature=1.0)
    assert entropy is None


@pytest.mark.parametrize("chunk_size", [1, 3, 4])
def test_chunked_equals_unchunked_values_and_gradients(tiny_model, chunk_size):
    _, graphdef, params = tiny_model
    g_full = _assert_chunked_equals_unchunked(graphdef, params, chunk_size, seed=0)
    assert any(np.abs(np.asarray(g)).max() > 0 for g in jax.tree.leaves(g_full))


def _assert_chunked_equals_unchunked(graphdef, params, chunk_size, seed):
    """Log-probs, entropies, a weighted objective and its gradients at ``chunk_size`` against the unchunked pass;
    returns the unchunked gradients."""
    weights = jnp.asarray(np.random.default_rng(seed).normal(size=COMPLETION_IDS.shape), jnp.float32)

    def objective(p, chunk):
        logps, entropy = completion_logps(graphdef, p, PROMPT_IDS, PROMPT_MASK, COMPLETION_IDS, COMPLETION_MASK,
                                          temperature=0.7, with_entropy=True, chunk_size=chunk)
        return jnp.sum((logps + 0.1 * entropy) * weights * COMPLETION_MASK), (logps, entropy)

    grad_fn = jax.jit(jax.value_and_grad(objective, has_aux=True), static_argnums=1)
    (full, (logps, entropy)), g_full = grad_fn(params, 0)
    (chunked, (logps_c, entropy_c)), g_chunked = grad_fn(params, chunk_size)
    np.testing.assert_allclose(logps_c, logps, atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(entropy_c, entropy, atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(chunked, full, atol=1e-5, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g_chunked), jax.tree.leaves(g_full)):
        # the chunked scan sums row contributions in another order: float32 rounding scales with the
        # largest entry of the leaf (tied embedding gradients reach ~10), not with each element
        np.testing.assert_allclose(a, b, atol=1e-5 * max(1.0, float(np.abs(b).max())), rtol=1e-5)
    return g_full


# two groups of two rows: rows 0, 1 share prompt row 1 (one pad), rows 2, 3 prompt row 3 (five pads)
GROUPED = (PROMPT_IDS[[1, 1, 3, 3]], PROMPT_MASK[[1, 1, 3, 3]], COMPLETION_IDS, COMPLETION_MASK)


@pytest.mark.parametrize("window", [None, 2])
def test_shared_prompt_forward_matches_naive_reference(tiny_model, window):
    """With a sliding window too: the window counts tokens, not the prefix's hidden last slot."""
    config, graphdef, params = tiny_model
    if window is not None:
        graphdef, params = init_model(dataclasses.replace(config, model_type="mistral", sliding_window=window), 0)
    logps, entropy = completion_logps(graphdef, params, *GROUPED, temperature=0.8, with_entropy=True,
                                      prompt_group_size=2)
    ref_logps, ref_entropy = naive(graphdef, params, 0.8, *GROUPED)
    mask = COMPLETION_MASK == 1
    np.testing.assert_allclose(np.asarray(logps)[mask], ref_logps[mask], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(entropy)[mask], ref_entropy[mask], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk_size", [0, 3])
def test_shared_prompt_forward_gradients_equal_per_row(tiny_model, chunk_size):
    _, graphdef, params = tiny_model
    weights = jnp.asarray(np.random.default_rng(2).normal(size=COMPLETION_IDS.shape), jnp.float32)

    def objective(p, group):
        logps, entropy = completion_logps(graphdef, p, *GROUPED, temperature=0.7, with_entropy=True,
                                          chunk_size=chunk_size, prompt_group_size=group)
        return jnp.sum((logps + 0.1 * entropy) * weights * COMPLETION_MASK)

    grad_fn = jax.jit(jax.value_and_grad(objective), static_argnums=1)
    (per_row, g_per_row), (shared, g_shared) = grad_fn(params, 1), grad_fn(params, 2)
    np.testing.assert_allclose(shared, per_row, atol=1e-5, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g_shared), jax.tree.leaves(g_per_row)):
        # the group's prompt gradient is one sum of two rows' terms instead of two: rounding scales with the leaf
        np.testing.assert_allclose(a, b, atol=1e-5 * max(1.0, float(np.abs(b).max())), rtol=1e-5)
    assert any(np.abs(np.asarray(g)).max() > 0 for g in jax.tree.leaves(g_per_row))


def test_prompt_group_size_must_divide_the_rows(tiny_model):
    _, graphdef, params = tiny_model
    with pytest.raises(ValueError, match="prompt_group_size=3 must be a positive integer dividing the 4 rows"):
        completion_logps(graphdef, params, *GROUPED, temperature=1.0, prompt_group_size=3)


def test_gradient_matches_finite_difference(tiny_model):
    # d/d(norm weight) of the masked log-prob sum, central differences in float32
    _, graphdef, params = tiny_model

    def total(p):
        logps, _ = completion_logps(graphdef, p, PROMPT_IDS, PROMPT_MASK, COMPLETION_IDS, COMPLETION_MASK,
                                    temperature=1.0)
        return jnp.sum(logps * COMPLETION_MASK)

    grad = jax.jit(jax.grad(total))(params)
    direction = jax.tree.map(lambda x: jnp.zeros_like(x), params)
    direction["norm"]["weight"][...] = jnp.asarray(np.random.default_rng(1).normal(size=32), jnp.float32)
    eps = 1e-2
    plus = jax.tree.map(lambda x, d: x + eps * d, params, direction)
    minus = jax.tree.map(lambda x, d: x - eps * d, params, direction)
    fd = (float(jax.jit(total)(plus)) - float(jax.jit(total)(minus))) / (2 * eps)
    analytic = float(jnp.vdot(grad["norm"]["weight"][...], direction["norm"]["weight"][...]))
    np.testing.assert_allclose(analytic, fd, rtol=1e-3, atol=1e-3)


def test_chunked_backward_never_holds_the_whole_batch_logits():
    # compiled buffer assignment, not timing: the float32 [B, T, V] logits (and their softmax) are the biggest
    # temporaries unchunked; chunked (and rematerialised per chunk in the backward pass) only one row's exist
    from grpo_jax.models import ModelConfig, init_model
    B, P, T, V = 32, 4, 16, 4096
    graphdef, params = init_model(ModelConfig(vocab_size=V, hidden_size=16, intermediate_size=32,
                                              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1), 0)
    ids = jnp.zeros((B, P), jnp.int32), jnp.ones((B, P), jnp.int32), jnp.zeros((B, T), jnp.int32)
    mask = jnp.ones((B, T), jnp.int32)

    def temp_bytes(chunk):
        def objective(p):
            logps, entropy = completion_logps(graphdef, p, *ids, mask, temperature=1.0, with_entropy=True,
                                              chunk_size=chunk)
            return jnp.sum(logps + entropy)
        return jax.jit(jax.grad(objective)).lower(params).compile().memory_analysis().temp_size_in_bytes

    logits_bytes = B * T * V * 4
    assert temp_bytes(0) > logits_bytes
    # the rest: one row's logits and its softmax, plus the decoder's activations (~40 KB a row vs 256 KB of logits)
    assert temp_bytes(1) < logits_bytes / 2


@pytest.mark.parametrize("group, buffers", [(1, 0), (2, 0), (1, 1), (1, 2), (2, 1)])
def test_packed_forward_matches_naive_reference(tiny_model, group, buffers):
    # a completion masked away entirely (row 2 keeps 1 token; zero it) sits in its buffer as an empty branch;
    # buffers > 0 hold several groups one after another
    _, graphdef, params = tiny_model
    mask = COMPLETION_MASK.copy()
    mask[2] = 0
    rows = (*GROUPED[:3], mask)
    length = packed_length(np.sum(rows[1], 1), np.sum(mask, 1), group, buffers)
    assert length < rows[0].shape[1] * (4 // group) + mask.size  # shorter than the padded rows
    logps, entropy = completion_logps(graphdef, params, *rows, temperature=0.8, with_entropy=True,
                                      prompt_group_size=group, packed_length=length, packed_buffers=buffers)
    ref_logps, ref_entropy = naive(graphdef, params, 0.8, *rows)
    real = mask == 1
    np.testing.assert_allclose(np.asarray(logps)[real], ref_logps[real], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(entropy)[real], ref_entropy[real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group, chunk_size, buffers", [(1, 0, 0), (2, 0, 0), (2, 3, 0), (2, 3, 1), (1, 0, 2)])
def test_packed_forward_gradients_equal_the_padded_ones(tiny_model, group, chunk_size, buffers):
    _, graphdef, params = tiny_model
    weights = jnp.asarray(np.random.default_rng(2).normal(size=COMPLETION_IDS.shape), jnp.float32)

    def objective(p, length):
        logps, entropy = completion_logps(graphdef, p, *GROUPED, temperature=0.7, with_entropy=True,
                                          chunk_size=chunk_size, prompt_group_size=group, packed_length=length,
                                          packed_buffers=buffers)
        return jnp.sum((logps + 0.1 * entropy) * weights * COMPLETION_MASK)

    grad_fn = jax.jit(jax.value_and_grad(objective), static_argnums=1)
    (padded, g_padded), (packed, g_packed) = grad_fn(params, 0), grad_fn(params, packed_length(
        np.sum(GROUPED[1], 1), np.sum(COMPLETION_MASK, 1), group, buffers))
    np.testing.assert_allclose(packed, padded, atol=1e-5, rtol=1e-6)
    # float32 rounding at each leaf's scale: the packed sums run in another order (AVX-512 rounds them apart more)
    for a, b in zip(jax.tree.leaves(g_packed), jax.tree.leaves(g_padded)):
        np.testing.assert_allclose(a, b, atol=1e-5 * max(1.0, float(np.abs(b).max())), rtol=1e-5)


def test_packed_logps_apply_the_vocabulary_to_the_buffers_slots_not_the_padded_rows():
    # compiled buffer assignment: 2 groups of 4 short completions pack into 2 buffers of 16 slots, so no
    # float32 logits of the [B, T, V] padded rows may exist, in the forward or the backward pass
    from grpo_jax.models import ModelConfig, init_model
    B, G, P, T, V = 8, 4, 4, 64, 4096
    graphdef, params = init_model(ModelConfig(vocab_size=V, hidden_size=16, intermediate_size=32,
                                              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1), 0)
    prompt_mask = jnp.ones((B, P), jnp.int32)
    mask = (jnp.arange(T)[None] < 2).astype(jnp.int32) * jnp.ones((B, 1), jnp.int32)
    ids = jnp.zeros((B, P), jnp.int32), prompt_mask, jnp.zeros((B, T), jnp.int32)
    length = packed_length(np.sum(prompt_mask, 1), np.sum(mask, 1), G)
    assert length == 16

    def temp_bytes(packed):
        def objective(p):
            logps, entropy = completion_logps(graphdef, p, *ids, mask, temperature=1.0, with_entropy=True,
                                              prompt_group_size=G, packed_length=packed)
            return jnp.sum((logps + entropy) * mask)
        return jax.jit(jax.grad(objective)).lower(params).compile().memory_analysis().temp_size_in_bytes

    logits_bytes = B * T * V * 4
    assert temp_bytes(0) > logits_bytes  # the padded layout holds them (and their softmax)
    assert temp_bytes(length) < logits_bytes / 2  # 32 slots' logits of 512 (4x the logits before: 33.6 MB)


def test_packed_length_is_the_longest_group_rounded_to_four_steps_an_octave():
    prompt_mask = np.repeat(PROMPT_MASK[[1, 3]], 2, axis=0)  # 5 and 1 real prompt tokens
    # a buffer: the prompt less its last token, then per row that token and the completion:
    # groups (5 - 1) + 2 + 3 + 5 = 14 and (1 - 1) + 2 + 1 + 4 = 7 -> 14, at least 16
    assert packed_length(np.sum(prompt_mask, 1), np.sum(COMPLETION_MASK, 1), 2) == 16
    assert packed_length(np.sum(prompt_mask, 1), np.sum(COMPLETION_MASK, 1), 1) == 16  # rows alone: 10 at most
    # both groups in one buffer: 14 + 7 = 21 slots, steps of 4 between 16 and 32
    assert packed_length(np.sum(prompt_mask, 1), np.sum(COMPLETION_MASK, 1), 2, buffers=1) == 24
    wide = np.ones((2, 300), np.int32)
    assert packed_length(wide[:, 0], wide.sum(1), 2) == 640  # 602 slots: steps of 128 between 512 and 1024
    assert packed_length(wide[:, 0], wide[:, :255].sum(1), 1) == 256
    assert packed_length(np.array([1]), np.array([1024]), 1) == 1280  # 1025 slots: steps of 256 past 1024
    assert packed_length(np.zeros(0), np.zeros(0), 1) == 0


@pytest.mark.parametrize("chunk_size", [1, 3])
def test_long_rows_in_pieces_equal_unchunked_values_and_gradients(tiny_model, chunk_size, monkeypatch):
    """A chunk whose float32 logits pass LOGITS_PIECE_BYTES runs its rows in pieces of slots (here 2 of a row's
    slots, which do not divide it): the same log-probs, entropies and gradients as the whole batch at once."""
    from grpo_jax.algo import logprobs
    _, graphdef, params = tiny_model
    V, C = model_config(graphdef, params).vocab_size, COMPLETION_IDS.shape[1]
    monkeypatch.setattr(logprobs, "LOGITS_PIECE_BYTES", 2 * chunk_size * V * 4)
    assert logprobs._slots_per_piece(C, chunk_size * V) == 2 and C % 2
    _assert_chunked_equals_unchunked(graphdef, params, chunk_size, seed=3)


def test_long_rows_in_pieces_never_hold_a_whole_rows_logits(monkeypatch):
    """Compiled buffer assignment: chunk 1 holds several copies of one row's float32 logits (logits, softmax,
    their gradients); in pieces of 8 of its 64 slots, under one copy (the rest: the [V, D] weight gradients)."""
    from grpo_jax.algo import logprobs
    from grpo_jax.models import ModelConfig, init_model
    B, P, T, V = 2, 4, 64, 8192
    graphdef, params = init_model(ModelConfig(vocab_size=V, hidden_size=16, intermediate_size=32,
                                              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1), 0)
    ids = jnp.zeros((B, P), jnp.int32), jnp.ones((B, P), jnp.int32), jnp.zeros((B, T), jnp.int32)
    mask = jnp.ones((B, T), jnp.int32)

    def temp_bytes():
        def objective(p):
            logps, entropy = completion_logps(graphdef, p, *ids, mask, temperature=1.0, with_entropy=True,
                                              chunk_size=1)
            return jnp.sum(logps + entropy)
        return jax.jit(jax.grad(objective)).lower(params).compile().memory_analysis().temp_size_in_bytes

    row_logits_bytes = T * V * 4
    whole_rows = temp_bytes()
    assert whole_rows > 3 * row_logits_bytes
    monkeypatch.setattr(logprobs, "LOGITS_PIECE_BYTES", 8 * V * 4)
    assert temp_bytes() < min(row_logits_bytes, whole_rows / 4)



@pytest.mark.parametrize("chunk_size, packed", [(0, False), (1, False), (3, True)])
def test_row_sharded_logps_program_equals_one_device(tiny_model, chunk_size, packed):
    """`programs.jit_logps` on 4 fsdp devices (rows kept split, `row_sharding`) against one device, whose program
    is `completion_logps` itself, bit for bit."""
    from grpo_jax.algo import programs
    from grpo_jax.device import sharding

    _, graphdef, params = tiny_model
    length = packed_length(PROMPT_MASK.sum(1), COMPLETION_MASK.sum(1), 1) if packed else 0
    args = (PROMPT_IDS, PROMPT_MASK, COMPLETION_IDS, COMPLETION_MASK, None, length)
    direct = jax.jit(lambda p: completion_logps(graphdef, p, *args[:4], temperature=0.7, chunk_size=chunk_size,
                                                packed_length=length)[0])(params)
    out = {}
    for fsdp in (1, 4):
        mesh = sharding.make_mesh(data=1, fsdp=fsdp, devices=jax.devices()[:fsdp])
        shardings = sharding.param_shardings(mesh, params)
        logps = programs.jit_logps(graphdef, mesh, temperature=0.7, chunk_size=chunk_size, params_sharding=shardings)
        out[fsdp] = np.asarray(logps(jax.device_put(params, shardings), *args))
    np.testing.assert_array_equal(out[1], np.asarray(direct))
    np.testing.assert_allclose(out[4] * COMPLETION_MASK, out[1] * COMPLETION_MASK, atol=1e-5, rtol=1e-5)

@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu not installed (pip install -e '.[tpu]'): no TPU topology to compile for")
@pytest.mark.parametrize("experts, B, T, bound", [(1, 32, 512, 0.5), (2, 64, 1024, 1.0)])
def test_tpu_logps_program_keeps_only_each_chips_rows(monkeypatch, experts, B, T, bound):
    """The log-prob program compiled for 16 TPU chips (dense: fsdp 16, 2 rows a chip; MoE: expert 2 x fsdp 8, 4 rows
    a chip; a logps chunk of 1 row) needs fewer temporaries than all rows' hidden states. Before, XLA split the hidden
    size like the fsdp params, and the chunks' map stepped through every shard's rows, holding every row on every
    chip: dense 56 MiB of temporaries (all rows' hidden states 36 MiB; now 5 MiB), MoE 132 MiB (128; now 84)."""
    from flax import nnx

    from grpo_jax.algo import programs
    from grpo_jax.api import plan
    from grpo_jax.device import sharding
    from grpo_jax.models import ModelConfig, Transformer

    if experts == 1:
        monkeypatch.setattr(logprobs, "LOGITS_PIECE_BYTES", 2 ** 20)  # the long-row pieces' inner map too
    P, D = 64, 1024
    moe = dict(model_type="qwen3_moe", moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2,
               norm_topk_prob=True) if experts > 1 else {}
    config = ModelConfig(vocab_size=256, hidden_size=D, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, dtype="bfloat16", param_dtype="float32", **moe)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(config, nnx.Rngs(0))))
    devices = plan.topology_devices("v5e:4x4")
    mesh = sharding.make_mesh(data=1, fsdp=len(devices) // experts, expert=experts, devices=devices)
    shardings = sharding.param_shardings(mesh, abstract)
    params = jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s), abstract, shardings)
    rows = lambda n: jax.ShapeDtypeStruct((B, n), jnp.int32, sharding=sharding.row_sharded(mesh))  # noqa: E731
    logps = programs.jit_logps(graphdef, mesh, temperature=1.0, chunk_size=1, params_sharding=shardings)
    memory = logps.lower(params, rows(P), rows(P), rows(T), rows(T), None).compile().memory_analysis()
    all_rows_hidden = B * (P + T) * D * 2  # bf16
    assert memory.temp_size_in_bytes < bound * all_rows_hidden, (memory.temp_size_in_bytes, all_rows_hidden)
