"""Trajectories as model inputs (`grpo_jax.trajectory`): positions, the three layouts' shapes against the FLOPs the
cost model charges them, the CPU's block count against the blocked attention's own, and the layout choice."""

import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax import cpu, trajectory
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


@pytest.mark.parametrize("group, packed", [(1, 0), (G, 0), (G, 256), (1, 64)])
def test_the_cost_model_charges_each_layout_what_its_arrays_run(group, packed):
    """Tokens: every buffer slot (and prefix slot); pairs: every score XLA computes for the layout's masks."""
    layout = _layout(group_size=group, packed_length=packed)
    tokens = layout.ids.size + (0 if layout.prefix is None else layout.prefix[0].size)
    if layout.mask.ndim == 3:  # a whole mask: [R, L, L] scores
        pairs = layout.mask.size
    else:  # each buffer slot against the prefix and buffer slots; the prefix against itself
        pairs = layout.ids.size * layout.mask.shape[1] + (0 if layout.prefix is None else
                                                          layout.prefix[0].shape[0] * layout.prefix[0].shape[1] ** 2)
    want = tokens * FLOPS[0] + pairs * FLOPS[1]
    got = trajectory.layout_flops(PROMPT_TOKENS, COMPLETION_TOKENS, group, P, T, FLOPS, packed_length=packed)
    assert got == want
    assert packed == 0 or packed >= trajectory.packed_need(PROMPT_TOKENS, COMPLETION_TOKENS, group)


def test_the_cpu_block_count_is_the_blocked_attentions_own():
    """`cpu.blocked_pairs` from host counts == the blocks `blocked_attention` finds needed in the real masks."""
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
    assert cpu.blocked_pairs(prompt[::4] - 1, branches, L) == needed.sum() * b * b
    assert needed.sum() < n * n  # branches skip each other's blocks
    assert cpu.blocked_pairs(prompt[::4] - 1, branches, 256) is None  # short buffers stay dense


def test_packing_is_chosen_when_it_costs_less_or_as_configured():
    args = (PROMPT_TOKENS, COMPLETION_TOKENS, G, P, T)
    L = trajectory.packed_length(PROMPT_TOKENS, COMPLETION_TOKENS, G)
    assert trajectory.choose_packed_length(*args, FLOPS, packing=False) == 0
    assert trajectory.choose_packed_length(*args, FLOPS, packing=True) == L
    packed = trajectory.layout_flops(*args, FLOPS, packed_length=L)
    static = trajectory.layout_flops(*args, FLOPS)
    assert trajectory.choose_packed_length(*args, FLOPS, packing=None) == (L if packed < static else 0)
    # matmuls dominate: dropping the padding wins; attention dominates: dense packed buffers lose to shared prompts
    assert trajectory.choose_packed_length(*args, (1e6, 1.0), packing=None) == L
    assert trajectory.choose_packed_length(*args, (1.0, 1e6), packing=None) == 0
