"""The glm4_moe family beyond the HF folder tests (test_pretrained runs logits, greedy decoding, the KV cache and the
round trip for it, tied and untied): the router against transformers' own, the two stacks of layers in a scan,
with remat and in the decoder, routing replay over the routed layers, the correction bias never trained, LoRA on
both stacks and the config mapping."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hf_fixtures as hf
from grpo_jax.algo import decoder
from grpo_jax.algo.logprobs import completion_logps
from grpo_jax.config.sections import SamplingConfig
from grpo_jax.models import ModelConfig, forward, glm4_moe, init_model, lora
from grpo_jax.models.lora import LoRAConfig
from grpo_jax.models.registry import config_fields, to_hf_config

B, P, T, G = 4, 5, 6, 2


def _config(**overrides) -> ModelConfig:
    """The test zoo's tied GLM-4-MoE (one dense layer, two routed; 8 experts in 4 groups) as a ModelConfig."""
    return ModelConfig(**{**config_fields(hf.hf_config("glm4_moe", tied=True), "glm4_moe"), **overrides})


@pytest.fixture(scope="module")
def glm():
    config = _config()
    graphdef, params = init_model(config, seed=0)
    # a correction bias that moves the choice of experts, as a trained checkpoint's does
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: jax.random.normal(jax.random.key(1), x.shape) if "e_score_correction_bias" in
        jax.tree_util.keystr(path) else x, params)
    return config, graphdef, params


def _rows(seed=0):
    rng = np.random.default_rng(seed)
    prompt_ids = np.repeat(rng.integers(3, hf.VOCAB, (B // G, P)), G, axis=0).astype(np.int32)
    prompt_mask = np.ones((B, P), np.int32)
    prompt_mask[:G, :2] = 0
    completion_ids = rng.integers(3, hf.VOCAB, (B, T)).astype(np.int32)
    completion_mask = (np.arange(T)[None] < np.array([6, 3, 4, 1])[:, None]).astype(np.int32)
    return prompt_ids, prompt_mask, completion_ids, completion_mask


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_router_chooses_and_weighs_as_transformers(norm_topk_prob):
    torch = pytest.importorskip("torch")
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    hf_config = hf.hf_config("glm4_moe", tied=True, norm_topk_prob=norm_topk_prob)
    config = _config(norm_topk_prob=norm_topk_prob)
    router = Glm4MoeTopkRouter(hf_config)
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((config.num_experts, config.hidden_size)).astype(np.float32) * 0.3
    bias = rng.standard_normal(config.num_experts).astype(np.float32)
    x = rng.standard_normal((64, config.hidden_size)).astype(np.float32)
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(weight))
        router.e_score_correction_bias.copy_(torch.from_numpy(bias))
        _, want_w, want_e = (t.numpy() for t in router(torch.from_numpy(x)))
    experts, weights = glm4_moe.route(jnp.asarray(x @ weight.T), jnp.asarray(bias), config)
    order, want_order = np.argsort(experts, -1), np.argsort(want_e, -1)  # transformers' top k is unsorted
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(experts), order, -1),
                                  np.take_along_axis(want_e, want_order, -1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), order, -1),
                               np.take_along_axis(want_w, want_order, -1), rtol=1e-5)
    # the bias moved some choices, and the groups kept some experts out that the plain top k would take
    plain = np.asarray(jax.lax.top_k(jax.nn.sigmoid(jnp.asarray(x @ weight.T)), config.num_experts_per_tok)[1])
    assert (np.sort(plain, -1) != np.sort(np.asarray(experts), -1)).any()


def test_two_stacks_run_alike_as_a_loop_a_scan_with_remat_and_in_the_decoder(glm):
    config, graphdef, params = glm
    assert set(params) >= {"dense_layers", "layers"}
    assert params["dense_layers"]["mlp"]["gate_proj"]["kernel"].shape[0] == config.first_k_dense_replace
    rows = _rows(3)
    want, _ = completion_logps(graphdef, params, *rows, temperature=1.0)
    for options in (dict(scan_layers=True), dict(remat="full"), dict(scan_layers=True, remat="full")):
        other, _ = init_model(dataclasses.replace(config, **options), seed=0)
        got, _ = completion_logps(other, params, *rows, temperature=1.0)
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=str(options))
    # the decoder's KV cache path over both stacks: its log-probs are the full forward's
    options = decoder.DecodeOptions(sampling=SamplingConfig(max_completion_length=T), eos_token_ids=(1,),
                                    pad_token_id=0, group_size=G, record_routing=True)
    out = decoder.generate(graphdef, params, *rows[:2], jax.random.key(0), options)
    logps, _ = completion_logps(graphdef, params, *rows[:2], out.completion_ids, out.completion_mask, temperature=1.0)
    m = np.asarray(out.completion_mask) == 1
    np.testing.assert_allclose(np.asarray(out.sampler_per_token_logps)[m], np.asarray(logps)[m], atol=1e-5)
    # routing covers the routed layers only: the sampler's record is what a full forward chooses
    routed = config.num_hidden_layers - config.first_k_dense_replace
    assert out.routed_experts.shape == (B, P + T, routed, config.num_experts_per_tok)
    mask = np.concatenate([rows[1], np.asarray(out.completion_mask)], 1)
    _, _, routing = forward(graphdef, params, np.concatenate([rows[0], np.asarray(out.completion_ids)], 1),
                            np.maximum(np.cumsum(mask, 1) - 1, 0), mask, return_routing=True)
    own = np.asarray(routing.experts).transpose(1, 2, 0, 3)
    fed = mask == 1
    fed[np.arange(B), P + m.sum(1) - 1] = False  # the last token is never fed back
    np.testing.assert_array_equal(np.sort(np.asarray(out.routed_experts), -1)[fed], np.sort(own, -1)[fed])


def test_routing_replay_changes_the_routed_layers_only_through_their_experts(glm):
    config, graphdef, params = glm
    rows = _rows()
    mask = np.concatenate([rows[1], rows[3]], 1)
    _, _, routing = forward(graphdef, params, np.concatenate([rows[0], rows[2]], 1),
                            np.maximum(np.cumsum(mask, 1) - 1, 0), mask, return_routing=True)
    own = np.asarray(routing.experts).transpose(1, 2, 0, 3)
    base, _ = completion_logps(graphdef, params, *rows, temperature=1.0)
    same, _ = completion_logps(graphdef, params, *rows, temperature=1.0, routing=own)
    real = rows[3] == 1
    np.testing.assert_allclose(np.asarray(same)[real], np.asarray(base)[real], atol=2e-5)
    other = (own + 1) % config.num_experts
    moved, _ = completion_logps(graphdef, params, *rows, temperature=1.0, routing=other)
    assert np.abs(np.asarray(moved) - np.asarray(base))[real].max() > 1e-3


def test_the_correction_bias_is_a_buffer_no_update_moves(glm):
    """AdamW with weight decay over a loss of every parameter: each one moves but the correction bias."""
    from grpo_jax.algo.state import as_float32
    from grpo_jax.models import families

    config, graphdef, params = glm
    rows = _rows(1)

    def loss(p):
        logps, _ = completion_logps(graphdef, p, *rows, temperature=1.0)
        return -jnp.sum(logps * rows[3])

    grads = jax.grad(loss)(params)
    bias_grad = grads["layers"]["mlp"]["gate"]["e_score_correction_bias"][...]
    assert not np.asarray(bias_grad).any()
    optimizer = optax.adamw(1e-2, weight_decay=0.5)
    updates, _ = optimizer.update(as_float32(grads), optimizer.init(as_float32(params)), as_float32(params))
    new = optax.apply_updates(params, families.without_buffers(updates))
    moved = jax.tree_util.tree_map_with_path(lambda path, a, b: (jax.tree_util.keystr(path), bool((a != b).any())),
                                             params, new)
    flags = dict(jax.tree.leaves(moved, is_leaf=lambda x: isinstance(x, tuple)))
    frozen = [k for k, v in flags.items() if not v]
    assert frozen and all("e_score_correction_bias" in k for k in frozen), frozen


def test_lora_on_both_stacks_merges_and_names_every_layer_as_peft(glm):
    from grpo_jax.models.peft_io import peft_names

    config, _, params = glm
    lora_config = dataclasses.replace(config, lora=LoRAConfig(rank=2, target_modules="all-linear"))
    graphdef, adapted = init_model(lora_config, seed=0)
    flat = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(adapted)}
    a_names = [k for k in flat if "lora_a" in k]
    assert any("dense_layers" in k and "gate_proj" in k for k in a_names)  # the dense MLP
    assert any("shared_experts" in k for k in a_names)  # the shared experts, as PEFT's all-linear adapts them
    # B drawn non-zero: merged kernels give the adapted model's logits
    adapted = jax.tree_util.tree_map_with_path(lambda path, x: x + 0.1 if "lora_b" in jax.tree_util.keystr(path)
                                               else x, adapted)
    rows = _rows(2)
    want, _ = completion_logps(graphdef, adapted, *rows, temperature=1.0)
    got, _ = completion_logps(*lora.merged(graphdef, adapted), *rows, temperature=1.0)
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert peft_names("dense_layers.self_attn.q_proj.lora_a", config) == [
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    assert peft_names("layers.mlp.shared_experts.up_proj.lora_b", config)[-1] == (
        "base_model.model.model.layers.2.mlp.shared_experts.up_proj.lora_B.weight")


def test_config_maps_both_ways_and_refuses_what_glm_alone_has():
    pytest.importorskip("transformers")
    config = _config()
    hf_back = to_hf_config(config)
    assert hf_back.architectures == ["Glm4MoeForCausalLM"] and hf_back.first_k_dense_replace == 1
    assert hf_back.rope_parameters["partial_rotary_factor"] == 0.5
    assert ModelConfig(**config_fields(hf_back, "glm4_moe")) == config
    with pytest.raises(ValueError, match=r"model.first_k_dense_replace=1 is a GLM-4-MoE option: set it to 0"):
        ModelConfig(model_type="qwen3", first_k_dense_replace=1)
    with pytest.raises(ValueError, match=r"model.router_aux_loss_coef=0.001: GLM-4-MoE's sigmoid router"):
        _config(router_aux_loss_coef=0.001)
    with pytest.raises(ValueError, match=r"model.n_group=3 must divide model.num_experts=8"):
        _config(n_group=3)
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5 is not supported for model_type 'llama'"):
        config_fields(hf.hf_config("llama", tied=True, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                         "partial_rotary_factor": 0.5}), "llama")


def test_an_odd_rotary_dim_turns_as_transformers_turns_it(tmp_path):
    """head_dim 6 at factor 0.5: transformers' dim 3 has frequencies arange(0, 3, 2) / 3, two of them, which turn
    the first 4 dims (TRL's tiny GLM: head_dim 2, dim 1, the whole head)."""
    torch = pytest.importorskip("torch")
    from grpo_jax.models import from_pretrained

    torch_model = hf.build_model("glm4_moe", tied=True, head_dim=6)
    model, params = from_pretrained(hf.save_model(torch_model, tmp_path / "glm"))
    assert model.config.rotary_dim == 3
    ids = np.random.default_rng(0).integers(3, hf.VOCAB, (2, 9)).astype(np.int32)
    mask = np.ones_like(ids)
    with torch.no_grad():
        want = torch_model(input_ids=torch.tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(np.asarray(model(params, ids, mask)), want, atol=1e-4)


def test_the_router_stays_float32_where_decoding_casts_the_weights():
    """`compute_dtype_params` (the decoder's one cast) leaves GLM's router and its bias float32, as transformers keeps
    them, so a bfloat16 sampler routes on the numbers the update routes on; Qwen3-MoE's router is cast as before."""
    from grpo_jax.models import compute_dtype_params

    glm = _config(dtype="bfloat16")
    qwen = ModelConfig(model_type="qwen3_moe", vocab_size=64, num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=16, qk_norm=True, dtype="bfloat16")
    for config, router_dtype in ((glm, jnp.float32), (qwen, jnp.bfloat16)):
        cast = compute_dtype_params(*init_model(config, seed=0))
        dtypes = {jax.tree_util.keystr(p, simple=True, separator="."): x.dtype
                  for p, x in jax.tree_util.tree_leaves_with_path(cast)}
        assert dtypes["layers.mlp.gate.kernel.value"] == router_dtype
        assert dtypes["layers.self_attn.q_proj.kernel.value"] == jnp.bfloat16
    assert dtypes.get("layers.mlp.gate.e_score_correction_bias.value") is None  # qwen has none
