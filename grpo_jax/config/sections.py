"""The config sections: nested frozen dataclasses that check their own values (never files or user code).

Each section validates itself in `__post_init__` with a message that names the field and the fix. Checks that touch
the filesystem or import reward modules run when the run is built (`grpo_jax.api.run.check_inputs`). Option names follow
TRL's `GRPOConfig` where the concept exists. The model and loss sections are `grpo_jax.config.model` and
`grpo_jax.config.loss`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing

# a field holding a JSON object as text: a YAML mapping or a dict given for it is written as JSON, a text is checked
# to be one (`_coerce`), so a saved config.yaml and a checkpoint's flat keys keep it as one value
JSONObject = typing.NewType("JSONObject", str)


def check(ok: bool, message: str) -> None:
    """A ValueError with `message` (which names the field and the fix) unless `ok`: every config's validation."""
    if not ok:
        raise ValueError(message)


def check_interval(where: str, value: float, interval: str, why: str = "") -> None:
    """A ValueError unless `value` lies in `interval` ("[0, 1)", "(0, inf)": inf bounds are open, so NaN and inf are
    refused too), naming `where`, the range and `why` the range is what it is."""
    low, high = (float(bound) for bound in interval[1:-1].split(","))
    above = value > low if interval[0] == "(" else value >= low
    below = value < high if interval[-1] == ")" else value <= high
    wanted = f"in {interval}"
    if high == math.inf:
        wanted = ("finite and " if math.isfinite(low) and not math.isfinite(value) else "") + \
            f"{'>' if interval[0] == '(' else '>='} {interval[1:].split(',')[0]}"
    check(above and below, f"{where}={value} must be {wanted}" + (f" ({why})" if why else ""))


TASK_REWARDS = ("grpo_jax.data.task:char_accuracy", "grpo_jax.data.task:exact_match")
ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce_pp_baseline", "process")
SCALE_REWARDS = ("group", "batch", "none")
MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
HOST_ALLOCATORS = ("retain", "system")
REPORT_TO = ("jsonl", "tensorboard", "wandb")
SOFT_OVERLONG = "grpo_jax.rewards.functions:soft_overlong_punishment"


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where prompts come from: a file, folder or cached dataset (`grpo_jax.data.sources`), or the embedded synthetic
    task when `path` is None."""

    path: str | None = None  # JSONL/JSON/Parquet/CSV file or glob, save_to_disk folder, or cached dataset id
    split: str = "train"  # the split of a save_to_disk DatasetDict or a cached dataset id
    config_name: str | None = None  # a cached dataset's configuration (datasets' `name`)
    tokenizer_path: str | None = None  # Hugging Face tokenizer folder; None: model.path's, else the built-in one
    task: str = "reverse"  # embedded task when path is None: reverse, sort, add; lookup (multi-turn, a tool)
    task_min_len: int = 4
    task_max_len: int = 4
    task_num_train: int = 20000
    max_prompt_length: int | None = None  # left-padded (static shapes) to this; None: the data's longest prompt
    truncation: str = "left"  # left: keep the last tokens (warned once); error: refuse long prompts
    allow_changed: bool = False  # resume over data that differ from the checkpoint's fingerprint (warned), not refuse
    shuffle: bool = True  # TRL's shuffle_dataset: each epoch in its own seeded order; false: the rows' own order
    # TRL's chat_template_kwargs: a JSON object of arguments for the chat template (prompts, tool turns, reward
    # models), e.g. '{"enable_thinking": false}' for Qwen3
    chat_template_kwargs: JSONObject | None = None

    def __post_init__(self):
        check(self.task in ("reverse", "sort", "add", "lookup"),
               f"data.task={self.task!r} is unknown: use reverse, sort, add or lookup (or set data.path to a JSONL "
               "file)")
        check(1 <= self.task_min_len <= self.task_max_len,
               f"data.task_min_len={self.task_min_len}, data.task_max_len={self.task_max_len}: "
               "need 1 <= task_min_len <= task_max_len")
        check(self.task_num_train >= 1, f"data.task_num_train={self.task_num_train} must be >= 1")
        check(self.max_prompt_length is None or self.max_prompt_length >= 1,
              f"data.max_prompt_length={self.max_prompt_length} must be >= 1, or null (fit the data)")
        check(self.truncation in ("left", "error"),
               f"data.truncation={self.truncation!r}: use 'left' (truncate and count) or 'error'")

    @property
    def template_kwargs(self) -> dict:
        """`chat_template_kwargs` as keyword arguments ({} when unset; checked when the config is read)."""
        return {} if self.chat_template_kwargs is None else json.loads(self.chat_template_kwargs)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Sampling hyper-parameters (TRL GRPOConfig names); filters follow HF logits warpers.

    ``host_threads`` (grpo_jax only; used when ``cpu_speedups`` is on) splits a one-device decoding call's rows into
    that many chunks, each decoded from its own host thread (`stream.decode`). The tokens do not depend on it.
    0: one per CPU core on a one-device CPU mesh, else 1 (`cpu.host_chunks`).

    ``max_batch_rows`` (grpo_jax only) N > 0 fewer than a call's rows: continuous batching (`grpo_jax.algo.decoder`),
    N rows decode at once and a row that ends hands its slot to the next waiting row. The tokens do not depend on
    it. 0: every row of the call decodes at once until the longest ends. None: chosen round by round from the
    measured time of a decode step (`stream.plan_slots`).

    With tools (`Config.tools`, `Config.environment_factory`) a completion holds every turn and its tool results,
    all within ``max_completion_length``; ``max_tool_calling_iterations`` (TRL's) caps a rollout's rounds of tool
    calls (None: no cap) and ``tool_timeout`` (grpo_jax) a call's seconds, past which its result is an error.

    ``kv_cache`` (grpo_jax): the decoding KV cache, ``contiguous`` (prompt + completion per slot) or ``paged``
    (`models.paged`: pages of ``kv_page_size`` tokens from a pool of ``kv_cache_tokens``, 0: every slot's whole
    row, or on TPU/GPU what fits beside the weights, `rollout_layout.choose`); ``auto``: paged on TPU/GPU meshes (a
    pool per row shard), contiguous on CPUs (`programs.paged_page_size`).

    ``num_beams`` > 1 (transformers' generation names, TRL's ``generation_kwargs``): each row is the best of a beam
    search of that many beams (`grpo_jax.algo.beam`; sampling: transformers' beam sampling), hypotheses ranked by
    their log-probability over their length to the power ``length_penalty``; ``early_stopping`` (false: transformers'
    heuristic, true: once a row has ``num_beams`` finished hypotheses, "never": only when none can improve)."""

    max_completion_length: int = 8
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    host_threads: int = 0
    max_batch_rows: int | None = None
    max_tool_calling_iterations: int | None = None
    tool_timeout: float = 60.0
    kv_cache: str = "auto"
    kv_page_size: int = 16
    kv_cache_tokens: int = 0
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self):
        if not isinstance(self.max_completion_length, int) or self.max_completion_length < 1:
            raise ValueError(f"sampling.max_completion_length={self.max_completion_length!r} must be an "
                             "integer >= 1")
        check_interval("sampling.temperature", self.temperature, "(0, inf)",
                       "logits are divided by it; greedy=True takes the argmax")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"sampling.top_k={self.top_k!r} must be an integer >= 0 (0 disables it)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p={self.top_p} must be in (0, 1] (1.0 disables it)")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"sampling.min_p={self.min_p} must be in [0, 1) (0.0 disables it)")
        check_interval("sampling.repetition_penalty", self.repetition_penalty, "(0, inf)",
                       "1.0 disables it; > 1 discourages the row's prompt and completion tokens")
        if self.max_batch_rows is not None and (not isinstance(self.max_batch_rows, int) or self.max_batch_rows < 0):
            raise ValueError(f"sampling.max_batch_rows={self.max_batch_rows!r} must be an integer >= 0 (0: all of a "
                             "call's rows decode at once)")
        check(self.max_tool_calling_iterations is None or self.max_tool_calling_iterations >= 0,
              f"sampling.max_tool_calling_iterations={self.max_tool_calling_iterations} must be >= 0, or null (no cap)")
        check(self.tool_timeout > 0, f"sampling.tool_timeout={self.tool_timeout} must be > 0 seconds")
        check(self.kv_cache in ("auto", "paged", "contiguous"),
              f"sampling.kv_cache={self.kv_cache!r}: use 'auto', 'paged' or 'contiguous'")
        check(isinstance(self.kv_page_size, int) and self.kv_page_size >= 1,
              f"sampling.kv_page_size={self.kv_page_size!r} must be an integer >= 1 (tokens per page)")
        check(isinstance(self.kv_cache_tokens, int) and self.kv_cache_tokens >= 0,
              f"sampling.kv_cache_tokens={self.kv_cache_tokens!r} must be an integer >= 0 (0: every slot's whole row)")
        check(isinstance(self.num_beams, int) and not isinstance(self.num_beams, bool) and self.num_beams >= 1,
              f"sampling.num_beams={self.num_beams!r} must be an integer >= 1 (1: no beam search)")
        check(isinstance(self.length_penalty, (int, float)) and not isinstance(self.length_penalty, bool),
              f"sampling.length_penalty={self.length_penalty!r} must be a number (1.0: a hypothesis's mean log-prob)")
        check(self.early_stopping in (False, True, "never"),
              f"sampling.early_stopping={self.early_stopping!r}: use false, true or never")
        if not isinstance(self.host_threads, int) or self.host_threads < 0:
            raise ValueError(f"sampling.host_threads={self.host_threads!r} must be an integer >= 0 (0: one per CPU "
                             "core on CPU, 1 elsewhere)")


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """Reward functions by import path `module:function`, TRL's `fn(prompts, completions, **columns)`."""

    functions: tuple[str, ...] = TASK_REWARDS
    weights: tuple[float, ...] | None = None  # TRL's reward_weights; None: all 1
    soft_punish_cache: int = 0  # DAPO L_cache in tokens for grpo_jax.rewards.functions:soft_overlong_punishment
    allow_changed: bool = False  # resume with reward functions, tools or environments whose code changed (warned)

    def __post_init__(self):
        check(len(self.functions) >= 1, "reward.functions is empty: list at least one 'module:function'")
        check(self.soft_punish_cache >= 0, f"reward.soft_punish_cache={self.soft_punish_cache} must be >= 0")
        listed = SOFT_OVERLONG in self.functions
        check(listed == (self.soft_punish_cache > 0),
               f"reward.soft_punish_cache={self.soft_punish_cache} and reward.functions "
               f"{'lists' if listed else 'does not list'} {SOFT_OVERLONG}: the soft overlong punishment needs "
               "both (a cache > 0 and the function listed) or neither")
        if self.weights is not None:
            # the default functions may be replaced by reward_funcs from Python (TRL's GRPOTrainer): `build` checks
            check(len(self.weights) == len(self.functions) or self.functions == TASK_REWARDS,
                   f"reward.weights has {len(self.weights)} entries for {len(self.functions)} reward.functions: "
                   "give one weight per function")
            check(all(math.isfinite(w) for w in self.weights),
                   f"reward.weights={list(self.weights)}: every weight must be a finite number (a NaN or infinite "
                   "weight turns every reward into NaN, i.e. no reward)")


@dataclasses.dataclass(frozen=True)
class RefSyncConfig:
    """Static options of the reference update (TRL's GRPOConfig names; `grpo_jax.algo.reference`)."""

    sync_ref_model: bool = False
    ref_model_mixup_alpha: float = 0.6
    ref_model_sync_steps: int = 512


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """GRPO batch geometry, advantage scaling and the optimizer (TRL names)."""

    num_generations: int = 8  # G completions per prompt
    train_batch_size: int = 64  # rows (completions) per optimizer step, over all devices
    per_device_train_batch_size: int | None = None  # TRL's: set, train_batch_size = it x row devices x accumulation
    gradient_accumulation_steps: int = 1  # micro-batches inside one optimizer step
    steps_per_generation: int = 1  # optimizer steps per sampling round, on disjoint slices
    num_iterations: int = 1  # mu: passes over each round
    scale_rewards: str = "group"  # group, batch, none
    multi_objective_aggregation: str = "sum_then_normalize"  # or normalize_then_sum (GDPO)
    advantage_estimator: str = "grpo"  # grpo, rloo, reinforce_pp_baseline, process
    mask_truncated_completions: bool = False  # rows without EOS get mask 0 (DAPO overlong filtering)
    use_sampler_logps: bool = False  # hand the sampler's log-probs to the loss (TRL's vLLM log-probs role)
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, sample more
    max_num_gen_batches: int = 10  # dynamic sampling: sampling passes per round at most (then fill)
    sync_ref_model: bool = False  # TR-DPO: mix the policy into the reference every ref_model_sync_steps
    ref_model_mixup_alpha: float = 0.6  # 1.0: iterative GRPO (reset the reference to the policy)
    ref_model_sync_steps: int = 512
    learning_rate: float | None = None  # None: TRL's 1e-6 with model.path, 5e-4 for a random model (resolve_defaults)
    lr_scheduler_type: str = "constant"  # constant, linear, cosine
    warmup_steps: int = 0
    warmup_ratio: float = 0.0  # TRL's: with warmup_steps 0, ceil(warmup_ratio x max_steps) warmup steps
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0  # 0 disables clipping
    logps_chunk_size: int = 0  # rows per chunk for log-probs; 0: whole micro-batch at once
    share_prompt_prefix: bool = True  # run each group's prompt once in log-prob/update forwards (same numbers)
    packing: bool | None = None  # log-prob/update forwards over packed groups; null: when it costs fewer FLOPs
    packed_lengths: int = 2  # packed buffer lengths a run compiles before its first step (`grpo_jax.rollout.shapes`)
    ref_param_dtype: str | None = None  # reference params' storage dtype (float32, bfloat16); None: the params'
    offload_ref_params: bool = False  # keep the reference in pinned host memory (copied in for its log-probs)
    max_nonfinite_steps: int = 10  # steps skipped for a non-finite loss/gradient before the run stops
    stop_on_zero_gradient: bool = True  # stop after max_nonfinite_steps steps in a row of gradient norm 0 (TRL: off)
    max_staleness: int = 0  # k: round r samples with the params after step max(0, r*K - k) (`grpo_jax.rollout.async_rounds`)
    interruptible_rollouts: bool = False  # decode segment j of round r samples with the params after step
    # min(v(r) + j, max(v(r), r*K - 1)): rows still decoding continue with newer params

    def __post_init__(self):
        check(isinstance(self.max_staleness, int) and self.max_staleness >= 0,
              f"train.max_staleness={self.max_staleness!r} must be an integer >= 0 (0: synchronous rounds)")
        check(isinstance(self.packed_lengths, int) and self.packed_lengths >= 1,
              f"train.packed_lengths={self.packed_lengths!r} must be an integer >= 1 (buffer lengths compiled ahead; "
              "more: less padding, more compiling)")
        check(not self.interruptible_rollouts or self.max_staleness > 0,
              "train.interruptible_rollouts=true hands rounds newer params while they decode: it needs "
              "train.max_staleness > 0")
        for name in ("num_generations", "train_batch_size", "gradient_accumulation_steps",
                     "steps_per_generation", "num_iterations", "max_nonfinite_steps"):
            check(getattr(self, name) >= 1, f"train.{name}={getattr(self, name)} must be >= 1")
        check(self.num_generations >= 2,
               f"train.num_generations={self.num_generations}: GRPO needs >= 2 completions per prompt")
        check(0.0 <= self.warmup_ratio < 1.0, f"train.warmup_ratio={self.warmup_ratio} must be in [0, 1)")
        if self.per_device_train_batch_size is not None:  # the rows checks run once the device count is known
            check(isinstance(self.per_device_train_batch_size, int) and self.per_device_train_batch_size >= 1,
                  f"train.per_device_train_batch_size={self.per_device_train_batch_size!r} must be an integer >= 1")
            return self._check_rest()
        check(self.train_batch_size % self.gradient_accumulation_steps == 0,
               f"train.train_batch_size={self.train_batch_size} is not divisible by "
               f"train.gradient_accumulation_steps={self.gradient_accumulation_steps}: change either")
        check(self.generation_batch_size % self.num_generations == 0,
               f"train.train_batch_size * train.steps_per_generation = {self.generation_batch_size} rows per "
               f"round is not divisible by train.num_generations={self.num_generations}: make it a multiple")
        self._check_rest()

    def _check_rest(self):
        check(self.scale_rewards in ("group", "batch", "none"),
               f"train.scale_rewards={self.scale_rewards!r}: use group, batch or none")
        check(self.multi_objective_aggregation in MULTI_OBJECTIVE_AGGREGATIONS,
               f"train.multi_objective_aggregation={self.multi_objective_aggregation!r}: use "
               + " or ".join(MULTI_OBJECTIVE_AGGREGATIONS))
        check(self.advantage_estimator in ADVANTAGE_ESTIMATORS,
               f"train.advantage_estimator={self.advantage_estimator!r} is unknown: use "
               + ", ".join(ADVANTAGE_ESTIMATORS))
        check(self.advantage_estimator == "grpo" or self.multi_objective_aggregation == "sum_then_normalize",
               f"train.multi_objective_aggregation={self.multi_objective_aggregation!r} only applies to "
               f"train.advantage_estimator='grpo', not {self.advantage_estimator!r}: set it to sum_then_normalize")
        check(self.advantage_estimator == "grpo" or self.scale_rewards == "group",
               f"train.scale_rewards={self.scale_rewards!r} only applies to train.advantage_estimator='grpo': "
               f"{self.advantage_estimator!r} has its own scaling; leave scale_rewards at group")
        check(self.multi_objective_aggregation == "sum_then_normalize" or self.scale_rewards == "group",
               f"train.scale_rewards={self.scale_rewards!r} does not apply to train.multi_objective_aggregation="
               "'normalize_then_sum' (it normalises per function, then over the batch): leave scale_rewards at group")
        check(self.max_num_gen_batches >= 1, f"train.max_num_gen_batches={self.max_num_gen_batches} must be >= 1")
        check(0.0 < self.ref_model_mixup_alpha <= 1.0,
               f"train.ref_model_mixup_alpha={self.ref_model_mixup_alpha} must be in (0, 1] (1.0: iterative GRPO)")
        check(self.ref_model_sync_steps >= 1, f"train.ref_model_sync_steps={self.ref_model_sync_steps} must be >= 1")
        for name in ("learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon"):
            check(getattr(self, name) is None or math.isfinite(getattr(self, name)),
                   f"train.{name}={getattr(self, name)} must be a finite number (it would make every update NaN)")
        check(self.learning_rate is None or self.learning_rate > 0,
              f"train.learning_rate={self.learning_rate} must be > 0, or null (by model.path: 1e-6, else 5e-4)")
        for name in ("adam_beta1", "adam_beta2"):  # decay rates of Adam's moving averages; 1 never forgets step 0
            check_interval(f"train.{name}", getattr(self, name), "[0, 1)", "0.9 and 0.999 are usual")
        check_interval("train.weight_decay", self.weight_decay, "[0, inf)", "AdamW's decoupled decay; 0 disables it")
        check_interval("train.adam_epsilon", self.adam_epsilon, "(0, inf)",
                       "it keeps Adam's division by the second moment finite; 1e-8 is usual")
        check(self.lr_scheduler_type in ("constant", "linear", "cosine"),
               f"train.lr_scheduler_type={self.lr_scheduler_type!r}: use constant, linear or cosine")
        check(self.warmup_steps >= 0, f"train.warmup_steps={self.warmup_steps} must be >= 0")
        check(self.max_grad_norm >= 0, f"train.max_grad_norm={self.max_grad_norm} must be >= 0")
        check(self.logps_chunk_size >= 0, f"train.logps_chunk_size={self.logps_chunk_size} must be >= 0")
        check(self.ref_param_dtype in (None, "float32", "bfloat16"),
               f"train.ref_param_dtype={self.ref_param_dtype!r}: use float32, bfloat16 or null (the params' dtype)")

    @property
    def generation_batch_size(self) -> int:
        """Rows sampled per round: one optimizer step's batch per step of the round."""
        return self.train_batch_size * self.steps_per_generation

    @property
    def prompts_per_round(self) -> int:
        return self.generation_batch_size // self.num_generations

    @property
    def ref_sync(self) -> RefSyncConfig:
        """The reference-update options `train_step` needs (static)."""
        return RefSyncConfig(self.sync_ref_model, self.ref_model_mixup_alpha, self.ref_model_sync_steps)

    @property
    def steps_per_round(self) -> int:
        """K: the optimizer steps one round feeds (`steps_per_generation` slices, `num_iterations` times each)."""
        return self.steps_per_generation * self.num_iterations

    @property
    def needs_old_logps(self) -> bool:
        """Old log-probs differ from the current ones only when a round feeds more than one update."""
        return self.num_iterations > 1 or self.steps_per_generation > 1


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh shape (data, fsdp, tensor, expert; see grpo_jax/device/sharding.py): -1 on one axis takes the remaining
    devices. `rollout` > 0 sets that many devices apart for sampling (`grpo_jax.rollout.async_rounds`)."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    expert: int = 1  # mixture-of-experts models: experts split over this many devices (rows too)
    rollout: int = 0  # split placement: the first `rollout` devices sample, the rest train
    rollout_tensor: int = 0  # decoding's group (`grpo_jax.device.rollout_layout`): 0 chosen, -1 the training layout

    def __post_init__(self):
        check(isinstance(self.rollout_tensor, int) and self.rollout_tensor >= -1,
              f"mesh.rollout_tensor={self.rollout_tensor!r} must be an integer >= -1 (0: chosen from the model and "
              "chips, -1: decode in the training layout, n: tensor-parallel groups of n devices)")
        check(isinstance(self.rollout, int) and self.rollout >= 0,
              f"mesh.rollout={self.rollout!r} must be an integer >= 0 (0: sampling and training share every device)")
        sizes = (self.data, self.fsdp, self.tensor, self.expert)
        check(sizes.count(-1) <= 1, "mesh: at most one of mesh.data, mesh.fsdp, mesh.tensor, mesh.expert may be -1")
        check(all(s == -1 or s >= 1 for s in sizes), f"mesh sizes {sizes} must be >= 1 or -1")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation before, after and every `steps` steps of training: greedy, and `num_generations`
    sampled completions per prompt for pass@k and maj@n (`grpo_jax.rollout.evaluation`)."""

    num_examples: int = 200  # embedded task: held-out prompts generated with another seed
    path: str | None = None  # held-out prompts, any form data.path takes (with the columns the rewards need)
    split: str = "test"  # the split of a save_to_disk DatasetDict or a cached dataset id
    reward_functions: tuple[str, ...] | None = None  # None: the training ones (the embedded task: its own)
    steps: int = 500  # also evaluate every N optimizer steps (TRL's eval_steps); 0: before and after training only
    num_generations: int = 0  # n sampled completions per prompt (pass@k, maj@n); 0: greedy only
    temperature: float = 1.0  # of the sampled completions
    pass_at_k: tuple[int, ...] | None = None  # k of the pass@k reported; None: 1 and num_generations
    answer_extractor: str = "grpo_jax.rewards.math:extract_answer"  # completion text -> answer (or None), for maj@n

    def __post_init__(self):
        check(self.num_examples >= 0, f"eval.num_examples={self.num_examples} must be >= 0")
        check(self.reward_functions is None or len(self.reward_functions) >= 1,
              "eval.reward_functions is empty: list at least one 'module:function', or null (the training ones)")
        check(self.steps >= 0, f"eval.steps={self.steps} must be >= 0 (0: evaluate before and after training only)")
        check(self.num_generations >= 0, f"eval.num_generations={self.num_generations} must be >= 0 (0: greedy only)")
        check_interval("eval.temperature", self.temperature, "(0, inf)", "logits are divided by it")
        if self.pass_at_k is not None:
            check(all(1 <= k <= self.num_generations for k in self.pass_at_k),
                   f"eval.pass_at_k={list(self.pass_at_k)} needs 1 <= k <= eval.num_generations="
                   f"{self.num_generations} for every k: raise eval.num_generations or drop the larger k")

    @property
    def ks(self) -> tuple[int, ...]:
        """The k of the pass@k reported (none without sampled completions)."""
        if self.pass_at_k is not None:
            return tuple(sorted(set(self.pass_at_k)))
        return tuple(sorted({1, self.num_generations})) if self.num_generations else ()


DISTRIBUTED_MODES = ("never", "auto", "always")  # not off/on: YAML would read those as booleans


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """How this process joins a multi-process run (JAX's `jax.distributed.initialize` arguments)."""

    mode: str = "never"  # never: one process; auto: initialise when the env/cluster says so; always: initialise
    coordinator_address: str | None = None  # host:port of process 0; None: JAX_COORDINATOR_ADDRESS or detection
    num_processes: int | None = None  # None: JAX_NUM_PROCESSES or detection
    process_id: int | None = None  # None: JAX_PROCESS_ID or detection
    cpu_collectives: str | None = None  # CPU-only runs across processes: "gloo" (or "mpi")
    # seconds without a process's heartbeat before the others stop (a host lost); a slow tool or disk sends them on
    heartbeat_timeout: int = 60
    initialization_timeout: int = 300  # seconds the processes wait for each other to start
    shutdown_timeout: int = 300  # seconds a process that ends waits for the others to end

    def __post_init__(self):
        if self.mode not in DISTRIBUTED_MODES:
            raise ValueError(f"distributed.mode={self.mode!r}: use never, auto or always")
        if self.num_processes is not None and self.num_processes < 1:
            raise ValueError(f"distributed.num_processes={self.num_processes} must be >= 1 (or null)")
        if self.process_id is not None and self.process_id < 0:
            raise ValueError(f"distributed.process_id={self.process_id} must be >= 0 (or null)")
        if self.num_processes is not None and self.process_id is not None and self.process_id >= self.num_processes:
            raise ValueError(f"distributed.process_id={self.process_id} must be < distributed.num_processes="
                             f"{self.num_processes}")
        for key in ("heartbeat_timeout", "initialization_timeout", "shutdown_timeout"):
            if getattr(self, key) < 1:
                raise ValueError(f"distributed.{key}={getattr(self, key)} must be >= 1 (seconds)")
        if self.cpu_collectives not in (None, "gloo", "mpi"):
            raise ValueError(f"distributed.cpu_collectives={self.cpu_collectives!r}: use gloo, mpi or null")
