"""Models: the decoder architecture (`transformer`) used as pure functions over a params pytree."""

from grpo_jax.models.transformer import (
    KVCache,
    ModelConfig,
    Transformer,
    forward,
    init_cache,
    init_model,
    model_config,
    positions_from_mask,
    unembed,
)

__all__ = ["KVCache", "ModelConfig", "Transformer", "forward", "init_cache", "init_model", "model_config",
           "positions_from_mask", "unembed"]
