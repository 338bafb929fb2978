"""grpo_jax: Group Relative Policy Optimization (DeepSeekMath) as pure JAX functions.

The Python API: `train(config, train_dataset=..., reward_funcs=...)` with a `Config` from `make_config(...)` or
`load_config(...)`, or TRL's `GRPOTrainer(model, reward_funcs, args=GRPOConfig(...), ...).train()`. The names are
imported when first used: `import grpo_jax` imports no jax.
"""

import importlib

__version__ = "0.1.0"

# public name -> the module that defines it
_LAZY = {"train": "grpo_jax.api.trainer", "Config": "grpo_jax.config", "load_config": "grpo_jax.config",
         "make_config": "grpo_jax.config", "GRPOConfig": "grpo_jax.api.trl_api", "GRPOTrainer": "grpo_jax.api.trl_api"}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'grpo_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # looked up once
    return value


def __dir__():
    return sorted([*globals(), *_LAZY])
