"""Models: the decoder (`transformer`, over the shared `layers` and one module per family: `llama`, `gemma`,
behind `families`) used as pure functions over a params pytree, and Hugging Face checkpoints in and out
(`pretrained`, `hf_config`, `safetensors_io`)."""

from grpo_jax.config.model import ModelConfig
from grpo_jax.models.pretrained import (  # noqa: E402
    Model,
    abstract_model,
    eos_token_ids,
    from_pretrained,
    save_pretrained,
)
from grpo_jax.models.registry import resolve_config  # noqa: E402
from grpo_jax.models.transformer import (
    KVCache,
    Transformer,
    compute_dtype_params,
    forward,
    init_cache,
    init_model,
    layer_params,
    model_config,
    positions_from_mask,
    rotary_tables,
    unembed,
)

__all__ = ["KVCache", "ModelConfig", "Transformer", "compute_dtype_params", "forward", "init_cache", "init_model",
           "layer_params", "model_config", "positions_from_mask", "rotary_tables", "unembed", "Model", "abstract_model",
           "eos_token_ids", "from_pretrained", "resolve_config", "save_pretrained"]
