"""Expert parallelism (grpo_jax/models/moe.py `expert_parallel`): tokens split over the row axes, gathered per
chunk over ``expert`` and reduce-scattered back, equal the single-device block in values and gradients on 8 fake
CPU devices; compiled for a TPU topology, its memory stays bounded by a chunk, not by every device's tokens."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpo_jax.device import sharding
from grpo_jax.models import ModelConfig, gpt_oss, moe

D, E, F, K = 32, 8, 16, 2


def _block(seed=0, family="qwen3_moe", **kw):
    """Qwen3-MoE's block, or GPT-OSS's (biased router and experts, biases drawn, a clamp of 0.3 that binds)."""
    config = ModelConfig(vocab_size=64, hidden_size=D, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=F,
                         norm_topk_prob=True, initializer_range=0.2, model_type=family, swiglu_limit=0.3, **kw)
    graphdef, params = nnx.split((gpt_oss.MLP if family == "gpt_oss" else moe.SparseMoE)(config, nnx.Rngs(seed)))
    rng = np.random.default_rng(seed)
    return graphdef, jax.tree_util.tree_map_with_path(
        lambda path, x: x + 0.2 * rng.standard_normal(x.shape).astype(x.dtype)
        if "bias" in jax.tree_util.keystr(path) else x, params)


def _loss(graphdef):
    def loss(params, x):
        out, logits, _ = nnx.merge(graphdef, params)(x)
        return jnp.sum(out ** 2) + jnp.sum(logits ** 2), out
    return loss


def _close(got, want):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * float(np.abs(want).max()))


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("chunk_assignments, rows", [(moe.CHUNK_ASSIGNMENTS, 4), (8, 4), (4, 3)])
def test_chunked_tokens_split_over_rows_equal_one_device(monkeypatch, chunk_assignments, rows, family):
    """data 2 x fsdp 2 x expert 2, the weights split over expert and fsdp as `sharding.PARTITION_RULES` say: all
    20 tokens' 40 assignments on every device (`_all_tokens`); chunks of 2 tokens (4 x 5 tokens: 3 a device,
    padded to 2 chunks); chunks of 1 token with 3 x 5 tokens, which do not split over the 8 devices (padded with
    tokens sent to no expert). Same outputs and gradients (weights, biases, router, tokens) as one device, for
    Qwen3-MoE's experts and GPT-OSS's."""
    assert moe.ROWS == sharding.ROWS  # the block splits tokens as the batch's rows are split
    graphdef, params = _block(family=family)
    x = jax.random.normal(jax.random.key(7), (rows, 5, D), jnp.float32)
    grad = jax.grad(_loss(graphdef), argnums=(0, 1), has_aux=True)
    want_grad, want_out = grad(params, x)

    monkeypatch.setattr(moe, "CHUNK_ASSIGNMENTS", chunk_assignments)
    mesh = sharding.make_mesh(data=2, fsdp=2, expert=2, devices=jax.devices()[:8])
    params_sharded = jax.device_put(params, jax.tree_util.tree_map_with_path(  # the block's rules inside a layer
        lambda path, v: NamedSharding(mesh, sharding.partition_spec("mlp." + sharding.path_name(path), v.shape,
                                                                    mesh)), params))
    x_sharded = jax.device_put(x, NamedSharding(mesh, PartitionSpec(sharding.ROWS)) if rows % 8 == 0
                               else NamedSharding(mesh, PartitionSpec()))
    first = "gate_up_proj" if family == "gpt_oss" else "gate_proj"
    assert params_sharded["experts"][first][...].sharding.spec[:2] == ("expert", "fsdp")
    with jax.set_mesh(mesh):
        lowered = jax.jit(grad).lower(params_sharded, x_sharded)
        got_grad, got_out = lowered.compile()(params_sharded, x_sharded)
    text = lowered.as_text()
    # chunks: a reduce-scatter brings the outputs home; all tokens at once: a psum
    assert ("reduce_scatter" if chunk_assignments < 40 else "all_reduce") in text
    # float32 sums in another order (split over devices): agreement relative to each array's scale (the router's
    # gradient sums terms near 40 down to entries near 0.3)
    jax.tree.map(_close, (got_out, got_grad), (want_out, want_grad))


@pytest.mark.parametrize("axes", ["fsdp_expert", "expert_only"])
def test_chunks_do_not_change_the_expert_parallel_block(axes):
    """`expert_parallel` itself, every token on every device (few tokens), one chunk, and chunks of 3 tokens (fsdp 2
    x expert 2: a device's 6 tokens in 2; or a mesh of the ``expert`` axis alone): the same values and gradients,
    all the single-device `expert_mlp`'s."""
    rng = np.random.default_rng(0)
    N = 24
    x = jnp.asarray(rng.normal(size=(N, D)), jnp.float32)
    experts = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(N)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(size=(N, K)), jnp.float32)
    stacks = tuple(jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32) for s in ((E, D, F), (E, D, F), (E, F, D)))
    mesh = (sharding.make_mesh(data=1, fsdp=2, expert=2, devices=jax.devices()[:4]) if axes == "fsdp_expert"
            else Mesh(np.asarray(jax.devices()[:2]), ("expert",)))

    def loss(fn):
        return jax.jit(jax.value_and_grad(lambda x, w, *s: jnp.sum(fn(x, experts, w, s) ** 2),
                                          argnums=(0, 1, 2, 3, 4)))

    want = loss(moe.expert_mlp)(x, weights, *stacks)
    for chunk in (None, 12, 3):  # all tokens at once (`_all_tokens`), one chunk, two chunks
        got = loss(lambda *a: moe.expert_parallel(mesh, *a, chunk_tokens=chunk))(x, weights, *stacks)
        jax.tree.map(_close, got, want)


needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu not installed (pip install -e '.[tpu]'): no TPU topology to "
                                         "compile for")


@needs_libtpu
def test_tpu_memory_is_bounded_by_a_chunk_not_every_devices_tokens(monkeypatch):
    """A qwen3_moe block (bf16 over float32 params) on v5p:2x2x2, expert 4 x fsdp 2, 4,096 tokens a chip, forward
    and backward compiled by XLA's TPU compiler: its temporaries per chip stay under ONE float32 [n_expert * tokens
    * K, D] buffer, the size of the outputs of every assignment the old block gathered over ``expert``
    (64 MiB here; the old block, which took every chip's tokens at once, needed 369 MiB; 256-token chunks 23 MiB)."""
    from grpo_jax.api import plan

    monkeypatch.setattr(moe, "CHUNK_ASSIGNMENTS", 4096)  # 256 tokens a chunk: 16 chunks a chip
    Dt, Et, Ft, Kt, tokens = 256, 16, 128, 4, 4096
    config = ModelConfig(vocab_size=64, hidden_size=Dt, num_experts=Et, num_experts_per_tok=Kt,
                         moe_intermediate_size=Ft, norm_topk_prob=True, model_type="qwen3_moe", dtype="bfloat16",
                         param_dtype="float32")
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: moe.SparseMoE(config, nnx.Rngs(0))))
    mesh = sharding.make_mesh(data=1, fsdp=2, expert=4, devices=plan.topology_devices("v5p:2x2x2"))
    params = jax.tree_util.tree_map_with_path(lambda path, v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=(
        NamedSharding(mesh, sharding.partition_spec("mlp." + sharding.path_name(path), v.shape, mesh)))), abstract)
    x = jax.ShapeDtypeStruct((8 * tokens // 512, 512, Dt), jnp.bfloat16,
                             sharding=NamedSharding(mesh, PartitionSpec(sharding.ROWS)))

    def loss(p, x):
        return jnp.sum(nnx.merge(graphdef, p)(x)[0].astype(jnp.float32) ** 2)

    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        memory = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile().memory_analysis()
    gathered_outputs = 4 * tokens * Kt * Dt * 4
    assert 0 < memory.temp_size_in_bytes < gathered_outputs
