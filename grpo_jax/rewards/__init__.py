"""What scores a completion on the host: built-in reward functions (`functions`, `math`), the resolution of
`reward.functions` names into callables (`reward_specs`), reward models scored in JAX (`reward_model`), and the
fingerprints of the host code a run calls (`code_fingerprints`). May import `config`, `data`, `device`, `models` and
`algo` (a reward model's jitted pass); never `rollout`, `tools` or `api`.
"""
