"""What a run's device programs are to the host code that calls them, apart from how they are built: `Programs` (a
run's jitted programs), `Decoder` (its decoding programs) and `RunShapes` (the shapes they are compiled for, fixed
before the first round). Plain named tuples with no jax: the run context (`grpo_jax.rollout.context`) and the round
code hold and call them, and `programs` (which jits them) and `rollout.shapes` (which lists and compiles the shapes)
sit above, so the round code does not import the jit builders.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple


class Decoder(NamedTuple):
    """A run's decoding programs over the mesh (`grpo_jax.algo.decoder`), jitted once; `stream.decode` drives them.

    - `layout(params) -> params`: the policy as the other programs take it, once per call: resharded into the
      rollout layout (`grpo_jax.device.rollout_layout`), or the params as they are
    - `generate(params, prompt_ids, prompt_mask, key, row_offset, options) -> (Trajectory, view)`: a call decoded
      to its end in one program (a static batch)
    - `start(params, prompt_ids, prompt_mask, key, row_offset, options) -> Decoding`
    - `advance(params, decoding, options, segment) -> (Decoding, view)`, the decoding donated; ``view`` (ended,
      length, at_eos [B], tokens [B, T], decode steps, paused [B]) is what the host reads between segments
    - `append(params, decoding, rows, tokens, counts, options)`, `retire(decoding, rows)`: multi-turn rows
    - `trajectory(decoding) -> Trajectory`; `concat(trajectories)` joins host-thread chunks' rows
    - `options(rows, total_rows, greedy, slots=0) -> DecodeOptions` of a call (or chunk) of ``rows`` rows; ``slots``
      the call's slot count (`stream.plan_slots`), 0: `sampling.max_batch_rows`'s
    - `chunks(rows, group_size) -> k`: host-thread chunks of a call (`cpu.host_chunks`; 1 off the CPU switch)
    - `place((prompt_ids, prompt_mask))`: a whole call's host rows as its programs take them (`sharding.host_rows`)
    """

    layout: Callable
    generate: Callable
    start: Callable
    advance: Callable
    append: Callable
    retire: Callable
    trajectory: Callable
    concat: Callable
    options: Callable
    chunks: Callable
    place: Callable


class Programs(NamedTuple):
    """The jitted device programs a run calls, built once by `programs.build`.

    - `decoder`: the round's decoding programs (`programs.jit_decoder`, driven by `stream.decode`); greedy evaluation uses
      them too
    - `eval_decoder`: the same at `eval.temperature` with `eval.num_generations` rows per prompt; None when
      evaluation samples nothing (`grpo_jax.rollout.evaluation`)
    - `sample_key(key, round_index, draw_index) -> key`: the key of a round's sampling pass
    - `logps(params, prompt_ids, prompt_mask, completion_ids, completion_mask) -> [N, T]` (old policy)
    - `ref_logps(ref_params, ...)`: the same over the reference's layout; None when beta = 0. With LoRA
      adapters it takes the policy's params (`TrainState.reference_params`) and runs them with the adapters off
    - `advantages(rewards_NxF, weights_F, mask_NxT, step_rewards, step_ends) -> (advantages, r_N, std_N)`, on the
      host's CPU (where the rewards are): numpy in, numpy out
    - `rows(trajectory, advantages, old, ref) -> Trajectory`: the round's rows for its steps, row-split, the
      advantages uploaded (`train.mask_truncated_completions` clears truncated rows' loss mask here)
    - `take(rows, rows_B) -> Trajectory`: one step's rows of a round, gathered on the devices
    - `step(state, rows) -> (state, metrics)`: one optimizer step, the state donated
    - `eval_loss(params, reference_params) -> program or None`: TRL's `eval_loss` of held-out rows
      (`programs.eval_loss`, `rollout.eval_loss`)
    """

    decoder: Decoder
    sample_key: Callable
    logps: Callable
    ref_logps: Callable | None
    advantages: Callable
    rows: Callable
    take: Callable
    step: Callable
    eval_decoder: Decoder | None = None
    eval_loss: Callable | None = None


class RunShapes(NamedTuple):
    """What a run's programs are compiled for, known before its first round."""

    round_rows: int  # N rows a round samples (`train.generation_batch_size`)
    step_rows: int  # B rows an optimizer step takes (`train.train_batch_size`)
    prompt_length: int  # P: prompts left-padded to it
    completion_length: int  # T: `sampling.max_completion_length`
    prompt_range: tuple[int, int]  # (fewest, most) real tokens of a prompt
    round_packings: tuple  # ((buffer length, buffers), ...) of the reference / old log-prob passes; (0, 0): static
    step_packings: tuple  # the same of the optimizer step (buffers a micro-batch)
    decode_slots: tuple  # slots a decoding call may take (`stream.plan_slots`), one per program; 0: every row
    micro_batches: int = 1  # the step's (`train.gradient_accumulation_steps`)

    def describe(self) -> list[str]:
        """One line per phase: the shapes it is compiled for."""
        def packings(pairs):
            return ", ".join("static" if not L else f"{K}x{L}" for L, K in pairs) or "none"
        return [f"decode: {self.round_rows} rows x {self.prompt_length} + {self.completion_length} tokens, slots "
                + ", ".join(str(s) if s else "all" for s in self.decode_slots),
                f"log-probs: {self.round_rows} rows, layouts {packings(self.round_packings)} (buffers x length)",
                f"train step: {self.step_rows} rows in {self.micro_batches} micro-batch(es), layouts "
                f"{packings(self.step_packings)} (buffers x length a micro-batch)"]
