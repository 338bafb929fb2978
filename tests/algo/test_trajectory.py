"""Trajectories as model inputs (`grpo_jax.algo.trajectory`): positions, the three layouts' shapes against the FLOPs the
cost model charges them, the CPU's block count against the blocked attention's own, and the layout choice."""

import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.algo import trajectory
from grpo_jax.device import cpu
from grpo_jax.models import positions_from_mask

rng = np.random.default_rng(0)
G, R, P, T = 4, 3, 12, 40
B = G * R
PROMPT_TOKENS = np.repeat(rng.integers(2, P + 1, R), G)
COMPLETION_TOKENS = rng.integers(0, T + 1, B)
PROMPT_MASK = (np.arange(P)[None] >= P - PROMPT_TOKENS[:, None]).astype(np.int32)
COMPLETION_MASK = (np.arange(T)[None] < COMPLETION_TOKENS[:, None]).astype(np.int32)
PROMPT_IDS = np.where(PROMPT_MASK == 1, rng.integers(3, 30, (B, P)), 0).astype(np.int32)
COMPLETION_IDS = rng.integers(3, 30, (B, T)).astype(np.int32)
FLOPS = (1000.0, 7.0)


def _layout(**options):
    return trajectory.layout(PROMPT_IDS, PROMPT_MASK, COMPLETION_IDS, COMPLETION_MASK, **options)


def test_positions_follow_the_masks():
    prompt, completion = trajectory.positions(jnp.asarray(PROMPT_MASK), jnp.asarray(COMPLETION_MASK))
    whole = positions_from_mask(jnp.concatenate([PROMPT_MASK, np.ones_like(COMPLETION_MASK)], axis=1))
    np.testing.assert_array_equal(prompt, whole[:, :P])
    np.testing.assert_array_equal(completion, whole[:, P:])


@pytest.mark.parametrize("group, packing, buffers, pair_cost", [
    (1, False, 0, 1.0), (G, False, 0, 1.0), (G, True, 0, 1.0), (1, True, 0, 1.0), (G, True, 1, 1.0), (1, True, 3, 1.0),
    (1, True, 4, 1.0), (G, False, 0, 6.0), (G, True, 1, 6.0)])
def test_the_cost_model_charges_each_layout_what_its_arrays_run(group, packing, buffers, pair_cost):
    """Tokens: every buffer slot (and prefix slot); pairs: every score XLA computes for the layout's masks, each
    at ``pair_cost`` matmul FLOPs."""
    packed = trajectory.packed_length(PROMPT_TOKENS, COMPLETION_TOKENS, group, buffers) if packing else 0
    layout = _layout(group_size=group, packed_length=packed, packed_buffers=buffers)
    assert layout.ids.shape[0] == ((buffers or B // group) if packing else B)
    tokens = layout.ids.size + (0 if layout.prefix is None else layout.prefix[0].size)
    if layout.mask.ndim == 3:  # a whole mask: [R, L, L] scores
        pairs = layout.mask.size
    else:  # each buffer slot against the prefix and buffer slots; the prefix against itself
        pairs = layout.ids.size * layout.mask.shape[1] + (0 if layout.prefix is None else
                                                          layout.prefix[0].shape[0] * layout.prefix[0].shape[1] ** 2)
    want = tokens * FLOPS[0] + pairs * FLOPS[1] * pair_cost
    got = trajectory.layout_flops(PROMPT_TOKENS, COMPLETION_TOKENS, group, P, T, FLOPS, packed_length=packed,
                                  packed_buffers=buffers, dense_pair_cost=pair_cost)
    assert got == want
    assert packed == 0 or packed >= trajectory.packed_need(PROMPT_TOKENS, COMPLETION_TOKENS, group, buffers)


@pytest.mark.parametrize("buffers", [0, 1, 3])
def test_packed_buffers_hold_each_row_once_and_nothing_else(buffers):
    """Naive: each row's prompt ++ completion, read back out of the buffers through the layout's own ids, positions
    and masks: the slots `source` names hold the row's tokens at their positions and predict its completion, and a
    slot sees exactly its row's tokens up to itself."""
    L = trajectory.packed_length(PROMPT_TOKENS, COMPLETION_TOKENS, G, buffers)
    prompt_ids = np.repeat(PROMPT_IDS[::G], G, axis=0)  # a group's rows share its prompt
    layout = trajectory.layout(prompt_ids, PROMPT_MASK, COMPLETION_IDS, COMPLETION_MASK, group_size=G,
                               packed_length=L, packed_buffers=buffers)
    ids, positions, mask = (np.asarray(x) for x in (layout.ids, layout.positions, layout.mask))
    next_ids, source = np.asarray(layout.next_ids).reshape(-1), np.asarray(layout.source)
    for b in range(B):
        p, n = PROMPT_TOKENS[b], COMPLETION_TOKENS[b]
        row = np.concatenate([prompt_ids[b, P - p:], COMPLETION_IDS[b, :n]])
        slots = source[b, :max(n, 1)]  # the row's last prompt token, then its completion tokens but the last
        buffer, slots = slots[0] // L, slots % L
        assert np.all(source[b, :max(n, 1)] // L == buffer)
        np.testing.assert_array_equal(positions[buffer, slots], p - 1 + np.arange(len(slots)))
        np.testing.assert_array_equal(ids[buffer, slots], row[p - 1:p - 1 + len(slots)])
        np.testing.assert_array_equal(next_ids[buffer * L + slots[:n]], COMPLETION_IDS[b, :n])
        for slot in slots:  # a slot sees its row up to itself, each token once
            seen = np.flatnonzero(mask[buffer, slot])
            order = np.argsort(positions[buffer, seen])
            np.testing.assert_array_equal(positions[buffer, seen][order], np.arange(positions[buffer, slot] + 1))
            np.testing.assert_array_equal(ids[buffer, seen][order], row[:positions[buffer, slot] + 1])
    want = 0  # nothing else is seen: per group its prompt's causal triangle, per row its prompt and own triangle
    for p, n_G in zip(PROMPT_TOKENS[::G], COMPLETION_TOKENS.reshape(-1, G)):
        want += (p - 1) * p // 2 + sum((n + 1) * (p - 1) + (n + 1) * (n + 2) // 2 for n in n_G)
    assert mask.sum() == want


def test_the_cpu_block_count_is_the_blocked_attentions_own():
    """`cpu.blocked_pairs` from host counts == the blocks `blocked_attention` finds needed in the real masks (and
    its loop's steps)."""
    prompt = np.repeat(rng.integers(40, 300, 3), 4)
    completion = rng.integers(0, 200, 12)
    L = trajectory.packed_length(prompt, completion, 4)
    ids = np.zeros((12, prompt.max()), np.int32)
    mask = (np.arange(prompt.max())[None] >= prompt.max() - prompt[:, None]).astype(np.int32)
    cmask = (np.arange(200)[None] < completion[:, None]).astype(np.int32)
    layout = trajectory.layout(ids, mask, np.zeros((12, 200), np.int32), cmask, group_size=4, packed_length=L)
    b = 128
    n = L // b
    needed = np.asarray(layout.mask).reshape(3, n, b, n, b).any(axis=(0, 2, 4))
    branches = completion.reshape(3, 4) + 1
    def cost(blocks, buffers):  # the blocks computed in each buffer, and the loop's steps (skipped blocks too)
        return int(cpu.BLOCK_PAIR_COST * blocks * b * b * buffers + cpu.BLOCK_VISIT * n * n * b * b)

    assert cpu.blocked_pairs(prompt[::4] - 1, branches, L) == cost(needed.sum(), 3)
    assert needed.sum() < n * n  # branches skip each other's blocks
    assert cpu.blocked_pairs(prompt[::4] - 1, branches, 256) is None  # short buffers stay dense
    L = trajectory.packed_length(prompt, completion, 4, buffers=1)  # the three groups in one buffer
    layout = trajectory.layout(ids, mask, np.zeros((12, 200), np.int32), cmask, group_size=4, packed_length=L,
                               packed_buffers=1)
    n = L // b
    needed = np.asarray(layout.mask).reshape(n, b, n, b).any(axis=(1, 3))
    assert cpu.blocked_pairs(prompt[::4] - 1, branches, L, buffers=1) == cost(needed.sum(), 1)


def test_packing_is_chosen_when_it_costs_less_or_as_configured():
    """Naive: every buffer count that splits the groups evenly over the shards, costed one by one."""
    args = (PROMPT_TOKENS, COMPLETION_TOKENS, G, P, T)

    def cheapest(flops, shards=1):
        options = [(trajectory.layout_flops(*args, flops, packed_length=trajectory.packed_length(*args[:3], K),
                                            packed_buffers=K), (trajectory.packed_length(*args[:3], K), K))
                   for K in range(1, R + 1) if R % K == 0 and K % shards == 0]
        return min(options)

    assert trajectory.choose_packing(*args, FLOPS, packing=False) == (0, 0)
    assert trajectory.choose_packing(*args, FLOPS, packing=True) == cheapest(FLOPS)[1]
    static = trajectory.layout_flops(*args, FLOPS)
    flops, packed = cheapest(FLOPS)
    assert trajectory.choose_packing(*args, FLOPS, packing=None) == (packed if flops < static else (0, 0))
    # matmuls dominate: one buffer, the least padding; dense attention dominates: the static layout with shared
    # prompts; the shards bound the buffers from below
    assert trajectory.choose_packing(*args, (1e6, 1.0), packing=None) == (trajectory.packed_length(*args[:3], 1), 1)
    assert trajectory.choose_packing(*args, (1.0, 1e6), packing=True) == cheapest((1.0, 1e6))[1]
    assert trajectory.choose_packing(*args, (1.0, 1e6), packing=None) == (0, 0)
    assert trajectory.choose_packing(*args, (1e6, 1.0), packing=True, shards=3)[1] == 3
    # micro-batches: rows in micro-batch order, buffers counted per micro-batch
    two = trajectory.choose_packing(*args, (1e6, 1.0), packing=True, micro_batches=3, shards=1)
    assert two == (trajectory.packed_length(*args[:3], 3), 1)
