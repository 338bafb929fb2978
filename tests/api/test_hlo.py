"""A compiled program read from its HLO (grpo_jax/api/hlo.py): collectives with their groups, bytes and loops, and the
HBM bytes of a run, once and per step of a decode loop, against XLA's own count where its rules are ours and
against hand counts where they are not (in-place updates, on-chip memory, kernels' page reads, loops' trips)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from grpo_jax.api import hlo, plan_programs


def test_collectives_are_read_with_their_groups_bytes_and_loops():
    """The parser against a hand-written HLO module: an all-reduce in a loop of unknown trip count (per step), one
    in a scan of known trip count (62 trips), an all-gather's result bytes and a reduce-scatter's operand bytes."""
    text = """HloModule m

%body (p: (s32[], bf16[32,512])) -> (s32[], bf16[32,512]) {
  %ar = bf16[32,512]{1,0} all-reduce(%x), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7},{8,9,10,11,12,13,14,15}}, to_apply=%add
  %scan = (s32[], f32[8]) while(%t), condition=%c2, body=%inner, backend_config={"known_trip_count":{"n":"62"}}
}

%inner (q: (s32[], f32[8])) -> (s32[], f32[8]) {
  %rs = f32[8]{0} reduce-scatter(%y), channel_id=2, replica_groups=[2,8]<=[16], dimensions={0}, to_apply=%add
}

ENTRY %main (a: bf16[32,512]) -> bf16[32,512] {
  %ag = f32[64,4]{1,0} all-gather(%z), channel_id=3, replica_groups=mesh['axis_0'=2,'axis_1'=8] {'axis_0'}, dimensions={0}
  %loop = (s32[], bf16[32,512]) while(%init), condition=%cond, body=%body
}
"""
    got = hlo.collectives(text, 16)
    assert hlo.Collective("all-gather", 64 * 4 * 4, 2, 1, False) in got
    assert hlo.Collective("all-reduce", 32 * 512 * 2, 8, 1, True) in got
    assert hlo.Collective("reduce-scatter", 8 * 4 * 8, 8, 62, True) in got
    assert len(got) == 3


# A decode step as XLA:TPU writes it, by hand: an embedding row gathered, a product with a weight held in VMEM
# (S(1)) and one in HBM, a token's keys scattered into the page pool in place, a paged-attention kernel over the
# pool, an all-reduce, and a conditional; before the loop the VMEM weight's prefetch and a scan of 10 trips.
TPU_TEXT = """HloModule decode

%take (p0: bf16[4096,512], p1: s32[32]) -> bf16[32,512] {
  %p0 = bf16[4096,512]{1,0} parameter(0)
  %p1 = s32[32]{0} parameter(1)
  ROOT %g = bf16[32,512]{1,0} gather(%p0, %p1), offset_dims={1}, collapsed_slice_dims={0}
}

%product (p0: bf16[32,512], p1: bf16[512,512]) -> bf16[32,512] {
  %p0 = bf16[32,512]{1,0} parameter(0)
  %p1 = bf16[512,512]{1,0} parameter(1)
  ROOT %d = bf16[32,512]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%write (p0: bf16[768,16,128], p1: s32[32,1], p2: bf16[32,1,128]) -> bf16[768,16,128] {
  %p0 = bf16[768,16,128]{2,1,0:T(8,128)(2,1)} parameter(0)
  %p1 = s32[32,1]{1,0} parameter(1)
  %p2 = bf16[32,1,128]{2,1,0} parameter(2)
  %b = bf16[768,16,128]{2,1,0} bitcast(%p0)
  ROOT %s = bf16[768,16,128]{2,1,0} scatter(%b, %p1, %p2), update_window_dims={1,2}
}

%small (p: bf16[1024]) -> bf16[1024] {
  %p = bf16[1024]{0} parameter(0)
  ROOT %n = bf16[1024]{0} negate(%p)
}

%large (p: bf16[1024]) -> bf16[1024] {
  %p = bf16[1024]{0} parameter(0)
  %e = bf16[1024]{0} exponential(%p)
  ROOT %n = bf16[1024]{0} negate(%e)
}

%step (arg: (bf16[768,16,128])) -> (bf16[768,16,128]) {
  %pool = bf16[768,16,128]{2,1,0:T(8,128)(2,1)} get-tuple-element(%arg), index=0
  %w = bf16[512,512]{1,0:T(8,128)(2,1)S(1)} get-tuple-element(%arg), index=1
  %w2 = bf16[512,512]{1,0:T(8,128)(2,1)} get-tuple-element(%arg), index=2
  %emb = bf16[4096,512]{1,0} get-tuple-element(%arg), index=3
  %ids = s32[32]{0} get-tuple-element(%arg), index=4
  %x = bf16[32,512]{1,0} fusion(%emb, %ids), kind=kCustom, calls=%take
  %y = bf16[32,512]{1,0} fusion(%x, %w), kind=kOutput, calls=%product
  %z = bf16[32,512]{1,0} fusion(%y, %w2), kind=kOutput, calls=%product
  %slot = s32[32,1]{1,0} get-tuple-element(%arg), index=5
  %kv = bf16[32,1,128]{2,1,0} bitcast(%z)
  %pool2 = bf16[768,16,128]{2,1,0:T(8,128)(2,1)} fusion(%pool, %slot, %kv), kind=kCustom, calls=%write
  %q = f32[32,128]{1,0} get-tuple-element(%arg), index=6
  %att = f32[32,128]{1,0} custom-call(%q, %pool2), custom_call_target="tpu_custom_call"
  %ar = bf16[32,512]{1,0} all-reduce(%z), channel_id=1, replica_groups=[8,8]<=[64], to_apply=%add
  %v = bf16[1024]{0} get-tuple-element(%arg), index=7
  %c = bf16[1024]{0} conditional(%pred, %v, %v), branch_computations={%small, %large}
  ROOT %t = (bf16[768,16,128]) tuple(%pool2)
}

%scanned (arg: (f32[250])) -> (f32[250]) {
  %a = f32[250]{0} get-tuple-element(%arg), index=0
  %b = f32[250]{0} negate(%a)
  ROOT %t = (f32[250]) tuple(%b)
}

ENTRY %main (w: bf16[512,512]) -> bf16[768,16,128] {
  %w = bf16[512,512]{1,0:T(8,128)(2,1)} parameter(0)
  %prefetch = (bf16[512,512]{1,0:T(8,128)(2,1)S(1)}, bf16[512,512]{1,0:T(8,128)(2,1)}, u32[]{:S(2)}) copy-start(%w)
  %done = bf16[512,512]{1,0:T(8,128)(2,1)S(1)} copy-done(%prefetch)
  %flat = s8[524288]{0:T(1024)(128)(4,1)} bitcast(%w)
  %piece = ((s8[524288]{0:T(1024)(128)(4,1)}), s8[131072]{0:T(1024)(128)(4,1)S(1)}, s32[]{:S(2)}) slice-start(%flat), slice={[0:131072]}
  %got = s8[131072]{0:T(1024)(128)(4,1)S(1)} slice-done(%piece)
  %scan = (f32[250]) while(%s0), condition=%c1, body=%scanned, backend_config={"known_trip_count":{"n":"10"}}
  %loop = (bf16[768,16,128]) while(%init), condition=%c2, body=%step
  ROOT %out = bf16[768,16,128]{2,1,0} get-tuple-element(%loop), index=0
}
"""


def test_hbm_bytes_follow_memory_spaces_in_place_updates_slices_kernels_and_loops():
    """`hlo.traffic` on TPU_TEXT against the rules, one instruction at a time (bytes): what XLA's cost analysis
    counts instead is the whole embedding table for the gathered rows, the VMEM weight as HBM traffic, the whole
    pool read and written for one token's keys, and the scan's body once."""
    row = 32 * 512 * 2
    step = {"gather": row + 32 * 4 + row,  # the 32 rows it returns, their ids, its result
            "VMEM weight": row + 0 + row,
            "HBM weight": row + 512 * 512 * 2 + row,
            "scatter": 32 * 128 * 2 + 32 * 4 + 32 * 128 * 2,  # the update read, its slots, the update written
            "kernel": 32 * 128 * 4 + 32 * 128 * 4,  # q and its result: the pool's pages are the caller's
            "all-reduce": row + row,
            "conditional": 4 * 1024 * 2}  # the larger branch: two ops, each reading and writing 1024
    # the prefetch's HBM read (its VMEM write is on chip); a quarter of the weight streamed into VMEM (its piece
    # read, not the whole weight); 10 scan trips
    once = 512 * 512 * 2 + 512 * 512 * 2 // 4 + 10 * 2 * 250 * 4
    assert hlo.traffic(TPU_TEXT, frozenset({(768, 16, 128)})) == hlo.Traffic(once, sum(step.values()))
    # without the skip the kernel reads the whole pool, as its operand says
    assert hlo.traffic(TPU_TEXT).per_step == sum(step.values()) + 768 * 16 * 128 * 2


def test_a_loop_free_programs_bytes_are_xlas_own():
    """Where XLA's rules and ours agree (operands and results of each fused kernel), the counts are equal: a
    product and a tanh on this CPU, within 10 % of the product's inputs and output by hand (the tanh is fused in
    or not: its intermediate)."""
    m, k, n = 8, 256, 512
    compiled = jax.jit(lambda x, w: jnp.tanh(x @ w)).lower(jnp.zeros((m, k)), jnp.zeros((k, n))).compile()
    got = hlo.traffic(compiled.as_text())
    assert got.per_step == 0 and got.once == plan_programs.xla_cost(compiled)[1]
    assert got.once == pytest.approx(4 * (m * k + k * n + m * n), rel=0.1)


def test_a_loop_of_unknown_trip_count_is_a_step_and_a_scan_its_trips():
    """A decode-like `while_loop` (its trip count an argument: unknown to XLA) that multiplies a row by a weight and
    writes the result into a [1024, 8, 512] buffer in place: a step moves the weight, the row and the written slice
    (the buffer's 16 MiB only once, the copy of it the loop starts from); a `fori_loop` of 5 static trips counts its
    body 5 times, as XLA counts the same body unrolled 5 times."""
    m, k, n, S = 8, 256, 512, 1024

    def decode(x, w, buffer, steps):
        def body(carry):
            i, x, buffer = carry
            y = jnp.tanh(x @ w)
            return i + 1, y[:, :k], jax.lax.dynamic_update_slice(buffer, y[None], (i, 0, 0))
        return jax.lax.while_loop(lambda c: c[0] < steps, body, (0, x, buffer))

    args = jnp.zeros((m, k)), jnp.zeros((k, n)), jnp.zeros((S, m, n))
    got = hlo.traffic(jax.jit(decode).lower(*args, 3).compile().as_text())
    hand = 4 * (k * n + m * k + m * n)  # weight, row in, the product out (= the slice written)
    assert hand <= got.per_step <= 1.3 * hand
    assert got.once == pytest.approx(2 * 4 * S * m * n, rel=0.01)

    def scan(x, w, unroll):
        return jax.lax.fori_loop(0, 5, lambda i, x: jnp.tanh(x @ w), x, unroll=unroll)

    square = jnp.zeros((m, k)), jnp.zeros((k, k))
    looped = jax.jit(scan, static_argnums=2).lower(*square, 1).compile()
    unrolled = jax.jit(scan, static_argnums=2).lower(*square, 5).compile()
    assert '"known_trip_count":{"n":"5"}' in looped.as_text()
    assert hlo.traffic(looped.as_text()).once == pytest.approx(plan_programs.xla_cost(unrolled)[1], rel=0.05)
