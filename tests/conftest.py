"""Shared tiny fixtures; the env vars must be set before anything imports jax."""
import os
import shutil
import sys
import tempfile

# 8 fake CPU devices for the sharding tests. Compiling dominates the suite, so it compiles cheaply: LLVM at -O0 (2-core
# EPYC: 193 s -> 92 s of CPU for test_micro_batched_step_equals_full_batch) and XLA:CPU's older loop emitters instead of
# its fusion emitters (the micro-batched and shared-prompt step tests: 74 s -> 36 s of CPU). Both change how float32
# ops round (FMA contraction, vector widths, loop order), never what a program computes. The README's command
# (test_trainer) and the CPU speed code's bit-for-bit promises (test_cpu, run by test_cpu_default_flags) are tested at
# XLA's default flags. Set XLA_FLAGS yourself (keeping the device count) to run everything at the defaults.
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
os.environ.setdefault("XLA_FLAGS", " ".join(("--xla_force_host_platform_device_count=8", *FAST_COMPILE_FLAGS)))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Compilation dominates the suite on CPU (a tiny model's train step takes ~4 s to compile, and many tests build the
# same programs: the same run config in several trainer/checkpoint tests, a subprocess's run resumed in the test
# process). JAX's persistent compilation cache lets every process of the session compile each program once. The
# directory is made fresh by the first process of the session (the xdist controller, or the only process) and handed
# down through the environment, which xdist workers and subprocesses (CLI runs, multi-process workers, notebook
# kernels) inherit; it is deleted when that process ends. Never a cache left by an earlier session: the suite's time
# must hold on a cold machine, and an executable compiled by other code must never stand in for this code's.
# Entries are loaded executables of the same HLO, flags and devices, so a cache hit computes the same bits.
_CACHE_OWNER = "GRPO_JAX_TEST_COMPILATION_CACHE" not in os.environ
if _CACHE_OWNER:
    os.environ["GRPO_JAX_TEST_COMPILATION_CACHE"] = tempfile.mkdtemp(prefix="grpo_jax_test_jit_cache_")
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["GRPO_JAX_TEST_COMPILATION_CACHE"]
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # the default 1 s would skip most of them
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
if "jax" in sys.modules:  # a plugin imported jax first: it has read its config from the environment already
    import jax

    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

import pytest  # noqa: E402

from grpo_jax.models import ModelConfig, init_model  # noqa: E402


# the longest tests (20-70 s each at -n 2), started first: xdist hands tests out in collection order, and one of them
# started last keeps a worker busy while the other idles
LONG_FIRST = ("test_cpu_default_flags.py::", "test_reward_rises_on_the_embedded_task",
              "test_full_rank_adapters_learn_the_embedded_task", "test_notebook_executes",
              "test_resumed_run_equals_uninterrupted_run_bitwise", "test_sigterm_saves_exits_and_resumes",
              "test_two_processes_equal_one", "test_grpo_jax_and_trl_one_step_profiled")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: not any(name in item.nodeid for name in LONG_FIRST))  # stable: the rest in order


def pytest_unconfigure(config):
    if _CACHE_OWNER:
        shutil.rmtree(os.environ["GRPO_JAX_TEST_COMPILATION_CACHE"], ignore_errors=True)


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
