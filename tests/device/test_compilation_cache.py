"""compilation_cache_dir: a second process running the same programs loads them from JAX's persistent cache."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp
    from grpo_jax.algo.programs import use_compilation_cache
    hits = []
    jax.monitoring.register_event_listener(lambda name, **kw: hits.append(name))
    use_compilation_cache(sys.argv[1])
    print(jax.config.jax_compilation_cache_dir)
    print(float(jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((8, 8))).sum()))
    print(hits.count("/jax/compilation_cache/cache_hits"))
""")


def _run(folder):
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(folder)], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_second_process_loads_its_programs_from_the_cache(tmp_path):
    folder = tmp_path / "made" / "by" / "the" / "run"  # created when missing
    first = _run(folder)
    assert first[0] == str(folder) and first[2] == "0" and any(folder.iterdir())
    second = _run(folder)
    assert second[1] == first[1] and int(second[2]) >= 1  # the same result, loaded instead of compiled


def test_a_cache_chosen_already_takes_precedence(tmp_path):
    import jax

    from grpo_jax.algo.programs import use_compilation_cache
    chosen = jax.config.jax_compilation_cache_dir  # this session's, from JAX_COMPILATION_CACHE_DIR (conftest)
    assert chosen
    use_compilation_cache(str(tmp_path / "config"))
    assert jax.config.jax_compilation_cache_dir == chosen and not (tmp_path / "config").exists()
