"""Shared tiny fixtures; the env vars must be set before anything imports jax."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

from grpo_jax.models import ModelConfig, init_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_config() -> ModelConfig:
    """A 2-layer GQA model small enough for every test to run in seconds on CPU."""
    # a wider init than HF's 0.02 keeps logits peaked, so arg-max comparisons have no near-ties
    return ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_config):
    """(config, graphdef, params) of the tiny model, seed 0."""
    graphdef, params = init_model(tiny_model_config, seed=0)
    return tiny_model_config, graphdef, params
