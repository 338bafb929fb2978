"""Tool calls in multi-turn rollouts: parsing a turn and rendering results (`calls`, `tool_parsers`), the
thread pool that runs them (`toolbox`), the training chat template of Qwen3, whose own is not
prefix-preserving (`templates`), sandboxed built-in tools (`sandbox`), the embedded tool task (`tool_task`)
and the journal that keeps side effects to one run (`journal`). May import `config`, `data` and `rewards`.
"""

from grpo_jax.config.moved import forward

# the flat layout's grpo_jax.tools module is tools.calls now: its names still read from here
__getattr__ = forward(__name__, "grpo_jax.tools.calls")
