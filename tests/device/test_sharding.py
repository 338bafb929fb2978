"""Mesh, partition rules and sharded == single-device on 8 fake CPU devices (train step, greedy sampling)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec

from grpo_jax.algo import reference
from grpo_jax.algo.programs import init_state, jit_decoder, jit_train_step
from grpo_jax.algo.sampling import SamplingConfig
from grpo_jax.algo.train_step import StepOptions
from grpo_jax.device import sharding
from grpo_jax.losses import LossConfig
from grpo_jax.models import ModelConfig, init_model
from grpo_jax.rollout import stream
from tests.algo.test_train_step import make_batch, one_device_mesh

MESHES = [(8, 1, 1), (2, 4, 1), (2, 2, 2), (1, 4, 2)]
needs_8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")


def specs(params) -> dict:
    return {sharding.path_name(p): x.sharding.spec for p, x in jax.tree_util.tree_leaves_with_path(params)}


@needs_8
def test_rules_cover_every_parameter_and_split_it():
    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attention_bias=True, tie_word_embeddings=False,
                         attention_out_bias=True, mlp_bias=True, qk_norm=True)
    mesh = sharding.make_mesh(2, 2, 2)
    _, params = init_model(config, 0)
    shardings = sharding.param_shardings(mesh, jax.eval_shape(lambda: params))
    placed = jax.device_put(params, shardings)
    got = specs(placed)
    expected_tail = {"q_proj.kernel": ("fsdp", "tensor"), "k_proj.kernel": ("fsdp", "tensor"),
                     "v_proj.kernel": ("fsdp", "tensor"), "o_proj.kernel": ("tensor", "fsdp"),
                     "gate_proj.kernel": ("fsdp", "tensor"), "up_proj.kernel": ("fsdp", "tensor"),
                     "down_proj.kernel": ("tensor", "fsdp"), "q_proj.bias": ("tensor",),
                     "embed_tokens.embedding": ("tensor", "fsdp"), "lm_head.kernel": ("fsdp", "tensor"),
                     "input_layernorm.weight": (None,), "norm.weight": (None,)}
    for name, spec in got.items():
        suffix = [k for k in expected_tail if name.endswith(k)]
        if suffix:
            want = expected_tail[max(suffix, key=len)]
            assert tuple(spec)[-len(want):] == want and all(a is None for a in tuple(spec)[:-len(want)]), name
    assert any(k.endswith("q_proj.kernel") for k in got) and any(k.endswith("lm_head.kernel") for k in got)
    # a split array really holds a slice per device
    q = next(x for p, x in jax.tree_util.tree_leaves_with_path(placed)
             if sharding.path_name(p).endswith("q_proj.kernel"))
    assert q.addressable_shards[0].data.shape[-2:] == (q.shape[-2] // 2, q.shape[-1] // 2)


@needs_8
def test_non_dividing_dim_stays_replicated_with_one_warning():
    mesh = sharding.make_mesh(1, 4, 2)
    abstract = {"embed_tokens": {"embedding": jax.ShapeDtypeStruct((33, 8), jnp.float32)},
                "mlp": {"up_proj": {"kernel": jax.ShapeDtypeStruct((8, 6), jnp.float32)}}}
    with pytest.warns(UserWarning, match="stay replicated") as record:
        out = sharding.param_shardings(mesh, abstract)
    assert len(record) == 1
    assert out["embed_tokens"]["embedding"].spec == PartitionSpec(None, "fsdp")  # 33 % 2 != 0
    assert out["mlp"]["up_proj"]["kernel"].spec == PartitionSpec("fsdp", "tensor")


def test_unknown_parameter_is_a_clear_error():
    mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    with pytest.raises(ValueError, match="no partition rule for parameter 'foo.weird'"):
        sharding.param_shardings(mesh, {"foo": {"weird": jax.ShapeDtypeStruct((4, 4), jnp.float32)}})


@needs_8
@pytest.mark.parametrize("sizes, match", [((3, 1, 1), "needs 3 devices"), ((-1, 3, 1), "do not divide the 8"),
                                          ((2, 2, 1), "needs 4 devices"), ((-1, -1, 2), "at most one"),
                                          ((0, 1, 8), "must be >= 1")])
def test_bad_mesh_sizes_are_clear_errors(sizes, match):
    with pytest.raises(ValueError, match=match):
        sharding.make_mesh(*sizes)


@needs_8
def test_rows_must_split_over_data_parallel_devices():
    with pytest.raises(ValueError, match="multiple of 4"):
        sharding.check_rows(6, sharding.make_mesh(2, 2, 2), "train.train_batch_size")


def run(config, mesh, *, steps=2, grad_accum=2):
    """`steps` SGD(lr 1) steps, so updated params minus the start are minus the summed gradients."""
    optimizer = optax.sgd(1.0)
    graphdef, state = init_state(config, optimizer, seed=0, with_reference=True, mesh=mesh)
    loss = LossConfig(beta=0.04)
    step = jit_train_step(graphdef, optimizer, StepOptions(loss, 1.0, grad_accum), mesh,
                          sharding.tree_shardings(state))
    metrics = []
    for seed in range(steps):
        batch = make_batch(graphdef, jax.device_get(state.params), seed=seed)
        state, m = step(state, batch)
        metrics.append(m)
    return state, jax.device_get(metrics), step


@pytest.fixture(scope="module")
def single(tiny_model_config):
    state, metrics, _ = run(tiny_model_config, one_device_mesh())
    return jax.device_get(state), metrics


@needs_8
@pytest.mark.parametrize("shape", MESHES)
def test_sharded_train_steps_equal_single_device(tiny_model_config, single, shape):
    mesh = sharding.make_mesh(*shape)
    state, metrics, step = run(tiny_model_config, mesh)
    single_state, single_metrics = single
    # float32; sharded matmuls and psums add in another order: ~1e-7 relative per op, a few ulps through the step.
    # The loss is a sum of O(1) per-token terms that cancel to O(1e-2): a few ulps of those terms, ~3e-7 absolute
    # (3.1e-7 measured at (1, 4, 2) since the step also computes the clip-ratio extremes and the entropy control)
    for m, s in zip(metrics, single_metrics):
        for k in ("loss", "grad_norm", "kl", "entropy"):
            np.testing.assert_allclose(m[k], s[k], rtol=1e-5, atol=1e-6 if k == "loss" else 1e-7, err_msg=k)
    # each updated element is init minus gradient sums over every row and token (the tied embedding's over ~1,000
    # terms of either sign): a small element is a cancellation of larger terms, so its rounding scales with the
    # leaf's largest magnitude (8 row shards vs 1 moved one embedding element by 1.3e-6; that leaf peaks at ~0.6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max()),
                 jax.device_get(state.params), single_state.params)
    assert step._cache_size() == 1  # no recompilation across steps
    q = next(x for p, x in jax.tree_util.tree_leaves_with_path(state.params)
             if sharding.path_name(p).endswith("q_proj.kernel"))
    assert tuple(q.sharding.spec)[-2:] == ("fsdp", "tensor")
    assert q.addressable_shards[0].data.shape[-2:] == (q.shape[-2] // shape[1], q.shape[-1] // shape[2])


@needs_8
@pytest.mark.parametrize("shape", MESHES)
def test_greedy_sampling_equals_single_device(tiny_model, shape):
    model_config, graphdef, params = tiny_model
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 32, (8, 5)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[::3, :2] = 0
    config = SamplingConfig(max_completion_length=6)

    def sample(mesh):
        shardings = sharding.param_shardings(mesh, params)
        dec = jit_decoder(graphdef, mesh, model_config, config=config, eos_token_ids=(1,), pad_token_id=0,
                          params_sharding=shardings)
        return jax.device_get(stream.generate(dec, jax.device_put(params, shardings), ids, mask, jax.random.key(0),
                                              greedy=True))

    single_out, out = sample(one_device_mesh()), sample(sharding.make_mesh(*shape))
    np.testing.assert_array_equal(out.completion_ids, single_out.completion_ids)
    np.testing.assert_array_equal(out.completion_mask, single_out.completion_mask)
    np.testing.assert_allclose(out.sampler_per_token_logps, single_out.sampler_per_token_logps, rtol=1e-5,
                               atol=1e-6)


@needs_8
def test_adam_moments_follow_params_and_stay_float32_with_bf16_params(tiny_model_config):
    config = dataclasses.replace(tiny_model_config, dtype="bfloat16", param_dtype="bfloat16")
    optimizer = optax.adamw(1e-3)
    mesh = sharding.make_mesh(2, 2, 2)
    graphdef, state = init_state(config, optimizer, seed=0, with_reference=True, mesh=mesh,
                                 ref_param_dtype="float32")
    params_specs = specs(state.params)
    for path, x in jax.tree_util.tree_leaves_with_path(state.opt_state):
        name = sharding.path_name(path)
        if x.ndim:
            assert x.dtype == jnp.float32, name
            match = [k for k in params_specs if name.endswith(k)]
            assert match and x.sharding.spec == params_specs[max(match, key=len)], name
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(state.ref_params)} == {jnp.dtype(jnp.float32)}
    step = jit_train_step(graphdef, optimizer, StepOptions(LossConfig(), 1.0), mesh, sharding.tree_shardings(state))
    new_state, metrics = step(state, make_batch(graphdef, jax.device_get(state.params)))
    assert np.isfinite(metrics["loss"]) and metrics["skipped"] == 0
    assert {x.dtype for x in jax.tree.leaves(new_state.params)} == {jnp.dtype(jnp.bfloat16)}


@needs_8
def test_offloaded_reference_lives_in_host_memory_and_mixes(tiny_model_config):
    mesh = sharding.make_mesh(2, 2, 2)
    optimizer = optax.sgd(1.0)
    graphdef, state = init_state(tiny_model_config, optimizer, seed=0, with_reference=True, mesh=mesh,
                                 offload_ref_params=True)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state.ref_params)} == {"pinned_host"}
    ref_before = jax.device_get(state.ref_params)
    sync = reference.RefSyncConfig(sync_ref_model=True, ref_model_mixup_alpha=0.5, ref_model_sync_steps=1)
    step = jit_train_step(graphdef, optimizer, StepOptions(LossConfig(), 1.0, ref_sync=sync), mesh,
                          sharding.tree_shardings(state))
    state, _ = step(state, make_batch(graphdef, jax.device_get(state.params)))
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state.ref_params)} == {"pinned_host"}
    expected = jax.tree.map(lambda r, p: 0.5 * p + 0.5 * r, ref_before, jax.device_get(state.params))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
                 jax.device_get(state.ref_params), expected)


@needs_8
def test_state_from_given_params_is_laid_out_like_init_state(tiny_model_config):
    from grpo_jax.algo.programs import state_from_params
    mesh = sharding.make_mesh(2, 2, 2)
    optimizer = optax.adamw(1e-3)
    _, state = init_state(tiny_model_config, optimizer, seed=0, with_reference=True, mesh=mesh)
    _, params = init_model(tiny_model_config, 0)
    expected = jax.device_get(params)
    given = state_from_params(params, optimizer, seed=0, with_reference=True, mesh=mesh)
    assert jax.tree.structure(given) == jax.tree.structure(state)
    jax.tree.map(lambda a, b: a.sharding.is_equivalent_to(b.sharding, a.ndim) or pytest.fail(str(a.sharding)),
                 given, state)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(given.params), expected)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(given.ref_params), expected)


@needs_8
def test_host_threads_refuse_a_multi_device_mesh(tiny_model):
    model_config, graphdef, _ = tiny_model
    with pytest.raises(ValueError, match="sampling.host_threads=2 .* 8 devices"):
        jit_decoder(graphdef, sharding.make_mesh(8, 1, 1), model_config, config=SamplingConfig(host_threads=2),
                    eos_token_ids=(1,), pad_token_id=0, cpu_speedups=True)
    # the CPU speed-ups off: host_threads is not used, nothing to refuse
    jit_decoder(graphdef, sharding.make_mesh(8, 1, 1), model_config, config=SamplingConfig(host_threads=2),
                eos_token_ids=(1,), pad_token_id=0, cpu_speedups=False)


MOE = dict(model_type="qwen3_moe", qk_norm=True, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
           norm_topk_prob=True)


@needs_8
@pytest.mark.parametrize("shape", [(4, 1, 1, 2), (2, 1, 1, 4), (1, 2, 1, 4), (1, 2, 2, 2)])
def test_moe_train_steps_with_expert_axis_equal_single_device(tiny_model_config, shape):
    """Qwen3-MoE with its experts split 2 or 4 ways over the `expert` axis: the same steps as one device."""
    config = dataclasses.replace(tiny_model_config, **MOE)
    data, fsdp, tensor, expert = shape
    state, metrics, step = run(config, sharding.make_mesh(data, fsdp, tensor, expert=expert))
    single_state, single_metrics = run(config, one_device_mesh())[:2]
    for m, s in zip(metrics, single_metrics):
        for k in ("loss", "grad_norm", "kl", "entropy"):
            np.testing.assert_allclose(m[k], s[k], rtol=1e-5, atol=1e-7, err_msg=k)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max()),
                 jax.device_get(state.params), jax.device_get(single_state.params))
    assert step._cache_size() == 1
    up = next(x for p, x in jax.tree_util.tree_leaves_with_path(state.params)
              if sharding.path_name(p).endswith("experts.up_proj"))
    assert tuple(up.sharding.spec) == (None, "expert", "fsdp", "tensor")
    assert up.addressable_shards[0].data.shape[1] == MOE["num_experts"] // expert


@needs_8
def test_moe_greedy_sampling_with_expert_axis_equals_single_device(tiny_model_config):
    """Decoding (prefill, cached steps) with the experts split 4 ways: the same tokens, log-probs and recorded
    routing as one device."""
    config = dataclasses.replace(tiny_model_config, routing_replay=True, **MOE)
    graphdef, params = init_model(config, 0)
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 32, (8, 5)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[::3, :2] = 0

    def sample(mesh):
        shardings = sharding.param_shardings(mesh, params)
        dec = jit_decoder(graphdef, mesh, config, config=SamplingConfig(max_completion_length=6), eos_token_ids=(1,),
                          pad_token_id=0, params_sharding=shardings)
        return jax.device_get(stream.generate(dec, jax.device_put(params, shardings), ids, mask, jax.random.key(0),
                                              greedy=True))

    single_out, out = sample(one_device_mesh()), sample(sharding.make_mesh(2, 1, 1, expert=4))
    np.testing.assert_array_equal(out.completion_ids, single_out.completion_ids)
    np.testing.assert_array_equal(out.routed_experts, single_out.routed_experts)
    np.testing.assert_allclose(out.sampler_per_token_logps, single_out.sampler_per_token_logps, rtol=1e-5,
                               atol=1e-6)
