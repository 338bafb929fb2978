"""Running a turn's tool calls off the decoding thread, with TRL 1.16's semantics (`_tool_call_loop`).

Sync tools each on a daemon thread of their own, async ones awaited together on one event loop thread, every call
under a timeout past which its result is an error message. An unknown tool or one that raises (or times out) gives
``{"error": "..."}`` and counts as a failure; results are ``str(result)``; the messages come in TRL's order (sync
calls in call order, then async ones). Each call's outcome is kept in call order (`Results.outcomes`), which a
replay (`multiturn.Journal`) gives back in place of calling a tool again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
from collections.abc import Callable
from typing import NamedTuple

from grpo_jax.rewards.functions import is_async_callable


class Results(NamedTuple):
    """One turn's tool calls, run: the tool messages in TRL's order, the counts, and each call's outcome in call
    order (what a replay gives back)."""

    messages: list  # [{"role": "tool", "name", "content"}]: sync calls in call order, then async ones (TRL)
    calls: int
    failures: int
    outcomes: list = []  # per call: ["ok", content] or ["error", message]


def _replayer(fn: Callable, outcome: list) -> Callable:
    """A stand-in for ``fn`` that gives its recorded outcome (sync or async as ``fn`` is: TRL orders by it)."""
    def give():
        if outcome[0] == "error":
            raise RuntimeError(outcome[1])
        return outcome[1]

    if is_async_callable(fn):
        async def replay(**arguments):
            return give()
    else:
        def replay(**arguments):
            return give()
    replay.__name__ = getattr(fn, "__name__", "tool")
    return replay


def _error(e: BaseException) -> dict:
    return {"error": str(e)}


class _Stop(NamedTuple):
    """An async tool's SystemExit or KeyboardInterrupt, carried out of the event loop as a value."""

    error: BaseException


def _stopped(name: str, error: BaseException) -> BaseException:
    """What a tool's SystemExit or KeyboardInterrupt becomes: the run stops (and saves its finished steps) with a
    message naming the tool; an interrupt stays a KeyboardInterrupt."""
    if isinstance(error, SystemExit):
        return RuntimeError(f"tool {name!r} called sys.exit({error.code!r}): raise an exception (the model sees its "
                            "message) instead")
    return KeyboardInterrupt(f"tool {name!r} raised KeyboardInterrupt")


class Toolbox:
    """Runs tool calls off the decoding thread: each sync call on a daemon thread of its own, async ones on one
    event loop thread, each call under ``timeout`` seconds (past it the call's message is an error; a sync tool's
    thread is left to finish on its own, as Python cannot stop it). `submit` returns a future of `Results`.
    ``environments``: the rollouts' environment instances (`calls.Environments`), which live as long as the box."""

    def __init__(self, timeout: float, workers: int = 32, environments=None):
        self.timeout = timeout
        self.environments = environments
        self._turns = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="grpo_jax-turn")
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="grpo_jax-tools-async", daemon=True).start()

    def close(self) -> None:
        self._turns.shutdown(wait=False, cancel_futures=True)
        self._loop.call_soon_threadsafe(self._loop.stop)

    def submit(self, calls: list[dict], tools: dict[str, Callable], replay: list | None = None,
               replayed: frozenset = frozenset(), record: Callable | None = None) -> concurrent.futures.Future:
        """Runs one turn's ``calls`` against ``tools`` (name -> callable) and gives their `Results`. Calls of the
        tools named in ``replayed`` give ``replay``'s outcome at their index (`Results.outcomes`) instead.
        ``record(results)`` runs on the turn's thread before the future resolves (the journal: off the decoding
        thread, on disk before the results are used)."""
        def run():
            results = self._run(calls, tools, replay, replayed)
            if record is not None:
                record(results)
            return results

        return self._turns.submit(run)

    def _call_sync(self, fn: Callable, arguments: dict):
        # a daemon thread of its own: a call that never returns is abandoned, and cannot hold the process at exit
        # (a pool's workers are joined then)
        future = concurrent.futures.Future()

        def run():
            try:
                future.set_result(fn(**arguments))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting turn
                future.set_exception(e)

        threading.Thread(target=run, name=f"grpo_jax-tool-{getattr(fn, '__name__', 'tool')}", daemon=True).start()
        try:
            return future.result(timeout=self.timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"tool {fn.__name__!r} did not return within {self.timeout:g} s") from None

    def _run(self, calls: list[dict], tools: dict[str, Callable], replay, replayed) -> Results:
        done, pending = [], []  # (call index, name, result or {"error": ...}); async calls wait in pending
        failed = set()  # indices of the calls that failed
        for i, call in enumerate(calls):
            if call.get("type") != "function":
                failed.add(i)
                done.append((i, call.get("name", "unknown"),
                             {"error": f"Unsupported tool call type: {call.get('type')}"}))
                continue
            name, arguments = call["function"]["name"], call["function"]["arguments"]
            fn = tools.get(name)
            try:
                if fn is None:
                    raise ValueError(f"Tool {name} not found.")
                if not isinstance(arguments, dict):
                    raise TypeError(f"{name}() arguments must be an object, got {json.dumps(arguments)}")
                if replay is not None and name in replayed:
                    fn = _replayer(fn, replay[i])
                if is_async_callable(fn):
                    pending.append((i, name, fn, arguments))
                else:
                    done.append((i, name, fn(**arguments) if name in replayed and replay is not None
                                 else self._call_sync(fn, arguments)))
            except Exception as e:  # noqa: BLE001 - TRL: a failing tool is part of the episode
                failed.add(i)
                done.append((i, name, _error(e)))
            except (SystemExit, KeyboardInterrupt) as e:  # stops the run (which saves first), naming the tool
                raise _stopped(name, e) from e
        if pending:
            async def guarded(fn, args):
                try:
                    return await fn(**args)
                except (SystemExit, KeyboardInterrupt) as e:  # out of a task they would end the loop's thread
                    return _Stop(e)

            async def gather():
                return await asyncio.gather(*(asyncio.wait_for(guarded(fn, args), self.timeout)
                                              for _, _, fn, args in pending), return_exceptions=True)

            outs = asyncio.run_coroutine_threadsafe(gather(), self._loop).result()
            for (i, name, _, _), out in zip(pending, outs):
                if isinstance(out, _Stop):
                    raise _stopped(name, out.error) from out.error
                if isinstance(out, asyncio.TimeoutError | TimeoutError):
                    out = TimeoutError(f"tool {name!r} did not return within {self.timeout:g} s")
                if isinstance(out, BaseException):
                    failed.add(i)
                    out = _error(out)
                done.append((i, name, out))
        messages, outcomes = [], [None] * len(calls)
        for i, name, out in done:
            content = out if isinstance(out, list) else str(out)
            messages.append({"role": "tool", "name": name, "content": content})
            outcomes[i] = ["error", out["error"]] if i in failed else ["ok", content]
        return Results(messages, len(calls), len(failed), outcomes)
