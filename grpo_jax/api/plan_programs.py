"""The programs `grpo_jax.api.plan` compiles for a run (`programs`) and their FLOPs and bytes per chip (`costs`).

`programs` lowers and compiles the run's prefill, decode step, log-prob forward and train step over a mesh for
abstract inputs (nothing is allocated). `costs` reads XLA's `cost_analysis` of those same programs and corrects it
for loops, which XLA counts one trip of: the scan over the layers (extrapolated from one more compile of each
scanned program at another `model.scan_unroll`) and the micro-batches (times their number). A decode step's bytes
are read from its HLO instruction by instruction (`hlo.traffic`: the loop's body a step, the call's one-time work
spread over its steps, in-place writes as their updates). What XLA cannot see is counted by hand: Pallas splash
attention's FLOPs (`kernel_attention_flops`), the paged-attention kernels' reads of the KV pages in a decode step
(`paged_kernel_bytes`), megablox's grouped products in a mixture of experts beyond XLA's count of them
(`kernel_expert_flops`) and the chunked unembedding's other trips (`unembedding_flops`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from typing import NamedTuple

from grpo_jax.api import hlo
from grpo_jax.config import Config


class Refused(NamedTuple):
    """A program XLA would not compile for want of memory: its message and the bytes it names (a lower bound)."""

    message: str
    needs: int


class Program(NamedTuple):
    """One phase's program: a digest of its lowered text (equal digests: the same program), its executable, the
    bytes a chip reads inside kernels that XLA's cost analysis leaves out (`paged_kernel_bytes`), the executable
    whose cost the plan counts where it is not this one (`steady_state`), and a decode program's HBM traffic read
    from that executable's HLO (`hlo.traffic`)."""

    digest: str
    compiled: object  # jax's Compiled, or Refused
    kernel_bytes: float = 0.0
    counted: object = None  # None: ``compiled``
    traffic: object = None  # `hlo.Traffic` of a decode program, else None


def decode_steps(config: Config) -> int:
    """Decode steps a round runs (an upper bound: every row to max_completion_length), its rows in calls of
    ``sampling.max_batch_rows`` slots."""
    tc = config.train
    slots = config.sampling.max_batch_rows or tc.generation_batch_size
    return config.sampling.max_completion_length * -(-tc.generation_batch_size // slots)


def kernel_operands(decoding) -> frozenset:
    """The per-chip shapes of a decoding state's page pools, which the paged-attention kernels read only where the
    page table points (`paged_kernel_bytes`), not whole as their operands say."""
    from grpo_jax.models import paged

    cache = decoding.cache
    if not isinstance(cache, paged.PagedKVCache):
        return frozenset()
    return frozenset(tuple(x.sharding.shard_shape(x.shape)) for x in (*cache.k, *cache.v)
                     if not isinstance(x, paged.Ring))


def steady_state(decoding):
    """A decoding state in its steady state, for a decode step's cost: every slot's row decoding, none waiting for
    pages. With a pool smaller than every slot's whole row the step holds conditionals (preempt rows, recompute the
    ones admitted again in one pass) that run only when the pool runs short, yet XLA's cost analysis counts each
    branch every trip (v5p:4x4x4, tensor 8 x data 8, 2 layers, 256 rows of 128 + 1024 tokens, a pool of a quarter
    of them: 40.8 GFLOP and 1942 MiB a step against 0.243 GFLOP and 115 MiB without them). Without its preemption
    count the step traces without them; memory stays the program's that runs."""
    return decoding if decoding.preempted is None else decoding._replace(preempted=None)


def _needs(message: str) -> int:
    """The bytes an XLA out-of-memory message names: an allocation's size, or the temporaries' total (0: none)."""
    found = re.search(r"Allocation \(size=(\d+)\)", message)
    if found:
        return int(found.group(1))
    found = re.search(r"HLO temporaries \(([\d.]+)([KMGT]?)\)", message)
    if found:
        return int(float(found.group(1)) * 1024 ** " KMGT".index(found.group(2) or " "))
    return 0


def compile_program(lowered, tpu: bool, reuse: Program | None = None) -> Program:
    """``lowered``'s `Program`: ``reuse``'s executable when its lowered text is the same, else XLA's (or `Refused`).
    On a TPU a program over the chip's HBM is still compiled (``xla_tpu_no_crash_on_oom``) so that its sizes come
    back: the plan judges the fit itself; an allocation larger than the whole HBM is refused all the same."""
    digest = hashlib.sha256(lowered.as_text().encode()).hexdigest()
    if reuse is not None and reuse.digest == digest:
        return reuse
    try:
        return Program(digest, lowered.compile({"xla_tpu_no_crash_on_oom": True} if tpu else None))
    except Exception as e:  # noqa: BLE001 - XLA's RESOURCE_EXHAUSTED is a JaxRuntimeError
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        return Program(digest, Refused(str(e).strip().splitlines()[0][:300], _needs(str(e))))


def paged_kernel_bytes(config: Config, model, decode_mesh) -> float:
    """Bytes a chip's paged-attention kernels read in one decode step, which XLA's cost analysis does not count
    (a Mosaic custom call: its pool operands are left out of the total): each full-attention layer's keys and
    values of the chip's rows over its key/value heads, a row holding P + t tokens at step t, so P + T / 2 on
    average over the T steps of rows that run to the end (the plan's decode steps). 0 where no kernel reads pages
    (the contiguous cache, the dense read-back, window rings: XLA counts those)."""
    import jax
    import jax.numpy as jnp

    from grpo_jax.algo.programs import paged_page_size
    from grpo_jax.models import attention, paged
    from grpo_jax.models.transformer import layer_windows

    B, K = config.train.generation_batch_size, model.num_key_value_heads
    with jax.sharding.use_abstract_mesh(decode_mesh.abstract_mesh):  # as the decode program is traced
        backend, split = attention.resolve(model.attention), paged.split(B, K)
    if not paged_page_size(config.sampling, decode_mesh) or not attention.paged_kernel(backend, model):
        return 0.0
    P, T = config.data.max_prompt_length, config.sampling.max_completion_length
    heads = K // decode_mesh.shape[split.head] if split.head else K
    full = sum(w is None for w in layer_windows(model))
    return (B / split.shards * full * (P + T / 2) * 2 * heads * model.resolved_head_dim
            * jnp.dtype(model.jnp_dtype).itemsize)


def _abstract(shapes, shardings):
    import jax

    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)


def decode_layout(config: Config, mesh, model, chip, shapes, shardings):
    """The run's decoding layout over ``mesh`` (`rollout_layout.choose`, as `grpo_jax.api.run` chooses it)."""
    from grpo_jax.device import rollout_layout

    tc = config.train
    return rollout_layout.choose(config.mesh.rollout_tensor, model, mesh, chip=chip,
                                 rows=config.sampling.max_batch_rows or tc.generation_batch_size,
                                 prompt=config.data.max_prompt_length, completion=config.sampling.max_completion_length,
                                 abstract_params=shapes.params,
                                 state_bytes=rollout_layout.bytes_per_device(shapes, shardings))


def programs(config: Config, mesh, model, *, tpu: bool, reuse: dict | None = None, chip=None,
             compare_layouts: bool = False, decoding: bool = True) -> dict[str, Program]:
    """{phase: `Program`} of a run of ``model`` over ``mesh`` for abstract inputs (nothing allocated); a phase whose
    lowered text equals ``reuse``'s (a previous call's result) takes its executable instead of compiling again.
    Decoding runs in the layout the run would choose on ``chip`` (`decode_layout`), its reshard as ``layout``; with
    ``compare_layouts`` the training layout's decode step too, as ``decode_step_training_layout``; ``decoding``
    False: the log-prob and train programs only."""
    import jax
    import jax.numpy as jnp

    from grpo_jax.algo import programs as jitted
    from grpo_jax.api import run
    from grpo_jax.device import sharding
    from grpo_jax.models.moe import routing_dtype
    from grpo_jax.rollout.context import prompt_group_sizes
    from grpo_jax.algo.state import abstract_state, entropy_control, model_graphdef, optimizer_from_config
    from grpo_jax.algo.train_step import StepOptions
    from grpo_jax.algo.trajectory import Trajectory

    reuse = reuse or {}
    tc, P, T = config.train, config.data.max_prompt_length, config.sampling.max_completion_length
    config = dataclasses.replace(config, model=model)
    _, optimizer = optimizer_from_config(tc, config.max_steps)
    beta = config.loss.beta
    shapes = abstract_state(model, optimizer, with_reference=beta != 0.0, ref_param_dtype=tc.ref_param_dtype)
    control = entropy_control(config.loss)  # the adaptive entropy bonus's state, as `run.build` adds it
    shapes = shapes._replace(entropy_control=None if control is None else jax.eval_shape(lambda: control))
    shardings = sharding.state_shardings(mesh, shapes, offload_ref=tc.offload_ref_params)
    state, graphdef = _abstract(shapes, shardings), model_graphdef(model)
    rows = sharding.row_sharded(mesh)

    def array(*shape, dtype=jnp.int32, where=rows):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=where)

    def routed(b):  # the sampler's experts, replayed (model.routing_replay)
        if not model.routing_replay:
            return None
        return array(b, P + T, model.routed_layers, model.num_experts_per_tok,
                     dtype=routing_dtype(model.num_experts))

    def build(name, lowered):
        out[name] = compile_program(lowered, tpu, reuse.get(name))

    B, out = tc.generation_batch_size, {}
    round_group, step_group = prompt_group_sizes(config, mesh)
    layout = decode_layout(config, mesh, model, chip, shapes, shardings)
    placement = jitted.rollout_placement(mesh, layout, shapes.params)

    def decode(name, placement):
        decoder = jitted.jit_decoder(graphdef, mesh, model, config=config.sampling, eos_token_ids=(0,),
                                     pad_token_id=0, params_sharding=shardings.params,
                                     prompt_group_size=tc.num_generations, rollout=placement)
        if placement is not None:
            build("layout", decoder.layout.lower(state.params))
            params = _abstract(jax.eval_shape(decoder.layout, state.params), placement.params_sharding)
        else:
            params = state.params
        decode_mesh = mesh if placement is None else placement.mesh
        decode_rows, decode_replicated = sharding.row_sharded(decode_mesh), sharding.replicated(decode_mesh)
        options = decoder.options(B, B, False)
        start_args = (params, array(B, P, where=decode_rows), array(B, P, where=decode_rows),
                      array(2, dtype=jnp.uint32, where=decode_replicated),
                      array(dtype=jnp.int32, where=decode_replicated))
        prefill_name = "prefill" if name == "decode_step" else f"prefill_{name}"
        build(prefill_name, decoder.start.lower(*start_args, options))
        prefill = out[prefill_name].compiled
        if isinstance(prefill, Refused):  # the decode step's inputs are the prefill's outputs, as it lays them out
            out[name] = Program("", Refused("not compiled: the prefill was refused", 0))
        else:
            decoding = _abstract(jax.eval_shape(lambda *a: decoder.start(*a, options), *start_args),
                                 prefill.output_shardings)
            build(name, decoder.advance.lower(params, decoding, options, False))
            out[name] = out[name]._replace(kernel_bytes=paged_kernel_bytes(config, model, decode_mesh))
            if steady_state(decoding) is not decoding and out[name].counted is None:  # reused: counted already
                steady = compile_program(decoder.advance.lower(params, steady_state(decoding), options, False), tpu)
                out[name] = out[name]._replace(counted=steady.compiled)
            counted = out[name].counted or out[name].compiled
            if out[name].traffic is None and not isinstance(counted, Refused):
                out[name] = out[name]._replace(traffic=hlo.traffic(counted.as_text(), kernel_operands(decoding)))
        if name != "decode_step":
            out.pop(prefill_name)

    if decoding:
        decode("decode_step", placement)
    if decoding and compare_layouts and placement is not None:
        decode("decode_step_training_layout", None)
    if tc.needs_old_logps or beta != 0.0:
        logps = jitted.jit_logps(graphdef, mesh, temperature=config.sampling.temperature,
                                 chunk_size=tc.logps_chunk_size, params_sharding=shardings.params,
                                 prompt_group_size=round_group)
        build("logps", logps.lower(state.params, array(B, P), array(B, P), array(B, T), array(B, T), routed(B)))
    options = StepOptions(loss=dataclasses.replace(config.loss, max_completion_length=T),
                          temperature=config.sampling.temperature,
                          gradient_accumulation_steps=tc.gradient_accumulation_steps,
                          logps_chunk_size=tc.logps_chunk_size, prompt_group_size=step_group, ref_sync=tc.ref_sync,
                          router_aux_loss_coef=run.router_aux_loss_coef(config),
                          use_sampler_logps=tc.use_sampler_logps or config.loss.off_policy_correction == "decoupled")
    b, f32 = tc.train_batch_size, jnp.float32
    batch = Trajectory(array(b, P), array(b, P), array(b, T), array(b, T), array(b, T), array(b, T, dtype=f32),
                       array(b, T), array(b, dtype=jnp.bool_),
                       advantages=array(b, T, dtype=f32) if tc.advantage_estimator == "process"
                       else array(b, dtype=f32),
                       old_per_token_logps=array(b, T, dtype=f32) if tc.needs_old_logps else None,
                       ref_per_token_logps=array(b, T, dtype=f32) if beta != 0.0 else None, routed_experts=routed(b))
    step = jitted.jit_train_step(graphdef, optimizer, options, mesh, shardings)
    build("train_step", step.lower(state, batch))
    return out


def xla_cost(compiled) -> tuple[float, float]:
    """(FLOPs, bytes accessed) per chip of one run of ``compiled`` as XLA's cost analysis counts them: every loop's
    body once (nan: refused)."""
    if isinstance(compiled, Refused):
        return math.nan, math.nan
    cost = compiled.cost_analysis()
    cost = (cost[0] if cost else {}) if isinstance(cost, list) else (cost or {})
    return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))


def layers_counted(layers: int, unroll: int) -> int:
    """Layers XLA's cost analysis counts in a scan over ``layers`` at ``unroll`` layers per iteration: the loop's
    body once, plus the remainder jax runs outside the loop (all of them when nothing is left to loop)."""
    return layers if unroll >= layers else unroll + layers % unroll


# attention XLA sees as a custom call, its FLOPs uncounted (cuDNN's too, but it falls back to XLA's attention for
# some shapes and dtypes, which XLA counts: GPU plans leave it uncounted rather than count it twice)
KERNEL_BACKENDS = ("splash",)


def _visible_pairs(first: int, last: int, window: int | None) -> int:
    """Causal (query, key) pairs of the queries at slots first .. last - 1, each seeing itself and the slots before
    it (the ``window`` last of them)."""
    if window is None or window >= last:
        return (last * (last + 1) - first * (first + 1)) // 2
    ramp = max(0, min(last, window) - first)  # queries that see every slot before them
    start = first + ramp
    return (start * (start + 1) - first * (first + 1)) // 2 + (last - start) * window


def kernel_attention_flops(config: Config, *, rows: int, group: int, tensor: int, passes: int) -> float:
    """FLOPs per chip of an attention kernel's scores and weighted values, by hand: 4 x head_dim per visible
    (query, key) pair (q k^T and p v), per query head and layer (a sliding layer's window counted), over ``rows``
    rows of prompt + completion slots, a prompt run once per ``group`` rows (the shared-prompt layout); ``passes``
    forwards' worth (a backward counted as two)."""
    from grpo_jax.models.families import kind_window, layer_kinds

    model, P = config.model, config.data.max_prompt_length
    S = P + config.sampling.max_completion_length
    kinds, kind_of_layer = layer_kinds(model)
    pairs = 0
    for kind, window in ((k, kind_window(model, k)) for k in kinds):
        per_group = _visible_pairs(0, P, window) + group * _visible_pairs(P, S, window)
        pairs += kind_of_layer.count(kinds.index(kind)) * per_group
    heads = model.num_attention_heads // tensor
    return 4.0 * model.resolved_head_dim * heads * pairs * (rows / group) * passes


def kernel_expert_flops(config: Config, mesh, forwards: tuple[float, ...], *, passes: int) -> float:
    """FLOPs per chip to add to XLA's count of megablox's grouped products (`models.grouped`) in a program whose
    ``forwards`` run that many tokens a chip each, ``passes`` forwards' worth: the work done, 6 x hidden x
    ``moe_intermediate_size`` per token-expert assignment (gate, up and down), K a token in each layer, less what
    XLA counts. XLA takes the kernel's own estimate, 2 m k n per call over ALL m rows it is given, and one trip of
    `moe.expert_parallel`'s loop over chunks: a chunk's rows gathered over ``expert`` (n x the chunk's tokens x K,
    of which a chip runs its own experts' share, 1 / n) padded to whole row tiles. On one chip every assignment is
    local and counted: nothing to add. A forward of `moe.CHUNK_ASSIGNMENTS` assignments or fewer runs
    `jax.lax.ragged_dot` (`moe._all_tokens`), counted by XLA too."""
    from grpo_jax.models import grouped, moe

    model, chips = config.model, mesh.devices.size
    K, n, D, F = model.num_experts_per_tok, mesh.shape["expert"], model.hidden_size, model.moe_intermediate_size
    if chips == 1:
        return 0.0
    per_assignment = 6.0 * D * F * model.routed_layers * passes
    add = 0.0
    for tokens in forwards:
        if tokens * chips * K <= moe.CHUNK_ASSIGNMENTS:
            continue
        tokens = math.ceil(tokens)
        chunk = max(1, moe.CHUNK_ASSIGNMENTS // (n * K))
        chunks = -(-tokens // chunk)
        gathered = n * -(-tokens // chunks) * K  # one chunk's rows
        tile = grouped.tiling(gathered, D, F)[0]
        add += (tokens * K - -(-gathered // tile) * tile) * per_assignment
    return add


def unembedding_flops(config: Config, *, rows: int, chips: int, passes: int, shards: int = 1) -> tuple[float, int]:
    """(FLOPs per chip of unembedding ``rows`` rows' T completion slots, 2 x hidden x vocab a slot, ``passes``
    forwards' worth, the work split evenly over ``chips``; the trips of `logprobs`' loop over chunks and pieces).
    Under ``train.logps_chunk_size`` XLA's count holds one trip of them: the loop runs over each of ``shards`` row
    shards' rows (the log-prob program and the train step pin rows to their shards, `completion_logps`'s
    ``row_sharding``)."""
    from grpo_jax.algo.logprobs import _slots_per_piece

    model, T, chunk = config.model, config.sampling.max_completion_length, config.train.logps_chunk_size
    piece = _slots_per_piece(T, chunk * model.vocab_size)
    trips = -(-(-(-rows // shards)) // chunk) * -(-T // piece)
    return 2.0 * model.hidden_size * model.vocab_size * T * rows / chips * passes, trips


def costs(config: Config, mesh, compiled: dict[str, Program], *, tpu: bool, chip=None
          ) -> dict[str, tuple[float, float]]:
    """{phase: (FLOPs, bytes)} per chip of one run of each of the run's ``compiled`` programs (`programs`).

    XLA counts each loop's body once. The layers: with ``model.scan_layers`` the run's programs count
    `layers_counted` (u) of the L layers; the same programs at another `model.scan_unroll` (u') count u', and the
    difference is one layer: cost = run's + (L - u) x (run's - other's) / (u - u'). Programs whose lowered text the
    unroll does not change (the decoder's, which loops over the layers in Python) are not compiled again. The train
    step's micro-batches: times `train.gradient_accumulation_steps` (the optimizer's update, outside their loop, is
    counted that many times: about 16 bytes a parameter per chip each). Added by hand, FLOPs only: splash
    attention's (a custom call to XLA: `kernel_attention_flops`) and the unembedding's trips XLA did not count under
    ``train.logps_chunk_size`` (`unembedding_flops`); their bytes stay XLA's count (the kernels' operands, one
    trip of the unembedding: a lower bound). A decode step's bytes are its `Program.traffic`: a trip of the loop
    plus the call's one-time work (its state's set-up, the layers' weights sliced out of their stack) over the
    round's `decode_steps`, and the kernels' page reads."""
    model, tc = config.model, config.train
    L, u = model.num_hidden_layers, model.scan_unroll
    own = {name: xla_cost(p.compiled if p.counted is None else p.counted) for name, p in compiled.items()}
    kernels = {name: p.kernel_bytes for name, p in compiled.items()}
    counted = other_counted = layers_counted(L, u)
    other = own
    if model.scan_layers and counted < L:
        other_unroll = 1 if u > 1 else 2
        other_counted = layers_counted(L, other_unroll)
        variant = dataclasses.replace(model, scan_unroll=other_unroll)
        other = {name: xla_cost(p.compiled if p.counted is None else p.counted) for name, p in
                 programs(config, mesh, variant, tpu=tpu, reuse=compiled, chip=chip,
                          compare_layouts="decode_step_training_layout" in compiled,
                          decoding="decode_step" in compiled).items()}
    out = {}
    for name, (flops, bytes_) in own.items():
        totals = []
        for mine, theirs in ((flops, other[name][0]), (bytes_, other[name][1])):
            layer = 0.0 if other_counted == counted else (mine - theirs) / (counted - other_counted)
            totals.append(mine + (L - counted) * layer)
        scale = tc.gradient_accumulation_steps if name == "train_step" else 1
        out[name] = (max(totals[0], 0.0) * scale, max(totals[1], 0.0) * scale + kernels[name])
        traffic = compiled[name].traffic
        if traffic is not None:  # a decode step: its loop's body, and the call's one-time work over its steps
            out[name] = (out[name][0], traffic.per_step + traffic.once / decode_steps(config) + kernels[name])
    from grpo_jax.device import sharding
    from grpo_jax.rollout.context import prompt_group_sizes

    m, shards = tc.gradient_accumulation_steps, sharding.num_row_shards(mesh)
    round_group, step_group = prompt_group_sizes(config, mesh)
    layer_remat = 1 if model.remat != "none" else 0  # a checkpointed layer's forward again in the backward
    if tc.logps_chunk_size > 0:  # the unembedding's trips XLA did not count
        chips = mesh.devices.size
        remat = 2  # its pieces are checkpointed: forward, again in the backward, and the backward's two products
        for name, rows, passes, scale in (("logps", tc.generation_batch_size, 1, 1),
                                          ("train_step", tc.train_batch_size // m, 2 + remat, m)):
            if name in out:
                flops, trips = unembedding_flops(config, rows=rows, chips=chips, passes=passes, shards=shards)
                out[name] = (out[name][0] + flops * (1 - 1 / trips) * scale, out[name][1])
    platform = mesh.devices.flat[0].platform
    if model.num_experts and platform == "tpu":  # megablox's grouped products (`models.grouped.resolve`)
        P, T = config.data.max_prompt_length, config.sampling.max_completion_length

        def forwards(rows, group):  # tokens a chip runs in each forward: the shared layout's prompts, then branches
            return (rows / group * P, rows * T) if group > 1 else (rows * (P + T),)

        for name, runs, passes, scale in (
                ("prefill", (tc.generation_batch_size / shards / tc.num_generations * P,), 1, 1),
                ("logps", forwards(tc.generation_batch_size / shards, round_group), 1, 1),
                # the chunks' checkpoint runs their forward again in the backward, and so does a layer's remat
                ("train_step", forwards(tc.train_batch_size / m / shards, step_group), 4 + layer_remat, m)):
            if name in out:
                flops = kernel_expert_flops(config, mesh, runs, passes=passes) * scale
                out[name] = (out[name][0] + flops, out[name][1])
    backend = model.attention if model.attention != "auto" else {"tpu": "splash"}.get(platform)
    if backend in KERNEL_BACKENDS:  # the kernels' FLOPs, which XLA does not see (their bytes it does: operands)
        tensor = mesh.shape.get("tensor", 1)
        for name, rows, group, passes in (("logps", tc.generation_batch_size, round_group, 1),
                                          ("train_step", tc.train_batch_size, step_group, 3 + layer_remat)):
            if name in out:
                flops = kernel_attention_flops(config, rows=rows / shards, group=group, tensor=tensor, passes=passes)
                out[name] = (out[name][0] + flops, out[name][1])
    return out
