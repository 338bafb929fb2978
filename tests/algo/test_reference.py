"""Reference updates: TR-DPO mixing and iterative-GRPO resets, alone and inside the jitted train step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from grpo_jax.algo import reference
from grpo_jax.algo.programs import init_state, jit_train_step
from grpo_jax.algo.reference import RefSyncConfig
from grpo_jax.algo.train_step import StepOptions
from grpo_jax.device import sharding
from grpo_jax.losses import LossConfig
from tests.algo.test_train_step import make_batch


def _trees(seed):
    rng = np.random.default_rng(seed)
    return {"w": rng.normal(size=(3, 4)).astype(np.float32), "b": {"c": rng.normal(size=(5,)).astype(np.float32)}}


def test_mix_is_alpha_policy_plus_one_minus_alpha_ref():
    ref, policy = _trees(0), _trees(1)
    out = jax.jit(reference.mix, static_argnums=2)(ref, policy, 0.6)
    naive = {"w": 0.6 * policy["w"] + 0.4 * ref["w"], "b": {"c": 0.6 * policy["b"]["c"] + 0.4 * ref["b"]["c"]}}
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), out, naive)


@pytest.mark.parametrize("alpha", [0.6, 1.0])
def test_update_fires_only_on_multiples_of_the_sync_period(alpha):
    ref, policy = _trees(0), _trees(1)
    config = RefSyncConfig(sync_ref_model=True, ref_model_mixup_alpha=alpha, ref_model_sync_steps=3)
    update = jax.jit(reference.update, static_argnums=3)
    for step in (1, 2, 4, 5):
        jax.tree.map(np.testing.assert_array_equal, update(ref, policy, jnp.int32(step), config), ref)
    for step in (3, 6):
        out = update(ref, policy, jnp.int32(step), config)
        expected = jax.tree.map(lambda r, p: alpha * p + (1 - alpha) * r, ref, policy)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), out, expected)
    if alpha == 1.0:  # iterative GRPO: an exact copy of the policy
        jax.tree.map(np.testing.assert_array_equal, update(ref, policy, jnp.int32(3), config), policy)


def test_update_is_a_no_op_when_off_or_without_reference():
    ref, policy = _trees(0), _trees(1)
    assert reference.update(None, policy, jnp.int32(3), RefSyncConfig(True, 0.5, 1)) is None
    assert reference.update(ref, policy, jnp.int32(512), RefSyncConfig()) is ref


def _run(tiny_model_config, ref_sync, steps):
    mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    optimizer = optax.sgd(0.1)
    graphdef, state = init_state(tiny_model_config, optimizer, seed=0, with_reference=True, mesh=mesh)
    step = jit_train_step(graphdef, optimizer, StepOptions(LossConfig(), 1.0, ref_sync=ref_sync), mesh,
                          sharding.tree_shardings(state))
    history = []
    for i in range(steps):
        before = jax.device_get(state.ref_params)
        state, _ = step(state, make_batch(graphdef, state.params, seed=i))
        history.append((before, jax.device_get(state.params), jax.device_get(state.ref_params)))
    return history


def test_train_step_mixes_the_reference_every_k_steps(tiny_model_config):
    """ref after step k = 0.6·policy_k + 0.4·ref_{k-1} on k = 2, 4; unchanged otherwise."""
    history = _run(tiny_model_config, RefSyncConfig(True, 0.6, 2), steps=4)
    for k, (ref_before, params, ref_after) in enumerate(history, start=1):
        if k % 2:
            jax.tree.map(np.testing.assert_array_equal, ref_after, ref_before)
        else:
            expected = jax.tree.map(lambda p, r: 0.6 * p + 0.4 * r, params, ref_before)
            jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), ref_after, expected)
    # the reference moved away from the initial policy
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(history[-1][2]),
                                                        jax.tree.leaves(history[0][0])))


def test_iterative_grpo_resets_the_reference_to_the_policy(tiny_model_config):
    history = _run(tiny_model_config, RefSyncConfig(True, 1.0, 2), steps=3)
    jax.tree.map(np.testing.assert_array_equal, history[0][2], history[0][0])  # step 1: still the initial policy
    jax.tree.map(np.testing.assert_array_equal, history[1][2], history[1][1])  # step 2: reset to the policy
    jax.tree.map(np.testing.assert_array_equal, history[2][2], history[1][1])  # step 3: kept until step 4
