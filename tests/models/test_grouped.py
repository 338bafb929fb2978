"""The grouped product's backends (grpo_jax/models/grouped.py): megablox's kernel in interpret mode equals
jax.lax.ragged_dot in values and gradients, alone and inside the expert-parallel block; compiled for a TPU, its
weight gradient is no longer a dense product over every expert."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.device import sharding
from grpo_jax.models import grouped, moe


@pytest.mark.parametrize("sizes, past", [([10, 0, 25, 3], 2), ([0, 0, 30, 33], 0), ([0, 7, 0, 0], 13)])
def test_interpreted_megablox_equals_ragged_dot(sizes, past):
    """Empty groups, a first or last group empty, rows past every group (which give 0) and a row count that is no
    multiple of 8 (padded to whole tiles): values and both gradients as ragged_dot's."""
    rng = np.random.default_rng(0)
    M, K, N = sum(sizes) + past, 32, 16
    x = jnp.asarray(rng.normal(size=(M, K)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(len(sizes), K, N)), jnp.float32)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    proj = jnp.asarray(rng.normal(size=(M, N)), jnp.float32)

    def f(dot):
        return jax.value_and_grad(lambda x, w: jnp.sum(jnp.sin(dot(x, w, group_sizes)) * proj), argnums=(0, 1))

    got = grouped.interpreted_dot(x, w, group_sizes)
    np.testing.assert_allclose(got, jax.lax.ragged_dot(x, w, group_sizes), rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(got)[sum(sizes):])
    (got_loss, got_grads), (want_loss, want_grads) = f(grouped.interpreted_dot)(x, w), f(jax.lax.ragged_dot)(x, w)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    for got, want in zip(got_grads, want_grads):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_tiles_divide_real_shapes():
    """Qwen3-30B-A3B's expert products (D 2048, F 768) and small shapes: tiles of whole dims or dividing ones."""
    assert grouped.tiling(4096, 2048, 768) == (512, 1024, 768)  # gate/up: x [M, D] x [E, D, F]
    assert grouped.tiling(4096, 768, 2048) == (512, 768, 1024)  # down: h [M, F] x [E, F, D]
    assert grouped.tiling(4096, 1536, 2560) == (512, 768, 640)
    assert grouped.tiling(37, 32, 16) == (40, 32, 16)  # 37 rows padded to 40


@pytest.mark.parametrize("shape", [(2, 2), (4, 1)])
def test_interpreted_megablox_in_the_expert_parallel_block(shape):
    """The block's kernel path (every mesh axis manual, `grouped.needs_manual`) over fsdp x expert 2 x 2, or fsdp 4
    with mesh.expert 1: the values and gradients of `expert_mlp` with ragged_dot on one device."""
    fsdp, expert = shape
    rng = np.random.default_rng(1)
    N, D, E, F, K = 16, 32, 4, 16, 2
    x = jnp.asarray(rng.normal(size=(N, D)), jnp.float32)
    experts = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(N)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(size=(N, K)), jnp.float32)
    stacks = tuple(jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32) for s in ((E, D, F), (E, D, F), (E, F, D)))
    mesh = sharding.make_mesh(data=1, fsdp=fsdp, expert=expert, devices=jax.devices()[:4])

    def loss(fn):
        return jax.jit(jax.value_and_grad(lambda x, w, *s: jnp.sum(fn(x, experts, w, s) ** 2),
                                          argnums=(0, 1, 2, 3, 4)))

    want = loss(moe.expert_mlp)(x, weights, *stacks)
    got = loss(lambda *a: moe.expert_parallel(mesh, *a, chunk_tokens=4, ragged_dot=grouped.interpreted_dot,
                                              manual=True))(x, weights, *stacks)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(np.abs(w).max())),
                 got, want)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu not installed (pip install -e '.[tpu]'): no TPU topology to compile for")
def test_tpu_weight_gradient_is_not_dense_over_every_expert():
    """Compiled for one v5e chip at Qwen3-30B-A3B's expert shapes (4,096 assignments, D 2048, F 768, 32 experts):
    XLA runs ragged_dot's weight gradient as a dense product over all 32 experts (at least 32 x 2 M D F FLOPs);
    through `grouped.grouped_dot` (megablox on TPU) it is one grouped product, 2 M D F (XLA counts the kernel's own
    estimate, 2 m k n over the rows it is given: 1.2893e10 against 2 M D F = 1.2885e10)."""
    from grpo_jax.api import plan

    M, D, F, E = 4096, 2048, 768, 32
    mesh = sharding.make_mesh(1, 1, 1, devices=plan.topology_devices("v5e:2x2")[:1])
    one = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    x = jax.ShapeDtypeStruct((M, D), jnp.bfloat16, sharding=one)
    w = jax.ShapeDtypeStruct((E, D, F), jnp.bfloat16, sharding=one)
    sizes = jax.ShapeDtypeStruct((E,), jnp.int32, sharding=one)

    def flops(dot):
        weight_grad = jax.grad(lambda w, x, g: jnp.sum(dot(x, w, g).astype(jnp.float32)))
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            cost = jax.jit(weight_grad).lower(w, x, sizes).compile().cost_analysis()
        return float((cost[0] if isinstance(cost, list) else cost)["flops"])

    assert flops(jax.lax.ragged_dot) >= E * 2 * M * D * F
    assert 2 * M * D * F <= flops(grouped.grouped_dot) < 1.01 * 2 * M * D * F
