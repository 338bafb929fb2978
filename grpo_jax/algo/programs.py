"""Every device program of a run, jitted here and nowhere else: explicit in/out shardings, donated state.

The maths lives in pure functions (`decoder`, `logprobs.completion_logps`, `train_step.train_step`,
`advantages`, `rounds.round_advantages`); this module only says how each runs over the mesh. `build` makes the
`Programs` of one run; the `jit_*` functions are the same programs one by one, for library use and tests.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from grpo_jax.algo import beam, decoder, rounds
from grpo_jax.algo.logprobs import completion_logps
from grpo_jax.algo.program_types import Decoder, Programs  # noqa: F401  (re-exported)
from grpo_jax.algo.state import TrainState, abstract_state, model_graphdef, new_state
from grpo_jax.algo.train_step import StepOptions, train_step
from grpo_jax.config.model import ModelConfig
from grpo_jax.config.sections import SamplingConfig
from grpo_jax.device import cpu, rollout_layout, sharding
from grpo_jax.losses import compute_loss
from grpo_jax.models import lora
from grpo_jax.models.transformer import compute_dtype_params, forward, init_model


def use_compilation_cache(path: str | None) -> None:
    """JAX's persistent compilation cache in `path` (`compilation_cache_dir`), so that a second start of a run (a
    resume, the same command again) loads its programs instead of compiling them. A cache chosen already (the
    environment's JAX_COMPILATION_CACHE_DIR, or jax.config in the caller's code) is left as it is. JAX keys each
    entry by the program, the compile options, the devices and the jaxlib version: a hit is the same executable."""
    if path is None or jax.config.jax_compilation_cache_dir:
        return
    folder = Path(path).expanduser()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        warnings.warn(f"compilation_cache_dir={path!r} cannot be created ({e.strerror}): compiling without a "
                      "persistent cache; point compilation_cache_dir at a writable folder, or null to silence this",
                      RuntimeWarning, stacklevel=2)
        return
    jax.config.update("jax_compilation_cache_dir", str(folder))
    # every program, not only those over JAX's default 1 s: a start runs dozens of sub-second ones
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def _on_device(shardings):
    """The same shardings in device memory (None when none of them is elsewhere)."""
    leaves = jax.tree.leaves(shardings)
    if not any(getattr(x, "memory_kind", None) not in (None, "device") for x in leaves):
        return None
    return jax.tree.map(lambda x: x.with_memory_kind("device"), shardings)


@dataclasses.dataclass(frozen=True)
class RefApartStep:
    """The train step for a reference kept in host memory: the reference is a separate, non-donated argument.

    A host-side numpy view of a host-memory reference (a checkpoint, a device_get) would make its donation
    fail; without TR-DPO sync it is not even an output. Called like the plain program: `(state, batch)`.
    """

    jitted: Any  # jitted (state without ref, ref_params, batch) -> (state, metrics)
    sync: bool

    def __call__(self, state, batch, packed_length=0, packed_buffers=0):
        new_state, metrics = self.jitted(state._replace(ref_params=None), state.ref_params, batch, packed_length,
                                         packed_buffers)
        return (new_state if self.sync else new_state._replace(ref_params=state.ref_params)), metrics

    def lower(self, state, batch, packed_length=0, packed_buffers=0):
        """The jitted program lowered for these arguments (memory analysis, HLO)."""
        return self.jitted.lower(state._replace(ref_params=None), state.ref_params, batch, packed_length,
                                 packed_buffers)

    def _cache_size(self) -> int:
        return self.jitted._cache_size()


def jit_train_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation, options: StepOptions,
                   mesh: Mesh, state_sharding):
    """`train_step` over the mesh: state in `state_sharding` (in and out) and donated, batch rows split over
    the data axes, metrics replicated: `fn(state, batch, packed_length=0, packed_buffers=0)`, the last two static
    (`train_step`).

    `state_sharding`: `sharding.state_shardings(mesh, abstract_state)` or `sharding.tree_shardings(state)`.
    A reference in host memory (`train.offload_ref_params`) runs as a `RefApartStep`.
    """
    replicated, rows = sharding.replicated(mesh), sharding.row_sharded(mesh)
    ref_device = _on_device(state_sharding.ref_params)
    step = sharding.traced_in(mesh, functools.partial(train_step, graphdef, optimizer, options, mesh=mesh,
                                                      ref_device_sharding=ref_device))
    if ref_device is None:
        return jax.jit(step, in_shardings=(state_sharding, rows), out_shardings=(state_sharding, replicated),
                       donate_argnums=0, static_argnums=(2, 3))
    sync = options.ref_sync.sync_ref_model
    no_ref = state_sharding._replace(ref_params=None)

    def split_step(state, ref_params, batch, packed_length=0, packed_buffers=0):
        new_state, metrics = step(state._replace(ref_params=ref_params), batch, packed_length, packed_buffers)
        return new_state._replace(ref_params=new_state.ref_params if sync else None), metrics

    jitted = jax.jit(split_step, in_shardings=(no_ref, state_sharding.ref_params, rows),
                     out_shardings=(state_sharding if sync else no_ref, replicated), donate_argnums=0,
                     static_argnums=(3, 4))
    return RefApartStep(jitted, sync)


def jit_logps(graphdef: nnx.GraphDef, mesh: Mesh, *, temperature: float, chunk_size: int = 0,
              params_sharding=None, prompt_group_size: int = 1):
    """Per-token log-probs of completions under some params (old policy or reference), rows sharded:
    `fn(params, prompt_ids, prompt_mask, completion_ids, completion_mask, routed_experts, packed_length=0,
    packed_buffers=0)`, the last two static (`logprobs.completion_logps`; one compilation per packing);
    ``routed_experts`` (`Trajectory.routed_experts`, or None) replays the sampler's experts.

    `prompt_group_size` G > 1: rows come in groups of G sharing a prompt (`trajectory.layout`).
    `params_sharding`: the params' shardings (`sharding.param_shardings`); a reference in host memory is
    brought to the devices inside. None: the layout of the params passed in (one compilation per layout).
    """
    rows = sharding.row_sharded(mesh)
    on_device = None if params_sharding is None else _on_device(params_sharding)
    split = rows if sharding.num_row_shards(mesh) > 1 else None  # one row shard: the program as before

    def logps(params, prompt_ids, prompt_mask, completion_ids, completion_mask, routed_experts, packed_length=0,
              packed_buffers=0):
        if on_device is not None:
            params = jax.device_put(params, on_device)
        out, _ = completion_logps(graphdef, params, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                  temperature=temperature, chunk_size=chunk_size,
                                  prompt_group_size=prompt_group_size, packed_length=packed_length,
                                  packed_buffers=packed_buffers, routing=routed_experts, row_sharding=split)
        return out

    return jax.jit(sharding.traced_in(mesh, logps), in_shardings=(params_sharding, rows, rows, rows, rows, rows),
                   out_shardings=rows, static_argnums=(6, 7))


def host_advantages(**options):
    """`rounds.round_advantages` with its static `options`, jitted for this process's CPU (the rewards are computed
    there, and the metrics and `log_completions` read the results there): numpy arrays in, numpy arrays out. Every
    device and process gets the same numbers, from one summation order whatever the mesh."""
    cpu_device = jax.local_devices(backend="cpu")[0]
    jitted = jax.jit(functools.partial(rounds.round_advantages, **options))

    def advantages(*args):
        with jax.default_device(cpu_device):
            return jax.device_get(jitted(*args))

    return advantages


@functools.lru_cache(maxsize=4)  # a run's model and loss: compiled once per evaluation shape
def _eval_loss(graphdef, ref_graphdef, loss_config, temperature: float):
    def loss(params, ref_params, prompt_ids, prompt_mask, completion_ids, completion_mask, loss_mask, advantages):
        rows = (prompt_ids, prompt_mask, completion_ids, completion_mask)
        logps, entropies = completion_logps(graphdef, params, *rows, temperature=temperature, with_entropy=True)
        ref = None if ref_graphdef is None else completion_logps(ref_graphdef, ref_params, *rows,
                                                                 temperature=temperature)[0]
        value, _ = compute_loss(logps, None, ref, advantages, loss_mask, config=loss_config,
                                num_items_in_batch=jnp.sum(loss_mask).astype(jnp.float32),
                                num_sequences=loss_mask.shape[0], entropies=entropies)
        return value

    return jax.jit(loss)


def eval_loss(graphdef, params, reference_params, *, loss_config, temperature: float):
    """TRL's `eval_loss` program (`rollout.eval_loss`): ``(prompt_ids, prompt_mask, completion_ids,
    completion_mask, loss_mask, advantages) -> the loss`` of those rows on-policy under ``params``, beta x KL to
    ``reference_params`` (LoRA without a copy: the base, the adapters off); None when beta != 0 and the run keeps
    no reference."""
    ref_graphdef = None
    if loss_config.resolved_beta != 0.0:
        if lora.has_adapters(params) and (reference_params is None or reference_params is params):
            ref_graphdef, reference_params = lora.adapters_off(graphdef, params), params  # the base is the reference
        elif reference_params is None:
            return None
        else:
            ref_graphdef = graphdef
    program = _eval_loss(graphdef, ref_graphdef, loss_config, temperature)
    return functools.partial(program, params, reference_params)


def jit_rows(mesh: Mesh, mask_truncated: bool):
    """`(trajectory, advantages, old, ref) -> trajectory` with those set, row-split over the mesh; with
    ``mask_truncated`` (TRL's `mask_truncated_completions`) rows that ran out of tokens train nothing."""
    def rows(trajectory, advantages, old, ref):
        loss_mask = trajectory.loss_mask
        if mask_truncated:
            loss_mask = rounds.mask_truncated(loss_mask, trajectory.is_truncated)
        return trajectory._replace(loss_mask=loss_mask, advantages=advantages, old_per_token_logps=old,
                                   ref_per_token_logps=ref)

    return jax.jit(rows, out_shardings=sharding.row_sharded(mesh))


def jit_take(mesh: Mesh):
    """`(rows, rows_B) -> rows[rows_B]` leaf by leaf, the result row-split: one step's rows of a round."""
    return jax.jit(lambda batch, rows_B: jax.tree.map(lambda x: x[rows_B], batch),
                   out_shardings=sharding.row_sharded(mesh))


def _view(decoding):
    """What the host reads of a decoding between segments: (ended, length, at_eos [B], tokens [B, T], steps,
    paused [B])."""
    return decoding.ended, decoding.length, decoding.at_eos, decoding.tokens, decoding.steps, decoding.paused


def paged_page_size(config, mesh) -> int:
    """The decoder's page size for ``sampling.kv_cache`` on ``mesh`` (0: the contiguous cache). ``auto`` pages on a
    TPU/GPU mesh (a pool per row shard, `models.paged.split`), where the decode kernels read the pages."""
    if config.kv_cache == "auto":
        return config.kv_page_size if mesh.devices.flat[0].platform != "cpu" else 0
    return config.kv_page_size if config.kv_cache == "paged" else 0


class RolloutPlacement(NamedTuple):
    """Where decoding runs when not in the training layout: the rollout mesh (`rollout_layout.rollout_mesh`), the
    params' shardings over it and the paged pool that fits there (`rollout_layout.Layout.kv_cache_tokens`)."""

    mesh: Mesh
    params_sharding: Any
    kv_cache_tokens: int = 0


def rollout_placement(mesh: Mesh, layout: rollout_layout.Layout | None, abstract_params) -> RolloutPlacement | None:
    """The `RolloutPlacement` of ``layout`` (`rollout_layout.choose`) over the training ``mesh``; None: none."""
    if layout is None:
        return None
    decode_mesh = rollout_layout.rollout_mesh(mesh, layout)
    return RolloutPlacement(decode_mesh, sharding.param_shardings(decode_mesh, abstract_params), layout.kv_cache_tokens)


def jit_decoder(graphdef, mesh, model_config: ModelConfig, *, config: SamplingConfig, eos_token_ids: tuple[int, ...],
                pad_token_id: int, params_sharding=None, prompt_group_size: int = 1,
                cpu_speedups: bool = False, rollout: RolloutPlacement | None = None) -> Decoder:
    """The decoding programs of `grpo_jax.algo.decoder` over `mesh` for the model `graphdef` of `model_config` (its
    vocabulary and key/value heads): prompt rows split over (data, fsdp), key replicated;
    `params_sharding` (`sharding.param_shardings`) None takes the params' own layout. A call's options are static:
    greedy calls (evaluation) have one row per prompt, sampling calls `prompt_group_size` rows per prompt, and
    slots (``config.max_batch_rows``, or the call's own) fewer than a call's rows decode them continuously batched.
    LoRA adapters are merged into the kernels once per program (`lora.merged`), not run in every decode step.
    ``cpu_speedups`` (`cpu.enabled`) draws the same tokens the CPU's faster way (`cpu.decode_options`) and on a
    one-device mesh may split a call into host-thread chunks (`cpu.host_chunks`, ``config.host_threads``).

    ``rollout`` (`rollout_placement`): the calls decode over its mesh, the policy taken there by ``layout`` once per
    call (one program: resharded from ``params_sharding``, LoRA adapters merged, cast to the compute dtype), the
    trajectories given back row-split over ``mesh``. None: ``layout`` gives the params as they are."""
    out_rows = sharding.row_sharded(mesh)  # trajectories: where the log-prob passes and the train step take them
    layout = None
    # the user's pool, else the one the rollout layout found room for (0: every slot's whole row)
    pool_tokens = config.kv_cache_tokens or (rollout.kv_cache_tokens if rollout is not None else 0)
    if rollout is not None:
        train_graphdef, train_sharding = graphdef, params_sharding
        premerged = lora.has_adapters(params_sharding)
        if premerged:  # merged once by the layout program; the decode programs run the base's products
            graphdef = lora.adapters_off(graphdef, params_sharding)

        def to_rollout(params):
            if premerged:
                params = lora.merged(train_graphdef, params)[1]
            return compute_dtype_params(train_graphdef, params)

        layout = jax.jit(to_rollout, in_shardings=(train_sharding,), out_shardings=rollout.params_sharding)
        mesh, params_sharding = rollout.mesh, rollout.params_sharding
    rows, replicated = sharding.row_sharded(mesh), sharding.replicated(mesh)
    row_shards = sharding.num_row_shards(mesh)
    if cpu_speedups and config.host_threads > 1 and mesh.devices.size > 1:
        raise ValueError(f"sampling.host_threads={config.host_threads} splits one device's rows over host "
                         f"threads, but the mesh has {mesh.devices.size} devices (which already sample in "
                         "parallel): set it to 0 or 1")

    def merged(params):
        # LoRA adapters merged into the kernels once per call (`lora.merged`): decode steps run the base's products
        if rollout is None and lora.has_adapters(params):
            return lora.merged(graphdef, params)
        return graphdef, params

    def options(num_rows: int, total_rows: int, greedy: bool, slots: int = 0) -> decoder.DecodeOptions:
        group = 1 if greedy else prompt_group_size
        kv_heads = model_config.num_key_value_heads
        base = decoder.DecodeOptions(
            sampling=config, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id, greedy=greedy, group_size=group,
            num_slots=0 if config.num_beams > 1 else decoder.continuous_slots(slots or config.max_batch_rows or 0,
                                                                              num_rows, total_rows, row_shards),
            cache_sharding=sharding.cache_sharding(mesh, kv_heads), record_routing=model_config.routing_replay,
            page_size=paged_page_size(config, mesh), kv_cache_tokens=pool_tokens)
        return cpu.decode_options(base, num_rows, model_config.vocab_size) if cpu_speedups else base

    def start(params, prompt_ids_BxP, prompt_mask_BxP, key, row_offset, options):
        return decoder.start(*merged(params), prompt_ids_BxP, prompt_mask_BxP, key, options, row_offset)

    def generate(params, prompt_ids_BxP, prompt_mask_BxP, key, row_offset, options):
        if options.sampling.num_beams > 1:  # each row the best of its beams: one program, no slots
            rows, steps = beam.generate(*merged(params), prompt_ids_BxP, prompt_mask_BxP, key, options, row_offset)
            ended = jnp.ones_like(rows.is_truncated)
            return rows, (ended, jnp.sum(rows.completion_mask, axis=1), ~rows.is_truncated, rows.completion_ids,
                          steps, ~ended)
        decoding = decoder.advance(*merged(params), start(params, prompt_ids_BxP, prompt_mask_BxP, key, row_offset,
                                                          options), options)
        return decoder.trajectory(decoding), _view(decoding)

    def advance(params, decoding, options, segment):
        decoding = decoder.advance(*merged(params), decoding, options, segment=segment)
        return decoding, _view(decoding)

    def append(params, decoding, rows_M, tokens_MxA, counts_M, options):
        return decoder.append(*merged(params), decoding, rows_M, tokens_MxA, counts_M, options)

    def chunks(num_rows: int, group_size: int) -> int:
        return cpu.host_chunks(config.host_threads, mesh, num_rows, group_size) if cpu_speedups else 1

    in_shardings = (params_sharding, rows, rows, replicated, replicated)
    pools = paged_page_size(config, mesh) > 0  # split over the row shards: traced under the mesh
    start, generate, advance, append = (sharding.traced_in(mesh, f, always=pools)
                                        for f in (start, generate, advance, append))
    return Decoder(
        layout=layout or (lambda params: params),
        generate=jax.jit(generate, static_argnums=5, in_shardings=in_shardings, out_shardings=(out_rows, None)),
        start=jax.jit(start, static_argnums=5, in_shardings=in_shardings),
        advance=jax.jit(advance, static_argnums=(2, 3), donate_argnums=1, in_shardings=(params_sharding, None)),
        append=jax.jit(append, static_argnums=5, donate_argnums=1,
                       in_shardings=(params_sharding, None, replicated, replicated, replicated)),
        # closures, not the module's functions: a jitted function's compilations are counted (and kept) per function
        retire=jax.jit(lambda d, rows_M: decoder.retire(d, rows_M), donate_argnums=0),
        trajectory=jax.jit(lambda d: decoder.trajectory(d), out_shardings=out_rows),
        concat=jax.jit(lambda parts: jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts), out_shardings=out_rows),
        options=options, chunks=chunks, place=lambda rows: sharding.host_rows(rows, mesh))


def init_state(model_config: ModelConfig, optimizer: optax.GradientTransformation, *, seed: int,
               with_reference: bool, mesh: Mesh, ref_param_dtype: str | None = None,
               offload_ref_params: bool = False) -> tuple[nnx.GraphDef, TrainState]:
    """Initialises model, optimizer and reference straight into their sharded layout (`sharding.state_shardings`).

    abstract_state -> shardings -> one jitted init with out_shardings: no host copy of the full params ever
    exists. The reference is stored in `ref_param_dtype` (None: the params' dtype), in host memory when
    `offload_ref_params`; optimizer moments are float32.
    """

    def init():
        return new_state(init_model(model_config, seed)[1], optimizer, seed=seed, with_reference=with_reference,
                         ref_param_dtype=ref_param_dtype)

    shapes = abstract_state(model_config, optimizer, with_reference=with_reference, ref_param_dtype=ref_param_dtype)
    shardings = sharding.state_shardings(mesh, shapes, offload_ref=offload_ref_params)
    state = jax.jit(init, out_shardings=shardings)()
    return model_graphdef(model_config), state


def state_from_params(params: Any, optimizer: optax.GradientTransformation, *, seed: int, with_reference: bool,
                      mesh: Mesh, ref_param_dtype: str | None = None, offload_ref_params: bool = False) -> TrainState:
    """A TrainState around given params (e.g. `from_pretrained`'s), laid out as `init_state` does.

    `params` is donated: the state's copy replaces it (load with `shardings=sharding.param_shardings(...)`
    so the policy never exists twice).
    """

    def init(params):
        return new_state(params, optimizer, seed=seed, with_reference=with_reference,
                         ref_param_dtype=ref_param_dtype)

    # the given params' own shapes (not the config's): the state is built around exactly these
    shardings = sharding.state_shardings(mesh, jax.eval_shape(init, params), offload_ref=offload_ref_params)
    # placed first (a no-op when already there), so the donated input and the params output alias exactly
    params = jax.device_put(params, shardings.params, donate=True)
    return jax.jit(init, in_shardings=(shardings.params,), out_shardings=shardings, donate_argnums=0)(params)


def init_adapters(model_config: ModelConfig, seed: int, shardings) -> nnx.State:
    """Fresh LoRA adapters of `model_config` (those `init_model` draws for `seed`), placed in their `shardings`
    (the model's params' shardings; None: the default device): one jitted init whose base weights XLA never
    computes."""
    def init():
        return nnx.filter_state(init_model(model_config, seed)[1], nnx.LoRAParam)

    out_shardings = None if shardings is None else nnx.filter_state(shardings, nnx.LoRAParam)
    return jax.jit(init, out_shardings=out_shardings)()


def _sample_key(key, round_index, draw_index: int):
    key = jax.random.fold_in(key, round_index)
    return jax.random.fold_in(key, draw_index) if draw_index else key  # dynamic sampling's extra passes


def build(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation, options: StepOptions, mesh: Mesh,
          state_sharding, *, decoder: Decoder, round_prompt_group_size: int, advantage_options: dict,
          mask_truncated: bool = False, eval_decoder: Decoder | None = None) -> Programs:
    """The run's programs over `mesh` for a state laid out as `state_sharding`; `decoder` and `eval_decoder` are
    `jit_decoder`'s, `round_prompt_group_size` the G of the round's log-prob passes."""
    logps = functools.partial(jit_logps, mesh=mesh, temperature=options.temperature,
                              chunk_size=options.logps_chunk_size, prompt_group_size=round_prompt_group_size)
    ref_logps = None
    if state_sharding.ref_params is not None:
        ref_logps = logps(graphdef, params_sharding=state_sharding.ref_params)
    elif options.loss.resolved_beta != 0.0 and lora.has_adapters(state_sharding.params):  # the base is the reference
        ref_logps = logps(lora.adapters_off(graphdef, state_sharding.params), params_sharding=state_sharding.params)
    return Programs(
        decoder=decoder,
        # one dispatch, not fold_in's primitives one by one
        sample_key=jax.jit(_sample_key, static_argnums=2),
        logps=logps(graphdef, params_sharding=state_sharding.params),
        ref_logps=ref_logps,
        advantages=host_advantages(**advantage_options),
        rows=jit_rows(mesh, mask_truncated),
        take=jit_take(mesh),
        step=jit_train_step(graphdef, optimizer, options, mesh, state_sharding),
        eval_decoder=eval_decoder,
        eval_loss=functools.partial(eval_loss, graphdef, loss_config=options.loss, temperature=options.temperature),
    )


def jit_reward_scores(graphdef: nnx.GraphDef):
    """A sequence classifier's first logit at each row's last non-pad token (transformers' pooling), for
    `grpo_jax.rewards.reward_model`: (params, score_weight [labels, D], ids [B, T], mask [B, T], pad_id) -> [B]."""
    def scores(params, score_weight, ids_BxT, mask_BxT, pad_id):
        positions_BxT = jnp.broadcast_to(jnp.arange(ids_BxT.shape[1]), ids_BxT.shape)  # right-padded rows
        hidden_BxTxD, _ = forward(graphdef, params, ids_BxT, positions_BxT, mask_BxT)
        logits_BxT = jnp.einsum("btd,d->bt", hidden_BxTxD.astype(jnp.float32), score_weight[0])
        last_B = jnp.argmax(jnp.arange(ids_BxT.shape[1]) * (ids_BxT != pad_id), axis=-1)
        return jnp.take_along_axis(logits_BxT, last_B[:, None], axis=1)[:, 0]

    return jax.jit(scores)

