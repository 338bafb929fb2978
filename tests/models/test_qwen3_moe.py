"""The qwen3_moe family beyond the HF folder tests (test_pretrained runs logits, greedy decoding, KV cache and the
round trip for it): routing through every layout and the decoder, the load-balancing loss against transformers',
its place in the train step, config mapping and LoRA."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from grpo_jax.algo import decoder
from grpo_jax.algo.logprobs import completion_logps
from grpo_jax.algo.programs import init_state, jit_train_step
from grpo_jax.algo.train_step import StepOptions
from grpo_jax.algo.trajectory import packed_length
from grpo_jax.config.sections import SamplingConfig
from grpo_jax.device import sharding
from grpo_jax.losses import LossConfig
from grpo_jax.models import forward, init_model
from grpo_jax.models.lora import LoRAConfig
from grpo_jax.models.moe import load_balancing_loss
from grpo_jax.models.registry import config_fields, to_hf_config

MOE = dict(model_type="qwen3_moe", qk_norm=True, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
           norm_topk_prob=True)
B, P, T, G = 4, 5, 6, 2


def _rows(seed=0):
    """Left-padded prompts (groups of G rows share one), right-padded completions of ragged lengths."""
    rng = np.random.default_rng(seed)
    prompt_ids = np.repeat(rng.integers(3, 32, (B // G, P)), G, axis=0).astype(np.int32)
    prompt_mask = np.ones((B, P), np.int32)
    prompt_mask[:G, :2] = 0
    completion_ids = rng.integers(3, 32, (B, T)).astype(np.int32)
    completion_mask = (np.arange(T)[None] < np.array([6, 3, 4, 1])[:, None]).astype(np.int32)
    return prompt_ids, prompt_mask, completion_ids, completion_mask


@pytest.fixture(scope="module")
def moe(tiny_model_config):
    config = dataclasses.replace(tiny_model_config, **MOE)
    graphdef, params = init_model(config, seed=0)
    return config, graphdef, params


def _own_routing(graphdef, params, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """The experts a padded forward of prompt ++ completion chooses: [B, P + T, L, K]."""
    mask = np.concatenate([prompt_mask, completion_mask], 1)
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
    _, _, routing = forward(graphdef, params, np.concatenate([prompt_ids, completion_ids], 1), positions, mask,
                            return_routing=True)
    return np.asarray(routing.experts).transpose(1, 2, 0, 3)


LAYOUTS = {"padded": {}, "shared": dict(prompt_group_size=G), "packed": dict(prompt_group_size=G, packed_length=1)}


def _layout(name, rows):
    options = dict(LAYOUTS[name])
    if "packed_length" in options:
        options["packed_length"] = packed_length(rows[1].sum(1), rows[3].sum(1), G)
    return options


def test_routing_replay_reaches_every_layout(moe):
    """Replaying the model's own routing changes nothing; replaying other experts changes the log-probs, the same
    way in the padded, shared-prompt and packed layouts (each slot replays its own token's experts)."""
    config, graphdef, params = moe
    rows = _rows()
    mask = rows[3] == 1
    own = _own_routing(graphdef, params, *rows)
    other = (own + 1 + np.arange(own.size).reshape(own.shape) % 3) % config.num_experts  # shifted, rarely equal
    other[..., 1] = np.where(other[..., 1] == other[..., 0], (other[..., 0] + 1) % config.num_experts, other[..., 1])
    other[:, :P] = np.repeat(other[::G, :P], G, axis=0)  # a group's rows share their prompt's routing
    base, _ = completion_logps(graphdef, params, *rows, temperature=1.0)
    replayed = {}
    for name in LAYOUTS:
        same, _ = completion_logps(graphdef, params, *rows, temperature=1.0, routing=own, **_layout(name, rows))
        np.testing.assert_allclose(np.asarray(same)[mask], np.asarray(base)[mask], atol=2e-5, err_msg=name)
        replayed[name], _ = completion_logps(graphdef, params, *rows, temperature=1.0, routing=other,
                                             **_layout(name, rows))
    assert np.abs(np.asarray(replayed["padded"]) - np.asarray(base))[mask].max() > 1e-2
    for name in ("shared", "packed"):
        np.testing.assert_allclose(np.asarray(replayed[name])[mask], np.asarray(replayed["padded"])[mask],
                                   atol=2e-5, err_msg=name)


def test_router_aux_loss_matches_transformers_in_padded_and_packed_layouts(moe):
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    config, graphdef, params = moe
    rows = _rows(1)
    mask = np.concatenate([rows[1], rows[3]], 1)
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
    _, _, routing = forward(graphdef, params, np.concatenate([rows[0], rows[2]], 1), positions, mask,
                            return_routing=True)
    # transformers' function on the router logits of every layer ([B * S, E] each) with the attention mask
    want = load_balancing_loss_func(tuple(torch.tensor(np.asarray(x).reshape(-1, config.num_experts))
                                          for x in routing.logits), config.num_experts, config.num_experts_per_tok,
                                    torch.tensor(mask)).numpy()
    for name in ("padded", "packed"):
        _, _, aux = completion_logps(graphdef, params, *rows, temperature=1.0, router_aux=True,
                                     **_layout(name, rows))
        np.testing.assert_allclose(aux, want, rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("num_slots", [0, 3])
def test_decoder_records_the_experts_of_every_token_it_runs(moe, num_slots):
    """The sampler's recorded experts are those a full forward of the sampled rows chooses (float32), for the
    prompt and every completion token fed back in (all but the last), with a slot per row or continuous
    batching."""
    config, graphdef, params = moe
    prompt_ids, prompt_mask, _, _ = _rows(2)
    options = decoder.DecodeOptions(sampling=SamplingConfig(max_completion_length=T), eos_token_ids=(1,),
                                    pad_token_id=0, group_size=G, num_slots=num_slots, record_routing=True)
    rows = decoder.generate(graphdef, params, prompt_ids, prompt_mask, jax.random.key(0), options)
    recorded = np.asarray(rows.routed_experts).astype(np.int32)
    assert recorded.shape == (B, P + T, config.num_hidden_layers, config.num_experts_per_tok)
    own = _own_routing(graphdef, params, prompt_ids, prompt_mask, np.asarray(rows.completion_ids),
                       np.asarray(rows.completion_mask))
    fed = np.concatenate([prompt_mask, np.asarray(rows.completion_mask)], 1) == 1
    fed[np.arange(B), P + np.asarray(rows.completion_mask).sum(1) - 1] = False  # the last token is never fed
    # the top K as a set: the order of two experts of equal rank is the routers' business
    np.testing.assert_array_equal(np.sort(recorded, -1)[fed], np.sort(own, -1)[fed])


def test_train_step_adds_the_router_aux_loss(moe):
    """loss(coef) - loss(0) == coef * router_aux_loss, the mean over micro-batches of transformers' loss."""
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
    from tests.algo.test_train_step import make_batch, one_device_mesh

    config, _, _ = moe
    mesh = one_device_mesh()
    optimizer = optax.sgd(0.0)
    graphdef, state = init_state(config, optimizer, seed=0, with_reference=True, mesh=mesh)
    batch = make_batch(graphdef, state.params, seed=0)
    metrics = {}
    for coef in (0.0, 0.5):
        step = jit_train_step(graphdef, optimizer, StepOptions(LossConfig(), 1.0, 2, router_aux_loss_coef=coef),
                              mesh, sharding.tree_shardings(state))
        _, metrics[coef] = jax.device_get(step(jax.tree.map(jnp.copy, state), batch))
    aux = metrics[0.5]["router_aux_loss"]
    np.testing.assert_allclose(metrics[0.5]["loss"] - metrics[0.0]["loss"], 0.5 * aux, rtol=1e-4)
    want = []
    for m in range(2):  # micro-batch m: rows m, m + 2, ...
        ids = np.concatenate([batch.prompt_ids, batch.completion_ids], 1)[m::2]
        mask = np.concatenate([batch.prompt_mask, batch.completion_mask], 1)[m::2]
        _, _, routing = forward(graphdef, state.params, ids, np.maximum(np.cumsum(mask, 1) - 1, 0), mask,
                                return_routing=True)
        want.append(load_balancing_loss_func(tuple(torch.tensor(np.asarray(x).reshape(-1, config.num_experts))
                                                   for x in routing.logits), config.num_experts,
                                             config.num_experts_per_tok, torch.tensor(mask)).item())
    np.testing.assert_allclose(aux, np.mean(want), rtol=1e-5)
    assert "router_aux_loss" not in metrics[0.0]


def test_scan_and_remat_equal_the_layer_loop(moe):
    config, graphdef, params = moe
    rows = _rows(3)
    want = completion_logps(graphdef, params, *rows, temperature=1.0, router_aux=True)
    for options in (dict(scan_layers=True), dict(remat="full")):
        other, _ = init_model(dataclasses.replace(config, **options), seed=0)
        got = completion_logps(other, params, *rows, temperature=1.0, router_aux=True)
        np.testing.assert_allclose(got[0], want[0], atol=1e-5)
        np.testing.assert_allclose(got[2], want[2], rtol=1e-6)
    assert float(load_balancing_loss(jnp.zeros((1, 4, 8)), 2)) == pytest.approx(2.0)  # uniform router: K


def test_config_maps_both_ways_and_refuses_dense_layers(moe):
    pytest.importorskip("transformers")
    config, _, _ = moe
    hf = to_hf_config(config)
    assert hf.architectures == ["Qwen3MoeForCausalLM"] and hf.num_experts == 8 and hf.norm_topk_prob
    assert dataclasses.replace(config, **config_fields(hf)) == dataclasses.replace(
        config, head_dim=config.resolved_head_dim)
    hf.mlp_only_layers = [1]
    with pytest.raises(ValueError, match="dense-MLP layers are not supported"):
        config_fields(hf)
    with pytest.raises(ValueError, match="mixture-of-experts models are qwen3_moe"):
        dataclasses.replace(config, model_type="qwen3")


def test_lora_adapts_attention_and_refuses_experts(moe):
    config, _, _ = moe
    graphdef, params = init_model(dataclasses.replace(config, lora=LoRAConfig(rank=4)), seed=0)
    names = {sharding.path_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)}
    adapted = {n.rsplit(".", 2)[-2] for n in names if n.endswith("lora_a")}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj"}
    with pytest.raises(ValueError, match="experts"):
        dataclasses.replace(config, lora=LoRAConfig(rank=4, target_modules=("q_proj", "up_proj")))


def test_a_moe_run_with_routing_replay_and_the_router_aux_loss(tmp_path):
    """The embedded task end to end on a random Qwen3-MoE: the sampler records routing, the steps replay it and
    log the load-balancing loss (the model's own coefficient: loss.router_aux_loss_coef null)."""
    import json

    from grpo_jax.api import trainer
    from grpo_jax.config import load_config

    overrides = [f"output_dir={tmp_path}", "max_steps=2", "train.train_batch_size=16", "train.num_generations=4",
                 "eval.num_examples=0", "sampling.max_completion_length=4", "model.init=random",
                 "model.routing_replay=true", "train.gradient_accumulation_steps=2",
                 *(f"model.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in MOE.items())]
    trainer.train(load_config(None, overrides), show_progress=False)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    aux = [line["router_aux_loss"] for line in lines if "router_aux_loss" in line]
    assert len(aux) == 2 and all(np.isfinite(aux)) and all(a > 0 for a in aux)


def test_router_aux_loss_coef_resolves_as_trl():
    """TRL's flat name is ours; null takes the model's own coefficient (0 for a dense model); a coefficient or
    routing replay for a dense model is refused."""
    from grpo_jax.api.run import router_aux_loss_coef
    from grpo_jax.config import load_config

    moe = [f"model.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in MOE.items()]
    assert load_config(None, ["router_aux_loss_coef=0.01"]).loss.router_aux_loss_coef == 0.01
    assert router_aux_loss_coef(load_config(None, [*moe, "model.router_aux_loss_coef=0.002"])) == 0.002
    assert router_aux_loss_coef(load_config(None, [*moe, "loss.router_aux_loss_coef=0"])) == 0.0
    assert router_aux_loss_coef(load_config(None, [])) == 0.0
    with pytest.raises(ValueError, match="has no experts"):
        router_aux_loss_coef(load_config(None, ["loss.router_aux_loss_coef=0.01"]))
    with pytest.raises(ValueError, match="routing_replay=true needs a mixture-of-experts model"):
        load_config(None, ["model.routing_replay=true"])
