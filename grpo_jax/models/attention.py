"""The attention function every layer calls, with its backends (``model.attention``): the dense softmax (the
reference), block-by-block attention over a whole [B, T, T] mask (packed layouts), and the kernels that ship with
jax: Pallas splash attention (TPU) and ``jax.nn.dot_product_attention`` (cuDNN on GPU), and for decoding over a
paged cache (`models.paged`) Pallas paged attention (TPU and GPU). Kernels never see a
[B, T, S] boolean: `Visibility` says who sees whom from structure (segment ids, the causal offset, a window).

Dimension letters as in `models.layers`: B rows, T queries, S keys, K key/value heads, G query heads per key/value
head, Dh head dim.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import paged_attention as gpu_paged
from jax.experimental.pallas.ops.tpu import splash_attention as splash_lib
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_paged_attention
from jax.sharding import PartitionSpec

# the mesh axes rows and heads are split over (grpo_jax/device/sharding.py: ROWS, TENSOR)
ROW_AXES, HEAD_AXIS = ("data", "fsdp", "expert"), "tensor"
KERNELS = ("splash", "splash_interpret", "cudnn", "xla")  # the backends a `Visibility` goes to


def resolve(setting: str) -> str:
    """``model.attention`` resolved: ``auto`` is splash on TPU, cudnn on GPU and dense elsewhere (the CPU), the
    platform being the abstract mesh's devices' when one is set (a program traced for a TPU mesh from a CPU host,
    `sharding.traced_in`), else jax's default backend."""
    if setting != "auto":
        return setting
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    platform = jax.default_backend() if device is None else device.platform
    return {"tpu": "splash", "gpu": "cudnn", "cuda": "cudnn"}.get(platform, "dense")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["q_segment_BxT", "kv_segment_BxS"],
                   meta_fields=["query_offset", "window", "hidden_slot"])
@dataclasses.dataclass(frozen=True)
class Visibility:
    """Who sees whom, as kernels take it. Query t sits at key slot ``query_offset`` + t and sees key slot s when
    s <= query_offset + t, their segment ids are equal and, with a ``window`` W, query_offset + t - s < W.

    Segment ids are the attention mask (1 visible, 0 padding) at the key slots and at the queries' own slots: a
    padding query sees padding keys and itself (never an empty row; its output is never used). ``hidden_slot``
    (a shared prefix): key slot query_offset - 1 is the prefix's hidden last token, left out so that a row's
    visible slots are contiguous (cuDNN's sequence lengths) and slots count positions on windowed layers
    (`models.positional.attention_mask`'s window counts positions). That is `trajectory.layout`'s shared layout,
    whose buffers start with that token again; a prefix whose last slot is visible would lose that key under a
    kernel backend (the dense backend takes any mask)."""

    q_segment_BxT: jax.Array
    kv_segment_BxS: jax.Array
    query_offset: int = 0
    window: int | None = None
    hidden_slot: bool = False

    def dense_mask(self) -> jax.Array:
        """The boolean [B, T, S] mask of the same visibility (the dense fallback, and tests)."""
        T, S = self.q_segment_BxT.shape[1], self.kv_segment_BxS.shape[1]
        q_slot_Tx1, k_slot_1xS = self.query_offset + jnp.arange(T)[:, None], jnp.arange(S)[None]
        distance_TxS = q_slot_Tx1 - k_slot_1xS
        if self.hidden_slot:  # slots past the hidden one sit one position closer
            distance_TxS = distance_TxS - (k_slot_1xS < self.query_offset)
        visible_TxS = q_slot_Tx1 >= k_slot_1xS
        if self.window is not None:
            visible_TxS &= distance_TxS < self.window
        same_BxTxS = self.q_segment_BxT[:, :, None] == self.kv_segment_BxS[:, None, :]
        if self.hidden_slot:
            same_BxTxS &= k_slot_1xS[None] != self.query_offset - 1
        return visible_TxS[None] & same_BxTxS


def visibility(attention_mask_BxS, query_offset: int, T: int, window: int | None, prefix: bool) -> Visibility:
    """`Visibility` of T queries at slots query_offset .. query_offset + T - 1 over the [B, S] ``attention_mask``
    (left-padded prompts, right-padded completions: a row's visible slots are contiguous, so a window counts
    slots; a shared ``prefix``'s hidden last slot is dropped)."""
    segment_BxS = (attention_mask_BxS > 0).astype(jnp.int32)
    return Visibility(segment_BxS[:, query_offset:query_offset + T], segment_BxS, query_offset, window, prefix)


# --- dense (the reference) ------------------------------------------------------------------------------------

def attention_scores(q_BxTxKxGxDh, k_BxKxSxDh, scale: float, softcap: float | None):
    """Scores [B, K, G, T, S] in float32: q.k * scale, with ``softcap`` c: c * tanh(scores / c) (Gemma 2)."""
    scores = jnp.einsum("btkgd,bksd->bkgts", q_BxTxKxGxDh, k_BxKxSxDh, preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    return scores


def dense(q_BxTxKxGxDh, k_BxKxSxDh, v_BxKxSxDh, mask_BxTxS, scale: float, softcap: float | None, sinks_KxG=None):
    """softmax(masked scores) v -> [B, K, G, T, Dh]: the [B, K, G, T, S] scores held whole. ``sinks_KxG``
    (GPT-OSS): each head's learned logit joins every query's softmax as one more key whose value is zero."""
    scores = attention_scores(q_BxTxKxGxDh, k_BxKxSxDh, scale, softcap)
    # a finite floor (not -inf) keeps fully masked padding queries NaN-free: they become uniform
    scores = jnp.where(mask_BxTxS[:, None, None], scores, jnp.finfo(jnp.float32).min)
    if sinks_KxG is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:
        sink = jnp.broadcast_to(sinks_KxG.astype(jnp.float32)[None, :, :, None, None], (*scores.shape[:-1], 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("bkgts,bksd->bkgtd", probs.astype(v_BxKxSxDh.dtype), v_BxKxSxDh)


# --- blocked (whole masks) ------------------------------------------------------------------------------------

ATTENTION_BLOCK = 128  # keys and queries per block of `blocked_attention`
MIN_BLOCKED_LENGTH = 512  # shorter buffers stay dense: too few blocks to skip


def blocked_attention(q_BxTxKxGxDh, k_BxKxTxDh, v_BxKxTxDh, mask_BxTxT, scale: float | None = None,
                      softcap: float | None = None, sinks_KxG=None):
    """Softmax attention over blocks of keys, skipping the blocks that no query of a query block sees: a packed
    buffer's branches see the prompt and themselves, not each other, so most blocks are empty. [B,K,G,T,Dh], the
    dense softmax's result up to float rounding (an online softmax, summed block by block); None when T is too
    short or splits into no blocks of at least 64 (the dense path then runs). A block is run when any row needs it.
    Each query block is rematerialised in the backward pass: no [T, T] scores are kept, so memory is linear in T
    beside the boolean mask (bounded by `trajectory.choose_packing`). Scores as `attention_scores` (``scale``
    None: Dh^-1/2); ``sinks_KxG`` as `dense`'s, the sink's term starting each query's running sum."""
    B, T, K, G, Dh = q_BxTxKxGxDh.shape
    score_scale = Dh ** -0.5 if scale is None else scale
    b = math.gcd(T, ATTENTION_BLOCK)
    if T < MIN_BLOCKED_LENGTH or b < 64:
        return None
    n = T // b
    floor = jnp.finfo(jnp.float32).min  # as the dense path: fully masked padding queries stay finite
    mask_Bxnxbxnxb = mask_BxTxT.reshape(B, n, b, n, b)
    needed_nxn = jnp.any(mask_Bxnxbxnxb, axis=(0, 2, 4))
    k_nxBxKxbxDh = k_BxKxTxDh.reshape(B, K, n, b, Dh).transpose(2, 0, 1, 3, 4)
    v_nxBxKxbxDh = v_BxKxTxDh.reshape(B, K, n, b, Dh).transpose(2, 0, 1, 3, 4)

    @jax.checkpoint
    def query_block(args):
        q_BxbxKxGxDh, mask_Bxbxnxb, needed_n = args

        def key_block(carry, xs):
            k_BxKxbxDh, v_BxKxbxDh, mask_Bxbxb, needed = xs

            def visit(carry):
                m_BxKxGxb, l_BxKxGxb, acc_BxKxGxbxDh = carry
                s = jnp.einsum("bqkgd,bksd->bkgqs", q_BxbxKxGxDh, k_BxKxbxDh,
                               preferred_element_type=jnp.float32) * score_scale
                if softcap is not None:
                    s = jnp.tanh(s / softcap) * softcap
                s = jnp.where(mask_Bxbxb[:, None, None], s, floor)
                # the shift cancels in the result: no gradient through it
                m_new = jax.lax.stop_gradient(jnp.maximum(m_BxKxGxb, s.max(axis=-1)))
                scale = jnp.exp(m_BxKxGxb - m_new)
                p = jnp.exp(s - m_new[..., None])
                pv = jnp.einsum("bkgqs,bksd->bkgqd", p.astype(v_BxKxbxDh.dtype), v_BxKxbxDh,
                                preferred_element_type=jnp.float32)
                return m_new, l_BxKxGxb * scale + p.sum(axis=-1), acc_BxKxGxbxDh * scale[..., None] + pv

            return jax.lax.cond(needed, visit, lambda c: c, carry), None

        if sinks_KxG is None:
            init = (jnp.full((B, K, G, b), floor, jnp.float32), jnp.zeros((B, K, G, b), jnp.float32))
        else:  # the sink is a key of value zero: it starts the max and adds exp(sink - max) to the sum
            sink_BxKxGxb = jnp.broadcast_to(sinks_KxG.astype(jnp.float32)[None, :, :, None], (B, K, G, b))
            m0 = jax.lax.stop_gradient(sink_BxKxGxb)
            init = (m0, jnp.exp(sink_BxKxGxb - m0))
        init = (*init, jnp.zeros((B, K, G, b, Dh), jnp.float32))
        (_, l, acc), _ = jax.lax.scan(key_block, init, (k_nxBxKxbxDh, v_nxBxKxbxDh,
                                                        mask_Bxbxnxb.transpose(2, 0, 1, 3), needed_n))
        return (acc / jnp.where(l > 0, l, 1.0)[..., None]).astype(v_BxKxTxDh.dtype)

    out_nxBxKxGxbxDh = jax.lax.map(query_block, (q_BxTxKxGxDh.reshape(B, n, b, K, G, Dh).transpose(1, 0, 2, 3, 4, 5),
                                                 mask_Bxnxbxnxb.transpose(1, 0, 2, 3, 4), needed_nxn))
    return out_nxBxKxGxbxDh.transpose(1, 2, 3, 0, 4, 5).reshape(B, K, G, T, Dh)


# --- kernels --------------------------------------------------------------------------------------------------

def _compact(k_BxKxSxDh, v_BxKxSxDh, vis: Visibility):
    """(k, v, kv segment ids, query offset) with a `Visibility.hidden_slot` dropped (else as given)."""
    if not vis.hidden_slot:
        return k_BxKxSxDh, v_BxKxSxDh, vis.kv_segment_BxS, vis.query_offset
    h = vis.query_offset - 1
    drop = lambda x, axis: jnp.concatenate([jax.lax.slice_in_dim(x, 0, h, axis=axis),  # noqa: E731
                                            jax.lax.slice_in_dim(x, h + 1, x.shape[axis], axis=axis)], axis=axis)
    return drop(k_BxKxSxDh, 2), drop(v_BxKxSxDh, 2), drop(vis.kv_segment_BxS, 1), h


SPLASH_BLOCK = 512  # largest splash tile; sequences pad to a multiple of 128 and tiles shrink to divide them


@functools.lru_cache(maxsize=64)
def _splash_kernel(T: int, S: int, G: int, offset: int, window: int | None, softcap: float | None, block: int,
                   interpret: bool):
    """A splash MQA kernel (G query heads over one key/value head) for [T, S] with its causal or local mask;
    made once per shape (it walks the mask's blocks in numpy)."""
    if window is None:
        mask = splash_lib.CausalMask((T, S), offset=offset)
    else:  # window W back, none ahead: causal too
        mask = splash_lib.LocalMask((T, S), window_size=(window - 1, 0), offset=offset)
    sizes = splash_lib.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                                  block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block,
                                  block_kv_dq=block)
    with jax.ensure_compile_time_eval():  # its block tables concrete constants, not tracers of the first trace
        return splash_lib.make_splash_mqa(splash_lib.MultiHeadMask([mask] * G), block_sizes=sizes, head_shards=1,
                                          q_seq_shards=1, attn_logits_soft_cap=softcap, interpret=interpret)


def _mesh_specs(B: int, K: int):
    """(abstract mesh, row axes, head axis) to split the kernel over, or (None, ...) with no mesh of > 1 device."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return None, (), None
    rows = tuple(a for a in ROW_AXES if a in mesh.axis_names and mesh.shape[a] > 1)
    if B % math.prod(mesh.shape[a] for a in rows):  # rows that do not split evenly run whole on every device
        rows = ()
    head = HEAD_AXIS if HEAD_AXIS in mesh.axis_names and K % mesh.shape[HEAD_AXIS] == 0 else None
    return mesh, rows, head


def splash(q_BxTxKxGxDh, k_BxKxSxDh, v_BxKxSxDh, vis: Visibility, scale: float, softcap: float | None,
           interpret: bool = False, sinks_KxG=None):
    """Pallas splash attention -> [B, K, G, T, Dh]: one MQA kernel per row and key/value head (vmapped), rows
    split over the abstract mesh's data axes and key/value heads over ``tensor`` in a ``shard_map`` (Mosaic
    kernels are not partitioned automatically). Queries and keys pad to tiles: padded ones get segment -1 and
    each padded query sees its own padded key. The queries are scaled before the kernel (it does not scale).
    ``sinks_KxG``: `dense`'s, the kernel's own ``sinks`` (its running max and sum start from them)."""
    B, T, K, G, Dh = q_BxTxKxGxDh.shape
    k_BxKxSxDh, v_BxKxSxDh, kv_segment_BxS, offset = _compact(k_BxKxSxDh, v_BxKxSxDh, vis)
    S = k_BxKxSxDh.shape[2]
    Tp = -(-T // 128) * 128
    Sp = -(-max(S, offset + Tp) // 128) * 128
    block = math.gcd(SPLASH_BLOCK, Tp, Sp)
    q_BxKxGxTxDh = (q_BxTxKxGxDh.astype(jnp.float32) * scale).astype(q_BxTxKxGxDh.dtype).transpose(0, 2, 3, 1, 4)
    q_BxKxGxTxDh = jnp.pad(q_BxKxGxTxDh, ((0, 0),) * 3 + ((0, Tp - T), (0, 0)))
    k_BxKxSxDh, v_BxKxSxDh = (jnp.pad(x.astype(q_BxKxGxTxDh.dtype), ((0, 0), (0, 0), (0, Sp - S), (0, 0)))
                              for x in (k_BxKxSxDh, v_BxKxSxDh))
    q_segment_BxT = jnp.pad(vis.q_segment_BxT, ((0, 0), (0, Tp - T)), constant_values=-1)
    kv_segment_BxS = jnp.pad(kv_segment_BxS, ((0, 0), (0, Sp - S)), constant_values=-1)
    kernel = _splash_kernel(Tp, Sp, G, offset, vis.window, softcap, block, interpret)

    def local(q, k, v, q_segment, kv_segment, *sinks):
        def row(q, k, v, qs, ks, *sink_G):
            return kernel(q, k, v, segment_ids=splash_lib.SegmentIds(q=qs, kv=ks), sinks=(sink_G or [None])[0])

        per_head = jax.vmap(row, in_axes=(0, 0, 0, None, None, *[0] * len(sinks)))
        return jax.vmap(per_head, in_axes=(0, 0, 0, 0, 0, *[None] * len(sinks)))(q, k, v, q_segment, kv_segment,
                                                                                 *sinks)

    mesh, rows, head = _mesh_specs(B, K)
    sinks = () if sinks_KxG is None else (sinks_KxG.astype(jnp.float32),)
    args = (q_BxKxGxTxDh, k_BxKxSxDh, v_BxKxSxDh, q_segment_BxT, kv_segment_BxS, *sinks)
    if mesh is None:
        out_BxKxGxTxDh = local(*args)
    else:
        rows = rows or None
        heads = PartitionSpec(rows, head, None, None)
        out_BxKxGxTxDh = jax.shard_map(
            local, mesh=mesh, in_specs=(PartitionSpec(rows, head, None, None, None), heads, heads,
                                        PartitionSpec(rows, None), PartitionSpec(rows, None),
                                        *[PartitionSpec(head, None)] * len(sinks)),
            out_specs=PartitionSpec(rows, head, None, None, None), check_vma=False)(*args)
    return out_BxKxGxTxDh[:, :, :, :T]


def dot_product(q_BxTxKxGxDh, k_BxKxSxDh, v_BxKxSxDh, vis: Visibility, scale: float, softcap: float | None,
                implementation: str):
    """``jax.nn.dot_product_attention`` (``implementation`` cudnn or xla) -> [B, K, G, T, Dh], or None where it
    cannot express the visibility (soft-capping) or cuDNN's flash attention takes no such operands (float32, a head
    dim past 128 or not a multiple of 8). It takes right-padded rows (sequence lengths) whose query i is key i, so
    the queries are padded in front to the S key slots (a shared prefix's slots: outputs dropped), each row's
    contiguous visible slots are rotated to the front, and the output rotated back."""
    B, T, K, G, Dh = q_BxTxKxGxDh.shape
    if softcap is not None:
        return None
    if implementation == "cudnn" and (q_BxTxKxGxDh.dtype not in (jnp.bfloat16, jnp.float16) or Dh > 128 or Dh % 8):
        return None
    k_BxKxSxDh, v_BxKxSxDh, kv_segment_BxS, offset = _compact(k_BxKxSxDh, v_BxKxSxDh, vis)
    S = k_BxKxSxDh.shape[2]
    if S < offset + T:
        return None
    q_BxSxHxDh = jnp.pad(q_BxTxKxGxDh.reshape(B, T, K * G, Dh), ((0, 0), (offset, S - offset - T), (0, 0), (0, 0)))
    visible_BxS = kv_segment_BxS > 0
    first_B = jnp.argmax(visible_BxS, axis=1).astype(jnp.int32)  # 0 for a row with nothing visible
    length_B = jnp.sum(visible_BxS, axis=1, dtype=jnp.int32)
    rotate_BxS = (jnp.arange(S)[None] + first_B[:, None]) % S
    back_BxS = (jnp.arange(S)[None] - first_B[:, None]) % S
    take = lambda x, idx: jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)  # noqa: E731
    q_BxSxHxDh = take(q_BxSxHxDh, rotate_BxS)
    k_BxSxKxDh, v_BxSxKxDh = (take(x.transpose(0, 2, 1, 3), rotate_BxS) for x in (k_BxKxSxDh, v_BxKxSxDh))
    window = None if vis.window is None else (vis.window - 1, 0)
    out_BxSxHxDh = jax.nn.dot_product_attention(
        q_BxSxHxDh, k_BxSxKxDh.astype(q_BxSxHxDh.dtype), v_BxSxKxDh.astype(q_BxSxHxDh.dtype), scale=scale,
        is_causal=True, query_seq_lengths=length_B, key_value_seq_lengths=length_B, local_window_size=window,
        implementation=implementation)
    out_BxTxHxDh = take(out_BxSxHxDh, back_BxS)[:, offset:offset + T]
    return out_BxTxHxDh.reshape(B, T, K, G, Dh).transpose(0, 2, 3, 1, 4)


def attend(q_BxTxKxGxDh, k_BxKxSxDh, v_BxKxSxDh, mask, *, scale: float, softcap: float | None, backend: str,
           whole_mask: bool = False, whole_mask_hook=None, sinks_KxG=None):
    """Attention -> [B, K, G, T, Dh] by ``backend`` (`resolve`d ``model.attention``). ``mask``: a `Visibility`
    (a kernel backend's training forward) or a boolean [B, T, S] (dense, decoding, packed). A whole [B, T, T] mask
    (``whole_mask``, packed layouts) goes to ``whole_mask_hook`` (the CPU speed-ups' `blocked_attention`) on the
    CPU and to `blocked_attention` under a kernel backend, dense where they return None. ``sinks_KxG``
    (`dense`'s) go to splash, and skip ``jax.nn.dot_product_attention``, which takes no sink logit."""
    args = (q_BxTxKxGxDh, k_BxKxSxDh, v_BxKxSxDh)
    if isinstance(mask, Visibility):
        if backend in ("splash", "splash_interpret"):
            return splash(*args, mask, scale, softcap, interpret=backend == "splash_interpret", sinks_KxG=sinks_KxG)
        cudnn = backend in ("cudnn", "xla") and sinks_KxG is None
        out = dot_product(*args, mask, scale, softcap, backend) if cudnn else None
        if out is not None:
            return out
        if mask.hidden_slot:
            k_BxKxSxDh, v_BxKxSxDh, segment_BxS, _ = _compact(k_BxKxSxDh, v_BxKxSxDh, mask)
            mask = dataclasses.replace(mask, kv_segment_BxS=segment_BxS, query_offset=mask.query_offset - 1,
                                       hidden_slot=False)
        return dense(q_BxTxKxGxDh, k_BxKxSxDh, v_BxKxSxDh, mask.dense_mask(), scale, softcap, sinks_KxG)
    out = None
    if whole_mask:
        attend_whole = blocked_attention if backend in KERNELS else whole_mask_hook
        if attend_whole is not None:
            out = attend_whole(*args, mask, scale, softcap, sinks_KxG=sinks_KxG)
    return dense(*args, mask, scale, softcap, sinks_KxG) if out is None else out


# --- decoding over a paged cache ------------------------------------------------------------------------------

DECODE_KERNELS = ("splash", "splash_interpret", "cudnn")  # backends whose paged decode runs a Pallas kernel


def paged_kernel(backend: str, model) -> bool:
    """Whether a decode step over a paged cache runs `paged_decode`'s kernel for the resolved ``backend`` and the
    ``model`` config (on a mesh in a ``shard_map`` over row shards and key/value heads, `models.paged.attend`): the
    TPU kernel's blocks take a head dim of whole 128-lane tiles (64 is refused by Mosaic) and neither kernel takes
    attention sinks; the dense path reads the pages back else."""
    head_dim = model.resolved_head_dim
    return (backend in DECODE_KERNELS and (backend != "splash" or head_dim % 128 == 0)
            and not model.attention_sinks)


PAGES_PER_BLOCK = 8  # pages a paged-attention kernel reads per compute block (fewer when a row has fewer)
K_SPLITS = 16  # parts of a row's pages the GPU kernel reads in parallel (fewer when they do not divide its pages)


def paged_decode(q_BxTxKxGxDh, k_KxPagesxPsxDh, v_KxPagesxPsxDh, pages_BxQ, length_B, *, scale: float,
                 softcap: float | None, backend: str, interpret: bool = False):
    """One query per row over its pages -> [B, K, G, 1, Dh]: row b sees its tokens [0, ``length_B[b]``) (page j //
    page_size of ``pages_BxQ``). ``backend`` splash: the TPU Pallas kernel; cudnn or xla: the GPU Pallas kernel,
    which ``interpret`` (or splash_interpret) runs in Pallas interpret mode on any backend (the TPU kernel has
    none). Queries are scaled before the kernels (they do not
    scale); pages past a row's length may be missing (the pool's page count), clamped to page 0, never read."""
    B, T, K, G, Dh = q_BxTxKxGxDh.shape
    if T != 1:
        raise ValueError(f"paged_decode takes one query per row, got {T}")
    pages = k_KxPagesxPsxDh.shape[1]
    Q = pages_BxQ.shape[1]
    q_BxHxDh = (q_BxTxKxGxDh.astype(jnp.float32) * scale).astype(q_BxTxKxGxDh.dtype).reshape(B, K * G, Dh)
    k, v = (x.astype(q_BxHxDh.dtype) for x in (k_KxPagesxPsxDh, v_KxPagesxPsxDh))
    pages_BxQ = jnp.where(pages_BxQ < pages, pages_BxQ, 0).astype(jnp.int32)
    if backend == "splash" and not interpret:
        out_BxHxDh = tpu_paged_attention(q_BxHxDh, k, v, length_B.astype(jnp.int32), pages_BxQ,
                                         attn_logits_soft_cap=softcap,
                                         pages_per_compute_block=math.gcd(Q, PAGES_PER_BLOCK))
    else:  # a row's pages split K_SPLITS ways run in parallel (few rows, long rows), combined by the kernel
        splits = math.gcd(Q, K_SPLITS)
        out_BxHxDh = gpu_paged.paged_attention(q_BxHxDh, k, v, pages_BxQ, length_B.astype(jnp.int32),
                                               pages_per_compute_block=math.gcd(Q // splits, PAGES_PER_BLOCK),
                                               k_splits=splits, attn_logits_soft_cap=softcap,
                                               interpret=interpret or backend == "splash_interpret")
    return out_BxHxDh.reshape(B, K, G, 1, Dh)
