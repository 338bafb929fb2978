"""The train state pytree and the optimizer that updates it."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from grpo_jax import reference, sharding
from grpo_jax.models import ModelConfig, Transformer, init_model


class TrainState(NamedTuple):
    """Everything a GRPO run carries from step to step, as one pytree.

    `ref_params` is None when beta == 0 (no reference model is kept or run); `grpo_jax.reference` updates it
    (TR-DPO mixing, iterative-GRPO resets) inside the train step. `key` is the run's root PRNG key;
    each use derives its own with `fold_in(key, step)` so the state never needs a split to stay reproducible.
    """

    params: Any
    opt_state: Any
    ref_params: Any
    step: jax.Array  # int32 scalar: optimizer steps taken (skipped non-finite steps included)
    key: jax.Array


def learning_rate_schedule(*, learning_rate: float, scheduler: str, warmup_steps: int,
                           max_steps: int) -> optax.Schedule:
    """Linear warm-up to `learning_rate`, then constant, linear or cosine decay to 0 at `max_steps`."""
    decay_steps = max(max_steps - warmup_steps, 1)
    if scheduler == "constant":
        decay = optax.constant_schedule(learning_rate)
    elif scheduler == "linear":
        decay = optax.linear_schedule(learning_rate, 0.0, decay_steps)
    elif scheduler == "cosine":
        decay = optax.cosine_decay_schedule(learning_rate, decay_steps)
    else:
        raise ValueError(f"train.lr_scheduler_type={scheduler!r}: use constant, linear or cosine")
    if warmup_steps == 0:
        return decay
    warmup = optax.linear_schedule(0.0, learning_rate, warmup_steps)
    return optax.join_schedules([warmup, decay], [warmup_steps])


def make_optimizer(schedule: optax.Schedule, *, weight_decay: float, b1: float, b2: float, eps: float,
                   max_grad_norm: float) -> optax.GradientTransformation:
    """AdamW (TRL's default optimizer) behind global-norm gradient clipping."""
    adamw = optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    if max_grad_norm > 0:
        return optax.chain(optax.clip_by_global_norm(max_grad_norm), adamw)
    return adamw


def model_graphdef(model_config: ModelConfig) -> nnx.GraphDef:
    """The model's static structure, without allocating its parameters."""
    abstract_model = nnx.eval_shape(lambda: Transformer(model_config, rngs=nnx.Rngs(0)))
    graphdef, _ = nnx.split(abstract_model)
    return graphdef


def init_state(model_config: ModelConfig, optimizer: optax.GradientTransformation, *, seed: int,
               with_reference: bool, mesh: Mesh) -> tuple[nnx.GraphDef, TrainState]:
    """Initialises the model, optimizer and reference straight into their (replicated) device layout."""

    def init():
        _, params = init_model(model_config, seed)
        ref_params = reference.init(params) if with_reference else None
        return TrainState(params=params, opt_state=optimizer.init(params), ref_params=ref_params,
                          step=jnp.zeros((), jnp.int32), key=jax.random.PRNGKey(seed))

    state = jax.jit(init, out_shardings=sharding.replicated(mesh))()
    return model_graphdef(model_config), state
