"""The jitted train step: micro-batching, sharding, recompilation and non-finite guards."""

import dataclasses
import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from grpo_jax.algo.logprobs import completion_logps
from grpo_jax.algo.programs import init_state, jit_train_step
from grpo_jax.algo.state import learning_rate_schedule, make_optimizer
from grpo_jax.algo.train_step import StepOptions, train_step
from grpo_jax.algo.trajectory import packed_length, Trajectory
from grpo_jax.device import sharding
from grpo_jax.losses import LossConfig, compute_loss

B, P, T = 16, 5, 6

# the batch's log-probs as one program (compiled once), not completion_logps' ops dispatched one by one
_batch_logps = jax.jit(functools.partial(completion_logps, temperature=1.0), static_argnums=0)


def make_batch(graphdef, params, *, seed=0, off_policy=True, beta=0.04, group_size=1) -> Trajectory:
    """Random rows with ragged masks, a fully masked row, and old/ref log-probs near the current ones;
    `group_size` consecutive rows share a prompt. The loss trains every completion token (loss mask = mask)."""
    rng = np.random.default_rng(seed)
    prompt_ids = np.repeat(rng.integers(3, 32, (B // group_size, P)).astype(np.int32), group_size, axis=0)
    prompt_mask = np.ones((B // group_size, P), np.int32)
    prompt_mask[::3, :2] = 0  # left padding
    prompt_mask = np.repeat(prompt_mask, group_size, axis=0)
    completion_ids = rng.integers(3, 32, (B, T)).astype(np.int32)
    lengths = rng.integers(1, T + 1, B)
    lengths[1] = 0  # a fully masked row
    completion_mask = (np.arange(T)[None] < lengths[:, None]).astype(np.int32)
    # on the host's params: every mesh's run of a test gets the same batch
    logps, _ = _batch_logps(graphdef, jax.device_get(params), prompt_ids, prompt_mask, completion_ids,
                            completion_mask)
    old = np.asarray(logps) + rng.normal(0, 0.3, (B, T)).astype(np.float32) if off_policy else None
    ref = np.asarray(logps) + rng.normal(0, 0.2, (B, T)).astype(np.float32) if beta else None
    advantages = rng.normal(0, 1, B).astype(np.float32)
    # the sampler's log-probs: near the learner's, so the sampler/learner IS correction and the off-policy mask act
    base = old if old is not None else np.asarray(logps)
    sampler = (base + rng.normal(0, 0.05, (B, T)).astype(np.float32)) * completion_mask
    return Trajectory(prompt_ids, prompt_mask, completion_ids, completion_mask, loss_mask=completion_mask,
                      sampler_per_token_logps=sampler, turns=np.where(completion_mask == 1, 0, -1),
                      is_truncated=lengths == T, advantages=advantages, old_per_token_logps=old,
                      ref_per_token_logps=ref)


def _options(loss, *args, **kwargs):
    """StepOptions whose loss gets the rows' sampler log-probs (the IS correction and off-policy mask act)."""
    return StepOptions(loss, *args, use_sampler_logps=True, **kwargs)


def _optimizer(lr, adam):
    return (make_optimizer(optax.constant_schedule(lr), weight_decay=0.0, b1=0.9, b2=0.99, eps=1e-8,
                           max_grad_norm=1.0) if adam else optax.sgd(1.0))


@functools.cache
def _initial_state(tiny_model_config, mesh, with_reference, lr, adam):
    """init_state once per (model, mesh, reference, optimizer): graphdef, a host copy, and its layout."""
    graphdef, state = init_state(tiny_model_config, _optimizer(lr, adam), seed=0, with_reference=with_reference,
                                 mesh=mesh)
    return graphdef, jax.device_get(state), sharding.tree_shardings(state)


def setup(tiny_model_config, mesh, *, beta=0.04, lr=1e-2, adam=True):
    """Adam for the update test; plain SGD (lr 1) elsewhere, so param differences are gradient differences
    (Adam's first step lr*g/(|g|+eps) turns rounding noise in near-zero gradients into lr-sized jumps)."""
    graphdef, host_state, shardings = _initial_state(tiny_model_config, mesh, beta != 0, lr, adam)
    # a fresh copy of init_state's output in its layout (the step donates the state it is given)
    return graphdef, _optimizer(lr, adam), jax.device_put(host_state, shardings)


def one_device_mesh():
    return sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])


def run_step(tiny_model_config, mesh, loss_config, grad_accum=1, batch_seed=0, group_size=1, prompt_group_size=1,
             packing=False, buffers=0, chunk_size=0):
    beta = loss_config.resolved_beta
    graphdef, optimizer, state = setup(tiny_model_config, mesh, beta=beta, adam=False)
    batch = make_batch(graphdef, state.params, seed=batch_seed, beta=beta, group_size=group_size)
    options = _options(loss_config, temperature=1.0, gradient_accumulation_steps=grad_accum,
                       prompt_group_size=prompt_group_size, logps_chunk_size=chunk_size)
    step = jit_train_step(graphdef, optimizer, options, mesh, sharding.tree_shardings(state))
    length = 0
    if packing:
        counts = [np.concatenate([np.sum(m, 1)[i::grad_accum] for i in range(grad_accum)])  # micro-batch order
                  for m in (batch.prompt_mask, batch.completion_mask)]
        length = packed_length(*counts, prompt_group_size, buffers * grad_accum)
    new_state, metrics = step(state, batch, length, buffers)
    return jax.device_get((new_state, metrics))


LOSSES = [LossConfig(loss_type="grpo"), LossConfig(loss_type="bnpo", beta=0.0),
          LossConfig(loss_type="dr_grpo", max_completion_length=T), LossConfig(loss_type="dapo", epsilon_high=0.28),
          LossConfig(loss_type="cispo", epsilon_high=1.2, beta=0.0), LossConfig(loss_type="sapo"),
          LossConfig(loss_type="luspo", importance_sampling_level="sequence"),
          LossConfig(loss_type="vespo", beta=0.0, vllm_importance_sampling_mode="token_truncate"),
          LossConfig(loss_type="grpo", importance_sampling_level="sequence_token", delta=2.0,
                     off_policy_mask_threshold=0.01, vllm_importance_sampling_mode="token_mask",
                     vllm_importance_sampling_clip_max=1.05),
          LossConfig(loss_type="dapo", entropy_coef=0.01, use_bias_correction_kl=True, kl_estimator="k1")]


def _loss_id(config):
    return "-".join([config.loss_type, config.importance_sampling_level, *(["entropy"] if config.entropy_coef else [])])


@pytest.mark.parametrize("loss_config", LOSSES, ids=_loss_id)
def test_micro_batched_step_equals_full_batch(tiny_model_config, loss_config):
    mesh = one_device_mesh()
    full_state, full_metrics = run_step(tiny_model_config, mesh, loss_config, grad_accum=1)
    keys = [k for k in ("loss", "grad_norm", "entropy", "kl", "clip_ratio/region_mean", "clip_ratio/low_mean",
                        "cispo_clip_ratio") if k in full_metrics]
    # 4 micro-batches (the accumulation scan is the same program for any count > 1; 2 is tested on a mesh in
    # test_sharding)
    state, metrics = run_step(tiny_model_config, mesh, loss_config, grad_accum=4)
    assert set(metrics) == set(full_metrics)
    for key in keys:
        # atol: the loss is a sum of O(1) per-token terms that cancel to O(1e-3), so float32 summation
        # order moves it by ~1e-7 absolute
        np.testing.assert_allclose(metrics[key], full_metrics[key], rtol=1e-5, atol=1e-6, err_msg=key)
    # SGD with lr 1: params = p - g, and g reaches the leaf's own scale (grad_norm ~16 for luspo, whose
    # length-scaled sequence ratio exp(sum of log-ratios) amplifies the ulp-level logps differences of
    # forwards over 16 vs 4 rows), so an element left small by a large step carries the leaf's rounding
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5,
                                                         atol=2e-6 * max(1.0, float(np.abs(b).max()))),
                 state.params, full_state.params)
    if "clip_ratio/region_mean" in full_metrics and loss_config.importance_sampling_level == "token":
        assert full_metrics["clip_ratio/region_mean"] > 0  # the case exercises the clip
    if loss_config.loss_type == "cispo":
        assert full_metrics["cispo_clip_ratio"] > 0


def test_step_passes_sampler_logps_and_entropies_to_the_loss(tiny_model_config):
    """The IS correction and the top-entropy mask reach the loss: each changes the step's gradient."""
    mesh = one_device_mesh()
    base = LossConfig(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=1.01)
    _, with_is = run_step(tiny_model_config, mesh, base)
    no_correction = dataclasses.replace(base, vllm_importance_sampling_correction=False)
    _, without_is = run_step(tiny_model_config, mesh, no_correction)
    _, top = run_step(tiny_model_config, mesh, dataclasses.replace(base, top_entropy_quantile=0.2))
    assert with_is["grad_norm"] != pytest.approx(without_is["grad_norm"], rel=1e-4)
    assert top["grad_norm"] != pytest.approx(with_is["grad_norm"], rel=1e-4)


def test_custom_loss_fn_replaces_compute_loss(tiny_model_config):
    """StepOptions.loss_fn: a user loss with compute_loss's signature runs inside the jitted step."""
    mesh = one_device_mesh()
    config = LossConfig()

    def scaled(*args, **kwargs):
        loss, aux = compute_loss(*args, **kwargs)
        return 2.0 * loss, {"kl": aux.kl, "my_metric": aux.kl + 1.0}

    graphdef, optimizer, state = setup(tiny_model_config, mesh, adam=False)
    batch = make_batch(graphdef, state.params)
    shardings = sharding.tree_shardings(state)
    reference_state, reference_metrics = jit_train_step(graphdef, optimizer, _options(config, 1.0), mesh,
                                                        shardings)(state, batch)
    _, _, state = setup(tiny_model_config, mesh, adam=False)
    custom_step = jit_train_step(graphdef, optimizer, _options(config, 1.0, loss_fn=scaled), mesh, shardings)
    _, metrics = custom_step(state, batch)
    np.testing.assert_allclose(metrics["loss"], 2 * reference_metrics["loss"], rtol=1e-6)
    np.testing.assert_allclose(metrics["grad_norm"], 2 * reference_metrics["grad_norm"], rtol=1e-5)
    np.testing.assert_allclose(metrics["my_metric"], reference_metrics["kl"] + 1.0, rtol=1e-6)
    assert "clip_ratio/low_mean" not in metrics


def test_step_matches_optax_update_of_the_loss_gradient(tiny_model_config):
    """One step == a hand-written AdamW step on jax.grad of compute_loss over completion_logps."""
    mesh = one_device_mesh()
    loss_config = LossConfig()
    graphdef, optimizer, state = setup(tiny_model_config, mesh)
    # no sampler log-probs here: this is about the optimizer step (near-zero gradient elements make Adam's
    # first step lr·g/(|g|+eps) amplify rounding, so the case is kept as it was; the IS plumbing is tested below)
    batch = make_batch(graphdef, state.params)

    def naive_loss(params):
        logps, _ = completion_logps(graphdef, params, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                    batch.completion_mask, temperature=1.0)
        return compute_loss(logps, batch.old_per_token_logps, batch.ref_per_token_logps, batch.advantages,
                            batch.loss_mask, config=loss_config)[0]

    params = jax.device_get(state.params)
    grads = jax.jit(jax.grad(naive_loss))(params)  # one program, not the ops one by one
    norm = optax.tree_utils.tree_norm(grads)
    scale = jnp.minimum(1.0, 1.0 / norm)
    # first Adam step: m = (1-b1) g, v = (1-b2) g^2, bias-corrected update = lr * g / (|g| + eps)
    expected = jax.tree.map(lambda p, g: p - 1e-2 * (g * scale) / (jnp.abs(g * scale) + 1e-8), params, grads)
    new_state, metrics = jax.jit(lambda s, b: train_step(graphdef, optimizer, StepOptions(loss_config, 1.0), s, b))(
        state, batch)
    np.testing.assert_allclose(metrics["grad_norm"], norm, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), new_state.params, expected)


@pytest.mark.parametrize("shape", [(8, 1, 1), (2, 4, 1), (4, 1, 2)])
def test_sharded_step_equals_single_device(tiny_model_config, shape):
    if len(jax.devices()) < 8:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
    loss_config = LossConfig()
    single_state, single_metrics = run_step(tiny_model_config, one_device_mesh(), loss_config, grad_accum=2)
    mesh = sharding.make_mesh(*shape)
    state, metrics = run_step(tiny_model_config, mesh, loss_config, grad_accum=2)
    np.testing.assert_allclose(metrics["loss"], single_metrics["loss"], rtol=1e-5, atol=1e-7)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 state.params, single_state.params)


@pytest.mark.parametrize("shape, chunk_size, packing", [((2, 4, 1), 3, False), ((2, 2, 2), 1, True)])
def test_row_sharded_chunked_step_equals_single_device(tiny_model_config, shape, chunk_size, packing):
    """A logps chunk over 8 row shards (each shard unembeds its own rows, `completion_logps`'s ``row_sharding``;
    3 does not divide a shard's 1 row, packed buffers of 2 groups) gives the single device's loss and update."""
    if len(jax.devices()) < 8:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
    loss_config = LossConfig(loss_type="dapo", entropy_coef=0.01)
    kwargs = dict(group_size=2, grad_accum=2, prompt_group_size=2 if packing else 1, packing=packing,
                  chunk_size=chunk_size)
    single, single_metrics = run_step(tiny_model_config, one_device_mesh(), loss_config, **kwargs)
    state, metrics = run_step(tiny_model_config, sharding.make_mesh(*shape), loss_config, **kwargs)
    for k in ("loss", "grad_norm", "entropy", "kl"):
        np.testing.assert_allclose(metrics[k], single_metrics[k], rtol=1e-5, atol=1e-7, err_msg=k)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), state.params, single.params)


@pytest.mark.parametrize("shape, packing, grad_accum, buffers", [
    (None, False, 1, 0), ((8, 1, 1), False, 1, 0), ((2, 2, 2), False, 1, 0), (None, True, 1, 0),
    ((2, 2, 2), True, 1, 0), (None, "rows", 2, 0), (None, True, 1, 1), ((2, 2, 2), True, 1, 4), (None, "rows", 2, 1)])
def test_shared_prompt_step_equals_per_row_step(tiny_model_config, shape, packing, grad_accum, buffers):
    # rows in groups of 2 sharing a prompt: one prompt forward per group, or packed buffers of one group each (or
    # one row each, micro-batched) or of several, gives the per-row step's loss and update
    if shape is not None and len(jax.devices()) < 8:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
    mesh = one_device_mesh() if shape is None else sharding.make_mesh(*shape)
    loss_config = LossConfig(loss_type="dapo", entropy_coef=0.01)
    per_row, per_row_metrics = run_step(tiny_model_config, mesh, loss_config, group_size=2, grad_accum=grad_accum)
    shared, shared_metrics = run_step(tiny_model_config, mesh, loss_config, group_size=2, grad_accum=grad_accum,
                                      prompt_group_size=1 if packing == "rows" else 2, packing=bool(packing),
                                      buffers=buffers)
    for k in ("loss", "grad_norm", "entropy", "kl"):
        np.testing.assert_allclose(shared_metrics[k], per_row_metrics[k], rtol=1e-5, atol=1e-7, err_msg=k)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), shared.params,
                 per_row.params)


def test_no_recompilation_on_second_step(tiny_model_config):
    mesh = one_device_mesh()
    graphdef, optimizer, state = setup(tiny_model_config, mesh)
    step = jit_train_step(graphdef, optimizer, _options(LossConfig(), 1.0, 2), mesh, sharding.tree_shardings(state))
    for seed in range(3):
        state, _ = step(state, make_batch(graphdef, state.params, seed=seed))
    assert step._cache_size() == 1
    assert int(state.step) == 3


@pytest.mark.parametrize("cause", ["nan_loss", "overflowing_update"])
def test_non_finite_loss_skips_the_update(tiny_model_config, cause):
    """A NaN loss, or a finite loss and gradient whose update would make params non-finite (an infinite learning
    rate), leaves params and optimizer state as they were."""
    mesh = one_device_mesh()
    graphdef, optimizer, state = setup(tiny_model_config, mesh, lr=np.inf if cause == "overflowing_update" else 1e-2)
    before = jax.device_get(state)
    batch = make_batch(graphdef, state.params)
    if cause == "nan_loss":
        batch = batch._replace(advantages=np.full(B, np.nan, np.float32))
    step = jit_train_step(graphdef, optimizer, _options(LossConfig(), 1.0), mesh, sharding.tree_shardings(state))
    state, metrics = jax.device_get(step(state, batch))
    assert metrics["skipped"] == 1
    assert np.isfinite(metrics["loss"]) == np.isfinite(metrics["grad_norm"]) == (cause == "overflowing_update")
    jax.tree.map(np.testing.assert_array_equal, state.params, before.params)
    jax.tree.map(np.testing.assert_array_equal, state.opt_state, before.opt_state)
    assert state.step == 1


def test_beta_zero_keeps_no_reference(tiny_model_config):
    _, _, state = setup(tiny_model_config, one_device_mesh(), beta=0.0)
    assert state.ref_params is None
    _, metrics = run_step(tiny_model_config, one_device_mesh(), dataclasses.replace(LOSSES[1]))
    assert "kl" not in metrics


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
def test_learning_rate_schedule_against_formula(kind):
    lr, warmup, total = 1e-3, 10, 110
    schedule = learning_rate_schedule(learning_rate=lr, scheduler=kind, warmup_steps=warmup, max_steps=total)
    for step in (0, 5, 10, 60, 109):
        if step < warmup:
            expected = lr * step / warmup
        else:
            frac = (step - warmup) / (total - warmup)
            expected = {"constant": lr, "linear": lr * (1 - frac),
                        "cosine": lr * 0.5 * (1 + np.cos(np.pi * frac))}[kind]
        # atol: optax evaluates 1 + cos(pi * frac) in float32, which cancels near the end of the decay
        np.testing.assert_allclose(float(schedule(step)), expected, rtol=1e-5, atol=lr * 1e-6)


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_equals_no_remat(tiny_model_config, remat):
    # the same maths recomputed in the backward pass: only XLA's fusion choices may differ (float32 ulps)
    loss_config = LossConfig(entropy_coef=0.01)
    base_state, base_metrics = run_step(tiny_model_config, one_device_mesh(), loss_config, grad_accum=2)
    config = dataclasses.replace(tiny_model_config, remat=remat)
    state, metrics = run_step(config, one_device_mesh(), loss_config, grad_accum=2)
    for k in ("loss", "grad_norm", "entropy"):
        np.testing.assert_allclose(metrics[k], base_metrics[k], rtol=1e-6, atol=1e-7, err_msg=k)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), state.params,
                 base_state.params)


def test_attention_sees_every_completion_token_and_the_loss_trains_the_loss_mask(tiny_model_config):
    """Rows with tokens from outside (loss mask 0 inside the completion): the step's loss and gradient are
    compute_loss over the loss mask of log-probs whose forward attended every completion token, and a token
    outside the loss mask changes the gradient only through what later tokens see of it."""
    mesh = one_device_mesh()
    loss_config = LossConfig(loss_type="dapo")
    graphdef, optimizer, state = setup(tiny_model_config, mesh, adam=False)
    batch = make_batch(graphdef, state.params)
    outside = np.zeros_like(batch.loss_mask)
    outside[:, 1:3] = 1  # two tokens of every row came from outside
    batch = batch._replace(loss_mask=batch.completion_mask * (1 - outside))
    assert 0 < batch.loss_mask.sum() < batch.completion_mask.sum()

    def naive_loss(params, ids):
        logps, _ = completion_logps(graphdef, params, batch.prompt_ids, batch.prompt_mask, ids, batch.completion_mask,
                                    temperature=1.0)
        return compute_loss(logps, batch.old_per_token_logps, batch.ref_per_token_logps, batch.advantages,
                            batch.loss_mask, config=loss_config,
                            num_items_in_batch=jnp.sum(batch.loss_mask).astype(jnp.float32))[0]

    params = jax.device_get(state.params)
    want, grads = jax.jit(jax.value_and_grad(naive_loss))(params, batch.completion_ids)
    step = jit_train_step(graphdef, optimizer, StepOptions(loss_config, 1.0), mesh, sharding.tree_shardings(state))
    new_state, metrics = jax.device_get(step(state, batch))
    np.testing.assert_allclose(metrics["loss"], want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(metrics["grad_norm"], optax.tree_utils.tree_norm(grads), rtol=1e-5)
    # another token outside the loss mask: the loss changes only through the tokens after it that attend to it
    changed = batch.completion_ids.copy()
    changed[:, 1] = (changed[:, 1] + 1) % 32
    assert naive_loss(params, changed) != pytest.approx(float(want), rel=1e-6)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu not installed (pip install -e '.[tpu]'): no TPU topology to compile for")
def test_tpu_train_program_keeps_only_each_chips_rows():
    """The train program compiled for 16 TPU chips (fsdp 16, 2 rows a chip of 64 + 512 tokens, a logps chunk of 1
    row) needs under twice all rows' hidden states of temporaries (36 MiB; its own rows' activations for the backward
    and the gathered params are most of it: 45 MiB). Before, the chunks' map stepped through every row of the
    micro-batch, holding every row's hidden states and their gradients on every chip: 326 MiB. (At 4 rows of 64 +
    1,024 a chip: 1,769 -> 263 MiB; a qwen3_moe over expert 2 x fsdp 8 there: 600 -> 570, its expert block's
    buffers, not rows, the most.)"""
    from flax import nnx

    from grpo_jax.algo.state import abstract_state
    from grpo_jax.api import plan
    from grpo_jax.models import ModelConfig, Transformer

    B, P, T, D = 32, 64, 512, 1024
    config = ModelConfig(vocab_size=256, hidden_size=D, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, dtype="bfloat16", param_dtype="float32")
    graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(config, nnx.Rngs(0))))[0]
    devices = plan.topology_devices("v5e:4x4")
    mesh = sharding.make_mesh(data=1, fsdp=len(devices), devices=devices)
    optimizer = optax.adamw(1e-5)
    shapes = abstract_state(config, optimizer, with_reference=False)
    shardings = sharding.state_shardings(mesh, shapes)
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)
    rows = lambda *shape, dtype=jnp.int32: jax.ShapeDtypeStruct(  # noqa: E731
        shape, dtype, sharding=sharding.row_sharded(mesh))
    f32 = jnp.float32
    batch = Trajectory(rows(B, P), rows(B, P), rows(B, T), rows(B, T), rows(B, T), rows(B, T, dtype=f32),
                       rows(B, T), rows(B, dtype=jnp.bool_), advantages=rows(B, dtype=f32))
    options = StepOptions(LossConfig(beta=0.0), temperature=1.0, logps_chunk_size=1)
    step = jit_train_step(graphdef, optimizer, options, mesh, shardings)
    memory = step.lower(state, batch).compile().memory_analysis()
    all_rows_hidden = B * (P + T) * D * 2  # bf16
    assert memory.temp_size_in_bytes < 2 * all_rows_hidden, (memory.temp_size_in_bytes, all_rows_hidden)


def test_adaptive_entropy_applies_the_coefficient_of_the_last_step_and_updates_it(tiny_model_config):
    """TRL's use_adaptive_entropy (Skywork-OR1): a step applies the coefficient the last step left, only when that
    step's entropy was at or below entropy_target (step 1: none known, no bonus), then moves it by entropy_coef_delta
    toward more bonus (entropy at or below the target) or less (above), within [min, max], from the state it carries.
    The applied bonus equals the fixed coefficient's; the update follows the naive rule on the logged entropy."""
    mesh = one_device_mesh()
    graphdef, optimizer, state = setup(tiny_model_config, mesh, beta=0.0, adam=False)
    batch = make_batch(graphdef, state.params, seed=0, beta=0.0)

    def step(loss_config, control=None):
        options = _options(loss_config, temperature=1.0, gradient_accumulation_steps=2)
        s = jax.tree.map(jnp.copy, state)  # the step donates its state
        s = s if control is None else s._replace(entropy_control=jnp.asarray(control, jnp.float32))
        return jax.device_get(jit_train_step(graphdef, optimizer, options, mesh, sharding.tree_shardings(s))(
            s, batch, 0, 0))

    fixed = {c: step(LossConfig(loss_type="dapo", beta=0.0, entropy_coef=c)) for c in (0.0, 0.3)}
    adaptive = dict(loss_type="dapo", beta=0.0, use_adaptive_entropy=True, entropy_coef=0.3, entropy_coef_delta=0.05,
                    entropy_coef_max=0.32)
    entropy = float(fixed[0.0][1]["entropy"])
    for last, target, applied in ((np.inf, 100.0, 0.0), (0.1, 100.0, 0.3), (0.005, 0.01, 0.3), (5.0, 1.0, 0.0)):
        new_state, metrics = step(LossConfig(**adaptive, entropy_target=target), [0.3, last])
        np.testing.assert_allclose(metrics["loss"], fixed[applied][1]["loss"], rtol=1e-6, atol=1e-7)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
                     new_state.params, fixed[applied][0].params)
        moved = min(0.3 + 0.05, 0.32) if entropy <= target else max(0.3 - 0.05, 0.0)
        np.testing.assert_allclose(new_state.entropy_control, [moved, entropy], rtol=1e-6)
        assert metrics["entropy_coef"] == pytest.approx(moved) and "policy_loss" in metrics
    assert fixed[0.3][1]["loss"] != fixed[0.0][1]["loss"]  # the bonus is felt
