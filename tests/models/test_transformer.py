"""Model tests: stacked-layer scan against an unrolled float64 numpy reference for every family option, cache ==
no cache, padding and causality invariances, remat, dtypes, transformers' rotary tables and PyTorch models."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax.models import ModelConfig, Transformer, forward, init_cache, init_model, positions_from_mask, unembed
from grpo_jax.models.positional import rope_cos_sin
from grpo_jax.models.transformer import attention_mask, rope_attention_scaling, rope_inv_freq, rotary_tables

# rows of different real lengths, left-padded with token 0
PROMPT_IDS = np.array([[0, 0, 0, 5, 7, 9, 4], [0, 3, 1, 4, 1, 5, 9], [2, 7, 1, 8, 2, 8, 1]], np.int32)
PROMPT_MASK = np.array([[0, 0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]], np.int32)

# one entry per supported family option; llama3's original context 64 puts the head_dim-16 frequencies in all
# three regimes (kept, smoothed, divided by the factor); a window of 3 is shorter than every test sequence
FAMILIES = {
    "qwen2": dict(model_type="qwen2", attention_bias=True),
    "llama3": dict(model_type="llama", attention_bias=True, attention_out_bias=True, mlp_bias=True,
                   tie_word_embeddings=False, rope_type="llama3", rope_factor=8.0, rope_low_freq_factor=1.0,
                   rope_high_freq_factor=4.0, rope_original_max_position_embeddings=64, rope_theta=10000.0),
    "linear": dict(model_type="llama", rope_type="linear", rope_factor=2.0),
    "qwen3": dict(model_type="qwen3", qk_norm=True),
    "mistral": dict(model_type="mistral", sliding_window=3, tie_word_embeddings=False),
}


def family_model(tiny_model_config, family, **overrides):
    """(config, graphdef, params) with every leaf perturbed, so norm weights and biases are not 1 / 0."""
    config = dataclasses.replace(tiny_model_config, head_dim=16, **FAMILIES[family], **overrides)
    graphdef, params = init_model(config, seed=1)
    leaves, treedef = jax.tree.flatten(params)
    rng = np.random.default_rng(0)
    leaves = [x + jnp.asarray(0.1 * rng.standard_normal(x.shape), x.dtype) for x in leaves]
    return config, graphdef, jax.tree.unflatten(treedef, leaves)


@jax.jit
def full_logits(graphdef, params, ids, mask):
    hidden, _ = forward(graphdef, params, ids, positions_from_mask(mask), mask)
    return unembed(graphdef, params, hidden)


def naive_inv_freq(config: ModelConfig) -> list[float]:
    """Rotary frequencies in float64, Meta's Llama 3.1 `apply_scaling` loop for llama3."""
    Dh = config.resolved_head_dim
    freqs = [config.rope_theta ** (-2 * i / Dh) for i in range(Dh // 2)]
    if config.rope_type == "linear":
        return [f / config.rope_factor for f in freqs]
    if config.rope_type != "llama3":
        return freqs
    old, low, high = (config.rope_original_max_position_embeddings, config.rope_low_freq_factor,
                      config.rope_high_freq_factor)
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(f)
        elif wavelen > old / low:
            out.append(f / config.rope_factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / config.rope_factor + smooth * f)
    return out


def naive_logits(params, config: ModelConfig, ids_T):
    """Unbatched, unpadded float64 numpy forward: an unrolled loop over layers, explicit per-head loops."""
    p = jax.tree.map(lambda x: np.asarray(x, np.float64), nnx.to_pure_dict(params))
    H, K, Dh = config.num_attention_heads, config.num_key_value_heads, config.resolved_head_dim
    T = len(ids_T)
    inv_freq = naive_inv_freq(config)
    W = config.sliding_window or T

    def rms(x, w):
        return w * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + config.rms_norm_eps)

    def rope(x_TxDh):
        out = np.empty_like(x_TxDh)
        half = Dh // 2
        for pos in range(T):
            for i in range(half):  # pair (i, i + half) rotates by angle pos * inv_freq[i]
                a = pos * inv_freq[i]
                x1, x2 = x_TxDh[pos, i], x_TxDh[pos, i + half]
                out[pos, i] = x1 * np.cos(a) - x2 * np.sin(a)
                out[pos, i + half] = x2 * np.cos(a) + x1 * np.sin(a)
        return out

    def lin(x, m):
        return x @ m["kernel"] + m.get("bias", 0.0)

    visible = np.array([[0 <= q - k < W for k in range(T)] for q in range(T)])
    x = p["embed_tokens"]["embedding"][ids_T]
    for layer in range(config.num_hidden_layers):
        lp = jax.tree.map(lambda a: a[layer], p["layers"])
        attn = lp["self_attn"]
        h = rms(x, lp["input_layernorm"]["weight"])
        q = lin(h, attn["q_proj"]).reshape(T, H, Dh)
        k = lin(h, attn["k_proj"]).reshape(T, K, Dh)
        v = lin(h, attn["v_proj"]).reshape(T, K, Dh)
        if config.qk_norm:
            q, k = rms(q, attn["q_norm"]["weight"]), rms(k, attn["k_norm"]["weight"])
        heads = []
        for head in range(H):
            kv = head // (H // K)
            qh, kh = rope(q[:, head]), rope(k[:, kv])
            s = np.where(visible, qh @ kh.T / np.sqrt(Dh), -np.inf)
            w = np.exp(s - s.max(-1, keepdims=True))
            heads.append((w / w.sum(-1, keepdims=True)) @ v[:, kv])
        x = x + lin(np.concatenate(heads, -1), attn["o_proj"])
        h = rms(x, lp["post_attention_layernorm"]["weight"])
        g, u = lin(h, lp["mlp"]["gate_proj"]), lin(h, lp["mlp"]["up_proj"])
        x = x + lin(g / (1 + np.exp(-g)) * u, lp["mlp"]["down_proj"])
    x = rms(x, p["norm"]["weight"])
    head = p["embed_tokens"]["embedding"].T if config.tie_word_embeddings else p["lm_head"]["kernel"]
    return x @ head


def test_config_validation():
    with pytest.raises(ValueError, match=r"^model.num_attention_heads=6"):
        ModelConfig(num_attention_heads=6, num_key_value_heads=4, hidden_size=48)
    with pytest.raises(ValueError, match=r"^model.hidden_size=30"):
        ModelConfig(hidden_size=30, num_attention_heads=4)
    with pytest.raises(ValueError, match=r"^model.dtype='float16'"):
        ModelConfig(dtype="float16")
    with pytest.raises(ValueError, match=r"^model.param_dtype='int8'"):
        ModelConfig(param_dtype="int8")
    with pytest.raises(ValueError, match=r"^model.model_type='gpt2' .*qwen2, llama, qwen3, mistral"):
        ModelConfig(model_type="gpt2")
    with pytest.raises(ValueError, match=r"^model.remat='some' .*none, full, dots"):
        ModelConfig(remat="some")
    with pytest.raises(ValueError, match=r"^model.sliding_window=0 must be a positive integer"):
        ModelConfig(sliding_window=0)
    with pytest.raises(ValueError, match=r"^model.rope_type='dynamic' .*default, linear, llama3, yarn"):
        ModelConfig(rope_type="dynamic")
    with pytest.raises(ValueError, match=r"^model.rope_factor=2.0 has no effect .*rope_type='default'"):
        ModelConfig(rope_factor=2.0)
    with pytest.raises(ValueError, match=r"^model.rope_factor=0.5 must be >= 1"):
        ModelConfig(rope_type="linear", rope_factor=0.5)
    with pytest.raises(ValueError, match=r"^model.rope_original_max_position_embeddings=None"):
        ModelConfig(rope_type="llama3", rope_factor=8.0)
    with pytest.raises(ValueError, match=r"^model.rope_beta_fast=1.0, model.rope_beta_slow=1.0: need beta_fast"):
        ModelConfig(rope_type="yarn", rope_factor=4.0, rope_original_max_position_embeddings=16, rope_beta_fast=1.0)
    with pytest.raises(ValueError, match=r"^model.rope_original_max_position_embeddings=None .*'yarn'"):
        ModelConfig(rope_type="yarn", rope_factor=4.0)
    with pytest.raises(ValueError, match=r"^model.rope_low_freq_factor=4.0, model.rope_high_freq_factor=1.0"):
        ModelConfig(rope_type="llama3", rope_factor=8.0, rope_original_max_position_embeddings=8192,
                    rope_low_freq_factor=4.0, rope_high_freq_factor=1.0)
    assert ModelConfig(hidden_size=64, num_attention_heads=4).resolved_head_dim == 16
    assert ModelConfig(head_dim=8).resolved_head_dim == 8


def test_param_layout_is_stacked():
    L, D, F, V, H, K, Dh = 3, 32, 48, 40, 4, 2, 8
    config = ModelConfig(vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=L,
                         num_attention_heads=H, num_key_value_heads=K, attention_bias=True, attention_out_bias=True,
                         mlp_bias=True, qk_norm=True, tie_word_embeddings=False, param_dtype="bfloat16")
    _, params = init_model(config, seed=0)
    got = {".".join(str(k.key) for k in path): (leaf.shape, leaf.dtype)
           for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(params))}
    a, m = "layers.self_attn.", "layers.mlp."
    expected = {"embed_tokens.embedding": (V, D), "norm.weight": (D,), "lm_head.kernel": (D, V),
                a + "q_proj.kernel": (L, D, H * Dh), a + "q_proj.bias": (L, H * Dh),
                a + "k_proj.kernel": (L, D, K * Dh), a + "k_proj.bias": (L, K * Dh),
                a + "v_proj.kernel": (L, D, K * Dh), a + "v_proj.bias": (L, K * Dh),
                a + "o_proj.kernel": (L, H * Dh, D), a + "o_proj.bias": (L, D),
                a + "q_norm.weight": (L, Dh), a + "k_norm.weight": (L, Dh),
                m + "gate_proj.kernel": (L, D, F), m + "gate_proj.bias": (L, F),
                m + "up_proj.kernel": (L, D, F), m + "up_proj.bias": (L, F),
                m + "down_proj.kernel": (L, F, D), m + "down_proj.bias": (L, D),
                "layers.input_layernorm.weight": (L, D), "layers.post_attention_layernorm.weight": (L, D)}
    assert {k: s for k, (s, _) in got.items()} == expected
    assert {d for _, d in got.values()} == {jnp.dtype(jnp.bfloat16)}
    # layers get independent initialisations
    q_kernel = np.asarray(params["layers"]["self_attn"]["q_proj"]["kernel"][...], np.float32)
    assert not np.allclose(q_kernel[0], q_kernel[1])
    _, plain = init_model(dataclasses.replace(config, attention_bias=False, attention_out_bias=False,
                                              mlp_bias=False, qk_norm=False, tie_word_embeddings=True), seed=0)
    plain_keys = {".".join(str(k.key) for k in path) for path, _ in
                  jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(plain))}
    assert plain_keys == {k for k in expected if not k.endswith(("bias", "_norm.weight")) and k != "lm_head.kernel"}


def test_compiled_program_does_not_grow_with_depth(tiny_model_config):
    def num_eqns(layers):
        config = dataclasses.replace(tiny_model_config, num_hidden_layers=layers, scan_layers=True)
        graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
        jaxpr = jax.make_jaxpr(full_logits.__wrapped__, static_argnums=0)(graphdef, params, PROMPT_IDS, PROMPT_MASK)
        return len(jaxpr.eqns), str(jaxpr).count("scan[")

    assert num_eqns(2) == num_eqns(7)
    assert num_eqns(2)[1] == 1


@pytest.mark.parametrize("family", list(FAMILIES))
def test_matches_naive_numpy(tiny_model_config, family):
    config, graphdef, params = family_model(tiny_model_config, family)
    for row in range(len(PROMPT_IDS)):
        real = PROMPT_IDS[row][PROMPT_MASK[row] == 1]
        got = full_logits(graphdef, params, real[None], np.ones((1, len(real)), np.int32))[0]
        np.testing.assert_allclose(got, naive_logits(params, config, real), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_left_padding_does_not_change_real_logits(tiny_model_config, family):
    _, graphdef, params = family_model(tiny_model_config, family)
    padded = full_logits(graphdef, params, PROMPT_IDS, PROMPT_MASK)
    assert np.all(np.isfinite(padded))  # fully masked padding queries must not be NaN
    for row in range(len(PROMPT_IDS)):
        real = PROMPT_MASK[row] == 1
        alone = full_logits(graphdef, params, PROMPT_IDS[row][real][None], np.ones((1, real.sum()), np.int32))
        np.testing.assert_allclose(padded[row][real], alone[0], atol=1e-5, rtol=1e-5)


def test_causal(tiny_model):
    _, graphdef, params = tiny_model
    ids = PROMPT_IDS[2:3]
    changed = ids.copy()
    changed[0, 4] = (changed[0, 4] + 1) % 32
    a = full_logits(graphdef, params, ids, PROMPT_MASK[2:3])
    b = full_logits(graphdef, params, changed, PROMPT_MASK[2:3])
    np.testing.assert_array_equal(a[:, :4], b[:, :4])
    assert not np.allclose(a[:, 4:], b[:, 4:])


def test_sliding_window_mask_matches_naive():
    """The window counts positions: the visible slots before a key (a shared prefix's hidden slot is no token);
    on contiguous real slots that is transformers' slot rule q - s < W."""
    rng = np.random.default_rng(0)
    B, T, S, W, start = 3, 4, 11, 3, 5
    mask_BxS = rng.integers(0, 2, (B, S)).astype(np.int32)
    position_BxS = np.cumsum(mask_BxS, axis=1) - 1
    query_positions_BxT = position_BxS[:, start:start + T]
    got = np.asarray(attention_mask(mask_BxS, start + jnp.arange(T), W, query_positions_BxT))
    expected = np.zeros((B, T, S), bool)
    for b in range(B):
        for t in range(T):
            for s in range(S):
                q = start + t
                expected[b, t, s] = bool(mask_BxS[b, s]) and s <= q and sum(mask_BxS[b, s + 1:q + 1]) < W
    np.testing.assert_array_equal(got, expected)
    no_window = np.asarray(attention_mask(mask_BxS, start + jnp.arange(T)))
    assert not (expected & ~no_window).any()  # the window only removes keys
    assert (no_window & ~expected).any()  # and here it removes some
    contiguous_BxS = (np.arange(S)[None] >= np.array([[0], [2], [4]])).astype(np.int32)  # left padding
    got = np.asarray(attention_mask(contiguous_BxS, start + jnp.arange(T), W,
                                    (np.cumsum(contiguous_BxS, axis=1) - 1)[:, start:start + T]))
    q_T, s_S = start + np.arange(T), np.arange(S)
    slot_rule = (s_S[None] <= q_T[:, None]) & (q_T[:, None] - s_S[None] < W)
    np.testing.assert_array_equal(got, slot_rule[None] & (contiguous_BxS[:, None] == 1))


@pytest.mark.parametrize("family", [None, "mistral"])
def test_cache_prefill_and_decode_match_full_forward(tiny_model_config, family):
    if family is None:
        config, graphdef, params = tiny_model_config, *init_model(tiny_model_config, seed=0)
    else:  # sliding window and qk norm together
        config, graphdef, params = family_model(tiny_model_config, family, qk_norm=True)
    B, L = PROMPT_IDS.shape
    split = 3  # prefill 3 tokens in one call, then decode token by token
    expected = full_logits(graphdef, params, PROMPT_IDS, PROMPT_MASK)
    positions = positions_from_mask(PROMPT_MASK)
    extra = 2  # unused trailing slots: must be masked out of attention
    cache = init_cache(config, B, L + extra)
    mask_S = np.concatenate([PROMPT_MASK, np.zeros((B, extra), np.int32)], 1)
    step = jax.jit(forward)
    # the cache sees the mask of every slot written so far; later slots are excluded by the causal mask
    hidden, cache = step(graphdef, params, PROMPT_IDS[:, :split], positions[:, :split], mask_S, cache, 0)
    got = [unembed(graphdef, params, hidden)]
    for t in range(split, L):
        hidden, cache = step(graphdef, params, PROMPT_IDS[:, t:t + 1], positions[:, t:t + 1], mask_S, cache, t)
        got.append(unembed(graphdef, params, hidden))
    got = np.concatenate(got, axis=1)
    real = PROMPT_MASK == 1
    np.testing.assert_allclose(got[real], expected[real], atol=1e-5, rtol=1e-5)
    assert np.all(np.isfinite(got))


@pytest.mark.parametrize("family", [None, "mistral"])
def test_shared_prefix_keys_values_match_the_full_forward(tiny_model_config, family):
    # rows 2g, 2g+1 share prompt row g: the prompt runs once (return_kv), its keys/values serve both rows' suffixes
    if family is None:  # the layers as one scan (model.scan_layers) here; the families loop over them
        config = dataclasses.replace(tiny_model_config, scan_layers=True)
        graphdef, params = init_model(config, seed=0)
    else:  # sliding window (3 < the 8 slots, so the window cuts into the prefix) and qk norm together
        config, graphdef, params = family_model(tiny_model_config, family, qk_norm=True)
    G, P = 2, 5
    prompt_ids, prompt_mask = PROMPT_IDS[[2, 0], :P], PROMPT_MASK[[2, 0], :P]  # no pad; three pads
    suffix_ids = np.array([[4, 2, 9], [1, 1, 30], [3, 5, 7], [8, 31, 6]], np.int32)
    suffix_mask = np.array([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], np.int32)
    ids = np.concatenate([np.repeat(prompt_ids, G, 0), suffix_ids], 1)
    mask = np.concatenate([np.repeat(prompt_mask, G, 0), suffix_mask], 1)
    expected = full_logits(graphdef, params, ids, mask)[:, P:]
    _, prefix = forward(graphdef, params, prompt_ids, positions_from_mask(prompt_mask), prompt_mask, return_kv=True)
    assert len(prefix.k) == config.num_hidden_layers
    assert prefix.k[0].shape == (2, config.num_key_value_heads, P, config.resolved_head_dim)
    hidden, _ = forward(graphdef, params, suffix_ids, positions_from_mask(mask)[:, P:], mask, prefix=prefix,
                        prefix_group_size=G)
    got = np.asarray(unembed(graphdef, params, hidden))
    real = suffix_mask == 1
    np.testing.assert_allclose(got[real], expected[real], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="must cover the 5 prefix and T=3 input slots"):
        forward(graphdef, params, suffix_ids, positions_from_mask(mask)[:, P:], suffix_mask, prefix=prefix,
                prefix_group_size=G)


def test_remat_policies_and_layer_scan_give_equal_values_and_gradients(tiny_model_config):
    config, graphdef, params = family_model(tiny_model_config, "qwen3")
    weights = jnp.asarray(np.random.default_rng(1).standard_normal((*PROMPT_IDS.shape, config.vocab_size)),
                          jnp.float32)

    def loss(graphdef, params):
        return jnp.sum(jnp.tanh(full_logits.__wrapped__(graphdef, params, PROMPT_IDS, PROMPT_MASK)) * weights)

    results = {}
    variants = {"none": {}, "full": dict(remat="full"), "dots": dict(remat="dots"),
                "scan": dict(scan_layers=True), "scan+dots": dict(scan_layers=True, remat="dots")}
    for name, fields in variants.items():
        variant_graphdef, _ = init_model(dataclasses.replace(config, **fields), seed=1)
        grad_fn = jax.value_and_grad(loss, argnums=1)
        jaxpr = str(jax.make_jaxpr(grad_fn, static_argnums=0)(variant_graphdef, params))
        assert ("checkpoint[" in jaxpr or "remat" in jaxpr) == ("remat" in fields), name
        assert ("scan[" in jaxpr) == ("scan_layers" in fields), name  # the Python loop has no scan
        results[name] = jax.jit(grad_fn, static_argnums=0)(variant_graphdef, params)
    # recomputation may fuse and reassociate float32 sums differently: equal up to a few ulps of each leaf's scale
    for remat in ("full", "dots", "scan", "scan+dots"):
        np.testing.assert_allclose(results[remat][0], results["none"][0], rtol=1e-6)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-6 * np.abs(b).max(), rtol=0),
                     results[remat][1], results["none"][1])


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_bfloat16_compute_close_to_float32(tiny_model, param_dtype):
    config, graphdef, params = tiny_model
    bf16_graphdef, bf16_params = init_model(dataclasses.replace(config, dtype="bfloat16", param_dtype=param_dtype),
                                            seed=0)
    assert {x.dtype for x in jax.tree.leaves(bf16_params)} == {jnp.dtype(param_dtype)}
    bf16_params = jax.tree.map(lambda x: x.astype(param_dtype), params)
    ref = full_logits(graphdef, params, PROMPT_IDS, PROMPT_MASK)
    got = full_logits(bf16_graphdef, bf16_params, PROMPT_IDS, PROMPT_MASK)
    assert got.dtype == jnp.bfloat16
    err = np.abs(np.asarray(got, np.float32) - ref)
    # bf16 keeps 8 mantissa bits: relative error ~ 2^-8 per op, a few ops deep
    assert err.max() < 0.05 * np.abs(ref).max(), (err.max(), np.abs(ref).max())
    cache = init_cache(dataclasses.replace(config, dtype="bfloat16"), 2, 4)
    assert cache.k[0].dtype == jnp.bfloat16


ROPE_CASES = {  # Llama 3.1 8B's real rope settings, and a linear x4 one
    "llama3": (dict(rope_type="llama3", rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                    rope_original_max_position_embeddings=8192, rope_theta=500000.0),
               dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "linear": (dict(rope_type="linear", rope_factor=4.0, rope_theta=10000.0), dict(factor=4.0)),
    "default": (dict(rope_type="default", rope_theta=1000000.0), {}),
}


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rope_inv_freq_matches_transformers(case):
    pytest.importorskip("torch")
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    ours, theirs = ROPE_CASES[case]
    config = ModelConfig(hidden_size=256, num_attention_heads=2, max_position_embeddings=131072, **ours)
    hf_config = transformers.LlamaConfig(
        hidden_size=256, num_attention_heads=2, head_dim=128, max_position_embeddings=131072,
        rope_parameters={"rope_type": case, "rope_theta": config.rope_theta, **theirs})
    if case == "default":
        expected = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_config).inv_freq
    else:
        expected, attention_factor = ROPE_INIT_FUNCTIONS[case](hf_config, "cpu")
        assert attention_factor == 1.0
    np.testing.assert_allclose(rope_inv_freq(config), expected.numpy(), rtol=1e-6, atol=0)
    np.testing.assert_allclose(rope_inv_freq(config), naive_inv_freq(config), rtol=1e-6, atol=0)


# GPT-OSS's real YaRN (head_dim 64, no truncation) and Qwen's long-context recipe (head_dim 128, truncated range,
# transformers' default attention factor), and an explicit attention factor
YARN_CASES = {
    "gpt_oss": (64, dict(rope_theta=150000.0, rope_factor=32.0, rope_beta_fast=32.0, rope_beta_slow=1.0,
                         rope_truncate=False, rope_original_max_position_embeddings=4096)),
    "qwen": (128, dict(rope_theta=1000000.0, rope_factor=4.0, rope_original_max_position_embeddings=32768)),
    "explicit": (64, dict(rope_theta=10000.0, rope_factor=8.0, rope_original_max_position_embeddings=2048,
                          rope_attention_factor=1.25)),
}


def naive_yarn(config: ModelConfig) -> tuple[list[float], float]:
    """YaRN (arXiv 2309.00071, section 3.2-3.4) in float64: frequencies of wavelength r = L / (2 pi / f) rotations
    over the original context L kept above beta_fast, divided by the factor below beta_slow, linearly ramped over
    the dims between (the ramp's ends as dims, rounded outwards when truncating); mscale 0.1 ln(factor) + 1."""
    Dh, base, factor = config.resolved_head_dim, config.rope_theta, config.rope_factor
    L = config.rope_original_max_position_embeddings
    dim_of = lambda rotations: Dh * math.log(L / (rotations * 2 * math.pi)) / (2 * math.log(base))  # noqa: E731
    low, high = dim_of(config.rope_beta_fast), dim_of(config.rope_beta_slow)
    if config.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, Dh - 1)
    out = []
    for i in range(Dh // 2):
        f = base ** (-2 * i / Dh)
        keep = 1 - min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(keep * f + (1 - keep) * f / factor)
    scale = config.rope_attention_factor or 0.1 * math.log(factor) + 1
    return out, scale


@pytest.mark.parametrize("case", list(YARN_CASES))
def test_yarn_matches_transformers_and_the_paper(case):
    """YaRN's frequencies and cos/sin scale equal transformers' ``_compute_yarn_parameters`` and a float64 version
    of the paper's formulas; the rotary tables are cos/sin(position * inv_freq) times the scale."""
    pytest.importorskip("torch")
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    head_dim, ours = YARN_CASES[case]
    config = ModelConfig(hidden_size=2 * head_dim, num_attention_heads=2, max_position_embeddings=131072,
                         rope_type="yarn", **ours)
    theirs = dict(rope_type="yarn", rope_theta=config.rope_theta, factor=config.rope_factor,
                  beta_fast=config.rope_beta_fast, beta_slow=config.rope_beta_slow, truncate=config.rope_truncate,
                  original_max_position_embeddings=config.rope_original_max_position_embeddings)
    if config.rope_attention_factor is not None:
        theirs["attention_factor"] = config.rope_attention_factor
    hf_config = transformers.LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2, head_dim=head_dim,
                                         max_position_embeddings=131072, rope_parameters=theirs)
    expected, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config, "cpu")
    np.testing.assert_allclose(rope_inv_freq(config), expected.numpy(), rtol=1e-6, atol=0)
    naive, naive_scale = naive_yarn(config)
    np.testing.assert_allclose(rope_inv_freq(config), naive, rtol=2e-6, atol=0)
    assert rope_attention_scaling(config) == pytest.approx(attention_factor, rel=1e-12)
    assert rope_attention_scaling(config) == pytest.approx(naive_scale, rel=1e-12) and naive_scale > 1
    positions_BxT = np.array([[0, 3, 4095, 70000]], np.int32)
    cos, sin = rope_cos_sin(positions_BxT, rotary_tables(config, 70001)["full_attention"])
    angles = positions_BxT[..., None].astype(np.float64) * np.asarray(naive)
    angles = np.concatenate([angles, angles], axis=-1)
    np.testing.assert_allclose(cos, naive_scale * np.cos(angles), rtol=0, atol=2e-2 * naive_scale)
    np.testing.assert_allclose(cos[0, :2], naive_scale * np.cos(angles[0, :2]), rtol=0, atol=5e-6)
    np.testing.assert_allclose(sin[0, :2], naive_scale * np.sin(angles[0, :2]), rtol=0, atol=5e-6)


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rotary_tables_give_each_position_its_rotation(case):
    """Gathered table rows are cos/sin(position * inv_freq) evaluated directly, bit for bit (the forward's values
    do not change), match float64 numpy, repeat the frequencies in HF's layout and are NaN past the table."""
    config = ModelConfig(hidden_size=256, num_attention_heads=2, max_position_embeddings=131072, **ROPE_CASES[case][0])
    positions_BxT = np.array([[0, 0, 1, 2, 3], [4, 17, 18, 19, 19]], np.int32)
    cos, sin = jax.jit(lambda p: rope_cos_sin(p, rotary_tables(config, 20)["full_attention"]))(positions_BxT)
    freqs = jax.jit(lambda p: p.astype(jnp.float32)[..., None] * jnp.asarray(rope_inv_freq(config)))(positions_BxT)
    freqs = jnp.concatenate([freqs, freqs], axis=-1)
    np.testing.assert_array_equal(cos, jax.jit(jnp.cos)(freqs))
    np.testing.assert_array_equal(sin, jax.jit(jnp.sin)(freqs))
    angles = positions_BxT[..., None].astype(np.float64) * rope_inv_freq(config).astype(np.float64)
    angles = np.concatenate([angles, angles], axis=-1)
    np.testing.assert_allclose(cos, np.cos(angles), rtol=0, atol=2e-6)
    np.testing.assert_allclose(sin, np.sin(angles), rtol=0, atol=2e-6)
    past_cos, past_sin = rope_cos_sin(jnp.array([[19, 20]]), rotary_tables(config, 20)["full_attention"])
    assert np.isfinite(past_cos[0, 0]).all() and np.isnan(past_cos[0, 1]).all() and np.isnan(past_sin[0, 1]).all()

def _hf_model(config: ModelConfig, params):
    """The transformers PyTorch model of the family, loaded with our (unstacked, transposed) params."""
    torch = pytest.importorskip("torch")
    import transformers

    common = dict(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                  intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
                  num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
                  head_dim=config.resolved_head_dim, rms_norm_eps=config.rms_norm_eps,
                  tie_word_embeddings=config.tie_word_embeddings, attn_implementation="eager")
    rope = {"rope_type": config.rope_type, "rope_theta": config.rope_theta}
    if config.rope_type != "default":
        rope["factor"] = config.rope_factor
    if config.rope_type == "llama3":
        rope.update(low_freq_factor=config.rope_low_freq_factor, high_freq_factor=config.rope_high_freq_factor,
                    original_max_position_embeddings=config.rope_original_max_position_embeddings)
    if config.model_type == "qwen2":
        hf_cls, hf_config = transformers.Qwen2ForCausalLM, transformers.Qwen2Config(rope_parameters=rope, **common)
    elif config.model_type == "qwen3":
        hf_cls, hf_config = transformers.Qwen3ForCausalLM, transformers.Qwen3Config(rope_parameters=rope, **common)
    elif config.model_type == "mistral":
        hf_cls, hf_config = transformers.MistralForCausalLM, transformers.MistralConfig(
            rope_parameters=rope, sliding_window=config.sliding_window, **common)
    else:
        hf_cls, hf_config = transformers.LlamaForCausalLM, transformers.LlamaConfig(
            rope_parameters=rope, attention_bias=config.attention_bias, mlp_bias=config.mlp_bias,
            max_position_embeddings=4096, **common)
    model = hf_cls(hf_config).eval()
    state = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(params)):
        keys = [str(k.key) for k in path]
        value = np.asarray(leaf, np.float32)
        if keys[-1] == "kernel":
            keys[-1], value = "weight", np.swapaxes(value, -1, -2)
        elif keys[-1] == "embedding":
            keys[-1] = "weight"
        name = ".".join(keys)
        if keys[0] == "layers":
            for i in range(config.num_hidden_layers):
                state[f"model.layers.{i}." + ".".join(keys[1:])] = torch.from_numpy(value[i].copy())
        else:
            state[name if name.startswith("lm_head") else "model." + name] = torch.from_numpy(value.copy())
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    return model


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("cpu_speedups", [False, True])
def test_matches_transformers(tiny_model_config, family, cpu_speedups):
    torch = pytest.importorskip("torch")
    from grpo_jax.device import cpu
    config, graphdef, params = family_model(tiny_model_config, family)
    graphdef = cpu.linear_layers(graphdef, params, cpu_speedups)
    model = _hf_model(config, params)
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(PROMPT_IDS.astype(np.int64)),
                    attention_mask=torch.from_numpy(PROMPT_MASK.astype(np.int64)),
                    position_ids=torch.from_numpy(np.asarray(positions_from_mask(PROMPT_MASK), np.int64)))
    expected = out.logits.numpy()
    got = np.asarray(full_logits(graphdef, params, PROMPT_IDS, PROMPT_MASK))
    real = PROMPT_MASK == 1
    np.testing.assert_allclose(got[real], expected[real], atol=1e-5, rtol=1e-5)
