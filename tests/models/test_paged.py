"""The paged KV cache (`grpo_jax.models.paged`): decoding through it draws the contiguous cache's tokens and
log-probs bit for bit (static batch, continuous batching, rows that pause for appended tokens); pages are taken and
given back as rows grow and end; the decode kernel (Pallas, interpret mode) equals the dense path; and the sizing.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.algo import decoder
from grpo_jax.models import attention, paged
from tests.algo.test_decoder import PROMPT_IDS, PROMPT_MASK, _late_appends, make_decoder


def _generate(model, options, key=3):
    _, graphdef, params = model
    d = decoder.start(graphdef, params, PROMPT_IDS, PROMPT_MASK, jax.random.key(key), options)
    return jax.device_get(jax.jit(decoder.advance, static_argnums=3)(graphdef, params, d, options))


def assert_pages_accounted(d):
    """In each row shard every page held belongs to one of its slots and is not free; every other page is free."""
    shards, pages = d.page_free.shape
    for free, table in zip(d.page_free, d.cache.pages_NxQ.reshape(shards, -1)):
        held = table[table < pages]
        assert len(set(held.tolist())) == len(held) and not free[held].any()
        assert free.sum() + len(held) == pages


def _assert_same(a, b):
    for x, y in ((a.tokens, b.tokens), (a.logps, b.logps), (a.sampled, b.sampled), (a.length, b.length)):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("slots, group, eos", [(4, 1, (-1,)), (2, 1, (2, 5)), (3, 2, (2, 5)), (2, 4, (5,)),
                                               (1, 4, (5,))])
def test_paged_decoding_equals_the_contiguous_cache_bit_for_bit(tiny_model, slots, group, eos):
    """Tokens, sampler log-probs and lengths equal the contiguous cache's, for a static batch and for fewer slots
    than rows (slots reassigned as rows end, their pages given back and taken again); page size 4 does not divide
    the 6 + 10 slots of a row. One slot: XLA:CPU compiles the one-row program's dots differently (log-probs within
    an ulp or two; the tokens the same)."""
    base = dataclasses.replace(make_decoder(tiny_model, eos=eos, group=group, max_completion_length=10)
                               .options(4, 4, False), num_slots=slots, group_size=group)
    want = _generate(tiny_model, base)
    got = _generate(tiny_model, dataclasses.replace(base, page_size=4))
    if slots == 1:
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_allclose(got.logps, want.logps, rtol=1e-6, atol=1e-6)
    else:
        _assert_same(got, want)
    assert isinstance(got.cache, paged.PagedKVCache) and want.length.max() > 4
    assert_pages_accounted(got)


def test_paused_rows_with_appended_tokens_equal_the_contiguous_cache(tiny_model):
    """Multi-turn rows (pause at EOS, tokens appended late, rows retired): a slot each (the row keeps its slot,
    the appended tokens run into its pages) and 2 slots (a paused row gives its slot and pages up and is run again
    into fresh pages when admitted again): the contiguous cache's tokens and loss mask bit for bit, log-probs
    within a few ulps (XLA:CPU may round the same dots differently in the two programs: 2.4e-7 seen at log-prob 2.7)."""
    want = {slots: _late_appends(tiny_model, slots, 1) for slots in (4, 2)}
    for slots in (4, 2):
        got = _late_appends(tiny_model, slots, 1, page_size=4)
        assert np.any(got.turns == 1)
        np.testing.assert_array_equal(got.completion_ids, want[slots].completion_ids)
        np.testing.assert_array_equal(got.loss_mask, want[slots].loss_mask)
        np.testing.assert_allclose(got.sampler_per_token_logps, want[slots].sampler_per_token_logps, atol=3e-7)


@pytest.mark.parametrize("G, Q, softcap", [(2, 4, None), (7, 8, 1.5)])
def test_decode_kernel_in_interpret_mode_equals_the_dense_path(G, Q, softcap):
    """The GPU Pallas paged-attention kernel (interpret mode: its pages split over `attention.K_SPLITS`
    partitions, some past a row's length) over scattered pages, rows of 1, 5 and 16 tokens (pages past a row's
    length missing), equals dense attention over the same tokens gathered in order; 7 query heads per key/value
    head (Qwen2.5-7B's) pad to the kernel's head block; a soft cap (Gemma 2) bends the scores alike."""
    B, K, Dh, ps = 3, 2, 16, 4
    pages = B * Q + 2
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    k_pool = jax.random.normal(k1, (K, pages, ps, Dh))
    v_pool = jax.random.normal(k2, (K, pages, ps, Dh))
    q = jax.random.normal(k3, (B, 1, K, G, Dh))
    length = jnp.array([5, 16, 1], jnp.int32)
    order = np.random.RandomState(0).permutation(pages)[:B * Q].reshape(B, Q)
    table = jnp.where(jnp.arange(Q)[None] < -(-length[:, None] // ps), jnp.asarray(order), pages)
    got = attention.paged_decode(q, k_pool, v_pool, table, length, scale=0.25, softcap=softcap, backend="cudnn",
                                 interpret=True)
    position = jnp.broadcast_to(jnp.arange(Q * ps)[None], (B, Q * ps))
    keys, values = paged.gather(k_pool, table, position), paged.gather(v_pool, table, position)
    want = attention.dense(q, keys, values, (jnp.arange(Q * ps)[None] < length[:, None])[:, None], 0.25, softcap)
    np.testing.assert_allclose(got, want, atol=2e-6)


def test_pool_sizing_and_refusal():
    """The default pool holds every slot's whole row (a larger one is cut to it); one below a single row is refused
    naming the key; the bytes are 2 x layers x K x Dh x bytes per token held (hand count). The 7B-like shape
    (28 layers, 4 KV heads, Dh 128, bf16, 1k prompt, 15k completion, 16 rows of one prompt, mean completion 5k):
    the contiguous cache holds 16 whole rows; a pool of the live tokens 16 x (1k + 5k)."""
    assert paged.num_pages(0, 16, 1024, 15360, 16) == 16 * 1024
    assert paged.num_pages(10 ** 9, 16, 1024, 15360, 16) == 16 * 1024
    assert paged.num_pages(16 * 6144, 16, 1024, 15360, 16) == 6144
    with pytest.raises(ValueError, match="sampling.kv_cache_tokens"):
        paged.num_pages(16000, 16, 1024, 15360, 16)
    shape = dict(layers=28, kv_heads=4, head_dim=128, dtype_bytes=2, slots=16, prompt_length=1024,
                 completion_length=15360)
    per_token = 28 * 2 * 4 * 128 * 2
    before = paged.cache_bytes(**shape)
    assert before == (1024 + 16 * 16384) * per_token
    assert paged.cache_bytes(**shape, page_size=16) == before
    after = paged.cache_bytes(**shape, page_size=16, kv_cache_tokens=16 * (1024 + 5120))
    assert after == (1024 + 16 * 6144) * per_token
    print(f"7B-like decode KV cache: contiguous {before / 2**30:.2f} GiB, paged pool of live tokens "
          f"{after / 2**30:.2f} GiB")


@pytest.mark.parametrize("slots, tokens", [(4, 16), (4, 28), (2, 20)])
def test_a_small_pool_makes_rows_wait_and_preempts_them_without_changing_their_tokens(tiny_model, slots, tokens):
    """A pool of one or two rows' pages for 4 rows of 6 + 10 tokens: rows wait for pages to be admitted and the
    youngest live rows are preempted (pages given back) and run again in one pass when pages free up; every row
    still ends with the contiguous cache's tokens (log-probs within the recompute's float rounding), nothing
    deadlocks, and every page is back or held by one slot at the end."""
    base = dataclasses.replace(make_decoder(tiny_model, eos=(5,), max_completion_length=10).options(4, 4, False),
                               num_slots=slots)
    want = _generate(tiny_model, base)
    got = _generate(tiny_model, dataclasses.replace(base, page_size=4, kv_cache_tokens=tokens))
    assert got.page_free.shape == (1, tokens // 4) and got.preempted > 0
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.length, want.length)
    np.testing.assert_allclose(got.logps, want.logps, atol=1e-5)
    assert_pages_accounted(got)


def test_decoding_through_the_kernel_draws_the_dense_paths_tokens(tiny_model_config, monkeypatch):
    """A whole decode whose steps run the paged-attention kernel (``model.attention`` splash_interpret: the GPU
    Pallas kernel in interpret mode) draws the contiguous dense cache's tokens, log-probs within float rounding:
    the kernel reads each row's real tokens [0, length) where the dense path reads the left-padded slots."""
    from grpo_jax.models import init_model
    config = dataclasses.replace(tiny_model_config, attention="splash_interpret")
    graphdef, params = init_model(config, seed=0)
    model = (config, graphdef, params)
    dense_graphdef, dense_params = init_model(tiny_model_config, seed=0)
    base = dataclasses.replace(make_decoder(model, eos=(2, 5), max_completion_length=10).options(4, 4, False),
                               num_slots=3)
    want = _generate((tiny_model_config, dense_graphdef, dense_params), base)
    traced = []
    kernel = attention.paged_decode
    monkeypatch.setattr(attention, "paged_decode", lambda *a, **kw: traced.append(kw["backend"]) or kernel(*a, **kw))
    got = _generate(model, dataclasses.replace(base, page_size=4))
    assert traced == ["splash_interpret"] * tiny_model_config.num_hidden_layers  # every layer's decode step
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.logps, want.logps, atol=1e-5)


def test_tpu_decode_kernel_compiles_for_a_tpu_chip():
    """The TPU Pallas paged-attention kernel (``splash``) has no interpret mode: it is compiled here for a v5e chip
    with the pools, page table and lengths as `paged_decode` maps them (shapes, dtypes, page blocks accepted by
    Mosaic; its values stay unmeasured without a TPU), its output [N, K, G, 1, Dh]."""
    from tests.models.test_attention import _tpu_devices
    device = _tpu_devices()[0]
    N, K, G, Dh, ps, Q = 8, 2, 4, 128, 16, 64
    on_chip = jax.sharding.SingleDeviceSharding(device)
    shapes = [((N, 1, K, G, Dh), jnp.bfloat16), ((K, N * Q, ps, Dh), jnp.bfloat16),
              ((K, N * Q, ps, Dh), jnp.bfloat16), ((N, Q), jnp.int32), ((N,), jnp.int32)]
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=on_chip) for shape, dtype in shapes]

    def kernel(q, k, v, table, length):
        return attention.paged_decode(q, k, v, table, length, scale=Dh ** -0.5, softcap=None, backend="splash")

    lowered = jax.jit(kernel).lower(*args)
    assert "tpu_custom_call" in lowered.as_text()
    compiled = lowered.compile()
    assert compiled.out_info.shape == (N, K, G, 1, Dh)
    print(f"v5e paged decode kernel temporaries: {compiled.memory_analysis().temp_size_in_bytes} bytes")


def test_the_runs_decoding_programs_take_the_cache_from_config(tiny_model):
    """``sampling.kv_cache``: the run's jitted decoder (`programs.jit_decoder`) pages with ``paged`` and gives the
    contiguous cache's rows bit for bit; ``auto`` keeps the contiguous cache on this CPU mesh."""
    from grpo_jax.algo import programs
    from tests.algo.test_decoder import one_device, run
    from grpo_jax.algo.sampling import SamplingConfig
    assert programs.paged_page_size(SamplingConfig(), one_device()) == 0
    assert programs.paged_page_size(SamplingConfig(kv_cache="paged", kv_page_size=8), one_device()) == 8
    want, got = run(tiny_model), run(tiny_model, kv_cache="paged", kv_page_size=4)
    for field in ("completion_ids", "completion_mask", "sampler_per_token_logps"):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field))
    with pytest.raises(ValueError, match="sampling.kv_cache="):
        SamplingConfig(kv_cache="pages")


@pytest.mark.parametrize("family", [
    dict(model_type="gemma2", sliding_window=4, attn_logit_softcapping=1.5, final_logit_softcapping=2.0,
         query_pre_attn_scalar=20),
    dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
         routing_replay=True)], ids=["gemma2", "qwen3_moe"])
def test_windowed_soft_capped_and_routed_families_page_like_the_contiguous_cache(tiny_model_config, family):
    """Gemma 2 (soft caps; its sliding layers keep a `paged.Ring` of their window of 4, not the rows' 16 slots) and a
    mixture of experts recording its routing: paged decoding with fewer slots than rows gives the contiguous
    cache's tokens, lengths and experts; log-probs bit for bit without windows, within float rounding with them
    (the window's softmax runs over its 4 entries, not 16 masked slots)."""
    from grpo_jax.models import init_model
    config = dataclasses.replace(tiny_model_config, **family)
    graphdef, params = init_model(config, seed=0)
    model = (config, graphdef, params)
    base = dataclasses.replace(make_decoder(model, eos=(2, 5), max_completion_length=10).options(4, 4, False),
                               num_slots=2)
    want = _generate(model, base)
    got = _generate(model, dataclasses.replace(base, page_size=4))
    if config.sliding_window:
        rings = [k for k in got.cache.k if isinstance(k, paged.Ring)]
        assert rings and {r.buf.shape for r in rings} == {(2, config.num_key_value_heads, 4, config.resolved_head_dim)}
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_array_equal(got.length, want.length)
        np.testing.assert_allclose(got.logps, want.logps, atol=1e-6)
    else:
        _assert_same(got, want)
    if config.routing_replay:
        assert got.routing is not None and got.routing.any()
        np.testing.assert_array_equal(got.routing, want.routing)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (XLA_FLAGS in conftest)")
def test_paged_decoding_on_a_mesh_equals_one_device(tiny_model):
    """``kv_cache: paged`` forced on a (2, 2, 2) mesh (one pool per mesh, the dense read-back partitioned by XLA)
    gives the one-device contiguous rows, static and continuously batched."""
    from grpo_jax.device import sharding
    from grpo_jax.rollout import stream
    from tests.algo.test_decoder import EOS, IDS, MASK, assert_same_rows, decode_rows
    ids, mask = np.concatenate([IDS, IDS[:1]]), np.concatenate([MASK, MASK[:1]])
    want = decode_rows(tiny_model, ids=ids, mask=mask, group=1)
    mesh = sharding.make_mesh(2, 2, 2)
    params = jax.device_put(tiny_model[2], sharding.param_shardings(mesh, tiny_model[2]))
    for slots in (0, 8):
        dec = make_decoder(tiny_model, mesh, eos=EOS, group=1, max_completion_length=9, temperature=0.9, top_k=12,
                           max_batch_rows=slots, kv_cache="paged", kv_page_size=4)
        assert_same_rows(jax.device_get(stream.generate(dec, params, ids, mask, jax.random.key(3))), want)


def test_a_small_pool_with_paused_rows_keeps_their_tokens(tiny_model, monkeypatch):
    """Multi-turn rows with 2 slots and a pool of one row (6 + 14 tokens): parked rows and preempted rows wait
    together for slots and pages; the tokens equal the contiguous cache's (log-probs within recompute rounding).
    With a slot per row (paused rows keep their pages) a pool below every row is refused."""
    want = _late_appends(tiny_model, 2, 1)
    preempted, trajectory = [], decoder.trajectory
    monkeypatch.setattr(decoder, "trajectory", lambda d: preempted.append(int(d.preempted)) or trajectory(d))
    got = _late_appends(tiny_model, 2, 1, page_size=4, kv_cache_tokens=20)
    assert preempted[0] > 0
    np.testing.assert_array_equal(got.completion_ids, want.completion_ids)
    np.testing.assert_array_equal(got.loss_mask, want.loss_mask)
    np.testing.assert_allclose(got.sampler_per_token_logps, want.sampler_per_token_logps, atol=1e-5)
    with pytest.raises(ValueError, match="sampling.kv_cache_tokens=20"):
        _late_appends(tiny_model, 4, 1, page_size=4, kv_cache_tokens=20)


def _decode_directly(model, mesh, ids, mask, eos, **sampling):
    """(trajectory on the host, final `Decoding`) of one call through the run's jitted decoder over ``mesh``."""
    from grpo_jax.device import sharding
    dec = make_decoder(model, mesh, eos=eos, group=1, max_completion_length=9, temperature=0.9, top_k=12,
                       **sampling)
    params = jax.device_put(model[2], sharding.param_shardings(mesh, model[2]))
    options = dec.options(len(ids), len(ids), False)
    d = dec.start(params, ids, mask, jax.random.key(3), 0, options)
    d, _ = dec.advance(params, d, options, False)
    return jax.device_get(dec.trajectory(d)), d


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (XLA_FLAGS in conftest)")
@pytest.mark.parametrize("data, tensor, slots, tokens", [(4, 2, 8, 0), (4, 2, 8, 96), (8, 1, 16, 128)],
                         ids=["tensor2-whole-pool", "tensor2-small-pool", "data8-small-pool"])
def test_pools_split_over_row_shards_keep_one_devices_tokens(tiny_model, data, tensor, slots, tokens):
    """A pool and free list per row shard (data 4 x tensor 2, a rollout layout's shape, and data 8), 16 rows over 8
    or 16 slots, continuously batched: one device's contiguous-cache rows, tokens exactly (log-probs within
    float rounding). Each shard's slots hold page ids of its own pool only, every device holds its shard's pages
    only (the pool's page axis split with the slots, key/value heads over ``tensor``), and a small pool (96 or 128
    tokens: 6 or 4 pages of 4 a shard for 2 slots of 7 + 9) makes rows wait and be preempted in their shard."""
    from tests.algo.test_decoder import EOS, IDS, MASK, NO_EOS, assert_same_rows, one_device
    from grpo_jax.device import sharding
    ids, mask = np.concatenate([IDS, IDS[:1]]), np.concatenate([MASK, MASK[:1]])
    eos = NO_EOS if tokens else EOS  # a small pool: every row runs to T, so that rows outgrow it
    want, _ = _decode_directly(tiny_model, one_device(), ids, mask, eos)
    mesh = sharding.make_mesh(data, 1, tensor)
    got, d = _decode_directly(tiny_model, mesh, ids, mask, eos, max_batch_rows=slots, kv_cache="paged",
                              kv_page_size=4, kv_cache_tokens=tokens)
    assert_same_rows(got, want)
    shards, pages = d.page_free.shape
    assert shards == data and pages == (tokens // 4 // data if tokens else slots // data * 4)
    pool = d.cache.k[0]
    K = tiny_model[0].num_key_value_heads
    assert pool.shape[1] == shards * pages
    assert {s.data.shape for s in pool.addressable_shards} == {(K // tensor, pages, 4, pool.shape[3])}
    host = jax.device_get(d)
    assert_pages_accounted(host)
    assert (host.preempted is not None and host.preempted > 0) == bool(tokens)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (XLA_FLAGS in conftest)")
def test_the_decode_kernel_runs_in_each_row_shard(tiny_model_config, monkeypatch):
    """On data 4 x tensor 2 the paged-attention kernel (the GPU Pallas kernel in interpret mode) runs in a
    ``shard_map``, each device over its shard's slots, pages and key/value head: one device's dense contiguous
    rows, tokens exactly."""
    from grpo_jax.device import sharding
    from grpo_jax.models import init_model
    from tests.algo.test_decoder import EOS, IDS, MASK, assert_same_rows, one_device
    ids, mask = np.concatenate([IDS, IDS[:1]]), np.concatenate([MASK, MASK[:1]])
    dense = (tiny_model_config, *init_model(tiny_model_config, seed=0))
    want, _ = _decode_directly(dense, one_device(), ids, mask, EOS)
    config = dataclasses.replace(tiny_model_config, attention="splash_interpret")
    shapes = []
    kernel = attention.paged_decode
    monkeypatch.setattr(attention, "paged_decode", lambda q, *a, **kw: shapes.append(q.shape) or kernel(q, *a, **kw))
    got, d = _decode_directly((config, *init_model(config, seed=0)), sharding.make_mesh(4, 1, 2), ids, mask, EOS,
                              max_batch_rows=8, kv_cache="paged", kv_page_size=4)
    assert_same_rows(got, want)
    K, G = config.num_key_value_heads, config.num_attention_heads // config.num_key_value_heads
    assert set(shapes) == {(8 // 4, 1, K // 2, G, config.resolved_head_dim)}  # a shard's slots and heads


# Gemma 2's alternation: a sliding layer (its ring) and a full one (its pages)
GEMMA2 = dict(model_type="gemma2", sliding_window=4, attn_logit_softcapping=1.5, final_logit_softcapping=2.0,
              query_pre_attn_scalar=20, layer_types=("sliding_attention", "full_attention"))


def test_window_rings_keep_their_tokens_through_appends_and_preemption(tiny_model_config):
    """Gemma 2's window rings (4 of a row's 6 + 14 positions) through the paths that rebuild a row: appended tokens
    run into a held slot (its rings read back and written again), a paused row re-admitted into another slot, and
    a small pool preempting rows (re-run in one pass): the contiguous cache's tokens and loss mask, log-probs within
    float rounding."""
    from grpo_jax.models import init_model
    config = dataclasses.replace(tiny_model_config, **GEMMA2)
    model = (config, *init_model(config, seed=0))
    for slots, tokens in ((4, 0), (2, 0), (2, 20)):
        want = _late_appends(model, slots, 1)
        got = _late_appends(model, slots, 1, page_size=4, kv_cache_tokens=tokens)
        assert np.any(got.turns == 1)
        np.testing.assert_array_equal(got.completion_ids, want.completion_ids)
        np.testing.assert_array_equal(got.loss_mask, want.loss_mask)
        np.testing.assert_allclose(got.sampler_per_token_logps, want.sampler_per_token_logps, atol=1e-5)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (XLA_FLAGS in conftest)")
def test_window_rings_split_over_row_shards(tiny_model_config):
    """Gemma 2 on data 4 x tensor 2 with a small pool: each device holds its shard's slots' rings over its key/value
    head ([2, 1, 4, Dh]); one device's contiguous-cache tokens."""
    from grpo_jax.device import sharding
    from grpo_jax.models import init_model
    from tests.algo.test_decoder import IDS, MASK, NO_EOS, assert_same_rows, one_device
    config = dataclasses.replace(tiny_model_config, **GEMMA2)
    model = (config, *init_model(config, seed=0))
    ids, mask = np.concatenate([IDS, IDS[:1]]), np.concatenate([MASK, MASK[:1]])
    want, _ = _decode_directly(model, one_device(), ids, mask, NO_EOS)
    got, d = _decode_directly(model, sharding.make_mesh(4, 1, 2), ids, mask, NO_EOS, max_batch_rows=8,
                              kv_cache="paged", kv_page_size=4, kv_cache_tokens=96)
    assert_same_rows(got, want)
    rings = [k for k in d.cache.k if isinstance(k, paged.Ring)]
    assert rings and all({s.data.shape for s in r.buf.addressable_shards} == {(2, 1, 4, config.resolved_head_dim)}
                         for r in rings)


@pytest.mark.parametrize("family", [GEMMA2, dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                                                 moe_intermediate_size=16)], ids=["gemma2", "qwen3_moe"])
def test_every_family_decodes_through_the_kernel_as_the_dense_contiguous_cache(tiny_model_config, family,
                                                                               monkeypatch):
    """The paged-attention kernel (GPU Pallas, interpret mode) on Gemma 2 (soft-capped scores on its full layer,
    its sliding layer over its ring) and a mixture of experts (q/k norms): the dense contiguous cache's tokens,
    log-probs within float rounding; the kernel traced once a full layer."""
    from grpo_jax.models import init_model
    traced, kernel_fn = [], attention.paged_decode
    monkeypatch.setattr(attention, "paged_decode", lambda *a, **kw: traced.append(kw["softcap"]) or kernel_fn(*a, **kw))
    dense = dataclasses.replace(tiny_model_config, **family)
    kernel = dataclasses.replace(dense, attention="splash_interpret")
    want_model = (dense, *init_model(dense, seed=0))
    base = dataclasses.replace(make_decoder(want_model, eos=(2, 5), max_completion_length=10).options(4, 4, False),
                               num_slots=3)
    want = _generate(want_model, base)
    got = _generate((kernel, *init_model(kernel, seed=0)), dataclasses.replace(base, page_size=4))
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.length, want.length)
    np.testing.assert_allclose(got.logps, want.logps, atol=1e-5)
    full = sum(t == "full_attention" for t in kernel.resolved_layer_types)
    assert traced == [kernel.attn_logit_softcapping] * full
