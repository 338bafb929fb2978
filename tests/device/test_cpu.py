"""The CPU speed-ups (grpo_jax.device.cpu) give the default path's numbers: tokens and log-probs of the sampler with the
switch on and off, chunked or not; the Linear layers' values and gradients; the host allocator policy, observed
through glibc's own accounting (mallinfo2) in a fresh process."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.algo import programs
from grpo_jax.algo.sampling import SamplingConfig
from grpo_jax.config import load_config
from grpo_jax.device import cpu, sharding
from grpo_jax.device.cpu import _glibc, configure_host_allocator
from grpo_jax.models import forward, init_model, positions_from_mask, unembed
from grpo_jax.rollout import stream

# this module's claims are about the programs users run: at the suite's LLVM -O0 (conftest) it runs in a subprocess
# at XLA's default flags instead (tests/device/test_cpu_default_flags.py)
pytestmark = pytest.mark.skipif("--xla_backend_optimization_level=0" in os.environ.get("XLA_FLAGS", ""),
                                reason="runs at XLA's default flags in tests/device/test_cpu_default_flags.py")

# mallinfo2: hblkhd = bytes in mmap'd blocks, arena = bytes of the brk heap (glibc >= 2.33)
PROBE = """
import ctypes, json, sys
from grpo_jax.device.cpu import configure_host_allocator
applied = configure_host_allocator(sys.argv[1])
libc = ctypes.CDLL("libc.so.6")
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
mapped_before = libc.mallinfo2().hblkhd
block = libc.malloc(64 << 20)
mapped_delta = libc.mallinfo2().hblkhd - mapped_before
libc.free(block)
print(json.dumps(dict(applied=applied, mapped_delta=mapped_delta, heap_after_free=libc.mallinfo2().arena)))
"""

needs_glibc = pytest.mark.skipif(_glibc() is None or not hasattr(_glibc(), "mallinfo2"),
                                 reason="glibc >= 2.33 only")


def _probe(policy: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, policy], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@needs_glibc
def test_retain_serves_a_64_mib_block_from_the_heap_and_keeps_it_after_free():
    got = _probe("retain")
    assert got["applied"] is True
    assert got["mapped_delta"] == 0
    assert got["heap_after_free"] >= 64 << 20


@needs_glibc
def test_system_leaves_glibc_mapping_large_blocks():
    got = _probe("system")
    assert got["applied"] is False
    assert got["mapped_delta"] >= 64 << 20  # glibc's default: a fresh mmap, unmapped again on free


def test_unknown_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="host_allocator='tcmalloc'.*retain, system"):
        configure_host_allocator("tcmalloc")
    with pytest.raises(ValueError, match="host_allocator='tcmalloc'.*retain, system"):
        load_config(None, ["host_allocator=tcmalloc"])


def test_enabled_resolves_none_to_the_cpu_backend():
    assert cpu.enabled(None) == (jax.default_backend() == "cpu")
    assert cpu.enabled(True) is True and cpu.enabled(False) is False
    assert load_config(None, []).cpu_speedups is None
    assert load_config(None, ["cpu_speedups=false"]).cpu_speedups is False
    with pytest.raises(ValueError, match="cpu_speedups"):
        load_config(None, ["cpu_speedups=1"])


# --- sampling ---------------------------------------------------------------------------------------------------

PROMPT_IDS = np.array([[0, 0, 0, 5, 7, 9], [0, 3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8], [0, 0, 0, 0, 0, 6]], np.int32)
PROMPT_MASK = (np.arange(6)[None] >= np.array([[3], [1], [0], [5]])).astype(np.int32)
IDS, MASK = np.repeat(PROMPT_IDS, 2, axis=0), np.repeat(PROMPT_MASK, 2, axis=0)  # 4 groups of 2 rows
FIELDS = ("completion_ids", "completion_mask", "loss_mask", "is_truncated", "sampler_per_token_logps")


def _sampler(model, mesh, on: bool, host_threads: int = 1, **config):
    """A run's decoder with the CPU switch ``on`` or off, as ``fn(params, ids, mask, key, greedy)`` (host rows)."""
    model_config, graphdef, _ = model
    config = SamplingConfig(max_completion_length=7, host_threads=host_threads, **config)
    dec = programs.jit_decoder(graphdef, mesh, model_config, config=config, eos_token_ids=(1, 3, 4, 7), pad_token_id=0,
                               prompt_group_size=2, cpu_speedups=on)
    return lambda params, ids, mask, key, greedy: stream.generate(dec, params, ids, mask, key, greedy=greedy,
                                                                  group_size=1 if greedy else 2)


def _one_device():
    return sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])


def _assert_same(got, want, logps_exact=True):
    for name in FIELDS:
        if name == "sampler_per_token_logps" and not logps_exact:
            # a chunk's forward runs at a smaller batch, whose XLA:CPU reductions may round differently
            np.testing.assert_allclose(got.sampler_per_token_logps, want.sampler_per_token_logps, rtol=1e-6,
                                       atol=1e-6)
        else:
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)


@pytest.mark.parametrize("filters", [dict(temperature=1.3), dict(temperature=0.9, top_k=8),
                                     dict(temperature=0.7, top_k=5, top_p=0.9), dict(min_p=0.1)])
def test_cpu_sampler_draws_the_default_paths_tokens(tiny_model, filters):
    # the switch on (noise before the loop, the two-reduction arg-max, 1 or 2 chunks) picks the default path's tokens
    # under every filter, with the same log-probs
    _, graphdef, params = tiny_model
    key = jax.random.key(3)
    want = jax.device_get(_sampler(tiny_model, _one_device(), False, **filters)(params, IDS, MASK, key, False))
    assert want.completion_mask.sum() < want.completion_mask.size  # some rows stop at EOS
    for threads in (1, 2):
        fn = _sampler(tiny_model, _one_device(), True, threads, **filters)
        assert cpu.host_chunks(threads, _one_device(), 8, 2) == threads
        _assert_same(jax.device_get(fn(params, IDS, MASK, key, False)), want, logps_exact=threads == 1)


def test_cpu_sampler_in_4_chunks_and_greedy_draws_the_default_paths_tokens(tiny_model):
    # 4 chunks of one group each; greedy: the two-reduction argmax picks jnp.argmax's tokens in 1, 2 or 4 chunks
    # (filters leave the arg-max alone, so one setting covers them)
    _, graphdef, params = tiny_model
    key, filters = jax.random.key(3), dict(temperature=0.7, top_k=5, top_p=0.9)
    for greedy, thread_counts in ((False, (4,)), (True, (1, 2, 4))):
        want = jax.device_get(_sampler(tiny_model, _one_device(), False, **filters)(params, IDS, MASK, key, greedy))
        for threads in thread_counts:
            fn = _sampler(tiny_model, _one_device(), True, threads, **filters)
            assert cpu.host_chunks(threads, _one_device(), 8, 1 if greedy else 2) == threads
            _assert_same(jax.device_get(fn(params, IDS, MASK, key, greedy)), want, logps_exact=threads == 1)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (XLA_FLAGS in conftest)")
def test_cpu_sampler_on_an_8_device_mesh_draws_the_default_paths_tokens(tiny_model):
    _, graphdef, params = tiny_model
    mesh = sharding.make_mesh(8, 1, 1)
    for greedy in (False, True):
        outs = [jax.device_get(_sampler(tiny_model, mesh, on, 0, top_k=8)(params, IDS, MASK, jax.random.key(5), greedy))
                for on in (False, True)]
        _assert_same(outs[1], outs[0])


@pytest.mark.parametrize("noise_bytes", [cpu.PRECOMPUTED_NOISE_BYTES, 0])
def test_noise_before_or_inside_the_loop_draws_the_same_tokens(tiny_model, monkeypatch, noise_bytes):
    monkeypatch.setattr(cpu, "PRECOMPUTED_NOISE_BYTES", noise_bytes)
    _, graphdef, params = tiny_model
    key = jax.random.key(7)
    outs = [jax.device_get(_sampler(tiny_model, _one_device(), on, 2, temperature=0.9, top_k=8)(params, IDS, MASK, key,
                                                                                           False))
            for on in (False, True)]
    _assert_same(outs[1], outs[0], logps_exact=False)


def test_argmax_last_axis_equals_jnp_argmax_with_ties_infs_and_nans():
    rng = np.random.default_rng(0)
    x = rng.integers(-3, 3, (64, 9)).astype(np.float32)  # many ties: the first maximum wins
    x[1, :] = -np.inf
    x[2, 4] = np.inf
    x[3, [2, 6]] = np.nan  # a NaN is the maximum, the first NaN wins
    x[4, :] = np.nan
    np.testing.assert_array_equal(cpu.argmax_last_axis(jnp.asarray(x)), np.asarray(jnp.argmax(x, axis=-1)))


def test_host_chunks_split_into_whole_groups_and_default_to_the_cpu_cores(monkeypatch):
    chunks = lambda threads, rows, group: cpu.host_chunks(threads, _one_device(), rows, group)  # noqa: E731
    assert chunks(2, 24, 8) == 1  # 3 groups do not split in 2
    assert chunks(3, 32, 8) == 2  # 4 groups: the most chunks <= 3 that split them
    assert chunks(8, 16, 8) == 2  # never more chunks than groups
    assert chunks(1, 32, 8) == 1
    monkeypatch.setattr(cpu.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert chunks(0, 32, 8) == 4  # 0: one per core on a one-device CPU mesh
    if len(jax.devices()) >= 8:  # the devices already sample in parallel
        assert cpu.host_chunks(0, sharding.make_mesh(8, 1, 1), 64, 8) == 1
    with pytest.raises(ValueError, match="sampling.host_threads=-1"):
        SamplingConfig(host_threads=-1)


# --- Linear layers ----------------------------------------------------------------------------------------------

def _logits(graphdef, params):
    hidden, _ = forward(graphdef, params, PROMPT_IDS, positions_from_mask(PROMPT_MASK), PROMPT_MASK)
    return unembed(graphdef, params, hidden)


def test_cpu_linear_weight_gradient_equals_the_plain_dots():
    rng = np.random.default_rng(0)
    x, w, g = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((37, 24), (24, 11), (37, 11)))
    plain = (((1,), (0,)), ((), ()))
    for dot in (cpu.dot_general, jax.lax.dot_general):
        value, grads = jax.value_and_grad(lambda x, w, dot=dot: jnp.sum(dot(x, w, plain) * g), argnums=(0, 1))(x, w)
        np.testing.assert_allclose(value, float(np.sum((np.asarray(x) @ np.asarray(w)) * np.asarray(g))), rtol=1e-5)
        np.testing.assert_allclose(grads[0], np.asarray(g) @ np.asarray(w).T, rtol=1e-5, atol=1e-5)  # dL/dx
        np.testing.assert_allclose(grads[1], np.asarray(x).T @ np.asarray(g), rtol=1e-5, atol=1e-5)  # dL/dW
    batched = jnp.asarray(rng.standard_normal((2, 5, 24)), jnp.float32)  # not a 2-D x @ W: plain dot_general
    three_d = (((2,), (0,)), ((), ()))
    np.testing.assert_array_equal(cpu.dot_general(batched, w, three_d), jax.lax.dot_general(batched, w, three_d))


def test_linear_layers_take_the_custom_vjp_only_when_on_and_without_remat(tiny_model_config):
    # remat's "dots" policy must see plain dots: a remat model keeps jax's own whatever the switch
    for remat, on, custom in (("none", True, True), ("none", False, False), ("dots", True, False)):
        graphdef, params = init_model(dataclasses.replace(tiny_model_config, remat=remat), seed=0)
        graphdef = cpu.linear_layers(graphdef, jax.eval_shape(lambda p=params: p), on)
        jaxpr = str(jax.make_jaxpr(_logits, static_argnums=0)(graphdef, params))
        assert ("custom_vjp_call" in jaxpr) == custom, (remat, on)


def test_linear_layers_give_the_same_logits_and_gradients(tiny_model):
    _, graphdef, params = tiny_model
    cpu_graphdef = cpu.linear_layers(graphdef, params, True)
    assert cpu_graphdef != graphdef
    weights = jnp.asarray(np.random.default_rng(1).standard_normal((*PROMPT_IDS.shape, 32)), jnp.float32)

    def loss(graphdef, params):
        return jnp.sum(jnp.tanh(_logits(graphdef, params)) * weights)

    value_and_grad = jax.jit(jax.value_and_grad(loss, argnums=1), static_argnums=0)
    np.testing.assert_array_equal(jax.jit(_logits, static_argnums=0)(cpu_graphdef, params),
                                  jax.jit(_logits, static_argnums=0)(graphdef, params))
    (value, grads), (cpu_value, cpu_grads) = value_and_grad(graphdef, params), value_and_grad(cpu_graphdef, params)
    np.testing.assert_array_equal(cpu_value, value)
    # the backward's sums run in another order: rounding at the leaf's scale (AVX-512 and AVX2 round differently)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * max(1.0, float(np.abs(b).max()))),
                 cpu_grads, grads)


# --- packed attention -------------------------------------------------------------------------------------------

def _packed_mask(rng, rows: int, length: int):
    """[rows, L, L] who-sees-whom of packed buffers (`trajectory.layout`, packed): a prompt, then branches that see
    the prompt and themselves; the tail is padding."""
    i = np.arange(length)
    masks = []
    for _ in range(rows):
        p = int(rng.integers(20, 200))
        lengths = rng.integers(1, 90, 4)
        starts = p + np.concatenate([[0], np.cumsum(lengths)[:-1]])
        branch = np.where(i < p, 0, np.searchsorted(starts, i, side="right"))
        valid = i < p + lengths.sum()
        masks.append((i[None] <= i[:, None]) & valid[None]
                     & ((branch[None] == 0) | (branch[None] == branch[:, None])))
    return jnp.asarray(np.stack(masks))


@pytest.mark.parametrize("scale, softcap", [(None, None), (0.3, 1.5)])  # Gemma: query_pre_attn_scalar, soft cap
def test_blocked_attention_equals_the_dense_softmax_and_its_gradients(scale, softcap):
    from grpo_jax.models.layers import attention_scores

    rng = np.random.default_rng(0)
    B, T, K, G, Dh = 2, 640, 2, 2, 8  # five blocks of 128; most of them empty (branches do not see each other)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((B, T, K, G, Dh), (B, K, T, Dh),
                                                                             (B, K, T, Dh)))
    mask = _packed_mask(rng, B, T).at[0, 5].set(False)  # and one query that sees nothing (finite junk)
    weights = jnp.asarray(rng.standard_normal((B, K, G, T, Dh)), jnp.float32)

    def dense(q, k, v):
        s = jnp.where(mask[:, None, None], attention_scores(q, k, Dh ** -0.5 if scale is None else scale, softcap),
                      jnp.finfo(jnp.float32).min)
        return jnp.einsum("bkgts,bksd->bkgtd", jax.nn.softmax(s, axis=-1), v)

    def objective(attend):
        return jax.jit(jax.value_and_grad(lambda *x: jnp.sum(attend(*x) * weights), argnums=(0, 1, 2)))

    seen = mask.any(axis=2)[:, None, None, :, None]  # queries that see a key: the rest are junk in both
    out, want = cpu.blocked_attention(q, k, v, mask, scale, softcap), dense(q, k, v)
    assert bool(jnp.isfinite(out).all())
    np.testing.assert_allclose(jnp.where(seen, out, 0), jnp.where(seen, want, 0), atol=2e-6, rtol=1e-5)
    weights = jnp.where(seen, weights, 0)
    blocked = objective(lambda *x: cpu.blocked_attention(*x, mask, scale, softcap))
    (value, grads), (want_value, want_grads) = blocked(q, k, v), objective(dense)(q, k, v)
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    for got, ref in zip(grads, want_grads):
        np.testing.assert_allclose(got, ref, atol=1e-5 * float(np.abs(ref).max()), rtol=1e-5)
    assert cpu.blocked_attention(q[:, :256], k[:, :, :256], v[:, :, :256], mask[:, :256, :256]) is None  # dense


def test_packed_attention_gives_packed_logps_and_gradients_equal_to_the_padded_layout(tiny_model):
    from grpo_jax.algo.logprobs import completion_logps
    from grpo_jax.algo.trajectory import packed_length

    _, graphdef, params = tiny_model
    rng = np.random.default_rng(3)
    G, R, P, T = 4, 2, 8, 160
    prompt_mask = np.repeat((np.arange(P)[None] >= rng.integers(0, 6, (R, 1))), G, axis=0).astype(np.int32)
    completion_mask = (np.arange(T)[None] < rng.integers(100, T + 1, (R * G, 1))).astype(np.int32)
    rows = (np.repeat(rng.integers(2, 32, (R, P)), G, axis=0).astype(np.int32), prompt_mask,
            rng.integers(2, 32, (R * G, T)).astype(np.int32), completion_mask)
    length = packed_length(np.sum(prompt_mask, 1), np.sum(completion_mask, 1), G)
    assert length >= cpu.MIN_BLOCKED_LENGTH
    blocked = cpu.packed_attention(graphdef, params, True)
    weights = jnp.asarray(rng.standard_normal((R * G, T)), jnp.float32) * completion_mask

    def objective(p, g, packed):
        logps, entropy = completion_logps(g, p, *rows, temperature=0.9, with_entropy=True, prompt_group_size=G,
                                          packed_length=packed)
        return jnp.sum((logps + 0.1 * entropy) * weights)

    grad_fn = jax.jit(jax.value_and_grad(objective), static_argnums=(1, 2))
    assert "cond" in str(jax.make_jaxpr(objective, static_argnums=(1, 2))(params, blocked, length))
    (value, grads), (want, want_grads) = grad_fn(params, blocked, length), grad_fn(params, graphdef, 0)
    np.testing.assert_allclose(value, want, rtol=1e-5)
    for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(got, ref, atol=1e-5 * max(1.0, float(np.abs(ref).max())), rtol=1e-5)


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (XLA_FLAGS in conftest)")
def test_blocked_attention_over_a_mesh_equals_one_device():
    # rows split over one axis, key/value heads over another: the skipped blocks are those no row of any device sees
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as S

    rng = np.random.default_rng(1)
    B, T, K, G, Dh = 2, 512, 2, 2, 8
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((B, T, K, G, Dh), (B, K, T, Dh),
                                                                             (B, K, T, Dh)))
    mask = _packed_mask(rng, B, T)
    mesh = Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2), ("data", "heads"))
    specs = (S("data", None, "heads"), S("data", "heads"), S("data", "heads"), S("data"))
    placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x, spec in zip((q, k, v, mask), specs)]
    grad = jax.grad(lambda q, k, v, m: jnp.sum(cpu.blocked_attention(q, k, v, m) ** 2), argnums=(0, 1, 2))
    out, want = jax.jit(cpu.blocked_attention)(*placed), jax.jit(cpu.blocked_attention)(q, k, v, mask)
    np.testing.assert_allclose(out, want, atol=1e-6, rtol=1e-6)
    for got, ref in zip(jax.jit(grad)(*placed), jax.jit(grad)(q, k, v, mask)):
        np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)
