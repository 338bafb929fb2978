"""Tool calls in multi-turn rollouts: parsing a turn and rendering results (`calls`, `tool_parsers`), the
thread pool that runs them (`toolbox`), the training chat template of Qwen3, whose own is not
prefix-preserving (`templates`), sandboxed built-in tools (`sandbox`), the embedded tool task (`tool_task`)
and the journal that keeps side effects to one run (`journal`). May import `config`, `data` and `rewards`.
"""
