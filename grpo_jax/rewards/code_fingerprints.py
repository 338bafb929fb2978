"""Fingerprints of the code a run calls from the host: its reward functions, tools and environments, recorded in
every checkpoint beside the data fingerprint (`grpo_jax.data.sources.fingerprint`) so that a resume over a changed one is
refused, not continued silently (`check`). A function is named and hashed by its source text (its compiled code where
no source can be read); a `functools.partial` by its function and arguments; an environment by its class's source; a
reward model by the files of its folder. Imports no jax.
"""

from __future__ import annotations

import functools
import inspect
import marshal
import os
from collections.abc import Callable, Sequence

import xxhash

from grpo_jax.data import sources

PRIMITIVES = (int, float, str, bool, type(None))


def code_hash(obj) -> str:
    """xxh3-64 of what `obj` does: a function's (or class's) source, a partial's function and arguments, a reward
    model's folder files, else its class's source. Never a `repr` that holds a memory address (it would differ on
    every run)."""
    h = xxhash.xxh3_64()
    if isinstance(obj, functools.partial):
        h.update(code_hash(obj.func).encode())
        h.update(repr([_plain(a) for a in obj.args] + sorted((k, _plain(v)) for k, v in obj.keywords.items())).encode())
        return h.hexdigest()
    folder = getattr(obj, "path", None)
    if isinstance(folder, (str, os.PathLike)) and os.path.isdir(folder):  # a reward model: its weights and config
        return sources.fingerprint([], str(folder), path=os.fspath(folder))["hash"][:16]
    target = obj if inspect.isfunction(obj) or inspect.isclass(obj) or inspect.ismethod(obj) else type(obj)
    try:
        h.update(inspect.getsource(target).encode())
    except (OSError, TypeError):  # defined in a notebook cell or exec'd text: its bytecode and constants
        code = getattr(target, "__code__", None)
        h.update(marshal.dumps(code.replace(co_filename="", co_firstlineno=1)) if code is not None
                 else target.__qualname__.encode())
    return h.hexdigest()


def _plain(value):
    return value if isinstance(value, PRIMITIVES) else type(value).__qualname__


def fingerprint(reward_fns: Sequence[tuple[str, Callable]], tooling=None) -> dict:
    """What a checkpoint records of the host code a run calls: {"reward_funcs": [[name, hash]], "tools": [...],
    "environments": [...]} (`tooling`: the run's `grpo_jax.tools.calls.Tooling`, or None)."""
    tools = [] if tooling is None else list(tooling.tools)
    environments = {} if tooling is None or tooling.factories is None else tooling.factories
    return {"reward_funcs": [[name, code_hash(fn)] for name, fn in reward_fns],
            "tools": [[getattr(t, "__name__", type(t).__name__), code_hash(t)] for t in tools],
            "environments": [[str(name), code_hash(type(tooling.probes[name]))] for name in environments]}


KINDS = {"reward_funcs": "reward function", "tools": "tool", "environments": "environment"}


def check(saved: dict | None, now: dict, *, step: int, allow_changed: bool) -> str | None:
    """None when the reward functions, tools and environments are those checkpoint `step` ran with (or it recorded
    none: written before these fingerprints); else a ValueError naming the first that changed, or with
    `allow_changed` (reward.allow_changed) the warning to print."""
    if saved is None:
        return None
    changes = []
    for kind, label in KINDS.items():
        then = [(n, h) for n, h in saved.get(kind, [])]
        current = [(n, h) for n, h in now[kind]]
        if then == current:
            continue
        if [n for n, _ in then] != [n for n, _ in current]:
            changes.append(f"the {label}s are now {[n for n, _ in current]}, then {[n for n, _ in then]}")
        else:
            changes += [f"{label} {n!r} has other code (xxh3 {h} now, {old} then)"
                        for (n, h), (_, old) in zip(current, then) if h != old]
    if not changes:
        return None
    what = f"{'; '.join(changes)} since checkpoint {step}"
    if allow_changed:
        return f"{what}: continuing with them (reward.allow_changed=true)"
    raise ValueError(f"cannot resume: {what}, so the run would go on scoring or acting differently: put the code "
                     "back, choose a new output_dir, or set reward.allow_changed=true to continue with the new code")
