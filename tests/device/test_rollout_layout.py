"""Decoding's own layout (grpo_jax/device/rollout_layout.py, `programs.jit_decoder(rollout=...)`): the same tokens as
the training layout on 8 fake CPU devices, the choice of group, and, compiled for a v5p:4x4x4 slice from here, a
decode loop whose collectives stay inside the tensor-parallel group (read from the HLO by grpo_jax/api/hlo.py).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.algo import programs
from grpo_jax.algo.sampling import SamplingConfig
from grpo_jax.api import hlo, plan_programs
from grpo_jax.config.model import LoRAConfig
from grpo_jax.device import chips, rollout_layout, sharding
from grpo_jax.models import ModelConfig, init_model
from grpo_jax.rollout import stream

MASK = np.concatenate([np.zeros((16, 2), np.int32), np.ones((16, 3), np.int32)], axis=1)  # left-padded prompts
IDS = np.random.default_rng(0).integers(4, 32, (16, 5)).astype(np.int32) * MASK


def decode(model, mesh, placement, *, greedy, slots=0):
    config, graphdef, params = model
    shardings = sharding.param_shardings(mesh, params)
    dec = programs.jit_decoder(graphdef, mesh, config, config=SamplingConfig(max_completion_length=7, temperature=0.9,
                                                                           max_batch_rows=slots),
                               eos_token_ids=(3,), pad_token_id=0, params_sharding=shardings,
                               prompt_group_size=1 if greedy else 2, rollout=placement)
    rows = stream.generate(dec, jax.device_put(params, shardings), IDS, MASK, jax.random.key(5), greedy=greedy,
                           group_size=1 if greedy else 2)
    return rows, jax.device_get(rows)


@pytest.mark.parametrize("greedy, slots, lora", [(True, 0, False), (False, 0, False), (False, 4, False),
                                                 (True, 0, True)])
def test_tensor_2_by_data_4_decodes_the_tokens_of_fsdp_8(tiny_model_config, greedy, slots, lora):
    """8 devices: the rollout layout (tensor 2 x data 4, the policy resharded into it once a call, LoRA adapters
    merged there) gives the training layout's (fsdp 8) tokens, its log-probs within float rounding, and its rows
    back in the training mesh's row layout, where the log-prob passes and the train step take them."""
    config = tiny_model_config
    if lora:  # adapters that change the tokens (B not zero)
        config = dataclasses.replace(config, lora=LoRAConfig(rank=4, alpha=8.0, init_lora_weights=False))
    graphdef, params = init_model(config, seed=0)
    model = (config, graphdef, params)
    mesh = sharding.make_mesh(1, 8, 1)
    layout = rollout_layout.Layout(2, "tensor", "test")
    placement = programs.rollout_placement(mesh, layout, params)
    assert dict(placement.mesh.shape) == {"data": 4, "fsdp": 1, "tensor": 2, "expert": 1}
    assert list(placement.mesh.devices.flat) == list(mesh.devices.flat)  # one device order: one program reshards
    _, want = decode(model, mesh, None, greedy=greedy, slots=slots)
    on_devices, got = decode(model, mesh, placement, greedy=greedy, slots=slots)
    np.testing.assert_array_equal(got.completion_ids, want.completion_ids)
    np.testing.assert_array_equal(got.completion_mask, want.completion_mask)
    np.testing.assert_allclose(got.sampler_per_token_logps, want.sampler_per_token_logps, rtol=1e-5, atol=1e-6)
    assert on_devices.completion_ids.sharding.is_equivalent_to(sharding.row_sharded(mesh), 2)
    assert np.any(got.completion_mask.sum(1) > 1)  # rows really decoded


def test_the_layout_program_splits_heads_columns_and_vocabulary_over_the_group(tiny_model):
    config, graphdef, params = tiny_model
    mesh = sharding.make_mesh(1, 8, 1)
    placement = programs.rollout_placement(mesh, rollout_layout.Layout(2, "tensor", "test"), params)
    shards = {sharding.path_name(p): s.shard_shape(x.shape) for (p, s), x in
              zip(jax.tree_util.tree_leaves_with_path(placement.params_sharding), jax.tree.leaves(params))}
    L, D, F, V = config.num_hidden_layers, config.hidden_size, config.intermediate_size, config.vocab_size
    assert shards["embed_tokens.embedding"] == (V // 2, D)  # vocabulary
    assert shards["layers.self_attn.q_proj.kernel"] == (L, D, config.num_attention_heads * config.resolved_head_dim // 2)
    assert shards["layers.mlp.down_proj.kernel"] == (L, F // 2, D)  # the MLP's rows: one all-reduce a block
    assert shards["layers.input_layernorm.weight"] == (L, D)  # norms whole


def test_the_choice_is_the_training_layout_on_cpus_and_a_key_is_checked(tiny_model_config):
    _, params = init_model(tiny_model_config, seed=0)
    mesh = sharding.make_mesh(1, 8, 1)
    common = dict(chip=None, rows=16, prompt=6, completion=6, abstract_params=params, state_bytes=0)
    assert rollout_layout.choose(0, tiny_model_config, mesh, **common) is None  # CPU: weights in host memory
    assert rollout_layout.choose(-1, tiny_model_config, mesh, **common) is None
    assert rollout_layout.choose(2, tiny_model_config, mesh, **common).group == 2
    with pytest.raises(ValueError, match=r"mesh.rollout_tensor=3 must divide the 8 devices"):
        rollout_layout.choose(3, tiny_model_config, mesh, **common)


def test_the_chosen_group_is_the_fastest_estimate_that_fits():
    """Gemma-3-27B's shape (62 layers, 52 of them sliding over 1,024 tokens) on 64 v5p chips at 1k + 15k, 256 rows:
    a bigger group reads fewer weight bytes a chip per step until the all-reduces' cost outweighs it; the KV a step
    reads is the 10 full layers' rows at half their completion plus the 52 windows (hand count, `row_tokens`); every
    candidate's estimate (`step_seconds`) is in the reason, the choice the smallest of them, and with a train
    state that leaves too little HBM for every whole row the layout names the pool that fits (rows wait beyond)."""
    types = ["sliding_attention"] * 5 + ["full_attention"]
    model = ModelConfig(vocab_size=262144, hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
                        num_attention_heads=32, num_key_value_heads=16, head_dim=128, dtype="bfloat16",
                        sliding_window=1024, layer_types=tuple((types * 11)[:62]))
    assert rollout_layout.row_tokens(model, 1024, 15360) == (10 * 16384, 10 * 8704 + 52 * 1024, 52 * 1024)
    devices = np.asarray([_FakeDevice(i) for i in range(64)])
    mesh = jax.sharding.Mesh(devices.reshape(1, 64, 1, 1), sharding.AXES)
    params = {"w": jax.ShapeDtypeStruct((27 * 10 ** 9,), jnp.float32)}
    chip = chips.CHIPS["v5p"]
    weights, layer_token = 27e9 * 2, 2 * 16 * 128 * 2

    def estimate(g):
        rows = 256 / (64 // g)
        kv = rows * (10 * 8704 + 52 * 1024) * layer_token / g
        return rollout_layout.step_seconds(chip, weights=weights / g, kv=kv,
                                           rows=int(rows), hidden=5376, layers=62, group=g)

    def whole(g):  # weights, rings and every whole row a chip
        return weights / g + 256 / (64 // g) * (52 * 1024 + 10 * 16384) * layer_token / g

    for state in (20 * 2 ** 30, 75 * 2 ** 30):
        layout = rollout_layout.choose(0, model, mesh, chip=chip, rows=256, prompt=1024, completion=15360,
                                       abstract_params=params, state_bytes=state)
        free = 0.9 * chip.hbm_bytes - state
        g = layout.group
        assert g == min((g for g in (1, 2, 4, 8, 16) if weights / g < free), key=estimate)
        assert layout.axis == "tensor" and f"{1e3 * estimate(g):.2f} ms" in layout.reason
        if whole(g) <= free:
            assert layout.kv_cache_tokens == 0
        else:  # the pool a chip holds over its heads: what the weights and rings leave, per full-layer token
            rings = 256 / (64 // g) * 52 * 1024 * layer_token / g
            per_shard = int((free - weights / g - rings) // (10 * layer_token / g))
            assert layout.kv_cache_tokens == per_shard * (64 // g)
            assert f"{layout.kv_cache_tokens} tokens" in layout.reason
            assert 16384 <= per_shard < 256 / (64 // g) * 16384
    assert layout.kv_cache_tokens  # 75 GiB of train state a chip: a pool
    print(layout.reason)


class _FakeDevice:
    platform, device_kind = "tpu", "TPU v5"

    def __init__(self, i):
        self.id = i

    def __repr__(self):
        return f"D{self.id}"


def test_ring_collective_seconds_by_hand():
    chip = chips.CHIPS["v5p"]  # 600 GB/s one way over 6 links, a ring over 2 of them: 200 GB/s
    assert chip.group_bandwidth == pytest.approx(200e9)
    assert chips.collective_seconds(chip, "all-reduce", 2e6, 8) == pytest.approx(14e-6 + 2 * 7 / 8 * 2e6 / 200e9)
    assert chips.collective_seconds(chip, "all-gather", 2e6, 8) == pytest.approx(7e-6 + 7 / 8 * 2e6 / 200e9)
    assert chips.collective_seconds(chip, "all-reduce", 2e6, 1) == 0.0


needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu not installed (pip install -e '.[tpu]'): no TPU topology to compile for")


@needs_libtpu
def _pod_decode(model: ModelConfig, tensor: int, B: int, P: int, T: int, *, axis="tensor", expert=1, **sampling):
    """A v5p:4x4x4 decoding call of ``B`` rows compiled from this CPU, decoding in the training layout (fsdp 64 /
    ``expert``, ``tensor`` 0) or in ``axis`` ``tensor`` x data 64 / ``tensor``: (compiled ``advance``, its decoding
    state)."""
    from grpo_jax.algo.state import model_graphdef
    from grpo_jax.api import plan

    mesh = sharding.make_mesh(1, -1, 1, devices=plan.topology_devices("v5p:4x4x4"), expert=expert)
    shapes = jax.eval_shape(lambda: init_model(model, 0)[1])
    shardings = sharding.param_shardings(mesh, shapes)
    placement = None
    if tensor:
        placement = programs.rollout_placement(mesh, rollout_layout.Layout(tensor, axis, "test"), shapes)
    dec = programs.jit_decoder(model_graphdef(model), mesh, model,
                               config=SamplingConfig(max_completion_length=T, **sampling), eos_token_ids=(0,),
                               pad_token_id=0, params_sharding=shardings, prompt_group_size=4, rollout=placement)
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)
    decode_mesh = mesh
    if placement is not None:
        params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16, sharding=s),
                              shapes, placement.params_sharding)
        decode_mesh = placement.mesh
    rows, rep = sharding.row_sharded(decode_mesh), sharding.replicated(decode_mesh)
    options = dec.options(B, B, False)
    args = (params, jax.ShapeDtypeStruct((B, P), jnp.int32, sharding=rows),
            jax.ShapeDtypeStruct((B, P), jnp.int32, sharding=rows),
            jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=rep), jax.ShapeDtypeStruct((), jnp.int32, sharding=rep))
    prefill = dec.start.lower(*args, options).compile()
    decoding = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            jax.eval_shape(lambda *a: dec.start(*a, options), *args), prefill.output_shardings)
    return dec.advance.lower(params, decoding, options, False).compile(), SimpleNamespace(
        decoding=decoding, dec=dec, options=options, params=params, page_free=decoding.page_free)


def test_a_v5p_pod_decodes_inside_its_tensor_groups():
    """A small Llama's decode loop compiled for v5p:4x4x4 (64 chips) from this CPU, 256 rows. In the training layout
    (fsdp 64) every step all-reduces over all 64 chips, the [256, vocab] logits among them. In the rollout layout
    (tensor 8 x data 8) no collective of the loop spans more than a group of 8, and each moves at most the group's
    rows' activations: the next token is drawn from the group's vocabulary shards (their arg-maxes gathered), never
    from logits crossing the pod. (A paged cache, ``kv_cache`` auto on TPUs; head dim 64: read back densely.)"""
    V, D, B, P, T = 4096, 512, 256, 64, 64
    model = ModelConfig(vocab_size=V, hidden_size=D, intermediate_size=1024, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=8, head_dim=64, dtype="bfloat16")

    def per_step(tensor):
        text = _pod_decode(model, tensor, B, P, T)[0].as_text()
        return [c for c in hlo.collectives(text, 64) if c.per_step]

    logits = B * V * 2
    training = per_step(0)
    assert max(c.group for c in training) == 64 and max(c.bytes for c in training) >= logits
    rollout = per_step(8)
    group_rows = B // 8
    assert rollout and max(c.group for c in rollout) <= 8
    assert max(c.bytes for c in rollout) <= group_rows * D * 2  # one group's rows' activations, bf16
    assert sum(c.bytes for c in rollout) < logits / 10


@pytest.mark.parametrize("replay", [False, True])
def test_a_v5p_pods_experts_decode_inside_their_expert_groups(replay):
    """A small Qwen3-MoE (64 experts, 8 a token) decoding on v5p:4x4x4 in expert 8 x data 8 (attention data parallel:
    4 of the 256 rows a chip), compiled from this CPU: each step a group of 8 gathers its 32 rows' tokens, routes
    them to its experts and sums their outputs inside the group; only the loop's stop test (a flag) spans the pod.
    Before, XLA split `moe._all_tokens`' sort and gathers over data as well and all-gathered the rows' tokens and
    the assignments' buffers across the data groups every step (15 MB here), and a static batch's rows were
    gathered through their slots (routing replay's record: 134 KB over all 64 chips)."""
    D, B = 512, 256
    model = ModelConfig(model_type="qwen3_moe", vocab_size=4096, hidden_size=D, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=64, dtype="bfloat16", num_experts=64,
                        num_experts_per_tok=8, moe_intermediate_size=256, routing_replay=replay)
    text = _pod_decode(model, 8, B, 64, 64, axis="expert", expert=8)[0].as_text()
    loop = [c for c in hlo.collectives(text, 64) if c.per_step]
    group_rows, K = B // 8, model.num_experts_per_tok
    assert loop and max((c.bytes for c in loop if c.group > 8), default=0) <= 512  # the stop test's flags
    assert max(c.bytes for c in loop) <= group_rows * D * 2  # a group's rows' activations, bf16
    assert sum(c.bytes for c in loop) < 0.2e6
    # what the layout chooser counts a routed layer (`rollout_layout.step_seconds`): the rows' tokens, expert ids
    # and routing weights gathered, the experts' outputs all-reduced
    in_group = sorted((c.kind, c.bytes) for c in loop if c.group == 8)
    layer = sorted([("all-gather", group_rows * D * 2), ("all-gather", group_rows * K * 4),
                    ("all-gather", group_rows * K * 2), ("all-reduce", group_rows * D * 2)])
    assert in_group == sorted(layer * model.num_hidden_layers)
    chip = chips.CHIPS["v5p"]
    assert rollout_layout.step_seconds(chip, weights=0, kv=0, rows=group_rows, hidden=D, layers=2, group=8,
                                       top_k=K) == pytest.approx(sum(chips.collective_seconds(chip, kind, n, 8)
                                                                     for kind, n in in_group))


def test_a_v5p_pods_kv_pages_follow_the_pool_not_rows_times_length():
    """Paged decoding on v5p:4x4x4 in tensor 8 x data 8, compiled from this CPU (head dim 128: the TPU paged-attention
    kernel reads the pages, in a ``shard_map``): each chip holds its row shard's pool over its key/value head, so a
    chip's decode state grows by 2 x layers x (tokens / 8 shards) x (K / 8) x Dh x 2 bytes (and the free lists'
    booleans) when the pool
    (``sampling.kv_cache_tokens``, sized to the rows' live tokens) grows, and saves against the contiguous cache
    about its whole rows' slots less the live tokens (hand count; other state differs by ~1 MiB); the decode loop's collectives stay inside the groups of 8 (no page crosses
    the pod)."""
    L, K, Dh, B, P, T = 2, 8, 128, 256, 128, 1024
    model = ModelConfig(vocab_size=4096, hidden_size=1024, intermediate_size=2048, num_hidden_layers=L,
                        num_attention_heads=16, num_key_value_heads=K, head_dim=Dh, dtype="bfloat16")
    live = B * (P + T // 4)  # rows at a quarter of their completions on average
    small, state = _pod_decode(model, 8, B, P, T, kv_cache_tokens=live)
    large, _ = _pod_decode(model, 8, B, P, T, kv_cache_tokens=2 * live)
    contiguous, _ = _pod_decode(model, 8, B, P, T, kv_cache="contiguous")
    assert "tpu_custom_call" in small.as_text()
    assert state.page_free.shape[0] == 8  # a pool per data-parallel row shard
    grown = large.memory_analysis().argument_size_in_bytes - small.memory_analysis().argument_size_in_bytes
    page = 16  # sampling.kv_page_size's default
    per_chip_pages = live // page // 8  # each shard's added pages (the pool doubles)
    kv = 2 * L * per_chip_pages * page * (K // 8) * Dh * 2
    assert kv <= grown <= kv + 8 * per_chip_pages  # beside the free lists' booleans (8 shards)
    per_token = 2 * L * (K // 8) * Dh * 2  # a chip's bytes a cached token (its key/value head)
    saved = contiguous.memory_analysis().argument_size_in_bytes - small.memory_analysis().argument_size_in_bytes
    assert saved >= 0.9 * (B // 8 * (P + T) - live // 8) * per_token  # whole rows' slots less the live tokens'
    loop = [c for c in hlo.collectives(small.as_text(), 64) if c.per_step]
    assert loop and max(c.group for c in loop) <= 8
    # the plan counts a step of the pool's steady state (`plan_programs.steady_state`): a pool smaller than every
    # slot's whole row adds preemption and readmission branches, which XLA counts every trip though they run only
    # when the pool runs short; without them a step is its products (the kernel's attention XLA does not count):
    # 2 x a group's 32 rows x a chip's eighth of the weights' products (q, k, v, o, MLP, unembedding), by hand
    dec, options, params = state.dec, state.options, state.params
    steady = dec.advance.lower(params, plan_programs.steady_state(state.decoding), options, False).compile()
    D, H, F, V = model.hidden_size, model.num_attention_heads, model.intermediate_size, model.vocab_size
    products = L * (2 * D * H * Dh + 2 * D * K * Dh + 3 * D * F) + D * V
    hand = 2 * (B // 8) * products / 8
    assert plan_programs.xla_cost(steady)[0] == pytest.approx(hand, rel=0.05)
    assert plan_programs.xla_cost(small)[0] > 100 * hand  # before: the untaken branches counted every step
    print(f"v5p:4x4x4 decode state a chip: paged {small.memory_analysis().argument_size_in_bytes / 2**20:.1f} MiB, "
          f"contiguous {contiguous.memory_analysis().argument_size_in_bytes / 2**20:.1f} MiB")


def test_a_v5p_decode_steps_hbm_bytes_are_its_weights():
    """A Llama of hidden 4096 (2 layers, vocabulary 32k, 32 query and 16 key/value heads of 128: two a chip)
    decoding on v5p:4x4x4 in tensor 8 x data 8, its decode loop read from the HLO instruction by instruction
    (`hlo.traffic`, what the plan counts a step): a chip's eighth of the weights, by hand, less what XLA keeps in
    VMEM across the loop's trips (its loop state laid out in ``S(1)``), within 10 % (the 32 rows' activations); the
    page pools' writes count as the tokens written, their reads are the kernel's (`paged_kernel_bytes`), and the
    call's one-time work (layers sliced out of their stack, the loop state's set-up) is apart. No pool is copied in
    the loop: scattered over their head axis, pools of two heads a chip were copied to and from the kernel's layout
    every step (192 MB a step at hidden 1024). Before: XLA's count, over 5x the step, was the plan's."""
    L, D, F, H, K, Dh, V, B, P, T = 2, 4096, 14336, 32, 16, 128, 32768, 256, 128, 1024
    model = ModelConfig(vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=L, num_attention_heads=H,
                        num_key_value_heads=K, head_dim=Dh, dtype="bfloat16")
    compiled, state = _pod_decode(model, 8, B, P, T)
    text = compiled.as_text()
    pools = plan_programs.kernel_operands(state.decoding)
    assert pools == {(2, 2304, 16, 128)}  # a chip's two key/value heads of its shard's pages
    traffic = hlo.traffic(text, pools)
    comps, entry = hlo.computations(text)
    loop = next(i for i in comps[entry] if i.opcode == "while" and "known_trip_count" not in i.line)
    body = comps[loop.attribute("body")[0]]
    assert not [i.name for i in body if i.opcode == "copy" and i.type.startswith("bf16[2,2304,16,128]")]
    in_vmem = sum(hlo.array_bytes(i.type) for i in body if i.opcode == "get-tuple-element" and "S(1)" in i.type)
    weights = (L * (2 * D * H * Dh + 2 * D * K * Dh + 3 * D * F) + D * V) * 2 / 8  # the embedding: its rows only
    assert weights <= traffic.per_step + in_vmem <= 1.1 * weights
    assert traffic.once > weights  # the layers' weights sliced out of their stack, once a call
    assert plan_programs.xla_cost(compiled)[1] > 5 * traffic.per_step
