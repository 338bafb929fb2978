"""Everything a run builds once before its loop: output folder, tokenizer and data, rewards, mesh, state, programs.

`build(config)` resolves a `Config` into an immutable `Run` and the initial `TrainState`; `grpo_jax.api.trainer`
drives them. A `model.path` (Hugging Face folder) supplies the architecture, weights (read straight into their
shards), tokenizer and EOS ids.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import numpy as np
import yaml

from grpo_jax.algo import programs
from grpo_jax.algo.state import TrainState, entropy_control, optimizer_from_config
from grpo_jax.algo.train_step import StepOptions
from grpo_jax.config import Config, for_run, resolve_defaults, to_dict
from grpo_jax.data import prompts as data, sources, task
from grpo_jax.device import chips, cpu, distributed, rollout_layout, sharding
from grpo_jax.io import checkpoint, lock, runs, trackers
from grpo_jax.models import ModelConfig, abstract_model, eos_token_ids, from_pretrained, lora, peft_io, resolve_config
from grpo_jax.rewards import code_fingerprints, reward_specs, functions as rewards
from grpo_jax.rollout import evaluation, shapes
from grpo_jax.rollout.context import Run, prompt_group_sizes
from grpo_jax.rollout.rollout_func import RolloutFunc
from grpo_jax.tools import tool_task, calls as tools

HELD_OUT_POOL = 16  # the embedded task draws this many prompts per held-out one asked, to find unseen ones


def _load_data(config: Config, output_dir: Path, train_dataset=None, eval_dataset=None, tool_specs=(),
               environment_factory=None):
    """The tokenizer, the training prompts tokenized (`data.Dataset`, left-padded to the run's prompt length L), the
    held-out rows (`grpo_jax.data.sources`) and the run's `tools.Tooling`: from files or datasets (or those given from
    Python), or the embedded task written to files. Prompts are rendered with their rows' tools."""
    tokenizer_dir = config.data.tokenizer_path or config.model.path  # a model folder holds its tokenizer
    given_data = config.data.path is not None or train_dataset is not None
    if not given_data:
        d = config.data
        lookup = d.task == "lookup"  # the multi-turn task: its own tokenizer and rows (`tool_task`)
        build = tokenizer_dir is None
        tokenizer_dir = output_dir / "tokenizer" if build else tokenizer_dir
        make = tool_task.make_examples if lookup else functools.partial(task.make_examples, d.task)
        train_rows = make(d.task_num_train, config.seed, d.task_min_len, d.task_max_len)
        n = config.eval.num_examples
        if lookup:  # a lookup row's value is drawn per row: nothing to hold out
            eval_rows = make(n, config.seed + 1_000_003, d.task_min_len, d.task_max_len)
        else:  # n prompts unseen in training where the task has them (drawn from a larger pool), else seen ones
            seen = {r["prompt"] for r in train_rows}
            pool = make(HELD_OUT_POOL * n, config.seed + 1_000_003, d.task_min_len, d.task_max_len)
            eval_rows = [r for r in pool if r["prompt"] not in seen][:n] or pool[:n]

        def write() -> None:
            if build:
                (tool_task if lookup else task).build_tokenizer(tokenizer_dir)
            (output_dir / "data").mkdir(exist_ok=True)
            task.write_jsonl(output_dir / "data" / "train.jsonl", train_rows)
            if eval_rows:
                task.write_jsonl(output_dir / "data" / "eval.jsonl", eval_rows)

        sharding.from_first_process(write)  # one writer: the other processes read the tokenizer once it is there
        train_where, train_lines, eval_where, eval_lines = "the embedded task", None, "its held-out rows", None
    else:
        if tokenizer_dir is None:
            raise ValueError("the prompts come from a dataset but neither data.tokenizer_path nor model.path is set: "
                             "point one of them at a Hugging Face folder holding the tokenizer")
        if train_dataset is not None:
            train_where, train_lines = "train_dataset", None
            train_rows = sources.from_python(train_dataset, train_where)
        else:
            train_where = config.data.path
            train_rows, train_lines = sources.load_rows(config.data.path, split=config.data.split,
                                                        config_name=config.data.config_name)
        eval_rows, eval_lines, eval_where = [], None, None
        if eval_dataset is not None:
            eval_where, eval_rows = "eval_dataset", sources.from_python(eval_dataset, "eval_dataset")
        elif config.eval.path:
            eval_where = config.eval.path
            eval_rows, eval_lines = sources.load_rows(config.eval.path, split=config.eval.split,
                                                      config_name=config.data.config_name, key="eval.path")
        if len(eval_rows) > config.eval.num_examples:
            eval_rows = eval_rows[: config.eval.num_examples] if isinstance(eval_rows, list) else \
                eval_rows.select(range(config.eval.num_examples))
    tokenizer_dir = Path(tokenizer_dir).absolute()
    tokenizer = data.load_tokenizer(tokenizer_dir, "data.tokenizer_path" if config.data.tokenizer_path else
                                    "model.path")
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer in {str(tokenizer_dir)!r} has no eos_token: set one in its tokenizer_config.json")
    if tokenizer.pad_token_id is None:  # Llama 3 has none: pad with EOS, as TRL does
        tokenizer.pad_token = tokenizer.eos_token
    if config.model.vocab_size is not None and len(tokenizer) > config.model.vocab_size:
        raise ValueError(f"model.vocab_size={config.model.vocab_size} is smaller than the tokenizer's "
                         f"{len(tokenizer)} tokens ({tokenizer_dir}): raise model.vocab_size or leave it unset")
    tooling = tools.build(tool_specs, environment_factory, tokenizer, timeout=config.sampling.tool_timeout,
                          max_iterations=config.sampling.max_tool_calling_iterations,
                          max_model_len=config.model.max_position_embeddings,
                          template_kwargs=config.data.template_kwargs)
    train_tools = eval_tools = template = None
    if tooling is not None:
        train_tools = tooling.row_schemas(train_rows, train_where)
        eval_tools = tooling.row_schemas(eval_rows, eval_where)
        template = tooling.chat_template
    # every row is checked before the first step: a bad one fails now, naming its line, not halfway through
    limit, truncation = config.data.max_prompt_length, config.data.truncation
    tokens, offsets = data.check_prompts(train_where, data.prompt_column(train_rows), train_lines, tokenizer, limit,
                                         truncation, tools=train_tools, chat_template=template,
                                         template_kwargs=config.data.template_kwargs)
    lengths = np.diff(offsets)
    if len(eval_rows):
        _, eval_offsets = data.check_prompts(eval_where, data.prompt_column(eval_rows), eval_lines, tokenizer, limit,
                                             "left", tools=eval_tools, chat_template=template,
                                             template_kwargs=config.data.template_kwargs)
        lengths = np.concatenate([lengths, np.diff(eval_offsets)])
    length = _prompt_length(limit, lengths)
    _check_positions(config, np.minimum(lengths, length))
    dataset = data.Dataset(train_rows, tokens, offsets, length, tokenizer.pad_token_id,
                           sources.fingerprint(train_rows, train_where,
                                               path=None if train_dataset is not None else config.data.path),
                           shuffle=config.data.shuffle)
    return tokenizer, tokenizer_dir, dataset, list(eval_rows), tooling


PROMPT_LENGTH_MULTIPLE = 16  # data.max_prompt_length: null rounds the longest prompt up to this


def _prompt_length(limit: int | None, lengths: np.ndarray) -> int:
    """The prompt length L of the run: `data.max_prompt_length`, or the longest prompt rounded up; prompts longer
    than an explicit L are warned about once, with their count (they lose their first tokens every round)."""
    longest = int(lengths.max())
    if limit is None:
        return -(-longest // PROMPT_LENGTH_MULTIPLE) * PROMPT_LENGTH_MULTIPLE
    over = int((lengths > limit).sum())
    if over:
        warnings.warn(f"{over} of {len(lengths)} prompts are longer than data.max_prompt_length={limit} tokens (the "
                      f"longest: {longest}): they lose their first tokens (a system message, the question's start) "
                      "every time they are sampled; raise data.max_prompt_length, set it to null (the longest "
                      "prompt), or data.truncation=error to refuse them", RuntimeWarning, stacklevel=3)
    return limit


def _check_positions(config: Config, lengths: np.ndarray) -> None:
    """Prompts (as truncated) whose tokens and a whole completion pass the model's `max_position_embeddings`: warned
    about once with their count, or refused with data.truncation=error, as prompts past data.max_prompt_length."""
    positions, T = config.model.max_position_embeddings, config.sampling.max_completion_length
    over = int((lengths + T > positions).sum())
    if not over:
        return
    fix = f"lower sampling.max_completion_length below {positions}"
    if positions > T:
        fix = (f"lower data.max_prompt_length to {positions - T} (longer prompts lose their first tokens) or "
               "sampling.max_completion_length")
    text = (f"{over} of {len(lengths)} prompts (the longest: {int(lengths.max())} tokens) plus sampling."
            f"max_completion_length={T} tokens pass model.max_position_embeddings={positions}: their completions run "
            f"past the positions the model knows; {fix}")
    if config.data.truncation == "error":
        raise ValueError(text)
    warnings.warn(text, RuntimeWarning, stacklevel=3)



def check_async(config: Config, num_devices: int) -> None:
    """Asynchronous rounds (`train.max_staleness`, `mesh.rollout`) need one process, and the split placement a
    device left to train on: one-line ValueErrors naming the key."""
    if (config.train.max_staleness or config.mesh.rollout) and jax.process_count() > 1:
        raise ValueError(f"train.max_staleness={config.train.max_staleness} / mesh.rollout={config.mesh.rollout} "
                         f"run in one process, not {jax.process_count()}: set both to 0 for a multi-host run")
    if config.mesh.rollout >= num_devices:
        raise ValueError(f"mesh.rollout={config.mesh.rollout} leaves none of the {num_devices} devices to train on: "
                         f"set it below {num_devices} (0: sample and train on every device)")


def _check_data_file(key: str, path: str | None) -> None:
    """A path that names a data file (not a glob, folder or dataset id) must exist: known before anything loads."""
    if path is not None and Path(path).suffix.lower() in (".jsonl", ".json", ".parquet", ".csv") \
            and not any(c in path for c in "*?[") and not Path(path).exists():
        raise ValueError(f"{key}={path!r} does not exist: point it at a JSONL, JSON, Parquet or CSV file (or a glob, a "
                         "save_to_disk folder, a cached dataset id)")


def check_inputs(config: Config, *, reward_funcs=None, train_dataset=None, eval_dataset=None,
                 eval_reward_funcs=None) -> None:
    """What a config names outside itself, checked before anything is built: data files and the tokenizer folder
    exist, reward functions and the answer extractor import, report_to's packages are installed. Each failure is a
    one-line ValueError naming the key."""
    trackers.check_installed(config.report_to)
    if train_dataset is None:
        _check_data_file("data.path", config.data.path)
    given = "train_dataset" if train_dataset is not None else None if config.data.path is None else "data.path"
    if given and config.model.path is None and config.model.init != "random":
        raise ValueError(f"{given} without model.path: set model.path to the Hugging Face model folder to fine-tune, "
                         "or model.init=random to train a randomly initialised model of the model.* sizes")
    if config.data.tokenizer_path is not None and not Path(config.data.tokenizer_path).is_dir():
        raise ValueError(f"data.tokenizer_path={config.data.tokenizer_path!r} is not a folder: point it at a saved "
                         "tokenizer")
    reward_specs.check_importable("reward.functions", config.reward.functions if reward_funcs is None else reward_funcs)
    if eval_dataset is None:
        _check_data_file("eval.path", config.eval.path)
    eval_paths = config.eval.reward_functions if eval_reward_funcs is None else eval_reward_funcs
    reward_specs.check_importable("eval.reward_functions" if eval_reward_funcs is None else "eval_reward_funcs",
                             eval_paths or ())
    reward_specs.check_importable("eval.answer_extractor", (config.eval.answer_extractor,))


def router_aux_loss_coef(config: Config) -> float:
    """`loss.router_aux_loss_coef` resolved as TRL resolves it: None takes the model's own (config.json's) for a
    mixture of experts and 0 for a dense model; a coefficient for a dense model, or routing replay without experts
    (both known once model.path is read), is an error."""
    model, coef = config.model, config.loss.router_aux_loss_coef
    if model.routing_replay and not model.num_experts:
        raise ValueError(f"model.routing_replay=true but {model.path or 'the model'} is not a mixture of experts "
                         f"(model_type {model.model_type!r}): set model.routing_replay=false")
    if coef is None:
        return model.router_aux_loss_coef if model.num_experts else 0.0
    if coef and not model.num_experts:
        raise ValueError(f"loss.router_aux_loss_coef={coef} but the model (model_type {model.model_type!r}) has no "
                         "experts: set it to null or 0")
    return float(coef)


def build(config: Config, *, loss_fn: Callable | None = None, train_dataset=None, eval_dataset=None,
          reward_funcs: Sequence[Callable | str] | None = None, tools: Sequence[Callable | str] | None = None,
          environment_factory=None, eval_reward_funcs: Sequence[Callable | str] | None = None,
          reward_processing_classes=None, restart: bool = False,
          rollout_func: Callable[[list, object], dict] | None = None) -> tuple[Run, TrainState, lock.RunLock]:
    """Resolves data, rewards, mesh, optimizer and the initial train state; builds the device programs.

    `loss_fn` replaces `grpo_jax.losses.compute_loss` in the train step (same signature; see
    `grpo_jax.algo.train_step`): the hook for a custom loss variant. As TRL's GRPOTrainer takes them,
    `train_dataset` / `eval_dataset` (a `datasets.Dataset` or a list of dicts) replace `data.path` / `eval.path`,
    `reward_funcs` (callables, 'module:function' paths, reward model folders or transformers
    `*ForSequenceClassification` objects, whose tokenizers `reward_processing_classes` gives) replaces
    `reward.functions` and `eval_reward_funcs` `eval.reward_functions`; `tools` and `environment_factory` replace
    the config's; `rollout_func` (TRL's, bound to its trainer: (prompts, trainer_state) -> dict) makes the training
    passes' rows instead of the sampler (`rollout.rollout_func`). None of these is part of `config.yaml`: a resumed
    run must be given them again.
    An `output_dir` holding a run is checked against its config.yaml (`checkpoint.check_compatible`), or with
    `restart` set aside for a new run (`runs.open_folder`). Returns
    the run, its initial train state and `output_dir`'s lock, held (a ValueError names the process holding it
    already) until its `release()`, which `train` calls at its end.
    """
    check_inputs(config, reward_funcs=reward_funcs, train_dataset=train_dataset, eval_dataset=eval_dataset,
                 eval_reward_funcs=eval_reward_funcs)
    if jax.process_count() > 1:  # processes started differently stop here together, before a folder is touched
        started = to_dict(config)  # the processes differ in their id only
        started["distributed"] = {**started["distributed"], **distributed.resolved_arguments(config.distributed),
                                  "process_id": None}
        distributed.check_same({"config": started, "code": distributed.code_fingerprint()}, "configs or code")
    config = runs.resolve(config)  # resume_from_checkpoint: the run folder it names or finds, as output_dir
    programs.use_compilation_cache(config.compilation_cache_dir)
    output_dir, resuming, held = runs.open_folder(config, multihost=jax.process_count() > 1, restart=restart)
    tool_specs = config.tools if tools is None else tuple(tools)
    factories = config.environment_factory if environment_factory is None else environment_factory
    try:
        run, state = _build(config, output_dir, resuming, loss_fn, train_dataset, eval_dataset, reward_funcs,
                            tool_specs, factories, eval_reward_funcs, reward_processing_classes, rollout_func)
    except BaseException:
        if not resuming and jax.process_index() == 0:
            runs.remove_setup_files(output_dir)
        held.release()
        raise
    return run, state, held


def _build(config: Config, output_dir: Path, resuming: bool, loss_fn: Callable | None,
           train_dataset, eval_dataset, reward_funcs, tool_specs, factories, eval_reward_funcs,
           processing_classes, rollout_func) -> tuple[Run, TrainState]:
    speedups = cpu.enabled(config.cpu_speedups)
    if speedups:
        cpu.configure_host_allocator(config.host_allocator)  # before the first jitted call allocates
    # a null learning rate: the resumed run's, else by model.path; config.yaml records it, so a resume is unchanged
    saved = None
    if resuming:  # compared with the learning rate resolved as below
        saved, now = runs.saved_config(output_dir, config)
        checkpoint.check_compatible(saved, now)
    config = resolve_defaults(config, saved)
    given = to_dict(config)  # config.yaml: as given, written once the run has built
    # a model.path fills the architecture, a model.lora.path the adapters' rank, alpha and targets
    model_config = resolve_config(config.model)
    model_config = dataclasses.replace(model_config, lora=peft_io.resolve_lora(model_config.lora))
    config = dataclasses.replace(config, model=model_config)
    aux_loss_coef = router_aux_loss_coef(config)
    tokenizer, tokenizer_dir, dataset, eval_rows, tooling = _load_data(config, output_dir, train_dataset,
                                                                       eval_dataset, tool_specs, factories)
    config = dataclasses.replace(config, data=dataclasses.replace(config.data,
                                                                  max_prompt_length=dataset.max_prompt_length))
    if config.model.vocab_size is None:
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, vocab_size=len(tokenizer)))
    devices = jax.devices()
    check_async(config, len(devices))
    # split placement: the first mesh.rollout devices sample, the others train
    mesh = sharding.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor, expert=config.mesh.expert,
                              devices=devices[config.mesh.rollout:])
    # TRL's per-device batch, epochs and warmup ratio in our counts, now that devices and prompts are known
    config = for_run(config, row_devices=sharding.num_row_shards(mesh), num_prompts=len(dataset))
    tc = config.train
    lengths = dict(max_completion_length=config.sampling.max_completion_length,
                   soft_punish_cache=config.reward.soft_punish_cache, template_kwargs=config.data.template_kwargs)
    reward_fns = reward_specs.resolve_all(config.reward.functions if reward_funcs is None else reward_funcs, mesh,
                                     processing_classes=processing_classes, **lengths)
    if config.reward.weights is not None and len(config.reward.weights) != len(reward_fns):
        raise ValueError(f"reward.weights has {len(config.reward.weights)} entries for the {len(reward_fns)} "
                         "reward_funcs: give one weight per function")
    eval_paths = evaluation.reward_functions(config, given_data=config.data.path is not None or train_dataset
                                             is not None, held_out=bool(eval_rows), eval_reward_funcs=eval_reward_funcs)
    eval_reward_fns = list(reward_fns) if eval_paths is None else reward_specs.resolve_all(eval_paths, mesh, **lengths)
    # a reward function that fails on its first call does so now, not after the sampler compiled
    where = "train_dataset" if train_dataset is not None else config.data.path or "the embedded task"
    if rollout_func is None:  # a rollout_func's rows carry the fields it returns, known once it runs
        rewards.check_reward_fns(reward_fns, [dataset.rows[i] for i in range(min(2, len(dataset)))],
                                 tokenizer.eos_token_id, where=where,
                                 process=config.train.advantage_estimator == "process")
    elif tooling is not None or config.model.routing_replay:
        raise ValueError("rollout_func makes whole rows, tool calls included, and records no routing: give it "
                         "without tools / environment_factory and with model.routing_replay=false")
    rewards.check_reward_fns(eval_reward_fns, eval_rows[:2], tokenizer.eos_token_id,
                             where="eval_dataset" if eval_dataset is not None else config.eval.path or where)
    # environments' get_reward, weight 1 each (`scoring.reward_weights`), named after the class; they need the rollouts'
    # environments, so the empty-completion check above does not call them
    reward_fns += tools.env_rewards(tooling)
    sharding.check_rows(tc.train_batch_size // tc.gradient_accumulation_steps, mesh,
                        "train.train_batch_size / train.gradient_accumulation_steps")
    if jax.process_count() > 1:
        distributed.check_same({"data": dataset.fingerprint, "eval_data": distributed.digest(eval_rows),
                                "code": code_fingerprints.fingerprint(reward_fns, tooling)}, "data or reward code")
    schedule, optimizer = optimizer_from_config(tc, config.max_steps)
    state_options = dict(seed=config.seed, with_reference=config.loss.beta != 0.0, mesh=mesh,
                         ref_param_dtype=tc.ref_param_dtype, offload_ref_params=tc.offload_ref_params)
    if config.model.path is None:
        graphdef, state = programs.init_state(config.model, optimizer, **state_options)
    else:  # each tensor read from the safetensors straight into its shard
        model, abstract_params = abstract_model(config.model)
        shardings = sharding.param_shardings(mesh, abstract_params)
        params = pretrained_params(config.model, config.seed, shardings)
        graphdef, state = model.graphdef, programs.state_from_params(params, optimizer, **state_options)
    control = entropy_control(config.loss)  # the adaptive entropy bonus's, in the state: a resume carries it on
    if control is not None:
        state = state._replace(entropy_control=jax.device_put(control, sharding.replicated(mesh)))
    graphdef = cpu.packed_attention(cpu.linear_layers(graphdef, state.params, speedups), state.params, speedups)
    graphdef = cpu.grouped_experts(graphdef, state.params, speedups)
    if config.model.path:
        eos_ids = eos_token_ids(config.model.path, tokenizer)
    elif config.data.path is None and config.data.task == "lookup":  # a turn also ends at its tool call
        eos_ids = tool_task.stop_token_ids(tokenizer)
    else:
        eos_ids = (tokenizer.eos_token_id,)
    loss_config = dataclasses.replace(config.loss, max_completion_length=config.sampling.max_completion_length)
    round_group, step_group = prompt_group_sizes(config, mesh)
    options = StepOptions(loss=loss_config, temperature=config.sampling.temperature,
                          gradient_accumulation_steps=tc.gradient_accumulation_steps,
                          logps_chunk_size=tc.logps_chunk_size, prompt_group_size=step_group,
                          ref_sync=tc.ref_sync, loss_fn=loss_fn, router_aux_loss_coef=aux_loss_coef,
                          # decoupled PPO's behaviour weight is the IS correction against the sampler's log-probs
                          use_sampler_logps=tc.use_sampler_logps or config.loss.off_policy_correction == "decoupled")
    state_sharding = sharding.tree_shardings(state)

    def choose_layout(over, state_bytes: int):  # decoding's own layout over the devices ``over`` (None: none)
        return rollout_layout.choose(
            config.mesh.rollout_tensor, config.model, over, chip=chips.device_chip(devices[0].device_kind),
            rows=config.sampling.max_batch_rows or tc.generation_batch_size,
            prompt=config.data.max_prompt_length, completion=config.sampling.max_completion_length,
            abstract_params=state.params, state_bytes=state_bytes)

    layout = None if config.mesh.rollout else choose_layout(mesh, rollout_layout.bytes_per_device(state,
                                                                                                  state_sharding))
    decoding = dict(eos_token_ids=eos_ids, pad_token_id=tokenizer.pad_token_id,
                    params_sharding=state_sharding.params, cpu_speedups=speedups,
                    rollout=programs.rollout_placement(mesh, layout, state.params))
    decoder = programs.jit_decoder(graphdef, mesh, config.model, config=config.sampling,
                                   prompt_group_size=tc.num_generations, **decoding)
    eval_decoder = None
    if config.eval.num_generations and eval_rows:  # evaluation's sampled completions, at their own temperature
        eval_sampling = dataclasses.replace(config.sampling, temperature=config.eval.temperature)
        eval_decoder = programs.jit_decoder(graphdef, mesh, config.model, config=eval_sampling,
                                            prompt_group_size=config.eval.num_generations, **decoding)
    advantage_options = dict(estimator=tc.advantage_estimator, scale_rewards=tc.scale_rewards,
                             multi_objective_aggregation=tc.multi_objective_aggregation,
                             num_generations=tc.num_generations)
    run_programs = programs.build(graphdef, optimizer, options, mesh, state_sharding, decoder=decoder,
                                  round_prompt_group_size=round_group, advantage_options=advantage_options,
                                  mask_truncated=tc.mask_truncated_completions, eval_decoder=eval_decoder)
    rollout_mesh = rollout_programs = None
    if config.mesh.rollout:
        rollout_mesh = sharding.make_mesh(config.mesh.rollout, 1, 1, devices=devices[:config.mesh.rollout])
        # the sampling devices in decoding's own layout: each holds 1 / g of the params versions, not a whole copy
        layout = choose_layout(rollout_mesh, 0)
        if layout is not None:
            rollout_mesh = rollout_layout.rollout_mesh(rollout_mesh, layout)
        sharding.check_rows(tc.generation_batch_size, rollout_mesh, "train.train_batch_size * "
                            "train.steps_per_generation (a round's rows, over mesh.rollout)")
        params_sharding = sharding.param_shardings(rollout_mesh, state.params)
        rollout_decoder = programs.jit_decoder(graphdef, rollout_mesh, config.model, config=config.sampling,
                                               prompt_group_size=tc.num_generations,
                                               **{**decoding, "params_sharding": params_sharding, "rollout": None})
        rollout_programs = programs.build(
            graphdef, optimizer, options, rollout_mesh, TrainState(params_sharding, None, None, None, None),
            decoder=rollout_decoder, round_prompt_group_size=prompt_group_sizes(config, rollout_mesh)[0],
            advantage_options=advantage_options, mask_truncated=tc.mask_truncated_completions)
    run_shapes = None  # asynchronous rounds: their sampler's programs are not compiled ahead (`shapes.compile_ahead`)
    if not (tc.max_staleness or config.mesh.rollout):
        run_shapes = shapes.run_shapes(config, mesh, shapes.prompt_range(dataset), round_group_size=round_group,
                                       step_group_size=step_group,
                                       decode_chunks=decoder.chunks(tc.generation_batch_size, tc.num_generations))
    if jax.process_index() == 0:
        (output_dir / "config.yaml").write_text(yaml.safe_dump(given, sort_keys=False))
        # what ran: TRL's per-device batch and epochs as counts, the model folder's architecture, the prompt length
        (output_dir / "resolved.yaml").write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
    run = Run(config=config, output_dir=output_dir, tokenizer=tokenizer, tokenizer_path=tokenizer_dir,
              dataset=dataset, eval_rows=eval_rows, reward_fns=reward_fns, eval_reward_fns=eval_reward_fns,
              mesh=mesh, graphdef=graphdef, schedule=schedule, programs=run_programs,
              step_prompt_group_size=step_group, round_prompt_group_size=round_group, resuming=resuming,
              tooling=tooling, rollout_mesh=rollout_mesh, rollout_programs=rollout_programs,
              shapes=run_shapes, decode_layout="the training layout" if layout is None else layout.reason,
              rollout_func=None if rollout_func is None else RolloutFunc(rollout_func, eos_ids,
                                                                          tokenizer.pad_token_id))
    return run, state


def pretrained_params(model_config: ModelConfig, seed: int, shardings=None):
    """The params of `model_config.path`'s folder (resolved: `registry.resolve_config`, `peft_io.resolve_lora`),
    each tensor read into its shard (`shardings`: the model's params' shardings; None: the default device), with
    the LoRA adapters of `model_config.lora.path`, or else fresh ones for `seed` when it has adapters."""
    _, params = from_pretrained(model_config.path, config=lora.base_config(model_config), shardings=shardings)
    if model_config.lora.path is not None:
        return lora.join(peft_io.load_adapters(model_config, shardings=shardings), params)
    if model_config.lora.enabled:
        return lora.join(programs.init_adapters(model_config, seed, shardings), params)
    return params
