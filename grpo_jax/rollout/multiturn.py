"""Multi-turn rollouts: a decoding call whose rows call tools between their turns, TRL 1.16's `_tool_call_loop`
token for token, with the devices decoding other rows while tools run.

A row's turn ends at EOS (`decoder` with ``pause_at_eos``). The host parses the turn (`tools.parse_turn`); its tool
calls go to the `toolbox.Toolbox` and the host goes on driving the decoder. When a turn's results are back they are
rendered (`tools.suffix_ids`) and appended to the row (`decoder.append`: into its slot, or admitted again at the
next free one when rows wait for slots); a row whose turn calls nothing, whose results would overflow
``max_completion_length`` (or the model's context; TRL rolls them back) or that used ``max_tool_calling_iterations``
rounds is retired. Each post-tool turn decodes only the budget left, where TRL decodes a full
``max_completion_length`` and cuts it.

Every turn's outcomes are written to a `journal.Journal` (checksummed lines) as they arrive: a pass sampled again
after a restart (its tokens are the same: `decoder` draws each row's tokens with its own noise, whenever its tools
return) gets a standalone tool's recorded outcome back instead of calling it again, so tools with side effects run
once; an environment's methods run again on the freshly reset instance, whose state they rebuild. The resumed run
equals the uninterrupted one.

With several processes every process decodes every row and must append the same tokens, so process 0 alone runs the
tools and environments (its `Journal` the only one) and hands each loop's returned results to the others
(`sharding.from_first_process`); the rewards of rows with environments are computed where those live
(`scores_on_first`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from pathlib import Path

import jax
import numpy as np

from grpo_jax.data import prompts as data
from grpo_jax.device import sharding
from grpo_jax.rollout.piece import Piece
from grpo_jax.tools import calls as tools
from grpo_jax.tools.journal import Journal
from grpo_jax.tools.toolbox import Results, Toolbox


@dataclasses.dataclass
class Episode:
    """One row's conversation after its prompt, on the host: what TRL's `completions` holds for it and its counts."""

    prompt_ids: list  # the row's real prompt tokens
    tools: dict  # name -> callable: the tools this row may call
    schemas: list  # their JSON schemas, for the response parser
    messages: list = dataclasses.field(default_factory=list)  # assistant and tool messages, TRL's `completions[i]`
    start: int = 0  # the completion index where the current turn began
    parsed: bool = False  # the current turn was parsed (it paused)
    appended: list = dataclasses.field(default_factory=list)  # (start, end) of each appended result, completion indices
    replayable: frozenset = frozenset()  # names of the standalone tools (a journal gives back their outcomes)
    rounds: int = 0  # tool rounds done
    done: bool = False  # retired by the host
    calls: int = 0
    failures: int = 0
    malformed: int = 0  # turns the response parser could not read (TRL: plain text, not counted)

    def turns(self) -> int:
        return sum(m["role"] == "assistant" for m in self.messages)


@dataclasses.dataclass(frozen=True)
class Turns:
    """What a multi-turn decoding call needs beside the decoder: its rows' episodes and how to run and render tools."""

    tokenizer: object
    episodes: list  # Episode per row of the call
    toolbox: Toolbox
    journal: Journal
    max_iterations: int | None = None  # TRL's max_tool_calling_iterations; None: no limit
    max_model_len: int | None = None  # the model's context (max_position_embeddings); None: no limit
    chat_template: str | None = None
    template_kwargs: dict = dataclasses.field(default_factory=dict)
    template: object = None  # the tokenizer's response template, compiled (`tools.compiled_template`)
    suffix_cache: dict = dataclasses.field(default_factory=dict)  # `tools.suffix_ids`'s renderings by tool name
    waits: list = dataclasses.field(default_factory=list)  # seconds each chunk's devices sat idle waiting on tools
    calls_tools: bool = True  # this process runs the tools: process 0 of several (the others take its results)


def _parse(turns: Turns, b: int, tokens_T: np.ndarray, length: int) -> dict:
    """Row ``b``'s current turn as an assistant message (its counts kept)."""
    ep = turns.episodes[b]
    message, malformed = tools.parse_turn(turns.tokenizer, tokens_T[ep.start:length].tolist(),
                                          ep.prompt_ids + tokens_T[:ep.start].tolist(), ep.schemas, turns.template)
    ep.malformed += malformed
    ep.messages.append(message)
    ep.parsed = True
    return message


def _results(turns: Turns, row: int, b: int, calls: list) -> concurrent.futures.Future | None:
    """A future of row ``b``'s turn's results (None where another process runs the tools). A standalone tool's
    recorded outcome is given back without calling it; an environment's methods run again (its state is the
    rollout's, rebuilt by `reset`)."""
    if not turns.calls_tools:
        return None
    ep = turns.episodes[b]
    round_ = ep.rounds
    saved = turns.journal.get(row, round_, calls)
    record = None if saved is not None else (lambda results: turns.journal.put(row, round_, calls, results))
    return turns.toolbox.submit(calls, ep.tools, saved, ep.replayable, record)


def _returned(turns: Turns, waiting: dict, idle: bool) -> list:
    """(row, `Results`) of the waiting rows whose tools have returned, after waiting for the first when ``idle``
    (nothing left to decode). Every process takes process 0's list: they all append the same tokens."""
    def returned():
        if idle:
            timer = time.perf_counter()
            concurrent.futures.wait(waiting.values(), return_when=concurrent.futures.FIRST_COMPLETED)
            turns.waits.append(time.perf_counter() - timer)
        return [(b, future.result()) for b, future in waiting.items() if future.done()]  # journalled before done

    return sharding.from_first_process(returned) if waiting else []


APPEND_ROWS = 8  # rows a `decoder.append` call takes: a fixed shape, so a row's numbers do not depend on its company


def _padded(rows: list, width: int) -> np.ndarray:
    return np.array(rows + [-1] * (width - len(rows)), np.int32)


def _bucket(n: int) -> int:
    """Appended tokens are padded to a power of two: few compiled shapes of `decoder.append`."""
    return 1 << max(3, (n - 1).bit_length())


@dataclasses.dataclass
class Waiting:
    """A decoding call's rows between their turns, across its segments (`between`)."""

    rows: dict = dataclasses.field(default_factory=dict)  # row -> future of its toolbox.Results (None on processes
    # that do not run the tools)
    gave: bool = False  # rows were appended after the segment now being read: the devices have work its view misses


def between(turns: Turns, waiting: Waiting, decoder, params, decoding, options, view: tuple, offset: int):
    """The host's part of a multi-turn call between two segments (`stream.chunk`, the one host driver): the paused
    rows' turns parsed, their tool calls sent to the toolbox, the results that are back appended to their rows
    (`decoder.append`) and the rows that called nothing, or can take no more, retired. ``view``: the segment's,
    on the host, one segment old (a row's tokens do not depend on when it is admitted again); ``decoding``: the
    state after the segment queued since, which this returns with the host's changes."""
    B, T = len(view[0]), options.sampling.max_completion_length
    ended, length, at_eos, tokens, steps, paused = view
    retire, give = [], []
    for b in np.flatnonzero(paused):
        ep = turns.episodes[b]
        if b in waiting.rows or ep.done or ep.parsed or length[b] <= ep.start:  # handled, or a pause already over
            continue
        calls = _parse(turns, b, tokens[b], int(length[b])).get("tool_calls")
        if calls and (turns.max_iterations is None or ep.rounds < turns.max_iterations):
            waiting.rows[b] = _results(turns, offset + int(b), b, calls)
        else:
            retire.append(int(b))
    idle = not retire and not waiting.gave and not np.any(~ended & ~paused)  # nothing to decode until a tool returns
    for b, results in _returned(turns, waiting.rows, idle):
        del waiting.rows[b]
        ep = turns.episodes[b]
        ep.calls, ep.failures = ep.calls + results.calls, ep.failures + results.failures
        suffix = tools.suffix_ids(turns.tokenizer, results.messages, turns.chat_template, turns.suffix_cache,
                                  **turns.template_kwargs)
        n = int(length[b])
        total = len(ep.prompt_ids) + n + len(suffix)
        if n + len(suffix) > T or (turns.max_model_len is not None and total >= turns.max_model_len):
            retire.append(int(b))  # TRL rolls the results back: the rollout ends after the calling turn
            continue
        ep.messages += results.messages
        ep.appended.append((n, n + len(suffix)))
        ep.start, ep.parsed, ep.rounds = n + len(suffix), False, ep.rounds + 1
        give.append((int(b), suffix))
    for b in retire:
        turns.episodes[b].done = True
    if retire:
        decoding = decoder.retire(decoding, _padded(retire, B))
    for width in sorted({_bucket(len(s)) for _, s in give}):  # a row's numbers: its own bucket's shape only
        same = [(b, s) for b, s in give if _bucket(len(s)) == width]
        for i in range(0, len(same), APPEND_ROWS):
            part = same[i:i + APPEND_ROWS]
            tokens_MxA = np.zeros((APPEND_ROWS, width), np.int32)
            for m, (_, suffix) in enumerate(part):
                tokens_MxA[m, :len(suffix)] = suffix
            decoding = decoder.append(params, decoding, _padded([b for b, _ in part], APPEND_ROWS), tokens_MxA,
                                      _padded([len(s) for _, s in part], APPEND_ROWS), options)
    waiting.gave = bool(give)
    return decoding


def piece(turns: Turns, rows: np.ndarray, offset: int, view: tuple) -> Piece:
    """Finished rows of a multi-turn call as a `Piece` (`_piece`), from the segment's host ``view``."""
    ended, length, at_eos, tokens, steps, _ = view
    return _piece(turns, rows, offset, tokens, length, at_eos, int(steps) if ended.all() else 0)


def _piece(turns: Turns, rows: np.ndarray, offset: int, tokens, length, at_eos, steps: int):
    """Finished rows as a `Piece`: their tokens, masks (the appended results attended, not trained), TRL's
    completion messages and tool counts [n, 4] (calls, failures, malformed turns, turns)."""
    T = tokens.shape[1]
    mask = (np.arange(T)[None] < length[rows, None]).astype(np.int32)
    loss_mask = mask.copy()
    completions, counts = [], np.zeros((len(rows), 4), np.int32)
    for i, b in enumerate(rows):
        ep = turns.episodes[b]
        if not ep.parsed and length[b] > ep.start:  # a last turn cut at T tokens (TRL parses it too)
            _parse(turns, b, tokens[b], int(length[b]))
        for start, end in ep.appended:
            loss_mask[i, start:end] = 0
        completions.append(ep.messages)
        counts[i] = ep.calls, ep.failures, ep.malformed, ep.turns()
    return Piece(rows + offset, tokens[rows], mask, ~at_eos[rows], decode_steps=steps, loss_mask=loss_mask,
                 completions=completions, tool_counts=counts)


def metrics(counts_Nx4: np.ndarray) -> dict:
    """TRL's tool metrics over a round's rows, and grpo_jax's: malformed calls per rollout (TRL counts them as
    nothing) and turns per rollout."""
    calls, failures, malformed, turns = counts_Nx4.sum(axis=0)
    n = len(counts_Nx4)
    return {"tools/call_frequency": calls / n, "tools/failure_frequency": failures / calls if calls else 0.0,
            "tools/malformed_frequency": malformed / n, "tools/turns_per_rollout": turns / n}


def make_turns(tokenizer, rows_tools: list, prompt_ids: list, toolbox: Toolbox, journal: Journal,
               replayable=None, **options) -> Turns:
    """`Turns` of a call whose row b may call ``rows_tools[b]`` (callables) after its prompt ``prompt_ids[b]``;
    ``replayable``: the names of those whose journalled outcomes are given back on a second sampling (None: all)."""
    episodes = [Episode(list(p), tools.tool_dict(t), tools.json_schemas(t),
                        replayable=frozenset(fn.__name__ for fn in t) if replayable is None else frozenset(replayable))
                for p, t in zip(prompt_ids, rows_tools)]
    return Turns(tokenizer, episodes, toolbox, journal, template=tools.compiled_template(tokenizer), **options)


def setup(tooling: tools.Tooling | None, tokenizer, batch, journal: Path | None, group_size: int, *,
          toolbox: Toolbox | None = None):
    """A sampling pass's rows (`data.PromptBatch`, G rows a prompt) made ready for their tools: each row's
    environment drawn from the toolbox's (`tools.Environments`) and reset with its row (TRL: the returned string is
    appended to the last user message, and the prompts are tokenized again), and the pass's `Turns`. Returns (batch,
    Turns or None, environments or None). With several processes only process 0 holds environments (the others get
    None) and its journal; its reset observations are every process's. ``toolbox`` runs the calls and holds the
    environments: the caller's (`tools.open_toolbox`), which it closes."""
    if tooling is None:
        return batch, None, None
    if toolbox is None:
        raise ValueError("a run with tools or environments samples with a toolbox: pass toolbox=grpo_jax.tools.calls."
                         "open_toolbox(run.tooling) (and close it when done), as `train` does")
    rows = [{"prompt": prompt, **{k: v[i] for k, v in batch.columns.items()}} for i, prompt in enumerate(batch.prompts)]
    calls_tools = jax.process_index() == 0
    environments = None
    prompts = list(batch.prompts)
    if tooling.factories is not None:
        multi = None not in tooling.factories

        def reset():
            nonlocal environments
            environments = toolbox.environments.draw(rows)
            return [_reset(env, {k: v for k, v in row.items() if k != "environment"} if multi else row)
                    for env, row in zip(environments, rows)]

        observations = sharding.from_first_process(reset)
        if any(o is not None for o in observations):
            prompts = [p if o is None else p[:-1] + [{**p[-1], "content": p[-1]["content"] + str(o)}]
                       for p, o in zip(prompts, observations)]
            _check_groups(prompts, group_size)
            ids, mask, _ = data.tokenize_prompts(tokenizer, prompts, batch.prompt_ids.shape[1], "left",
                                                 [tooling.schemas(r) for r in rows], tooling.chat_template,
                                                 tooling.template_kwargs)
            batch = batch._replace(prompt_ids=ids, prompt_mask=mask, prompts=prompts)
    # the others parse with the probe instances' tools (the same schemas) and never call them
    row_tools = [tooling.schemas(row) for row in rows] if environments is None else \
        [list(tooling.tools) + tools.methods(env) for env in environments]
    prompt_ids = [ids[m == 1].tolist() for ids, m in zip(batch.prompt_ids, batch.prompt_mask)]
    turns = make_turns(tokenizer, row_tools, prompt_ids, toolbox, Journal(journal if calls_tools else None),
                       replayable=[fn.__name__ for fn in tooling.tools],
                       max_iterations=tooling.max_iterations, max_model_len=tooling.max_model_len,
                       chat_template=tooling.chat_template, template_kwargs=tooling.template_kwargs,
                       calls_tools=calls_tools)
    return batch, turns, environments


def scores_on_first(tooling: tools.Tooling | None) -> bool:
    """Whether a pass's rewards are computed on process 0 alone and shared (`sharding.from_first_process`): with
    several processes only it holds the rollouts' environments, which reward functions read."""
    return tooling is not None and tooling.factories is not None and jax.process_count() > 1


def _reset(environment, row: dict):
    try:
        return environment.reset(**row)
    except Exception as e:
        raise RuntimeError(f"{type(environment).__name__}.reset raised {type(e).__name__}: {e} (on a row with "
                           f"columns {sorted(row)})") from e


def _check_groups(prompts: list, group_size: int) -> None:
    """Rows of one prompt must stay one prompt after their environments' resets: the decoder prefills a group's
    prompt once."""
    for g in range(0, len(prompts), group_size):
        for i in range(g + 1, g + group_size):
            if prompts[i] != prompts[g]:
                raise ValueError(f"environment reset returned different observations for rows {g} and {i} of one "
                                 "prompt's group: grpo_jax prefills a group's prompt once, so reset(**row) must "
                                 "return the same text for the same row (seed any randomness from the row)")
