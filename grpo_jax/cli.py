"""The `grpo-jax` script of installs made before the subpackage split: it imports `grpo_jax.cli:main`, which is
`grpo_jax.api.cli.main` (a new `pip install` writes that path). The one module left at a flat path."""

from grpo_jax.api.cli import main  # noqa: F401
