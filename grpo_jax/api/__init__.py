"""The user-facing entry points: the `grpo-jax` command (`cli`), `train(config)` and its loop (`trainer`), TRL's
`GRPOConfig`/`GRPOTrainer` (`trl_api`, `arguments`), the builder that resolves a config into a run (`run`) and
`grpo-jax plan` (`plan`). The top floor: it may import every other subpackage; nothing imports it.
"""
