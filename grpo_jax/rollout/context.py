"""The run context: what a run builds once and every round function reads (`Run`: config, tokenizer, data,
rewards, mesh, programs), and the prompt-sharing group sizes its programs are built for (`prompt_group_sizes`).
A frozen value made by `grpo_jax.api.run.build`, which sits above the round code that takes it. It holds the
programs as their types (`algo.program_types`), not their builders (`algo.programs`, `rollout.shapes`), so the
round code that reads it sits below those.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import optax
from flax import nnx
from jax.sharding import Mesh
from transformers import PreTrainedTokenizerBase

from grpo_jax.algo.program_types import Programs, RunShapes
from grpo_jax.config import Config
from grpo_jax.data import prompts as data
from grpo_jax.device import sharding
from grpo_jax.rollout.rollout_func import RolloutFunc
from grpo_jax.tools import calls as tools


@dataclasses.dataclass(frozen=True)
class Run:
    """Everything `train` builds once before the loop and never changes: config, data, rewards, mesh, programs.

    The train state is not here: `build` returns it beside the run, and the loop passes it explicitly.
    The data position is not here either: it is a `data.DataState` the loop passes beside the train state.
    Nor is what lives through the loop: the output_dir's lock (`build` returns it too) and the keys of warnings
    given once a run (a set the loop makes and passes to `prepare_round`).
    """

    config: Config
    output_dir: Path
    tokenizer: PreTrainedTokenizerBase
    tokenizer_path: Path
    dataset: data.Dataset
    eval_rows: list[dict]
    reward_fns: list[tuple[str, Callable]]
    eval_reward_fns: list[tuple[str, Callable]]
    mesh: Mesh
    graphdef: nnx.GraphDef
    schedule: optax.Schedule
    programs: Programs
    step_prompt_group_size: int = 1  # > 1: a step takes the round's rows in order (whole groups, shared prompts)
    round_prompt_group_size: int = 1  # > 1: the round's log-prob passes share each group's prompt
    resuming: bool = False  # output_dir holds this run already: `train` continues from its newest checkpoint
    tooling: tools.Tooling | None = None  # tools and environments of multi-turn rollouts (None: one turn a row)
    rollout_mesh: Mesh | None = None  # mesh.rollout > 0: the sampling devices (`mesh` holds the training ones)
    rollout_programs: Programs | None = None  # the sampling programs over `rollout_mesh`
    shapes: RunShapes | None = None  # what the programs are compiled for (None: asynchronous rounds, any)
    decode_layout: str = "the training layout"  # where decoding runs and why (`grpo_jax.device.rollout_layout`)
    rollout_func: RolloutFunc | None = None  # TRL's rollout_func: it makes the training passes' rows, not the sampler

    @property
    def keep_ref(self) -> bool:
        """Checkpoints carry ref_params only when the reference can move away from the initial weights."""
        return self.config.train.sync_ref_model


def prompt_group_sizes(config: Config, mesh) -> tuple[int, int]:
    """(G for a round's log-prob passes, G for the update) with `train.share_prompt_prefix`, else (1, 1).

    A round's rows are whole groups in order; a shared-prompt forward needs every device's rows to be whole
    groups too. The update shares prompts only when its batch is the whole round in one micro-batch
    (steps_per_generation = gradient_accumulation_steps = 1): then it takes the rows in order, where TRL
    shuffles them, which changes nothing but float summation order.
    """
    tc = config.train
    G = tc.num_generations
    if not tc.share_prompt_prefix or G == 1:
        return 1, 1
    shards = sharding.num_row_shards(mesh)
    round_g = G if (tc.generation_batch_size // shards) % G == 0 else 1
    # LoRA dropout draws a mask per row, as TRL's per-row forward does: a shared prompt would share its mask
    whole = tc.steps_per_generation == 1 and tc.gradient_accumulation_steps == 1 and config.model.lora.dropout == 0
    step_g = G if whole and (tc.train_batch_size // shards) % G == 0 else 1
    return round_g, step_g
