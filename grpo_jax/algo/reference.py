"""The reference policy over a run: frozen, TR-DPO mixing, or iterative-GRPO resets (docs/algorithms.md §8).

An optax-style `init`/`update` pair on `TrainState.ref_params`: `init(params)` copies the initial policy,
`update(ref_params, params, step, config)` returns the next reference after optimizer step `step` (counted
from 1). Both are pure and jittable; `train_step` applies `update` after every optimizer update, so the
reference lives in the train state and never leaves the device.

- `sync_ref_model: false`: ref stays the initial policy (DeepSeekMath's default).
- `sync_ref_model: true` (TR-DPO, TRL's `SyncRefModelCallback`): after every `ref_model_sync_steps`-th
  step, ref ← α·policy + (1−α)·ref with α = `ref_model_mixup_alpha`.
- α = 1 is iterative GRPO (DeepSeekMath Alg. 1): the reference is reset to the current policy at the start
  of each iteration of `ref_model_sync_steps` steps, exactly (a copy, no mixing arithmetic).

The mix is `optax.incremental_update` and the α = 1 reset `optax.periodic_update`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from grpo_jax.config.sections import RefSyncConfig


def init(params: Any) -> Any:
    """A copy of the policy params: the reference at step 0, and the iterative-GRPO reset."""
    return jax.tree.map(jnp.copy, params)


def mix(ref_params: Any, params: Any, alpha: float) -> Any:
    """TR-DPO soft update, leaf by leaf: α·policy + (1−α)·ref in float32, stored in the reference's dtype."""
    as_f32 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)  # noqa: E731
    mixed = optax.incremental_update(as_f32(params), as_f32(ref_params), alpha)
    return jax.tree.map(lambda m, r: m.astype(r.dtype), mixed, ref_params)


def update(ref_params: Any, params: Any, step: jax.Array, config: RefSyncConfig) -> Any:
    """The reference after optimizer step `step` (from 1): mixed/reset on multiples of the sync period.

    A no-op (the same pytree) when `sync_ref_model` is off or there is no reference (beta == 0).
    """
    if ref_params is None or not config.sync_ref_model:
        return ref_params
    alpha, period = config.ref_model_mixup_alpha, config.ref_model_sync_steps
    if alpha == 1.0:  # iterative GRPO: exactly the policy, no arithmetic
        return optax.periodic_update(params, ref_params, step, period)
    # lax.cond, not optax.periodic_update: that takes the new value already computed, and XLA would then mix
    # every parameter at every step instead of only on the sync steps
    return jax.lax.cond(step % period == 0, lambda _: mix(ref_params, params, alpha), lambda _: ref_params, None)
