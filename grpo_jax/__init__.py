"""grpo_jax: Group Relative Policy Optimization (DeepSeekMath) as pure JAX functions."""

__version__ = "0.1.0"
