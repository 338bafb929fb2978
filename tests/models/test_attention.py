"""`models.attention` against the dense softmax: splash attention in Pallas interpret mode and the
``jax.nn.dot_product_attention`` mapping (xla, the cuDNN call's arguments) for every layout (padded, shared prefix),
sliding windows, soft-caps and GQA, values and gradients; whole-model log-probs of each family; the ``shard_map``
over a mesh; and splash compiled for a TPU topology, its temporaries linear in the sequence."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_fixtures as hf
from grpo_jax.algo.logprobs import completion_logps
from grpo_jax.config.model import ModelConfig
from grpo_jax.device import sharding
from grpo_jax.models import attention, init_model
from grpo_jax.models.positional import attention_mask

B, K, G, Dh = 3, 2, 2, 8


def _rows(P: int, T: int, seed: int = 0):
    """Prompt masks left-padded ([B, P]) and completion masks right-padded ([B, T])."""
    rng = np.random.default_rng(seed)
    prompt = (np.arange(P)[None] >= rng.integers(0, P - 1, (B, 1))).astype(np.int32)
    completion = (np.arange(T)[None] < rng.integers(1, T + 1, (B, 1))).astype(np.int32)
    return prompt, completion


def _layout(kind: str, window):
    """(q slots T, mask [B, S], `Visibility`, the reference boolean [B, T, S], real queries [B, T]) of a layout:
    padded rows (prompt ++ completion), or a shared prefix (the prompt, its last slot hidden) before the
    completion slots as `trajectory.layout` builds it."""
    P, T = 5, 11
    prompt, completion = _rows(P, T)
    mask_BxS = np.concatenate([prompt, completion], 1)
    positions_BxS = np.maximum(np.cumsum(mask_BxS, 1) - 1, 0)
    if kind == "padded":
        offset, T = 0, P + T
        query_positions = positions_BxS
    else:  # the buffer repeats the prompt's last token; the prefix's copy of it is hidden
        offset = P
        mask_BxS = mask_BxS.copy()
        mask_BxS[:, P - 1] = 0
        query_positions = positions_BxS[:, P - 1:P - 1 + T]
    want = attention_mask(jnp.asarray(mask_BxS), offset + jnp.arange(T), window, jnp.asarray(query_positions))
    vis = attention.visibility(jnp.asarray(mask_BxS), offset, T, window, kind != "padded")
    return T, mask_BxS, vis, want, mask_BxS[:, offset:offset + T] == 1


def _qkv(T: int, S: int, seed: int = 1):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(keys[0], (B, T, K, G, Dh)), jax.random.normal(keys[1], (B, K, S, Dh)),
            jax.random.normal(keys[2], (B, K, S, Dh)))


def _compare(fn, ref, q, k, v, real_BxT, atol=2e-5):
    """fn and ref agree on the real queries' outputs and on the gradients of a loss over them."""
    weight = jax.random.normal(jax.random.key(7), (B, K, G, q.shape[1], Dh)) * real_BxT[:, None, None, :, None]
    outs, grads = [], []
    for f in (fn, ref):
        out = f(q, k, v)
        outs.append(np.asarray(out * real_BxT[:, None, None, :, None]))
        grads.append(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) * weight), argnums=(0, 1, 2))(q, k, v))
    np.testing.assert_allclose(outs[0], outs[1], atol=atol, rtol=0)
    for got, want in zip(*grads):
        np.testing.assert_allclose(got, want, atol=atol * max(1.0, float(np.abs(want).max())), rtol=0)
    return float(np.abs(outs[0] - outs[1]).max())


CASES = [("padded", None, None), ("padded", 4, None), ("padded", None, 2.0), ("shared", None, None),
         ("shared", 4, 2.0), ("shared", 3, None)]


@pytest.mark.parametrize("kind,window,softcap", CASES)
def test_visibility_is_the_dense_mask_on_real_queries(kind, window, softcap):
    """Structure (segment ids, causal offset, window, hidden slot) == `positional.attention_mask` for every real
    query; padding queries see padding only (never an empty row)."""
    T, _, vis, want, real = _layout(kind, window)
    got = np.asarray(vis.dense_mask())
    np.testing.assert_array_equal(got[real], np.asarray(want)[real])
    assert got.any(axis=-1).all()


@pytest.mark.parametrize("kind,window,softcap", CASES)
def test_splash_in_interpret_mode_equals_dense_values_and_gradients(kind, window, softcap):
    T, mask_BxS, vis, want, real = _layout(kind, window)
    q, k, v = _qkv(T, mask_BxS.shape[1])
    scale = 0.3
    diff = _compare(lambda q, k, v: attention.splash(q, k, v, vis, scale, softcap, interpret=True),
                    lambda q, k, v: attention.dense(q, k, v, want, scale, softcap), q, k, v, real)
    print(f"splash interpret vs dense, {kind} window={window} softcap={softcap}: max |diff| {diff:.2e}")


@pytest.mark.parametrize("kind,window", [("padded", None), ("padded", 4), ("shared", None), ("shared", 3)])
def test_dot_product_attention_mapping_equals_dense(kind, window):
    """The cuDNN call's arguments (queries padded in front to the key slots, rows rotated to right padding,
    sequence lengths, causal, local window), run by its xla implementation here: the dense result."""
    T, mask_BxS, vis, want, real = _layout(kind, window)
    q, k, v = _qkv(T, mask_BxS.shape[1])
    _compare(lambda q, k, v: attention.dot_product(q, k, v, vis, 0.3, None, "xla"),
             lambda q, k, v: attention.dense(q, k, v, want, 0.3, None), q, k, v, real)


def test_dot_product_declines_what_cudnn_cannot_express_and_attend_falls_back_to_dense():
    T, mask_BxS, vis, _, _ = _layout("padded", None)
    assert attention.dot_product(*_qkv(T, mask_BxS.shape[1]), vis, 0.3, None, "cudnn") is None  # float32
    for kind, softcap in (("shared", 2.0), ("padded", 2.0)):
        T, mask_BxS, vis, want, real = _layout(kind, 3)
        q, k, v = _qkv(T, mask_BxS.shape[1])
        assert attention.dot_product(q, k, v, vis, 0.3, softcap, "xla") is None
        _compare(lambda q, k, v: attention.attend(q, k, v, vis, scale=0.3, softcap=softcap, backend="xla"),
                 lambda q, k, v: attention.dense(q, k, v, want, 0.3, softcap), q, k, v, real)


def test_whole_masks_go_through_blocked_attention_under_a_kernel_backend():
    """Packed layouts' [B, T, T] masks: memory-linear blocked attention off the CPU, the dense result."""
    T = 512
    q, k, v = _qkv(T, T)
    causal = np.tril(np.ones((T, T), bool))
    mask = jnp.asarray(np.broadcast_to(causal & (np.arange(T)[None] % 200 < 150), (B, T, T)))  # empty key blocks
    real = np.asarray(mask).any(-1)
    _compare(lambda q, k, v: attention.attend(q, k, v, mask, scale=0.3, softcap=None, backend="splash",
                                              whole_mask=True),
             lambda q, k, v: attention.dense(q, k, v, mask, 0.3, None), q, k, v, real, atol=1e-4)


def _naive_sinks(q, k, v, mask, scale, sinks_KxG):
    """Attention with a sink logit per query head, from its definition in float64: softmax over the visible keys'
    scores and the sink, the sink's share dropped (GPT-OSS: the probabilities of a row sum to below 1)."""
    q, k, v, sinks_KxG = (np.asarray(x, np.float64) for x in (q, k, v, sinks_KxG))
    B_, T, K_, G_, _ = q.shape
    out = np.zeros((B_, K_, G_, T, v.shape[-1]))
    for b, h, g, t in np.ndindex(B_, K_, G_, T):
        visible = np.asarray(mask)[b, t]
        scores = (k[b, h] @ q[b, t, h, g]) * scale
        m = max(scores[visible].max(initial=-np.inf), sinks_KxG[h, g])
        e = np.where(visible, np.exp(scores - m), 0.0)
        out[b, h, g, t] = e @ v[b, h] / (e.sum() + np.exp(sinks_KxG[h, g] - m))
    return out


SINKS_KxG = jnp.asarray([[0.5, -1.0], [2.0, 0.0]], jnp.float32)


@pytest.mark.parametrize("kind,window", [("padded", None), ("shared", 3)])
def test_attention_sinks_in_dense_splash_and_blocked_equal_their_definition(kind, window):
    """GPT-OSS's sinks: dense == the float64 definition; splash (interpret mode, its own ``sinks``) and the
    memory-linear blocked path == dense in values and in the gradients of q, k, v and the sinks; attend under
    xla (no sink in ``dot_product_attention``) falls back to dense."""
    T, mask_BxS, vis, want, real = _layout(kind, window)
    q, k, v = _qkv(T, mask_BxS.shape[1])
    dense = attention.dense(q, k, v, want, 0.3, None, SINKS_KxG)
    naive = _naive_sinks(q, k, v, want, 0.3, SINKS_KxG)
    np.testing.assert_allclose(np.asarray(dense) * real[:, None, None, :, None], naive * real[:, None, None, :, None],
                               atol=2e-6, rtol=0)
    assert not np.allclose(dense, attention.dense(q, k, v, want, 0.3, None), atol=1e-2)  # the sinks matter
    ref = lambda s: lambda q, k, v: attention.dense(q, k, v, want, 0.3, None, s)  # noqa: E731
    paths = {"splash": lambda s: lambda q, k, v: attention.splash(q, k, v, vis, 0.3, None, interpret=True,
                                                                 sinks_KxG=s),
             "xla": lambda s: lambda q, k, v: attention.attend(q, k, v, vis, scale=0.3, softcap=None,
                                                              backend="xla", sinks_KxG=s)}
    for name, path in paths.items():
        _compare(path(SINKS_KxG), ref(SINKS_KxG), q, k, v, real)
        weight = real[:, None, None, :, None] * jax.random.normal(jax.random.key(9), dense.shape)
        grad = lambda f: jax.grad(lambda s: jnp.sum(f(s)(q, k, v) * weight))(SINKS_KxG)  # noqa: E731
        np.testing.assert_allclose(grad(path), grad(ref), atol=2e-5, rtol=0, err_msg=name)


def test_attention_sinks_in_blocked_attention_equal_dense():
    """Whole masks of packed layouts with sinks: the online softmax starts from the sink's term."""
    T = 512
    q, k, v = _qkv(T, T)
    causal = np.tril(np.ones((T, T), bool))
    mask = jnp.asarray(np.broadcast_to(causal & (np.arange(T)[None] % 200 < 150), (B, T, T)))
    real = np.asarray(mask).any(-1)
    blocked = lambda s: lambda q, k, v: attention.attend(q, k, v, mask, scale=0.3, softcap=None,  # noqa: E731
                                                         backend="splash", whole_mask=True, sinks_KxG=s)
    dense = lambda s: lambda q, k, v: attention.dense(q, k, v, mask, 0.3, None, s)  # noqa: E731
    _compare(blocked(SINKS_KxG), dense(SINKS_KxG), q, k, v, real, atol=1e-4)
    weight = real[:, None, None, :, None] * jax.random.normal(jax.random.key(9), (B, K, G, T, Dh))
    grad = lambda f: jax.grad(lambda s: jnp.sum(f(s)(q, k, v) * weight))(SINKS_KxG)  # noqa: E731
    np.testing.assert_allclose(grad(blocked), grad(dense), atol=1e-3, rtol=1e-4)


def test_auto_resolves_by_the_platform_and_bad_values_are_refused():
    assert attention.resolve("auto") == "dense"  # the CPU: today's path
    assert attention.resolve("splash") == "splash"
    with pytest.raises(ValueError, match="model.attention='flash'"):
        ModelConfig(attention="flash")


def test_splash_over_a_mesh_in_shard_map_equals_one_device():
    """Rows over the data axes, key/value heads over ``tensor`` (the abstract mesh set as `traced_in` sets it)."""
    T, mask_BxS, vis, want, real = _layout("shared", 4)
    q, k, v = _qkv(T, mask_BxS.shape[1])
    q, k, v = (jnp.concatenate([x, x[:1]]) for x in (q, k, v))  # 4 rows over data=2 x fsdp=2
    vis = attention.Visibility(*(jnp.concatenate([x, x[:1]]) for x in (vis.q_segment_BxT, vis.kv_segment_BxS)),
                               vis.query_offset, vis.window, vis.hidden_slot)
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2, devices=jax.devices()[:8])

    def run(q, k, v):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return attention.splash(q, k, v, vis, 0.3, None, interpret=True)
    one = jax.jit(lambda q, k, v: attention.splash(q, k, v, vis, 0.3, None, interpret=True))(q, k, v)
    split = jax.jit(run)(*(jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
        sharding.ROWS))) for x in (q, k, v)))
    np.testing.assert_allclose(np.asarray(split), np.asarray(one), atol=1e-6, rtol=0)
    assert "shard_map" in str(jax.make_jaxpr(run)(q, k, v))


# --- whole models ----------------------------------------------------------------------------------------------

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "qwen3_moe", "gpt_oss", "glm4_moe")


def _model(family: str, **options):
    from grpo_jax.models.registry import config_fields

    config = ModelConfig(**config_fields(hf.hf_config(family, tied=True), family), **options)
    return config, init_model(config, seed=0)


def _rollout(vocab: int, G: int = 2, P: int = 6, T: int = 9):
    rng = np.random.default_rng(3)
    prompt_mask = np.repeat(np.array([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], np.int32), G, axis=0)
    prompt_ids = np.where(prompt_mask == 1, np.repeat(rng.integers(3, vocab, (2, P)), G, axis=0), 0)
    completion_mask = (np.arange(T)[None] < np.array([[9], [5], [7], [2]])).astype(np.int32)
    completion_ids = np.where(completion_mask == 1, rng.integers(3, vocab, (4, T)), 0)
    return prompt_ids.astype(np.int32), prompt_mask, completion_ids.astype(np.int32), completion_mask


@pytest.mark.parametrize("family", FAMILIES)
def test_whole_model_logps_with_splash_equal_dense(family):
    """Each family's log-probs through splash (interpret mode) == dense, padded and shared-prompt layouts (rows
    longer than the windows of 4)."""
    config, (graphdef, params) = _model(family)
    splash_graphdef = init_model(dataclasses.replace(config, attention="splash_interpret"), seed=0)[0]
    rows = _rollout(config.vocab_size)
    real = rows[3] == 1
    for layout in (dict(), dict(prompt_group_size=2)):
        program = jax.make_jaxpr(lambda p: completion_logps(splash_graphdef, p, *rows, temperature=1.0, **layout))
        assert "pallas_call" in str(program(params))  # the kernel runs, not a fallback
        want, _ = completion_logps(graphdef, params, *rows, temperature=1.0, **layout)
        got, _ = completion_logps(splash_graphdef, params, *rows, temperature=1.0, **layout)
        np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=2e-5, err_msg=str(layout))


@pytest.mark.parametrize("options", [dict(), dict(scan_layers=True, remat="full")])
def test_whole_model_gradients_with_splash_equal_dense(options):
    """Gemma 2 (local and global layers, soft-capped scores, GQA), shared prompts: the loss gradient through splash
    == dense, with the layer loop and with a scan over layers of two kinds (a switch between their kernels)."""
    config, (graphdef, params) = _model("gemma2", **options)
    splash_graphdef = init_model(dataclasses.replace(config, attention="splash_interpret"), seed=0)[0]
    rows = _rollout(config.vocab_size)
    real = rows[3] == 1

    def loss(graphdef, params):
        logps, _ = completion_logps(graphdef, params, *rows, temperature=1.0, prompt_group_size=2)
        return jnp.sum(jnp.where(real, logps, 0.0))
    want = jax.grad(loss, argnums=1)(graphdef, params)
    got = jax.grad(loss, argnums=1)(splash_graphdef, params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5 * max(1.0, float(np.abs(b).max())),
                                                         rtol=0), got, want)


# --- a TPU topology, compiled from here ------------------------------------------------------------------------

def _tpu_devices():
    """The 4 chips of a v5e:2x2 topology (libtpu compiles for them on this host), or a skip."""
    try:
        from jax.experimental import topologies
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compiling only: other processes may hold libtpu
        return topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices
    except Exception as e:  # no libtpu (pip install "jax[tpu]"), or it cannot describe the topology
        pytest.skip(f"no TPU topology to compile for: {type(e).__name__}: {e}")


def _temporaries(mesh, T: int, backend: str, H: int = 8, heads_kv: int = 2, sinks: bool = False) -> int:
    """Per-chip temporary bytes of attention forward + backward over 4 rows of T tokens (bf16, Dh 128); with
    ``sinks`` (GPT-OSS's), their gradient too, and the program must hold the kernel."""
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(sharding.ROWS))

    def loss(q, k, v, segment, *sinks_KxG):
        vis = attention.Visibility(segment, segment)
        mask = vis if backend != "dense" else vis.dense_mask()
        out = attention.attend(q, k, v, mask, scale=128 ** -0.5, softcap=None, backend=attention.resolve(backend),
                               sinks_KxG=sinks_KxG[0] if sinks_KxG else None)
        return jnp.sum(out.astype(jnp.float32) ** 2)
    shapes = [((4, T, heads_kv, H // heads_kv, 128), jnp.bfloat16), ((4, heads_kv, T, 128), jnp.bfloat16),
              ((4, heads_kv, T, 128), jnp.bfloat16), ((4, T), jnp.int32)]
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=rows) for shape, dtype in shapes]
    if sinks:
        args.append(jax.ShapeDtypeStruct((heads_kv, H // heads_kv), jnp.float32,
                                         sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())))
    step = sharding.traced_in(mesh, jax.grad(loss, argnums=(0, 1, 2, 4) if sinks else (0, 1, 2)))
    lowered = jax.jit(step).lower(*args)
    assert not sinks or backend == "dense" or "tpu_custom_call" in lowered.as_text()  # the kernel, not a fallback
    return lowered.compile().memory_analysis().temp_size_in_bytes


def test_splash_compiles_for_a_tpu_pod_with_temporaries_linear_in_the_sequence():
    """Forward + backward with splash for v5e:2x2 (rows over the chips, `shard_map`): temporaries at 2L at most
    ~2x those at L and far below the dense path's [rows, heads, L, L] float32 scores, which it does hold; with
    attention sinks as at L without."""
    mesh = sharding.make_mesh(data=-1, devices=_tpu_devices())
    L, H = 2048, 8
    scores_per_chip = 1 * H * L * L * 4  # one row a chip
    dense = _temporaries(mesh, L, "dense", H)
    assert dense >= scores_per_chip
    at_L, at_2L = _temporaries(mesh, L, "auto", H), _temporaries(mesh, 2 * L, "auto", H)  # auto: splash on TPU
    print(f"v5e:2x2 fwd+bwd temporaries per chip: dense L={L}: {dense / 2**20:.1f} MiB; splash L: "
          f"{at_L / 2**20:.2f} MiB, 2L: {at_2L / 2**20:.2f} MiB")
    assert at_2L <= 2.5 * at_L + (1 << 20)
    assert at_2L < scores_per_chip / 16
    with_sinks = _temporaries(mesh, L, "auto", H, sinks=True)  # GPT-OSS: the kernel's own sinks, no dense fallback
    assert with_sinks <= 1.1 * at_L + (1 << 20)
