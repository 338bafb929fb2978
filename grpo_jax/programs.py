"""Every device program of a run, jitted here and nowhere else: explicit in/out shardings, donated state.

The maths lives in pure functions (`sampling.generate`, `logprobs.completion_logps`, `train_step.train_step`,
`advantages`, `rounds.round_advantages`); this module only says how each runs over the mesh. `build` makes the
`Programs` of one run; the `jit_*` functions are the same programs one by one, for library use and tests.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from grpo_jax import continuous, cpu, rounds, sharding, stream
from grpo_jax.logprobs import completion_logps
from grpo_jax.models import ModelConfig, init_model, lora, model_config
from grpo_jax.sampling import SampleOutput, SamplingConfig, generate
from grpo_jax.state import TrainState, abstract_state, model_graphdef, new_state
from grpo_jax.train_step import StepOptions, train_step


class Programs(NamedTuple):
    """The jitted device programs a run calls, built once by `build`.

    - `sample(params, prompt_ids, prompt_mask, key, greedy) -> SampleOutput` (`sampling.jit_generate`)
    - `sample_key(key, step, draw_index) -> key`: the key of a round's sampling pass
    - `logps(params, prompt_ids, prompt_mask, completion_ids, completion_mask) -> [N, T]` (old policy)
    - `ref_logps(ref_params, ...)`: the same over the reference's layout; None when beta = 0. With LoRA
      adapters it takes the policy's params (`TrainState.reference_params`) and runs them with the adapters off
    - `advantages(rewards_NxF, weights_F, mask_NxT, step_rewards, step_ends) -> (advantages, r_N, std_N)`
    - `take(batch, rows_B) -> Batch`: one step's rows of a round, gathered on the devices
    - `step(state, batch) -> (state, metrics)`: one optimizer step, the state donated
    - `eval_sample`: `sample` at `eval.temperature` with `eval.num_generations` rows per prompt; None when
      evaluation samples nothing (`grpo_jax.evaluation`)
    """

    sample: Callable
    sample_key: Callable
    logps: Callable
    ref_logps: Callable | None
    advantages: Callable
    take: Callable
    step: Callable
    eval_sample: Callable | None = None


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

    def __call__(self, state, batch, packed_length=0):
        new_state, metrics = self.jitted(state._replace(ref_params=None), state.ref_params, batch, packed_length)
        return (new_state if self.sync else new_state._replace(ref_params=state.ref_params)), metrics

    def lower(self, state, batch, packed_length=0):
        """The jitted program lowered for these arguments (memory analysis, HLO)."""
        return self.jitted.lower(state._replace(ref_params=None), state.ref_params, batch, packed_length)

    def _cache_size(self) -> int:
        return self.jitted._cache_size()


def jit_train_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation, options: StepOptions,
                   mesh: Mesh, state_sharding):
    """`train_step` over the mesh: state in `state_sharding` (in and out) and donated, batch rows split over
    the data axes, metrics replicated: `fn(state, batch, packed_length=0)`, the last static (`train_step`).

    `state_sharding`: `sharding.state_shardings(mesh, abstract_state)` or `sharding.tree_shardings(state)`.
    A reference in host memory (`train.offload_ref_params`) runs as a `RefApartStep`.
    """
    replicated, rows = sharding.replicated(mesh), sharding.row_sharded(mesh)
    ref_device = _on_device(state_sharding.ref_params)
    step = functools.partial(train_step, graphdef, optimizer, options, mesh=mesh, ref_device_sharding=ref_device)
    if ref_device is None:
        return jax.jit(step, in_shardings=(state_sharding, rows), out_shardings=(state_sharding, replicated),
                       donate_argnums=0, static_argnums=2)
    sync = options.ref_sync.sync_ref_model
    no_ref = state_sharding._replace(ref_params=None)

    def split_step(state, ref_params, batch, packed_length=0):
        new_state, metrics = step(state._replace(ref_params=ref_params), batch, packed_length)
        return new_state._replace(ref_params=new_state.ref_params if sync else None), metrics

    jitted = jax.jit(split_step, in_shardings=(no_ref, state_sharding.ref_params, rows),
                     out_shardings=(state_sharding if sync else no_ref, replicated), donate_argnums=0,
                     static_argnums=3)
    return RefApartStep(jitted, sync)


def jit_logps(graphdef: nnx.GraphDef, mesh: Mesh, *, temperature: float, chunk_size: int = 0,
              params_sharding=None, prompt_group_size: int = 1):
    """Per-token log-probs of completions under some params (old policy or reference), rows sharded:
    `fn(params, prompt_ids, prompt_mask, completion_ids, completion_mask, packed_length=0)`, the last static
    (`logprobs.completion_logps`; one compilation per length).

    `prompt_group_size` G > 1: rows come in groups of G sharing a prompt (`logprobs.completion_hidden`).
    `params_sharding`: the params' shardings (`sharding.param_shardings`); a reference in host memory is
    brought to the devices inside. None: the layout of the params passed in (one compilation per layout).
    """
    rows = sharding.row_sharded(mesh)
    on_device = None if params_sharding is None else _on_device(params_sharding)

    def logps(params, prompt_ids, prompt_mask, completion_ids, completion_mask, packed_length=0):
        if on_device is not None:
            params = jax.device_put(params, on_device)
        out, _ = completion_logps(graphdef, params, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                  temperature=temperature, chunk_size=chunk_size,
                                  prompt_group_size=prompt_group_size, packed_length=packed_length)
        return out

    return jax.jit(logps, in_shardings=(params_sharding, rows, rows, rows, rows), out_shardings=rows,
                   static_argnums=5)


def jit_advantages(mesh: Mesh, **options):
    """`rounds.round_advantages` with its static `options`: advantages placed row-split for the steps (they
    never come back to the host), r_N and std_N replicated for the round's reward metrics."""
    rows, replicated = sharding.row_sharded(mesh), sharding.replicated(mesh)

    def advantages(*args):
        # computed whole on every device, then split: group and batch statistics in one summation order, the
        # single-device one, whatever the mesh
        return jax.lax.with_sharding_constraint(rounds.round_advantages(*args, **options), replicated)

    return jax.jit(advantages, out_shardings=(rows, replicated, replicated))


def jit_take(mesh: Mesh):
    """`(batch, rows_B) -> batch[rows_B]` leaf by leaf, the result row-split: one step's rows of a round."""
    return jax.jit(lambda batch, rows_B: jax.tree.map(lambda x: x[rows_B], batch),
                   out_shardings=sharding.row_sharded(mesh))


def continuous_slots(max_batch_rows: int, rows: int, total_rows: int, row_shards: int) -> int:
    """Decode slots for ``rows`` of a sampling call over ``total_rows`` (a host-thread chunk takes its share of
    ``sampling.max_batch_rows``), a multiple of the mesh's ``row_shards``; ``rows`` (a static batch) when that is
    not fewer."""
    if not max_batch_rows:
        return rows
    share = -(-max_batch_rows * rows // total_rows)
    return min(rows, -(-share // row_shards) * row_shards)


def jit_generate(graphdef, mesh, *, config: SamplingConfig, eos_token_ids: tuple[int, ...], pad_token_id: int,
                 params_sharding=None, prompt_group_size: int = 1, cpu_speedups: bool = False):
    """`generate` jitted over `mesh`: `fn(params, prompt_ids, prompt_mask, key, greedy) -> SampleOutput`.

    Prompt rows and outputs split over (data, fsdp), key and step count replicated; `params_sharding`
    (`sharding.param_shardings`) None takes the params' own layout. `greedy` is static: greedy calls
    (evaluation) have one row per prompt, sampling calls `prompt_group_size` rows per prompt.
    LoRA adapters are merged into the kernels once per call (`lora.merged`), not run in every decode step.
    ``cpu_speedups`` (`cpu.enabled`) draws the same tokens with `cpu.token_chooser`, and on a one-device mesh
    ``config.host_threads`` may split a call into row chunks run concurrently (`cpu.ChunkedSampler`).
    ``config.max_batch_rows`` fewer than a call's rows decodes them continuously batched (`grpo_jax.continuous`).
    ``fn.stream(params, prompt_ids, prompt_mask, key)`` samples as a `stream.Stream`: groups reach the host as
    they finish.
    """
    rows, replicated = sharding.row_sharded(mesh), sharding.replicated(mesh)
    out_shardings = SampleOutput(rows, rows, rows, rows, num_decode_steps=replicated)
    row_shards = sharding.num_row_shards(mesh)

    def slots(num_rows: int, total_rows: int) -> int:
        return continuous_slots(config.max_batch_rows, num_rows, total_rows, row_shards)

    def merged(params):
        # LoRA adapters merged into the kernels once per call (`lora.merged`): decode steps run the base's products
        return lora.merged(graphdef, params) if lora.has_adapters(params) else (graphdef, params)

    def continuous_options(params, B, greedy, row_offset, total_rows):
        return dict(config=config, num_slots=slots(B, B if total_rows is None else total_rows),
                    eos_token_ids=eos_token_ids, pad_token_id=pad_token_id, greedy=greedy,
                    prompt_group_size=1 if greedy else prompt_group_size, row_offset=row_offset,
                    total_rows=total_rows, argmax=cpu.argmax_last_axis if cpu_speedups else None,
                    cache_sharding=sharding.cache_sharding(mesh, model_config(graphdef, params).num_key_value_heads))

    def sample(params, prompt_ids_BxP, prompt_mask_BxP, key, greedy, choose_tokens=None, row_offset=0,
               total_rows=None):
        options = continuous_options(params, prompt_ids_BxP.shape[0], greedy, row_offset, total_rows)
        model, params = merged(params)
        if options["num_slots"] < prompt_ids_BxP.shape[0]:
            return continuous.generate(model, params, prompt_ids_BxP, prompt_mask_BxP, key, **options)
        return generate(model, params, prompt_ids_BxP, prompt_mask_BxP, key, config=config,
                        eos_token_ids=eos_token_ids, pad_token_id=pad_token_id, greedy=greedy,
                        prompt_group_size=options["prompt_group_size"], cache_sharding=options["cache_sharding"],
                        choose_tokens=choose_tokens)

    # the continuously batched loop in segments (`grpo_jax.stream`): the decoding carried between them is donated
    def start(params, prompt_ids_BxP, prompt_mask_BxP, key, row_offset, total_rows):
        options = continuous_options(params, prompt_ids_BxP.shape[0], False, row_offset, total_rows)
        return continuous.start(*merged(params), prompt_ids_BxP, prompt_mask_BxP, key, **options)

    def advance(params, decoding, prompt_mask_BxP, key, row_offset, total_rows):
        options = continuous_options(params, prompt_mask_BxP.shape[0], False, row_offset, total_rows)
        decoding = continuous.advance(*merged(params), decoding, prompt_mask_BxP, key, **options)
        return decoding, continuous.output(decoding), decoding.state.ended_B

    jit_start = jax.jit(start, static_argnums=5, in_shardings=(params_sharding, rows, rows, replicated, replicated))
    jit_advance = jax.jit(advance, static_argnums=5, donate_argnums=1, out_shardings=(None, out_shardings, rows),
                          in_shardings=(params_sharding, None, rows, replicated, replicated))
    if not cpu_speedups:
        return stream.Sampler(jax.jit(sample, static_argnums=4, in_shardings=(params_sharding, rows, rows, replicated),
                                      out_shardings=out_shardings), jit_start, jit_advance, slots, prompt_group_size)
    if config.host_threads > 1 and mesh.devices.size > 1:
        raise ValueError(f"sampling.host_threads={config.host_threads} splits one device's rows over host "
                         f"threads, but the mesh has {mesh.devices.size} devices (which already sample in "
                         "parallel): set it to 0 or 1")

    def sample_rows(params, prompt_ids_BxP, prompt_mask_BxP, key, row_offset, greedy, total_rows):
        return sample(params, prompt_ids_BxP, prompt_mask_BxP, key, greedy,
                      cpu.token_chooser(row_offset, total_rows), row_offset, total_rows)

    jitted = jax.jit(sample_rows, static_argnums=(5, 6),
                     in_shardings=(params_sharding, rows, rows, replicated, replicated), out_shardings=out_shardings)
    split = jax.jit(lambda ids, mask, k: list(zip(jnp.split(ids, k), jnp.split(mask, k))), static_argnums=2)
    concat = jax.jit(lambda outs: SampleOutput(
        *(jnp.concatenate(parts) for parts in zip(*(o[:4] for o in outs))),
        num_decode_steps=jnp.max(jnp.stack([o.num_decode_steps for o in outs]))))
    return cpu.ChunkedSampler(jitted, split, concat, host_threads=config.host_threads, mesh=mesh,
                              prompt_group_size=prompt_group_size, offset_sharding=replicated,
                              segments=(jit_start, jit_advance, slots))


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
    (the model's params' shardings): one jitted init whose base weights XLA never computes."""
    def init():
        return nnx.filter_state(init_model(model_config, seed)[1], nnx.LoRAParam)

    return jax.jit(init, out_shardings=nnx.filter_state(shardings, nnx.LoRAParam))()


def jit_reward_scores(graphdef: nnx.GraphDef):
    """A sequence classifier's first logit at each row's last non-pad token (transformers' pooling), for
    `grpo_jax.reward_model`: (params, score_weight [labels, D], ids [B, T], mask [B, T], pad_id) -> [B]."""
    from grpo_jax.models import forward

    def scores(params, score_weight, ids_BxT, mask_BxT, pad_id):
        positions_BxT = jnp.broadcast_to(jnp.arange(ids_BxT.shape[1]), ids_BxT.shape)  # right-padded rows
        hidden_BxTxD, _ = forward(graphdef, params, ids_BxT, positions_BxT, mask_BxT)
        logits_BxT = jnp.einsum("btd,d->bt", hidden_BxTxD.astype(jnp.float32), score_weight[0])
        last_B = jnp.argmax(jnp.arange(ids_BxT.shape[1]) * (ids_BxT != pad_id), axis=-1)
        return jnp.take_along_axis(logits_BxT, last_B[:, None], axis=1)[:, 0]

    return jax.jit(scores)


def _sample_key(key, step, draw_index: int):
    key = jax.random.fold_in(key, step)
    return jax.random.fold_in(key, draw_index) if draw_index else key  # dynamic sampling's extra passes


def build(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation, options: StepOptions, mesh: Mesh,
          state_sharding, *, sample: Callable, round_prompt_group_size: int, advantage_options: dict,
          eval_sample: Callable | None = None) -> Programs:
    """The run's programs over `mesh` for a state laid out as `state_sharding`; `sample` and `eval_sample` are
    jitted samplers (`jit_generate`), `round_prompt_group_size` the G of the round's log-prob passes."""
    logps = functools.partial(jit_logps, mesh=mesh, temperature=options.temperature,
                              chunk_size=options.logps_chunk_size, prompt_group_size=round_prompt_group_size)
    ref_logps = None
    if state_sharding.ref_params is not None:
        ref_logps = logps(graphdef, params_sharding=state_sharding.ref_params)
    elif options.loss.beta != 0.0 and lora.has_adapters(state_sharding.params):  # the base is the reference
        ref_logps = logps(lora.adapters_off(graphdef, state_sharding.params), params_sharding=state_sharding.params)
    return Programs(
        sample=sample,
        # one dispatch, not fold_in's primitives one by one
        sample_key=jax.jit(_sample_key, static_argnums=2),
        logps=logps(graphdef, params_sharding=state_sharding.params),
        ref_logps=ref_logps,
        advantages=jit_advantages(mesh, **advantage_options),
        take=jit_take(mesh),
        step=jit_train_step(graphdef, optimizer, options, mesh, state_sharding),
        eval_sample=eval_sample,
    )
