"""Sparse mixture-of-experts feed-forward block (Qwen3-MoE's ``Qwen3MoeSparseMoeBlock``; GPT-OSS's experts and
biased router in `models.gpt_oss`) as pure NNX/JAX.

Dimension letters: N tokens (rows x positions, flattened), D hidden, E experts, F expert width
(``moe_intermediate_size``), K experts per token (``num_experts_per_tok``), M = N * K token-expert assignments.

A linear router (no bias) scores the E experts; softmax in float32; each token goes to its top K experts, whose
probabilities (renormalised to sum 1 with ``norm_topk_prob``) weight their SwiGLU outputs. The experts are ONE
stacked tensor per projection: ``experts.gate_proj`` [E, D, F], ``experts.up_proj`` [E, D, F],
``experts.down_proj`` [E, F, D] (kernels [in, out], HF's per-expert ``weight`` transposed).

Dispatch: the M assignments are sorted by expert and each expert's contiguous rows are multiplied by its weights with
``jax.lax.ragged_dot``: exact (no capacity, no dropped tokens, unlike capacity-factor einsum dispatch) and M*D*F work
where the backend has a grouped matmul (XLA's ragged-dot instruction on GPU; on TPU megablox's kernel,
`grouped.grouped_dot`, since XLA:TPU 0.10.2 expands ragged_dot's weight gradient into a dense product over every
group: E times its work). On CPU jax falls back to a masked dense product over all E groups (E times the work), so
the CPU speed-ups swap in a block-by-block product (`grpo_jax.cpu.grouped_experts`). With an ``expert`` mesh axis
each device holds E / n experts and its share of the tokens (split over data, fsdp and expert as the rows are); a
chunk of every device's tokens at a time is gathered over ``expert``, each device computes the assignments routed to
its experts, and a reduce-scatter adds the experts' outputs back on the token's device (`expert_parallel`). A chunk's
buffers ([n * chunk * K, D]) bound the memory (all tokens at once, Qwen3-30B-A3B's block at 16k tokens a chip needed
26 GiB of temporaries, 2 in chunks).

Routing replay: ``replay_NxK`` (expert indices chosen elsewhere, e.g. by the sampler) replaces the top-K choice;
the weights still come from the current router's probabilities at those experts, renormalised as the model does,
so the router keeps its gradient.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from grpo_jax.models import grouped

EXPERT, DATA = "expert", "data"  # the mesh axes experts are split over and weights never are (device/sharding.py)
ROWS = (DATA, "fsdp", EXPERT)  # the mesh axes tokens are split over (grpo_jax/device/sharding.py ROWS)
# assignments (tokens x K x mesh.expert) one chunk of `expert_parallel` dispatches: Qwen3-30B-A3B's block (D 2048,
# F 768) needs 2.1 GiB of temporaries a chip forward and backward at 16k tokens a chip on v5p (26.5 all at once)
CHUNK_ASSIGNMENTS = 1 << 16


class Routing(NamedTuple):
    """What the routers of an L-layer mixture-of-experts decoder did: logits [L, B, T, E] in the compute dtype and
    the experts each token went to [L, B, T, K] int32."""

    logits: jax.Array
    experts: jax.Array


def swiglu(xs_MxD, group_M, group_sizes_E, stacks, ragged_dot):
    """Qwen3-MoE's experts: down(silu(gate(x)) * up(x)) of each sorted assignment's expert, float32 [M, D].
    ``group_M``: each row's expert (E past the groups); ``stacks``: gate [E, D, F], up [E, D, F], down [E, F, D]."""
    gate_ExDxF, up_ExDxF, down_ExFxD = stacks
    h_MxF = jax.nn.silu(ragged_dot(xs_MxD, gate_ExDxF, group_sizes_E)) * ragged_dot(xs_MxD, up_ExDxF, group_sizes_E)
    return ragged_dot(h_MxF, down_ExFxD, group_sizes_E, preferred_element_type=jnp.float32)


class Experts(nnx.Module):
    """E SwiGLU experts stored as one stacked tensor per projection."""

    def __init__(self, config, rngs: nnx.Rngs):
        E, D, F = config.num_experts, config.hidden_size, config.moe_intermediate_size
        init = nnx.initializers.normal(config.initializer_range)
        dtype = config.param_jnp_dtype
        self.gate_proj = nnx.Param(init(rngs.params(), (E, D, F), dtype))
        self.up_proj = nnx.Param(init(rngs.params(), (E, D, F), dtype))
        self.down_proj = nnx.Param(init(rngs.params(), (E, F, D), dtype))
        self.dtype = config.jnp_dtype
        # the grouped product: the backend's (`grouped.grouped_dot`: megablox on TPU), or the CPU's
        # (`grpo_jax.cpu.grouped_experts`)
        self.ragged_dot = grouped.grouped_dot

    def stacks(self) -> tuple:
        """The stacked tensors `ffn` reads, each [E, ...]."""
        return self.gate_proj[...], self.up_proj[...], self.down_proj[...]

    ffn = staticmethod(swiglu)  # (sorted rows, their experts, group sizes, stacks, ragged_dot) -> [M, D]

    def __call__(self, x_NxD, experts_NxK, weights_NxK):
        """sum_k weights[n, k] * expert_{experts[n, k]}(x[n]) -> [N, D], experts split over an ``expert`` mesh
        axis when the abstract mesh (`jax.set_mesh`) has one of size > 1."""
        stacks = self.stacks()
        mesh = jax.sharding.get_abstract_mesh()
        # a kernel on several devices runs in expert_parallel's shard_map (XLA does not partition it), even at
        # mesh.expert 1
        manual = grouped.needs_manual(self.ragged_dot) and not mesh.empty and mesh.size > 1
        if EXPERT not in mesh.axis_names or (mesh.shape[EXPERT] == 1 and not manual):
            return expert_mlp(x_NxD, experts_NxK, weights_NxK, tuple(w.astype(self.dtype) for w in stacks),
                              ffn=self.ffn, ragged_dot=self.ragged_dot).astype(self.dtype)
        return expert_parallel(mesh, x_NxD, experts_NxK, weights_NxK, stacks, ffn=self.ffn, dtype=self.dtype,
                               ragged_dot=self.ragged_dot, manual=manual).astype(self.dtype)


def expert_mlp(x_NxD, experts_NxK, weights_NxK, stacks, first_expert=0, *, ffn=swiglu,
               ragged_dot=jax.lax.ragged_dot):
    """sum_k weights[n, k] * ffn_{experts[n, k]}(x[n]) over the experts first_expert .. first_expert + E - 1 (the
    given ``stacks``, each [E, ...]: `swiglu`'s by default); assignments to other experts contribute nothing.
    float32 [N, D]."""
    N, K = experts_NxK.shape
    E = stacks[0].shape[0]
    local_M = experts_NxK.reshape(-1) - first_expert
    is_local_M = (local_M >= 0) & (local_M < E)
    group_M = jnp.where(is_local_M, local_M, E)  # other devices' assignments sort last, past every group
    order_M = jnp.argsort(group_M, stable=True)
    token_M = order_M // K
    group_sizes_E = jnp.zeros((E + 1,), jnp.int32).at[group_M].add(1)[:E]
    ys_MxD = ffn(x_NxD[token_M], group_M[order_M], group_sizes_E, stacks, ragged_dot)
    w_M = jnp.where(is_local_M, weights_NxK.reshape(-1), 0)[order_M].astype(jnp.float32)
    # where, not a product: rows past the groups are not the experts' business (their value is unspecified)
    ys_MxD = jnp.where(is_local_M[order_M][:, None], ys_MxD * w_M[:, None], 0.0)
    return jnp.zeros((N, x_NxD.shape[-1]), jnp.float32).at[token_M].add(ys_MxD)


def expert_parallel(mesh, x_NxD, experts_NxK, weights_NxK, stacks, *, ffn=swiglu, dtype=None,
                    ragged_dot=jax.lax.ragged_dot, chunk_tokens=None, manual=False):
    """`expert_mlp` with the experts split over the mesh's ``expert`` axis and the tokens over its row axes (data,
    fsdp, expert): each device takes its tokens in chunks; a chunk's tokens are gathered over ``expert``, each
    device runs the assignments to its E / n experts, and a reduce-scatter over ``expert`` sums every token's
    experts back on the device that holds it. Exact (no capacity, nothing dropped). float32 [N, D]. When all the
    tokens' assignments fit in one chunk (decode) and no ``chunk_tokens`` is given, `_all_tokens` instead.

    With several chunks the weights come in as stored and are cast to ``dtype`` inside each, so their gradient
    sums the chunks in the stored dtype; with one (decode) they are cast first, so half the bytes move.
    ``chunk_tokens``: tokens of one device per chunk (default: `CHUNK_ASSIGNMENTS` / (n K)). ``manual``: the
    ``ragged_dot`` is a Pallas kernel (`grouped.needs_manual`), run with every mesh axis manual (the tokens
    replicated over ``tensor``); `_all_tokens` (no gradient to speed up: decode) then runs ``jax.lax.ragged_dot``."""
    E = stacks[0].shape[0]
    n = mesh.shape[EXPERT]
    if E % n:
        raise ValueError(f"model.num_experts={E} does not split over mesh.expert={n}: make mesh.expert divide it")
    N, K = experts_NxK.shape
    if chunk_tokens is None and N * K <= CHUNK_ASSIGNMENTS:
        return _all_tokens(mesh, x_NxD, experts_NxK, weights_NxK, tuple(w.astype(dtype or x_NxD.dtype) for w in stacks),
                           ffn=ffn, ragged_dot=jax.lax.ragged_dot if manual else ragged_dot)
    rows = tuple(axis for axis in ROWS if axis in mesh.axis_names)
    shards = math.prod(mesh.shape[axis] for axis in rows)
    chunk = chunk_tokens or max(1, CHUNK_ASSIGNMENTS // (n * K))
    dtype = dtype or x_NxD.dtype
    pad = -N % shards  # tokens past the end go to no expert (-1) and are cut off again
    x_NxD, experts_NxK, weights_NxK = _pad(pad, x_NxD, experts_NxK, weights_NxK)
    tokens = (N + pad) // shards
    chunks = -(-tokens // chunk)
    size = -(-tokens // chunks)
    if chunks == 1:
        stacks = tuple(w.astype(dtype) for w in stacks)

    def local(first_1, x, experts, weights, *stacks):
        first = first_1[0]
        # the weights vary over the row axes from here: the cast's transpose sums every device's gradient part
        others = tuple(axis for axis in rows if axis != EXPERT)
        if others and not manual:  # (without check_vma, below, shard_map's transpose sums them itself)
            stacks = tuple(jax.lax.pcast(w, others, to="varying") for w in stacks)
        x, experts, weights = _pad(chunks * size - tokens, x, experts, weights)

        def one(part):
            xs, es, ws = (jax.lax.all_gather(a, EXPERT, tiled=True) for a in part)
            ys = expert_mlp(xs, es, ws, tuple(w.astype(dtype) for w in stacks), first, ffn=ffn, ragged_dot=ragged_dot)
            return jax.lax.psum_scatter(ys, EXPERT, tiled=True)

        if chunks == 1:
            return one((x, experts, weights))[:tokens]
        # remat: a chunk's [n * size * K, D] buffers live only while that chunk runs, forward and backward
        parts = tuple(a.reshape(chunks, size, *a.shape[1:]) for a in (x, experts, weights))
        return jax.lax.map(jax.checkpoint(one), parts).reshape(chunks * size, -1)[:tokens]

    split, row_split = PartitionSpec(EXPERT), PartitionSpec(rows)
    # each device's first expert comes in as data split over the axis, not from axis_index: XLA's TPU SPMD
    # partitioner refuses the PartitionId that axis_index becomes in a shard_map with other axes left automatic
    # (Qwen3-30B-A3B's train step over expert x fsdp)
    first_n = jnp.arange(n, dtype=jnp.int32) * (E // n)
    out_NxD = jax.shard_map(local, mesh=mesh, in_specs=(split, row_split, row_split, row_split, *[split] * len(stacks)),
                            out_specs=row_split, axis_names=set(mesh.axis_names if manual else rows),
                            check_vma=not manual)(  # a Pallas call's outputs carry no varying-axes type
        first_n, x_NxD, experts_NxK, weights_NxK, *stacks)
    return out_NxD[:N]


def _all_tokens(mesh, x_NxD, experts_NxK, weights_NxK, stacks, *, ffn, ragged_dot):
    """`expert_parallel` for few tokens (decode): every device of an ``expert`` group runs its experts' assignments
    of ALL the group's tokens and a psum over ``expert`` adds them; the weights stay split over the other axes (0.26
    GB accessed a layer a chip at Qwen3-30B-A3B's 4 decode tokens a chip over expert 8 x fsdp 8, against 0.50 GB
    gathering them). The tokens stay split over ``data`` (the weights never are): left to XLA, the sort and gathers
    of `expert_mlp` were partitioned over data too and every step all-gathered the tokens and the assignments'
    buffers across the data groups (Qwen3-30B-A3B's rollout layout, expert 8 x data 8: 1.42 GB a step)."""

    def local(first_1, x, experts, weights, *stacks):
        # the tokens cast to varying over the axis up front, so the cast's transpose sums every device's part of
        # their gradient (left to jax 0.10's implicit casts, x's gradient came back wrong: tests/models/test_moe.py);
        # the weights vary over data from here, so their gradient's transpose sums the data shards' parts
        x = jax.lax.pcast(x, EXPERT, to="varying")
        if data:
            stacks = tuple(jax.lax.pcast(w, DATA, to="varying") for w in stacks)
        return jax.lax.psum(expert_mlp(x, experts, weights, stacks, first_1[0], ffn=ffn, ragged_dot=ragged_dot),
                            EXPERT)

    n, E = mesh.shape[EXPERT], stacks[0].shape[0]
    data = mesh.shape.get(DATA, 1) > 1
    N = x_NxD.shape[0]
    # tokens past the end go to no expert (-1) and are cut off again
    x_NxD, experts_NxK, weights_NxK = _pad(-N % mesh.shape[DATA] if data else 0, x_NxD, experts_NxK, weights_NxK)
    split, tokens = PartitionSpec(EXPERT), PartitionSpec(DATA if data else None)
    first_n = jnp.arange(n, dtype=jnp.int32) * (E // n)  # as data, not axis_index: see `expert_parallel`
    return jax.shard_map(local, mesh=mesh, in_specs=(split, tokens, tokens, tokens, *[split] * len(stacks)),
                         out_specs=tokens, axis_names={EXPERT, DATA} if data else {EXPERT})(
        first_n, x_NxD, experts_NxK, weights_NxK, *stacks)[:N]


def _pad(pad, x_NxD, experts_NxK, weights_NxK):
    """The three token arrays with ``pad`` more tokens that go to no expert (id -1, weight 0)."""
    if not pad:
        return x_NxD, experts_NxK, weights_NxK
    return (jnp.pad(x_NxD, ((0, pad), (0, 0))), jnp.pad(experts_NxK, ((0, pad), (0, 0)), constant_values=-1),
            jnp.pad(weights_NxK, ((0, pad), (0, 0))))


def route(router_logits_NxE, top_k: int, norm_topk_prob: bool, replay_NxK=None):
    """(experts [N, K] int32, their weights [N, K] float32) from the router logits: softmax in float32, the top K
    (or the replayed ``replay_NxK``) and, with ``norm_topk_prob``, their probabilities renormalised to sum 1."""
    probs_NxE = jax.nn.softmax(router_logits_NxE.astype(jnp.float32), axis=-1)
    if replay_NxK is None:
        weights_NxK, experts_NxK = jax.lax.top_k(probs_NxE, top_k)
    else:
        experts_NxK = replay_NxK.astype(jnp.int32)
        weights_NxK = jnp.take_along_axis(probs_NxE, experts_NxK, axis=-1)
    if norm_topk_prob:
        weights_NxK = weights_NxK / jnp.sum(weights_NxK, axis=-1, keepdims=True)
    return experts_NxK, weights_NxK


class SparseMoE(nnx.Module):
    """Router (``gate``: a bias-free [D, E] linear) and `Experts`, as Hugging Face's Qwen3MoeSparseMoeBlock."""

    def __init__(self, config, rngs: nnx.Rngs):
        self.gate = nnx.Linear(config.hidden_size, config.num_experts, use_bias=False, dtype=config.jnp_dtype,
                               param_dtype=config.param_jnp_dtype,
                               kernel_init=nnx.initializers.normal(config.initializer_range), rngs=rngs)
        self.experts = Experts(config, rngs)
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob

    def router_logits(self, x_NxD):
        """The router's logits [N, E] in the compute dtype."""
        return self.gate(x_NxD)

    def __call__(self, x_BxTxD, replay_BxTxK=None):
        """(out [B, T, D], router logits [B, T, E] in the compute dtype, chosen experts [B, T, K] int32).

        ``replay_BxTxK``: use these experts instead of the router's top K (routing replay)."""
        B, T, D = x_BxTxD.shape
        x_NxD = x_BxTxD.reshape(B * T, D)
        logits_NxE = self.router_logits(x_NxD)
        replay_NxK = None if replay_BxTxK is None else replay_BxTxK.reshape(B * T, -1)
        experts_NxK, weights_NxK = route(logits_NxE, self.top_k, self.norm_topk_prob, replay_NxK)
        # HF casts the weights to the compute dtype before they scale the experts' outputs
        out_NxD = self.experts(x_NxD, experts_NxK, weights_NxK.astype(logits_NxE.dtype))
        return (out_NxD.reshape(B, T, D), logits_NxE.reshape(B, T, -1),
                experts_NxK.reshape(B, T, -1))


class RoutedDecoderLayer(nnx.Module):
    """A pre-norm decoder block with a mixture of experts: x + attn(norm(x)), then x + mlp(norm(x)); also returns the
    router's logits and the experts each token went to (``routing``: replay these instead). A family's subclass
    builds ``self_attn``, ``mlp`` (a `SparseMoE`), ``input_layernorm`` and ``post_attention_layernorm``."""

    def __call__(self, x, cos, sin, mask, cache_kv, cache_index, prefix_kv=None, prefix_group_size=1,
                 whole_mask=False, routing=None):
        attn, cache_kv, new_kv = self.self_attn(self.input_layernorm(x), cos, sin, mask, cache_kv, cache_index,
                                                prefix_kv, prefix_group_size, whole_mask)
        x = x + attn
        out, router_logits, experts = self.mlp(self.post_attention_layernorm(x), routing)
        return x + out, cache_kv, new_kv, (router_logits, experts)


def routing_dtype(num_experts: int):
    """The smallest integer dtype of expert ids: recorded routing ([B, P + T, L, K] per round) is large."""
    return jnp.uint8 if num_experts <= 256 else jnp.int32


def load_balancing_loss(router_logits_LxNxE, top_k: int, mask_N=None):
    """Switch Transformer's auxiliary loss as transformers' ``load_balancing_loss_func``:
    E * sum_e f_e * P_e, where over all L layers' (unmasked) tokens f_e = (top-K assignments to e) / tokens and
    P_e = mean router probability of e. The top K is the router's own (never a replayed choice). float32 scalar."""
    L, N, E = router_logits_LxNxE.shape
    probs_LxNxE = jax.nn.softmax(router_logits_LxNxE.astype(jnp.float32), axis=-1)
    _, experts_LxNxK = jax.lax.top_k(probs_LxNxE, top_k)
    mask_N = jnp.ones((N,), jnp.float32) if mask_N is None else mask_N.astype(jnp.float32)
    counts_LxNxE = jnp.sum(jax.nn.one_hot(experts_LxNxK, E, dtype=jnp.float32), axis=2)
    total = L * jnp.sum(mask_N)
    tokens_per_expert_E = jnp.einsum("lne,n->e", counts_LxNxE, mask_N) / total
    prob_per_expert_E = jnp.einsum("lne,n->e", probs_LxNxE, mask_N) / total
    return E * jnp.sum(tokens_per_expert_E * prob_per_expert_E)
