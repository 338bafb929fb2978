"""The reference policy over a run: frozen, TR-DPO mixing, or iterative-GRPO resets (ALGORITHMS.md §8).

An optax-style `init`/`update` pair on `TrainState.ref_params`: `init(params)` copies the initial policy,
`update(ref_params, params, step, config)` returns the next reference after optimizer step `step` (counted
from 1). Both are pure and jittable; `train_step` applies `update` after every optimizer update, so the
reference lives in the train state and never leaves the device.

- `sync_ref_model: false`: ref stays the initial policy (DeepSeekMath's default).
- `sync_ref_model: true` (TR-DPO, TRL's `SyncRefModelCallback`): after every `ref_model_sync_steps`-th
  step, ref ← α·policy + (1−α)·ref with α = `ref_model_mixup_alpha`.
- α = 1 is iterative GRPO (DeepSeekMath Alg. 1): the reference is reset to the current policy at the start
  of each iteration of `ref_model_sync_steps` steps; `reset` copies exactly rather than mixing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class RefSyncConfig:
    """Static options of the reference update (TRL's GRPOConfig names)."""

    sync_ref_model: bool = False
    ref_model_mixup_alpha: float = 0.6
    ref_model_sync_steps: int = 512


def init(params: Any) -> Any:
    """The reference at step 0: a copy of the initial policy params."""
    return jax.tree.map(jnp.copy, params)


def mix(ref_params: Any, params: Any, alpha: float) -> Any:
    """TR-DPO soft update, leaf by leaf: α·policy + (1−α)·ref, in the reference's dtype."""
    return jax.tree.map(lambda r, p: (alpha * p.astype(jnp.float32) + (1.0 - alpha) * r.astype(jnp.float32))
                        .astype(r.dtype), ref_params, params)


def reset(params: Any) -> Any:
    """Iterative GRPO hard update: the reference becomes the current policy."""
    return jax.tree.map(jnp.copy, params)


def update(ref_params: Any, params: Any, step: jax.Array, config: RefSyncConfig) -> Any:
    """The reference after optimizer step `step` (from 1): mixed/reset on multiples of the sync period.

    A no-op (the same pytree) when `sync_ref_model` is off or there is no reference (beta == 0).
    """
    if ref_params is None or not config.sync_ref_model:
        return ref_params
    alpha = config.ref_model_mixup_alpha

    def synced(_):
        return reset(params) if alpha == 1.0 else mix(ref_params, params, alpha)

    return jax.lax.cond(step % config.ref_model_sync_steps == 0, synced, lambda _: ref_params, None)
