"""The sparse MoE block (grpo_jax/models/moe.py) against transformers' Qwen3MoeSparseMoeBlock, a naive NumPy
per-token loop, and transformers' load_balancing_loss_func; expert-parallel == single device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpo_jax.models import ModelConfig
from grpo_jax.models.moe import SparseMoE, load_balancing_loss

D, E, F, K = 32, 8, 16, 2


def _config(norm_topk_prob=True, **kw):
    return ModelConfig(vocab_size=64, hidden_size=D, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=F,
                       norm_topk_prob=norm_topk_prob, initializer_range=0.2, model_type="qwen3_moe", **kw)


def _block(config, seed=0):
    graphdef, params = nnx.split(SparseMoE(config, nnx.Rngs(seed)))
    return graphdef, params


def _apply(graphdef, params, x, replay=None):
    return nnx.merge(graphdef, params)(x, replay)


def _hf_block(params, norm_topk_prob):
    """transformers' block holding the same weights (HF stores gate and up fused: [E, 2F, D])."""
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeConfig, Qwen3MoeSparseMoeBlock

    hf = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(hidden_size=D, num_experts=E, num_experts_per_tok=K,
                                               moe_intermediate_size=F, norm_topk_prob=norm_topk_prob))
    t = lambda a: torch.tensor(np.asarray(a))  # noqa: E731
    with torch.no_grad():
        hf.gate.weight.copy_(t(params["gate"]["kernel"][...].T))
        gate_up = np.concatenate([params["experts"]["gate_proj"][...], params["experts"]["up_proj"][...]], axis=2)
        hf.experts.gate_up_proj.copy_(t(gate_up.transpose(0, 2, 1)))
        hf.experts.down_proj.copy_(t(np.asarray(params["experts"]["down_proj"][...]).transpose(0, 2, 1)))
    return hf


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_block_and_gradients_match_transformers(norm_topk_prob):
    torch = pytest.importorskip("torch")
    graphdef, params = _block(_config(norm_topk_prob))
    x = jax.random.normal(jax.random.key(1), (3, 5, D), jnp.float32)
    hf = _hf_block(params, norm_topk_prob)
    x_t = torch.tensor(np.asarray(x))
    out_t = hf(x_t)
    out, logits, experts = _apply(graphdef, params, x)
    np.testing.assert_allclose(out, out_t.detach().numpy(), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(logits.reshape(-1, E), hf.gate(x_t.reshape(-1, D))[0].detach().numpy(), atol=1e-5)
    assert experts.shape == (3, 5, K)
    # gradients of a random projection of the output, for the router and each stacked expert tensor
    proj = np.random.default_rng(0).normal(size=(3, 5, D)).astype(np.float32)
    (out_t * torch.tensor(proj)).sum().backward()
    grads = jax.grad(lambda p: jnp.sum(_apply(graphdef, p, x)[0] * proj))(params)
    np.testing.assert_allclose(grads["gate"]["kernel"][...], hf.gate.weight.grad.numpy().T, atol=1e-5)
    hf_gate_up = hf.experts.gate_up_proj.grad.numpy().transpose(0, 2, 1)
    np.testing.assert_allclose(grads["experts"]["gate_proj"][...], hf_gate_up[..., :F], atol=1e-5)
    np.testing.assert_allclose(grads["experts"]["up_proj"][...], hf_gate_up[..., F:], atol=1e-5)
    np.testing.assert_allclose(grads["experts"]["down_proj"][...],
                               hf.experts.down_proj.grad.numpy().transpose(0, 2, 1), atol=1e-5)


def _naive(params, x_NxD, experts_NxK, norm_topk_prob):
    """Per-token NumPy loop: softmax router, the given experts' probabilities (renormalised), SwiGLU experts."""
    p = {k: np.asarray(v[...], np.float64) for k, v in params["experts"].items()}
    logits = np.asarray(x_NxD, np.float64) @ np.asarray(params["gate"]["kernel"][...], np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(logits[:, :1] * 0 + np.zeros((1, D)))
    for n, chosen in enumerate(np.asarray(experts_NxK)):
        w = probs[n, chosen]
        w = w / w.sum() if norm_topk_prob else w
        for e, we in zip(chosen, w):
            g, u = x_NxD[n] @ p["gate_proj"][e], x_NxD[n] @ p["up_proj"][e]
            out[n] += we * ((g / (1 + np.exp(-g)) * u) @ p["down_proj"][e])
    return out


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_routing_replay_uses_the_given_experts(norm_topk_prob):
    graphdef, params = _block(_config(norm_topk_prob))
    x = jax.random.normal(jax.random.key(2), (2, 4, D), jnp.float32)
    out, _, chosen = _apply(graphdef, params, x)
    # replaying the block's own choice changes nothing; replaying other experts is the naive loop on those
    np.testing.assert_allclose(_apply(graphdef, params, x, chosen)[0], out, atol=1e-6)
    replay = jax.random.randint(jax.random.key(3), (2, 4, K), 0, E)
    replay = replay.at[..., 1].set((replay[..., 0] + 1 + replay[..., 1] % (E - 1)) % E)  # K distinct experts
    out_r, _, chosen_r = _apply(graphdef, params, x, replay)
    np.testing.assert_array_equal(chosen_r, replay)
    np.testing.assert_allclose(out_r.reshape(-1, D), _naive(params, np.asarray(x).reshape(-1, D),
                                                            replay.reshape(-1, K), norm_topk_prob), atol=1e-5)
    np.testing.assert_allclose(out.reshape(-1, D), _naive(params, np.asarray(x).reshape(-1, D),
                                                          chosen.reshape(-1, K), norm_topk_prob), atol=1e-5)
    # the router keeps a gradient under replay (the weights are its probabilities at the replayed experts)
    g = jax.grad(lambda p: jnp.sum(_apply(graphdef, p, x, replay)[0] ** 2))(params)
    assert float(jnp.abs(g["gate"]["kernel"][...]).max()) > 0


@pytest.mark.parametrize("masked", [False, True])
def test_load_balancing_loss_matches_transformers(masked):
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    B, T, L = 3, 6, 2
    logits_LxNxE = np.random.default_rng(4).normal(size=(L, B * T, E)).astype(np.float32)
    mask_BxT = (np.arange(T)[None] < np.array([6, 3, 4])[:, None]).astype(np.int64)
    want = load_balancing_loss_func(tuple(torch.tensor(x) for x in logits_LxNxE), E, K,
                                    torch.tensor(mask_BxT) if masked else None)
    got = load_balancing_loss(jnp.asarray(logits_LxNxE), K, mask_BxT.reshape(-1) if masked else None)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)


def test_expert_parallel_equals_single_device():
    """Experts split 4 ways over an `expert` mesh axis (tokens split 2 ways over data): same outputs and
    gradients (of the weights and of the tokens, which flows to the layers below) as one device."""
    graphdef, params = _block(_config())
    x = jax.random.normal(jax.random.key(5), (4, 3, D), jnp.float32)

    def loss(p, x):
        out, logits, _ = _apply(graphdef, p, x)
        return jnp.sum(out ** 2) + jnp.sum(logits ** 2), out

    want_grad, want_out = jax.grad(loss, argnums=(0, 1), has_aux=True)(params, x)
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 4), ("data", "expert"))
    expert_split = lambda path, v: NamedSharding(  # noqa: E731
        mesh, PartitionSpec("expert") if "experts" in str(path) else PartitionSpec())
    params_sharded = jax.device_put(params, jax.tree_util.tree_map_with_path(expert_split, params))
    x_sharded = jax.device_put(x, NamedSharding(mesh, PartitionSpec("data")))
    with jax.set_mesh(mesh):
        got_grad, got_out = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(params_sharded, x_sharded)
    assert got_grad[0]["experts"]["gate_proj"][...].sharding.spec[0] == "expert"
    # float32 sums in another order (the psum over experts): relative agreement, as for any reduction
    np.testing.assert_allclose(got_out, want_out, atol=1e-5, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5), got_grad, want_grad)


def test_expert_parallel_lowers_without_partition_id():
    """Experts over ``expert`` with ``fsdp`` left automatic: the program (forward and backward) holds no
    partition_id, which XLA's TPU SPMD partitioner refuses outside a manual region ("PartitionId instruction is not
    supported for SPMD partitioning": Qwen3-30B-A3B's train step over expert 8 x fsdp 8). jax.lax.axis_index
    lowered to one."""
    graphdef, params = _block(_config())
    x = jax.random.normal(jax.random.key(6), (4, 3, D), jnp.float32)
    mesh = Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2), ("fsdp", "expert"))

    def loss(p, x):
        out, logits, _ = _apply(graphdef, p, x)
        return jnp.sum(out ** 2) + jnp.sum(logits ** 2)

    with jax.set_mesh(mesh):
        text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).as_text()
    assert "shard_map" in text or "manual" in text  # the experts did run split over the axis
    assert "partition_id" not in text


def test_cpu_blocked_ragged_dot_equals_ragged_dot():
    """The CPU's block-by-block grouped product: the same values and gradients as jax.lax.ragged_dot, with empty
    groups, groups longer than a block and rows past every group (which give 0)."""
    from grpo_jax.device import cpu

    rng = np.random.default_rng(0)
    sizes = np.array([0, 5, cpu.EXPERT_BLOCK + 3, 0, 1, 2 * cpu.EXPERT_BLOCK], np.int32)
    M = int(sizes.sum()) + 4
    x = jnp.asarray(rng.normal(size=(M, 8)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(len(sizes), 8, 3)), jnp.float32)
    proj = rng.normal(size=(M, 3)).astype(np.float32)

    def f(dot):
        return lambda x, w: jnp.sum(dot(x, w, jnp.asarray(sizes), preferred_element_type=jnp.float32) * proj)

    np.testing.assert_allclose(cpu.blocked_ragged_dot(x, w, jnp.asarray(sizes)),
                               jax.lax.ragged_dot(x, w, jnp.asarray(sizes)), atol=1e-5)
    assert not np.any(cpu.blocked_ragged_dot(x, w, jnp.asarray(sizes))[-4:])
    for got, want in zip(jax.grad(f(cpu.blocked_ragged_dot), argnums=(0, 1))(x, w),
                         jax.grad(f(jax.lax.ragged_dot), argnums=(0, 1))(x, w)):
        np.testing.assert_allclose(got, want, atol=1e-5)
    # the block with the CPU's product is the block
    graphdef, params = _block(_config())
    x_BxTxD = jax.random.normal(jax.random.key(7), (3, 4, D), jnp.float32)
    fast = cpu.grouped_experts(graphdef, params, True)
    np.testing.assert_allclose(_apply(fast, params, x_BxTxD)[0], _apply(graphdef, params, x_BxTxD)[0], atol=1e-6)
