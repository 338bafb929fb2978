"""Prompts: reading rows from files or datasets (`sources`), tokenizing them and drawing seeded batches
(`prompts`), and the embedded digit-puzzle task (`task`). Imports no other subpackage but `config`.
"""

from grpo_jax.config.moved import forward

# the flat layout's grpo_jax.data module is data.prompts now: its names still read from here
__getattr__ = forward(__name__, "grpo_jax.data.prompts")
