"""`python -m grpo_jax` is the `grpo-jax` command."""

from grpo_jax.api.cli import main

raise SystemExit(main())
