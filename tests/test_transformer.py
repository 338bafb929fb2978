"""Model tests: cache == no cache, padding and causality invariances, naive numpy and HF references."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax.models import ModelConfig, forward, init_cache, init_model, positions_from_mask, unembed

# rows of different real lengths, left-padded with token 0
PROMPT_IDS = np.array([[0, 0, 0, 5, 7, 9], [0, 3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8]], np.int32)
PROMPT_MASK = np.array([[0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], np.int32)


@jax.jit
def full_logits(graphdef, params, ids, mask):
    hidden, _ = forward(graphdef, params, ids, positions_from_mask(mask), mask)
    return unembed(graphdef, params, hidden)


def naive_logits(params, config: ModelConfig, ids_T):
    """Unbatched, unpadded float64 numpy forward with explicit per-head loops (positions 0..T-1)."""
    p = jax.tree.map(lambda x: np.asarray(x, np.float64), nnx_to_dict(params))
    H, K, Dh = config.num_attention_heads, config.num_key_value_heads, config.resolved_head_dim
    T = len(ids_T)

    def rms(x, w):
        return w * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + config.rms_norm_eps)

    def rope(x_TxDh):
        out = np.empty_like(x_TxDh)
        half = Dh // 2
        for pos in range(T):
            for i in range(half):  # pair (i, i + half) rotates by angle pos * theta^(-2i/Dh)
                a = pos * config.rope_theta ** (-2 * i / Dh)
                x1, x2 = x_TxDh[pos, i], x_TxDh[pos, i + half]
                out[pos, i] = x1 * np.cos(a) - x2 * np.sin(a)
                out[pos, i + half] = x2 * np.cos(a) + x1 * np.sin(a)
        return out

    def lin(x, m):
        return x @ m["kernel"] + m.get("bias", 0.0)

    x = p["embed_tokens"]["embedding"][ids_T]
    for i in range(config.num_hidden_layers):
        lp = p["layers"][i]
        h = rms(x, lp["input_layernorm"]["weight"])
        q = lin(h, lp["self_attn"]["q_proj"]).reshape(T, H, Dh)
        k = lin(h, lp["self_attn"]["k_proj"]).reshape(T, K, Dh)
        v = lin(h, lp["self_attn"]["v_proj"]).reshape(T, K, Dh)
        heads = []
        for head in range(H):
            kv = head // (H // K)
            qh, kh = rope(q[:, head]), rope(k[:, kv])
            s = qh @ kh.T / np.sqrt(Dh) + np.triu(np.full((T, T), -np.inf), 1)
            w = np.exp(s - s.max(-1, keepdims=True))
            heads.append((w / w.sum(-1, keepdims=True)) @ v[:, kv])
        x = x + lin(np.concatenate(heads, -1), lp["self_attn"]["o_proj"])
        h = rms(x, lp["post_attention_layernorm"]["weight"])
        g, u = lin(h, lp["mlp"]["gate_proj"]), lin(h, lp["mlp"]["up_proj"])
        x = x + lin(g / (1 + np.exp(-g)) * u, lp["mlp"]["down_proj"])
    x = rms(x, p["norm"]["weight"])
    head = p["embed_tokens"]["embedding"].T if config.tie_word_embeddings else p["lm_head"]["kernel"]
    return x @ head


def nnx_to_dict(params):
    return nnx.to_pure_dict(params)


def test_config_validation():
    with pytest.raises(ValueError, match=r"^model.num_attention_heads=6"):
        ModelConfig(num_attention_heads=6, num_key_value_heads=4, hidden_size=48)
    with pytest.raises(ValueError, match=r"^model.hidden_size=30"):
        ModelConfig(hidden_size=30, num_attention_heads=4)
    with pytest.raises(ValueError, match=r"^model.dtype='float16'"):
        ModelConfig(dtype="float16")
    assert ModelConfig(hidden_size=64, num_attention_heads=4).resolved_head_dim == 16
    assert ModelConfig(head_dim=8).resolved_head_dim == 8


@pytest.mark.parametrize("tie, bias", [(True, False), (False, True)])
def test_matches_naive_numpy(tiny_model_config, tie, bias):
    config = dataclasses.replace(tiny_model_config, tie_word_embeddings=tie, attention_bias=bias, head_dim=16)
    graphdef, params = init_model(config, seed=1)
    if bias:  # zero-initialised biases would not test anything
        params = jax.tree.map(lambda x: x + 0.1 if x.ndim == 1 else x, params)
    for row in range(len(PROMPT_IDS)):
        real = PROMPT_IDS[row][PROMPT_MASK[row] == 1]
        got = full_logits(graphdef, params, real[None], np.ones((1, len(real)), np.int32))[0]
        np.testing.assert_allclose(got, naive_logits(params, config, real), atol=2e-5, rtol=1e-5)


def test_left_padding_does_not_change_real_logits(tiny_model):
    _, graphdef, params = tiny_model
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


def test_cache_prefill_and_decode_match_full_forward(tiny_model):
    config, graphdef, params = tiny_model
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


def test_bfloat16_close_to_float32(tiny_model):
    config, graphdef, params = tiny_model
    bf16_graphdef, _ = init_model(dataclasses.replace(config, dtype="bfloat16"), seed=0)
    bf16_params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    ref = full_logits(graphdef, params, PROMPT_IDS, PROMPT_MASK)
    got = full_logits(bf16_graphdef, bf16_params, PROMPT_IDS, PROMPT_MASK)
    assert got.dtype == jnp.bfloat16
    err = np.abs(np.asarray(got, np.float32) - ref)
    # bf16 keeps 8 mantissa bits: relative error ~ 2^-8 per op, a few ops deep
    assert err.max() < 0.05 * np.abs(ref).max(), (err.max(), np.abs(ref).max())


def _hf_model(config: ModelConfig, params):
    torch = pytest.importorskip("torch")
    import transformers

    hf_cls, cfg_cls = ((transformers.Qwen2ForCausalLM, transformers.Qwen2Config) if config.attention_bias
                       else (transformers.LlamaForCausalLM, transformers.LlamaConfig))
    hf_config = cfg_cls(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
                        num_attention_heads=config.num_attention_heads,
                        num_key_value_heads=config.num_key_value_heads, head_dim=config.resolved_head_dim,
                        rope_theta=config.rope_theta, rms_norm_eps=config.rms_norm_eps,
                        tie_word_embeddings=config.tie_word_embeddings, attn_implementation="eager")
    model = hf_cls(hf_config).eval()
    state = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx_to_dict(params)):
        keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
        value = np.asarray(leaf, np.float32)
        if keys[-1] == "kernel":
            keys[-1], value = "weight", value.T
        elif keys[-1] == "embedding":
            keys[-1] = "weight"
        name = ".".join(keys)
        state[name if name.startswith("lm_head") else "model." + name] = torch.from_numpy(value.copy())
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    return model


@pytest.mark.parametrize("tie, bias", [(True, True), (False, False)])
def test_matches_transformers(tiny_model_config, tie, bias):
    torch = pytest.importorskip("torch")
    config = dataclasses.replace(tiny_model_config, tie_word_embeddings=tie, attention_bias=bias)
    graphdef, params = init_model(config, seed=2)
    if bias:
        params = jax.tree.map(lambda x: x + 0.1 if x.ndim == 1 else x, params)
    model = _hf_model(config, params)
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(PROMPT_IDS.astype(np.int64)),
                    attention_mask=torch.from_numpy(PROMPT_MASK.astype(np.int64)),
                    position_ids=torch.from_numpy(np.asarray(positions_from_mask(PROMPT_MASK), np.int64)))
    expected = out.logits.numpy()
    got = np.asarray(full_logits(graphdef, params, PROMPT_IDS, PROMPT_MASK))
    real = PROMPT_MASK == 1
    np.testing.assert_allclose(got[real], expected[real], atol=1e-5, rtol=1e-5)
