"""One GRPO optimizer step as a pure function of (state, batch), with gradient accumulation inside.

The batch is the step's rows as a `trajectory.Trajectory`: attention sees every completion token
(``completion_mask``), the loss trains ``loss_mask`` (it is the ``completion_mask`` argument of the loss).

B rows per step split into M = `gradient_accumulation_steps` micro-batches; each micro-batch loss is
normalised by the whole step's row and token counts (`num_sequences`, `num_items_in_batch`), so the sum over
micro-batches, and its gradient, equal the full-batch values for every loss_type. Two options are computed
per micro-batch, as TRL does (see `grpo_jax.losses`): the top-entropy threshold (`top_entropy_quantile` < 1)
and the entropy bonus's mean then; with them, micro-batching changes the numbers.

After the update the reference is advanced by `grpo_jax.algo.reference.update` (TR-DPO mixing / iterative-GRPO
resets), so the whole step, reference included, is one pure function of (state, batch).

Custom losses: `StepOptions.loss_fn` replaces `compute_loss` with any function of the same signature,
`loss_fn(per_token_logps, old_per_token_logps, ref_per_token_logps, advantages, completion_mask, *, config,
num_items_in_batch, num_sequences, entropies, sampler_per_token_logps) -> (scalar, aux)`, where aux is a
NamedTuple or dict of scalars that are means over this micro-batch's active tokens (they are logged as step
means). It must be pure and jittable; `compute_loss`'s pieces in `grpo_jax.losses` are the building blocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpo_jax.algo import reference
from grpo_jax.algo.logprobs import completion_logps
from grpo_jax.algo.state import TrainState, as_float32
from grpo_jax.algo.trajectory import Trajectory
from grpo_jax.device import sharding
from grpo_jax.losses import CLIPPED_LOSS_TYPES, LossConfig, compute_loss, contracts
from grpo_jax.models import families, lora


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """Static (hashable) options of the train step."""

    loss: LossConfig
    temperature: float
    gradient_accumulation_steps: int = 1
    logps_chunk_size: int = 0
    prompt_group_size: int = 1  # G > 1: each micro-batch's rows are whole groups in order (shared prompt forward)
    ref_sync: reference.RefSyncConfig = reference.RefSyncConfig()
    loss_fn: Callable | None = None  # None: grpo_jax.losses.compute_loss (see the module docstring)
    use_sampler_logps: bool = False  # hand the rows' sampler log-probs to the loss (TRL's vLLM log-probs role)
    router_aux_loss_coef: float = 0.0  # mixture of experts: loss += coef * load-balancing loss / micro-batches


# folded into the state's key for LoRA dropout's keys (then the step, then the micro-batch): no other use draws it
LORA_DROPOUT_STREAM = 0x6C6F7261


# TRL's policy_loss metric is the mean over micro-batches of each one's policy loss: for these loss types that is
# its share of the step's loss (the step's / M), for the others its own mean (the step's, summed over micro-batches)
POLICY_LOSS_SHARES = ("cispo", "dapo", "vespo")


# LossAux field -> metric name as TRL logs it (docs/algorithms.md §9); other fields keep their own name
AUX_METRIC_NAMES = {"kl": "kl", "clip_ratio_low": "clip_ratio/low_mean", "clip_ratio_high": "clip_ratio/high_mean",
                    "clip_ratio_region": "clip_ratio/region_mean", "clip_ratio_low_min": "clip_ratio/low_min",
                    "clip_ratio_high_max": "clip_ratio/high_max"}
# batch extremes, not token means: the step logs their mean over micro-batches (TRL's mean of per-micro-batch values)
MICRO_BATCH_MEANS = ("clip_ratio/low_min", "clip_ratio/high_max")
CLIP_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", *MICRO_BATCH_MEANS)


def _aux_dict(aux) -> dict:
    """A loss's aux (NamedTuple, dict or None) as {metric name: scalar}."""
    if aux is None:
        return {}
    items = aux._asdict().items() if hasattr(aux, "_asdict") else dict(aux).items()
    return {AUX_METRIC_NAMES.get(k, k): v for k, v in items}


def _micro_batches(batch: Trajectory, num_micro: int, mesh: Mesh | None) -> Trajectory:
    """[B, ...] -> [M, B/M, ...], micro-batch m taking rows m, m+M, ... so each stays spread over the devices."""

    def split(x):
        x = x.reshape(x.shape[0] // num_micro, num_micro, *x.shape[1:]).swapaxes(0, 1)
        if mesh is not None:
            x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(None, sharding.ROWS)))
        return x

    return jax.tree.map(split, batch)


def train_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation, options: StepOptions,
               state: TrainState, batch: Trajectory, packed_length: int = 0, packed_buffers: int = 0,
               mesh: Mesh | None = None,
               ref_device_sharding=None) -> tuple[TrainState, dict]:
    """Accumulates the GRPO loss gradient over micro-batches and applies one optimizer update.

    A non-finite loss or gradient norm, or an update that would make any parameter non-finite, leaves params and
    optimizer state untouched (`skipped` = 1). The
    optimizer sees float32 gradients and params (float32 moments whatever `model.param_dtype`); the update is
    cast back to the params' dtype. With LoRA adapters only they are differentiated and updated
    (`lora.split_trainable`): the base gets no gradient, no optimizer state and no update.
    `packed_length` > 0 runs each micro-batch's groups (rows one by one when `prompt_group_size` is 1) packed into
    `packed_buffers` buffers of that many tokens (0: one a group; `logprobs.completion_logps`;
    `trajectory.choose_packing` picks both).
    `ref_device_sharding`: device-memory shardings of a reference kept in host memory, used to bring it over
    when TR-DPO mixing needs it.
    Mixture-of-experts models: rows carrying ``routed_experts`` (routing replay) run with the sampler's experts;
    ``router_aux_loss_coef`` adds coef * each micro-batch's load-balancing loss / M, as TRL does, logged as
    ``router_aux_loss`` (its mean over the micro-batches).
    """
    contracts.trajectory(batch)
    num_sequences = batch.loss_mask.shape[0]
    num_items = jnp.sum(batch.loss_mask).astype(jnp.float32)
    loss_fn_ = compute_loss if options.loss_fn is None else options.loss_fn
    trainable, frozen = lora.split_trainable(state.params)

    router_aux = options.router_aux_loss_coef != 0.0
    M = options.gradient_accumulation_steps
    # rows split over >1 shard stay on their shards through the unembedding (else XLA held every row on every chip)
    split = sharding.row_sharded(mesh) if mesh is not None and sharding.num_row_shards(mesh) > 1 else None
    # LoRA dropout (TRL's loss forward runs in train mode): a key per micro-batch from the state, so resume replays it
    dropout_keys = (jax.random.split(jax.random.fold_in(jax.random.fold_in(state.key, LORA_DROPOUT_STREAM),
                                                        state.step), M)
                    if lora.has_dropout(graphdef, state.params) else None)

    lc = options.loss
    bonus = lc.entropy_coef != 0.0 or lc.use_adaptive_entropy
    coef = {}  # Skywork-OR1's adaptive coefficient (TRL's): the one set after the last step, while its entropy was low
    if lc.use_adaptive_entropy:
        coefficient, last_entropy = state.entropy_control[0], state.entropy_control[1]
        coef = {"entropy_coef": jnp.where(last_entropy <= lc.entropy_target, coefficient, 0.0)}

    def loss_fn(trainable, micro: Trajectory, dropout_key=None):
        params = lora.join(trainable, frozen)
        model = (graphdef, params) if dropout_key is None else lora.with_dropout(graphdef, params, dropout_key)
        logps_BxT, entropy_BxT, *router = completion_logps(
            *model, micro.prompt_ids, micro.prompt_mask, micro.completion_ids, micro.completion_mask,
            temperature=options.temperature, with_entropy=True, chunk_size=options.logps_chunk_size,
            prompt_group_size=options.prompt_group_size, packed_length=packed_length,
            packed_buffers=packed_buffers, routing=micro.routed_experts, router_aux=router_aux, row_sharding=split)
        # the entropy carries gradient only for the entropy bonus (compute_loss differentiates through what it gets)
        entropies_BxT = entropy_BxT if bonus else jax.lax.stop_gradient(entropy_BxT)
        sampler = micro.sampler_per_token_logps if options.use_sampler_logps else None
        # the loss trains the loss mask; attention (the forward above) saw every completion token
        loss, aux = loss_fn_(logps_BxT, micro.old_per_token_logps, micro.ref_per_token_logps,
                             micro.advantages, micro.loss_mask, config=options.loss,
                             num_items_in_batch=num_items, num_sequences=num_sequences,
                             entropies=entropies_BxT, sampler_per_token_logps=sampler, **coef)
        # aux holds masked means over this micro-batch: weight by its tokens for exact step-level means
        tokens = jnp.sum(micro.loss_mask).astype(jnp.float32)
        aux = _aux_dict(aux)
        policy = aux.pop("policy_loss", None)
        extremes = {name: aux.pop(name) for name in MICRO_BATCH_MEANS if name in aux}
        aux = jax.tree.map(lambda x: jax.lax.stop_gradient(x) * tokens, aux)
        for name, value in extremes.items():  # scaled back by the token weighting below; a batch of no rows: 0
            aux[name] = jnp.nan_to_num(jax.lax.stop_gradient(value)) / M * num_items
        if policy is not None:  # a share of the step's loss, summed (scaled back by the token weighting below)
            share = 1.0 / M if options.loss.loss_type in POLICY_LOSS_SHARES else 1.0
            aux["policy_loss"] = jax.lax.stop_gradient(policy) * share * num_items
        if router_aux:  # a mean over micro-batches, not tokens: scaled back by the token weighting below
            loss = loss + options.router_aux_loss_coef * router[0] / M
            aux["router_aux_loss"] = jax.lax.stop_gradient(router[0]) / M * num_items
        entropy_sum = jnp.sum(jax.lax.stop_gradient(entropy_BxT) * micro.loss_mask)
        return loss, (aux, entropy_sum)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    micro_batches = _micro_batches(batch, options.gradient_accumulation_steps, mesh)

    def accumulate(carry, xs):
        grads, loss, aux_sum, entropy_sum = carry
        micro, dropout_key = xs
        (micro_loss, (aux, micro_entropy)), micro_grads = grad_fn(trainable, micro, dropout_key)
        return (jax.tree.map(jnp.add, grads, micro_grads), loss + micro_loss,
                jax.tree.map(jnp.add, aux_sum, aux), entropy_sum + micro_entropy), None

    zeros = jax.tree.map(jnp.zeros_like, trainable)
    aux_shape = jax.eval_shape(lambda: loss_fn(trainable, jax.tree.map(lambda x: x[0], micro_batches),
                                               None if dropout_keys is None else dropout_keys[0])[1][0])
    aux_zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), aux_shape)
    init = (zeros, jnp.zeros((), jnp.float32), aux_zeros, jnp.zeros((), jnp.float32))
    (grads, loss, aux_sum, entropy_sum), _ = jax.lax.scan(accumulate, init, (micro_batches, dropout_keys))

    grads = as_float32(grads)
    grad_norm = optax.tree_utils.tree_norm(grads)
    updates, new_opt_state = optimizer.update(grads, state.opt_state, as_float32(trainable))
    updates = families.without_buffers(updates)  # no gradient moves them, nor may weight decay
    new_trainable = optax.apply_updates(trainable, updates)  # in each param's own dtype
    # an update that overflows a parameter (a finite gradient times a huge step) is skipped like a NaN gradient
    params_finite = jax.tree.reduce(jnp.logical_and, jax.tree.map(lambda p: jnp.isfinite(p).all(), new_trainable))
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & params_finite
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
    params = lora.join(keep(new_trainable, trainable), frozen)
    step = state.step + 1
    ref_params = state.ref_params
    if ref_params is not None and options.ref_sync.sync_ref_model:
        if ref_device_sharding is not None:  # offloaded to host: mix on the device
            ref_params = jax.device_put(ref_params, ref_device_sharding)
        policy = jax.tree.map(lambda p, r: p.astype(r.dtype), params, ref_params)  # the reference's dtype
        ref_params = reference.update(ref_params, policy, step, options.ref_sync)
    new_state = state._replace(params=params, opt_state=keep(new_opt_state, state.opt_state), step=step,
                               ref_params=ref_params)
    entropy = entropy_sum / jnp.maximum(num_items, 1.0)  # the step's token-weighted entropy, all micro-batches
    if lc.use_adaptive_entropy:  # + delta at or below the target, - delta above, within [min, max]
        coefficient = jnp.where(entropy <= lc.entropy_target,
                                jnp.minimum(coefficient + lc.entropy_coef_delta, lc.entropy_coef_max),
                                jnp.maximum(coefficient - lc.entropy_coef_delta, lc.entropy_coef_min))
        new_state = new_state._replace(entropy_control=jnp.stack([coefficient, entropy]).astype(jnp.float32))

    aux_mean = jax.tree.map(lambda x: x / jnp.maximum(num_items, 1.0), aux_sum)
    if options.loss.resolved_beta == 0.0:
        aux_mean.pop("kl", None)  # no reference, no kl metric
    if options.loss_fn is None:  # log only the ratios this loss_type has, as TRL does
        if options.loss.loss_type not in CLIPPED_LOSS_TYPES:
            for name in CLIP_METRICS:
                aux_mean.pop(name, None)
        if options.loss.loss_type != "cispo":
            aux_mean.pop("cispo_clip_ratio", None)
        if not bonus:  # TRL logs these with its entropy bonus only
            aux_mean.pop("policy_loss", None)
        else:  # adaptive: the coefficient after this step's update, as TRL logs it
            aux_mean["entropy_coef"] = (new_state.entropy_control[0] if lc.use_adaptive_entropy
                                        else jnp.asarray(lc.entropy_coef, jnp.float32))
    metrics = {"loss": loss, "grad_norm": grad_norm, "skipped": (~finite).astype(jnp.int32), **aux_mean,
               "entropy": entropy}
    return new_state, metrics
