"""The import graph of grpo_jax (issue 43, docs/modules.md): imports only go down, at most 11 floors deep, and the
imports that wait inside functions are the few that keep a heavy dependency off a light path. Read from the source
with `ast` (module-level imports are edges; a package's own modules are nodes), and checked at run time where it
matters: the round's context imports no jit builder."""

import ast
import functools
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "grpo_jax"
MAX_FLOORS = 11
# module -> why its in-function grpo_jax imports wait (docs/modules.md lists the same)
DEFERRED = {
    "grpo_jax.api.cli": "a command imports what it runs: --help and config errors without jax",
    "grpo_jax.api.trl_api": "GRPOConfig without jax; the trainer once training starts",
    "grpo_jax.api.trl_state": "jax only for weights no folder holds (drawn adapters, a synced reference), generate",
    "grpo_jax.api.trl_inputs": "the tools' module (and its parsers) only for a trainer given tools or environments",
    "grpo_jax.api.plan": "jax once a topology's environment is set",
    "grpo_jax.api.plan_programs": "jax once a topology's environment is set",
    "grpo_jax.rewards.reward_model": "jax and the models only when a reward model is listed",
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _targets(module: str, path: Path, node, modules) -> set[str]:
    """The grpo_jax modules an import statement names (`from pkg import mod` names pkg.mod; else pkg)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in modules}
    if node.level:  # relative: from the module's package
        base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        source = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    if not source.startswith("grpo_jax"):
        return set()
    named = {f"{source}.{a.name}" for a in node.names} & set(modules)
    return named if len(named) == len(node.names) else named | ({source} & set(modules))


@functools.cache
def _graph():
    """(top-level edges, in-function edges, TYPE_CHECKING imports) by module."""
    modules = _modules()
    top, deferred, type_checking = {m: set() for m in modules}, {m: set() for m in modules}, set()
    for module, path in modules.items():
        tree = ast.parse(path.read_text())
        for stmt in tree.body:
            if isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test):
                type_checking.add(module)
            inside = isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            for node in ast.walk(stmt):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    (deferred if inside else top)[module] |= _targets(module, path, node, modules) - {module}
    return top, deferred, type_checking


def _floors(edges) -> dict[str, int]:
    """Each module's floor: 0 when it imports no grpo_jax module, else 1 + the highest floor it imports; a circle
    is an AssertionError naming it."""
    floors, visiting = {}, []

    def floor(m):
        assert m not in visiting, f"import circle: {' -> '.join(visiting[visiting.index(m):] + [m])}"
        if m not in floors:
            visiting.append(m)
            floors[m] = 1 + max((floor(t) for t in edges[m]), default=-1)
            visiting.pop()
        return floors[m]

    for m in edges:
        floor(m)
    return floors


def test_the_floor_count_of_a_hand_drawn_graph():
    """The floor rule on a graph counted by hand: a <- b <- c and a <- c: c is on floor 2; a circle is refused."""
    assert _floors({"a": set(), "b": {"a"}, "c": {"a", "b"}, "d": set()}) == {"a": 0, "b": 1, "c": 2, "d": 0}
    try:
        _floors({"a": {"b"}, "b": {"a"}})
    except AssertionError as e:
        assert "a -> b -> a" in str(e)
    else:
        raise AssertionError("a circle was not refused")


def test_imports_only_go_down_at_most_eleven_floors():
    top, _, _ = _graph()
    floors = _floors(top)
    assert len(top) > 90 and sum(map(len, top.values())) > 200  # the graph was read, not an empty walk
    highest = max(floors, key=floors.get)
    assert floors[highest] < MAX_FLOORS, f"{highest} is on floor {floors[highest]}: {MAX_FLOORS} floors at most"
    assert floors["grpo_jax.api.trainer"] > floors["grpo_jax.rollout.round"] > floors["grpo_jax.rollout.context"]


def test_no_import_waits_in_a_function_or_type_checking_to_hide_an_edge():
    _, deferred, type_checking = _graph()
    assert not type_checking, f"TYPE_CHECKING imports in {sorted(type_checking)}: import at the top"
    waiting = {m for m, targets in deferred.items() if targets}
    assert waiting <= set(DEFERRED), (f"{sorted(waiting - set(DEFERRED))} import grpo_jax modules inside functions: "
                                      "import them at the top (or say in DEFERRED which heavy dependency it delays)")
    assert {m for m in DEFERRED if m in waiting} == set(DEFERRED), "a DEFERRED entry no longer defers: remove it"


def test_the_round_context_loads_no_jit_builder():
    """`rollout.context` holds the programs by their types: importing it loads neither the jit builders nor the
    model, so the round code above it sits below them."""
    script = ("import sys, grpo_jax.rollout.context; print(sorted(m for m in ('grpo_jax.algo.programs', "
              "'grpo_jax.rollout.shapes', 'grpo_jax.algo.decoder', 'grpo_jax.models.transformer') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_only_algo_programs_jits():
    """Every device program is built in `algo/programs.py` (docs/modules.md): no `jax.jit` anywhere else in the
    package (the round, compile-ahead and the plan read what programs.py built), read from the syntax tree."""
    jitting = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "jit" and getattr(node.value, "id", None) == "jax":
                jitting.add(str(path.relative_to(ROOT)))
    assert jitting == {"grpo_jax/algo/programs.py"}, f"jax.jit outside algo/programs.py: {sorted(jitting)}"
