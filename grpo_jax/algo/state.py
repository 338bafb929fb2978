"""The train state pytree and the optimizer that updates it."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from grpo_jax.algo import reference
from grpo_jax.config import TrainConfig
from grpo_jax.config.model import ModelConfig
from grpo_jax.models import lora
from grpo_jax.models.transformer import Transformer, init_model


class TrainState(NamedTuple):
    """Everything a GRPO run carries from step to step, as one pytree.

    `ref_params` is None when beta == 0 (no reference model is kept or run) and when `params` hold LoRA
    adapters (the reference is their base, `lora.base_params`: no copy); `grpo_jax.algo.reference` updates it
    (TR-DPO mixing, iterative-GRPO resets) inside the train step. `key` is the run's root PRNG key;
    each use derives its own with `fold_in(key, step)` so the state never needs a split to stay reproducible.
    """

    params: Any
    opt_state: Any
    ref_params: Any
    step: jax.Array  # int32 scalar: optimizer steps taken (skipped non-finite steps included)
    key: jax.Array
    # [2] float32 with loss.use_adaptive_entropy (`entropy_control`): the bonus's coefficient, the last step's entropy
    entropy_control: jax.Array | None = None

    @property
    def reference_params(self) -> Any:
        """What the reference log-probs run on: `ref_params`, or with LoRA adapters the policy's params, whose
        base the reference program reads with the adapters off (`programs.build`)."""
        return self.params if self.ref_params is None and lora.has_adapters(self.params) else self.ref_params


def entropy_control(loss) -> jax.Array | None:
    """The adaptive entropy bonus's state at step 0 (`loss.use_adaptive_entropy`, TRL's): [coefficient, last step's
    entropy] = [loss.entropy_coef, inf] (no bonus before a step's entropy is known); None without it."""
    return jnp.asarray([loss.entropy_coef, jnp.inf], jnp.float32) if loss.use_adaptive_entropy else None


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
    """AdamW (TRL's default optimizer) behind global-norm gradient clipping.

    `programs.init_state` / `train_step` feed it float32 copies of params and gradients, so its moments are float32
    even when `model.param_dtype` is bfloat16.
    """
    adamw = optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    if max_grad_norm > 0:
        return optax.chain(optax.clip_by_global_norm(max_grad_norm), adamw)
    return adamw


def optimizer_from_config(train_config: TrainConfig, max_steps: int,
                          ) -> tuple[optax.Schedule, optax.GradientTransformation]:
    """(learning-rate schedule, optimizer) of a run: `learning_rate_schedule` and `make_optimizer` from `train.*`."""
    tc = train_config
    schedule = learning_rate_schedule(learning_rate=tc.learning_rate, scheduler=tc.lr_scheduler_type,
                                      warmup_steps=tc.warmup_steps, max_steps=max_steps)
    optimizer = make_optimizer(schedule, weight_decay=tc.weight_decay, b1=tc.adam_beta1, b2=tc.adam_beta2,
                               eps=tc.adam_epsilon, max_grad_norm=tc.max_grad_norm)
    return schedule, optimizer


def as_float32(tree: Any) -> Any:
    """Floating leaves cast to float32 (the optimizer's working precision); others unchanged."""
    return jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def cast_floating(tree: Any, dtype: str | None) -> Any:
    """Floating leaves cast to `dtype` ("float32" | "bfloat16"); None keeps them."""
    if dtype is None:
        return tree
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def model_graphdef(model_config: ModelConfig) -> nnx.GraphDef:
    """The model's static structure, without allocating its parameters."""
    abstract_model = nnx.eval_shape(lambda: Transformer(model_config, rngs=nnx.Rngs(0)))
    graphdef, _ = nnx.split(abstract_model)
    return graphdef


def new_state(params: Any, optimizer: optax.GradientTransformation, *, seed: int, with_reference: bool,
              ref_param_dtype: str | None) -> TrainState:
    """The state at step 0 around `params`: fresh optimizer moments (float32) for the trainable params (LoRA: the
    adapters, `lora.split_trainable`), the reference a copy of `params` (LoRA: none, the base is the reference)."""
    trainable, frozen = lora.split_trainable(params)
    copy = with_reference and frozen is None
    ref_params = cast_floating(reference.init(params), ref_param_dtype) if copy else None
    return TrainState(params=params, opt_state=optimizer.init(as_float32(trainable)), ref_params=ref_params,
                      step=jnp.zeros((), jnp.int32), key=jax.random.PRNGKey(seed))


def abstract_state(model_config: ModelConfig, optimizer: optax.GradientTransformation, *, with_reference: bool,
                   ref_param_dtype: str | None = None) -> TrainState:
    """The shapes and dtypes of `programs.init_state`'s state (ShapeDtypeStructs, no sharding): nothing is allocated.

    The tree a checkpoint of such a run holds (with `ref_params` None when it was saved without them).
    """
    return jax.eval_shape(lambda: new_state(init_model(model_config, 0)[1], optimizer, seed=0,
                                            with_reference=with_reference, ref_param_dtype=ref_param_dtype))
