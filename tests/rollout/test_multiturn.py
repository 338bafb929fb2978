"""Multi-turn rollouts (grpo_jax/rollout/multiturn.py, tools.py): the host's turn loop, driven by a scripted decoder, gives
TRL 1.16's own tool loop's token ids, tool mask, messages and counts (tests/trl_tools.py runs TRL's code); failures,
timeouts, overflow and the journal each have a case."""

import time
from types import SimpleNamespace

import numpy as np
import pytest

from grpo_jax.data import prompts as data
from grpo_jax.rollout import multiturn, stream
from grpo_jax.tools import calls as tools
from grpo_jax.tools.toolbox import Toolbox

pytest.importorskip("trl")
from trl_tools import add, explode, multiply, qwen_tokenizer, trl_tool_loop  # noqa: E402

PROMPT = [{"role": "user", "content": "What is 3 times 4?"}]
CALL = '<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call><|im_end|>'


def slow(x: int) -> int:
    """Sleeps past the timeout.

    Args:
        x: Any integer.
    """
    time.sleep(2.0)
    return x


class ScriptedDecoder:
    """`programs.Decoder`'s multi-turn API over host arrays: row b's k-th turn is ``turns[b][k]``, emitted whole in
    one `advance` (cut at T), pausing at EOS as `decoder` does with ``pause_at_eos``."""

    def __init__(self, turns, eos):
        self.turns, self.eos = turns, eos

    def start(self, params, ids, mask, key, offset, options):
        B, T = len(ids), options.sampling.max_completion_length
        return SimpleNamespace(T=T, tokens=np.zeros((B, T), np.int32), sampled=np.zeros((B, T), np.int32),
                               length=np.zeros(B, np.int32), next=np.zeros(B, int), ended=np.zeros(B, bool),
                               paused=np.zeros(B, bool), at_eos=np.zeros(B, bool), steps=0)

    def advance(self, params, d, options, segment):
        for b in np.flatnonzero(~d.ended & ~d.paused):
            turn = list(self.turns[b][d.next[b]])[:d.T - d.length[b]]
            n = d.length[b]
            d.tokens[b, n:n + len(turn)], d.sampled[b, n:n + len(turn)] = turn, 1
            d.length[b] += len(turn)
            d.next[b] += 1
            d.at_eos[b] = turn[-1] in self.eos
            d.paused[b], d.ended[b] = d.at_eos[b], not d.at_eos[b]
            d.steps += len(turn)
        return d, (d.ended.copy(), d.length.copy(), d.at_eos.copy(), d.tokens.copy(), d.steps, d.paused.copy())

    def append(self, params, d, rows, tokens, counts, options):
        for b, row_tokens, count in zip(rows, tokens, counts):
            if b < 0 or not d.paused[b]:
                continue
            n = d.length[b]
            count = min(int(count), d.T - n)
            d.tokens[b, n:n + count], d.length[b] = row_tokens[:count], n + count
            d.paused[b], d.at_eos[b], d.ended[b] = False, False, n + count >= d.T
        return d

    def retire(self, d, rows):
        for b in rows[rows >= 0]:
            d.ended[b], d.paused[b] = True, False
        return d

    def trajectory(self, d):
        return SimpleNamespace(completion_ids=d.tokens.copy(), loss_mask=d.sampled.copy())


@pytest.fixture(scope="module")
def tok():
    return qwen_tokenizer()


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def ours(tok, prompts, turns, fns, *, T, max_iterations=None, timeout=5.0, journal=None, group_size=1):
    """The rows through `stream.chunk` (the host driver, with turns) with the scripted decoder: (per-row dicts as `trl_tool_loop` gives,
    the trajectory)."""
    template = tools._parser_and_template(tok)
    prompt_ids = [ids(tok, data.render_prompt(tok, p, fns, template)) for p in prompts]
    P = max(map(len, prompt_ids))
    ids_BxP = np.array([[0] * (P - len(p)) + p for p in prompt_ids], np.int32)
    mask_BxP = (np.arange(P)[None] >= P - np.array([len(p) for p in prompt_ids])[:, None]).astype(np.int32)
    toolbox = Toolbox(timeout)
    turns_ = multiturn.make_turns(tok, [fns] * len(prompts), prompt_ids, toolbox, multiturn.Journal(journal),
                                  max_iterations=max_iterations, chat_template=template)
    options = SimpleNamespace(sampling=SimpleNamespace(max_completion_length=T))
    decoder = ScriptedDecoder(turns, {tok.eos_token_id})
    pieces, trajectory = [], None
    for event in stream.chunk(decoder, None, ids_BxP, mask_BxP, None, 0, options, group_size, turns_):
        if isinstance(event, SimpleNamespace):
            trajectory = event
        else:
            pieces.append(event)
    toolbox.close()
    out = [None] * len(prompts)
    for piece in pieces:
        for i, b in enumerate(piece.rows):
            n = int(piece.completion_mask[i].sum())
            out[b] = {"prompt_ids": prompt_ids[b], "completion_ids": piece.completion_ids[i, :n].tolist(),
                      "tool_mask": piece.loss_mask[i, :n].tolist(), "completions": piece.completions[i],
                      "counts": piece.tool_counts[i].tolist(), "is_truncated": bool(piece.is_truncated[i])}
    return out, trajectory


def same_as_trl(tok, prompts, turns, fns, *, T, max_iterations=None):
    """Ours and TRL's rows agree on prompt ids, completion ids, tool mask, messages and the call counts."""
    mine, _ = ours(tok, prompts, turns, fns, T=T, max_iterations=max_iterations)
    theirs = trl_tool_loop(tok, prompts, turns, fns, max_completion_length=T,
                           max_tool_calling_iterations=max_iterations)
    for m, t in zip(mine, theirs):
        assert m["prompt_ids"] == list(t["prompt_ids"])
        assert m["completion_ids"] == list(t["completion_ids"])
        assert m["tool_mask"] == list(t["tool_mask"])
        assert m["completions"] == t["completions"]
    assert sum(m["counts"][0] for m in mine) == theirs[0]["tool_call_count"]
    assert sum(m["counts"][1] for m in mine) == theirs[0]["tool_failure_count"]
    return mine


def call(name, **args):
    import json
    return CALL.format(name=name, args=json.dumps(args))


def test_a_tool_call_then_an_answer_matches_trl(tok):
    turns = [[ids(tok, call("multiply", a=3, b=4)), ids(tok, "12<|im_end|>")], [ids(tok, "12<|im_end|>")]]
    mine = same_as_trl(tok, [PROMPT, PROMPT], turns, [multiply], T=96)
    first = len(turns[0][0])
    assert mine[0]["tool_mask"][:first] == [1] * first and 0 in mine[0]["tool_mask"]
    assert mine[0]["counts"] == [1, 0, 0, 2] and mine[1]["counts"] == [0, 0, 0, 1]
    assert mine[0]["completions"][1] == {"role": "tool", "name": "multiply", "content": "12"}


def test_failing_unknown_and_async_tools_match_trl(tok):
    """An unknown tool and a raising one are error messages and failures; async results follow the sync ones."""
    two = ids(tok, '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
                   '<tool_call>\n{"name": "multiply", "arguments": {"a": 2, "b": 5}}\n</tool_call><|im_end|>')
    turns = [[ids(tok, call("explode", x=1)), ids(tok, "no<|im_end|>")],
             [ids(tok, call("nope", x=1)), ids(tok, "no<|im_end|>")],
             [two, ids(tok, "3 10<|im_end|>")]]
    mine = same_as_trl(tok, [PROMPT] * 3, turns, [multiply, explode, add], T=160)
    assert mine[0]["completions"][1]["content"] == "{'error': 'boom'}"
    assert mine[1]["completions"][1]["content"] == "{'error': 'Tool nope not found.'}"
    assert [m["name"] for m in mine[2]["completions"][1:3]] == ["multiply", "add"]


def test_results_that_would_overflow_are_rolled_back_and_the_row_ends_as_trl(tok):
    turn = ids(tok, call("multiply", a=3, b=4))
    mine = same_as_trl(tok, [PROMPT], [[turn, ids(tok, "12<|im_end|>")]], [multiply], T=len(turn) + 3)
    assert mine[0]["completion_ids"] == turn and mine[0]["counts"][0] == 1 and not mine[0]["is_truncated"]


def test_a_last_turn_cut_at_the_budget_and_the_iteration_cap_match_trl(tok):
    turn = ids(tok, call("multiply", a=3, b=4))
    long_answer = ids(tok, "the answer is twelve, of course<|im_end|>")
    same_as_trl(tok, [PROMPT], [[turn, long_answer]], [multiply], T=len(turn) + 30)
    mine = same_as_trl(tok, [PROMPT], [[turn, turn, long_answer]], [multiply], T=200, max_iterations=1)
    assert mine[0]["counts"][0] == 1  # the second call is the rollout's end, not run


def test_a_malformed_call_is_text_for_trl_and_counted_here(tok):
    bad = ids(tok, '<tool_call>\n{"name": "multiply", "arguments": {"a": 3,\n</tool_call><|im_end|>')
    mine = same_as_trl(tok, [PROMPT], [[bad]], [multiply], T=96)
    assert mine[0]["counts"] == [0, 0, 1, 1]


def test_a_tool_past_its_timeout_is_an_error_message_not_a_hung_run(tok):
    start = time.perf_counter()
    mine, _ = ours(tok, [PROMPT], [[ids(tok, call("slow", x=1)), ids(tok, "1<|im_end|>")]], [slow], T=128,
                   timeout=0.2)
    assert time.perf_counter() - start < 1.5
    assert mine[0]["completions"][1]["content"] == "{'error': \"tool 'slow' did not return within 0.2 s\"}"
    assert mine[0]["counts"][:2] == [1, 1]


def test_a_pass_sampled_again_reads_its_results_from_the_journal_and_calls_nothing(tok, tmp_path):
    calls = []

    def counted(a: int, b: int) -> int:
        """Multiplies, counting calls.

        Args:
            a: The first factor.
            b: The second factor.
        """
        calls.append((a, b))
        return a * b

    turns = [[ids(tok, call("counted", a=3, b=4)), ids(tok, "12<|im_end|>")]] * 2
    first, _ = ours(tok, [PROMPT] * 2, turns, [counted], T=96, journal=tmp_path / "j.jsonl", group_size=2)
    assert len(calls) == 2
    again, _ = ours(tok, [PROMPT] * 2, turns, [counted], T=96, journal=tmp_path / "j.jsonl", group_size=2)
    assert len(calls) == 2 and again == first
    other = [[ids(tok, call("counted", a=5, b=4)), ids(tok, "20<|im_end|>")]] * 2
    ours(tok, [PROMPT] * 2, other, [counted], T=96, journal=tmp_path / "j.jsonl", group_size=2)
    assert len(calls) == 4  # a turn that asks something else is called anew


def test_a_scripted_multi_turn_batch_trains_as_a_naive_per_row_loss(tok):
    """TRL's tool mask (zeros over the results) is the loss mask, and the batch's GRPO gradient (padded rows through
    `completion_logps` and `compute_loss`) equals a naive one: each row alone, unpadded, through a plain forward,
    -(A_i / |m_i|) sum_t m_it logp_it averaged over the rows."""
    import jax
    import jax.numpy as jnp

    from grpo_jax.algo.logprobs import completion_logps
    from grpo_jax.losses import LossConfig, compute_loss
    from grpo_jax.models import ModelConfig, forward, init_model, positions_from_mask, unembed

    turns = [[ids(tok, call("multiply", a=3, b=4)), ids(tok, "12<|im_end|>")], [ids(tok, "12<|im_end|>")],
             [ids(tok, call("nope", x=1)), ids(tok, "no<|im_end|>")]]
    prompts = [PROMPT] * 3
    mine, _ = ours(tok, prompts, turns, [multiply], T=96)
    theirs = trl_tool_loop(tok, prompts, turns, [multiply], max_completion_length=96)
    P, T = max(len(m["prompt_ids"]) for m in mine), max(len(m["completion_ids"]) for m in mine)
    prompt_ids, prompt_mask = np.zeros((3, P), np.int32), np.zeros((3, P), np.int32)
    completion_ids, completion_mask, loss_mask = (np.zeros((3, T), np.int32) for _ in range(3))
    for i, (m, t) in enumerate(zip(mine, theirs)):
        p, c = m["prompt_ids"], m["completion_ids"]
        prompt_ids[i, P - len(p):], prompt_mask[i, P - len(p):] = p, 1
        completion_ids[i, :len(c)], completion_mask[i, :len(c)], loss_mask[i, :len(c)] = c, 1, t["tool_mask"]
    assert [loss_mask[i, :len(m["tool_mask"])].tolist() for i, m in enumerate(mine)] == [m["tool_mask"] for m in mine]
    graphdef, params = init_model(ModelConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
                                  seed=0)
    advantages = jnp.array([1.0, -0.5, 0.25])

    def batched(params):
        logps, _ = completion_logps(graphdef, params, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                    temperature=1.0)
        return compute_loss(logps, None, None, advantages, loss_mask, config=LossConfig(beta=0.0, loss_type="grpo"))[0]

    def naive(params):
        total = 0.0
        for i, m in enumerate(mine):
            row = jnp.array([m["prompt_ids"] + m["completion_ids"]], jnp.int32)
            ones = jnp.ones_like(row)
            hidden, _ = forward(graphdef, params, row, positions_from_mask(ones), ones)
            logits = unembed(graphdef, params, hidden)[0, len(m["prompt_ids"]) - 1:-1]
            logps = jax.nn.log_softmax(logits.astype(jnp.float32))[jnp.arange(len(m["completion_ids"])),
                                                                    jnp.array(m["completion_ids"])]
            mask = jnp.array(m["tool_mask"], jnp.float32)
            total += -advantages[i] * jnp.sum(mask * jnp.exp(logps - jax.lax.stop_gradient(logps))) / mask.sum()
        return total / len(mine)

    want, got = jax.grad(naive)(params), jax.grad(batched)(params)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=2e-6)
    assert any(np.abs(np.asarray(a)).max() > 1e-4 for a in jax.tree.leaves(want))
