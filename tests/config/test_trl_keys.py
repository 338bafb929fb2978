"""TRL's names as config keys: every GRPOConfig / ModelConfig field handled, values written TRL's way, and a TRL name
and ours that disagree refused with both."""

import dataclasses
import warnings

import pytest
import yaml

from grpo_jax.config import Config, LoRAConfig, apply_overrides, load_config

LEAD_MAPS = {"resume_from_checkpoint"}  # mapped to our `resume` in the stop/resume work, not here


@pytest.mark.parametrize("overrides", [["beta=0.1", "loss.beta=0.2"], ["loss.beta=0.2", "beta=0.1"]])
def test_a_trl_name_and_ours_disagreeing_on_the_command_line_are_refused(overrides):
    with pytest.raises(ValueError) as error:
        load_config(None, overrides)
    message = str(error.value)
    assert "beta=0.1" in message and "loss.beta=0.2" in message and "\n" not in message, message


def test_a_trl_name_and_ours_disagreeing_in_a_file_are_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("learning_rate: 1.0e-6\ntrain:\n  learning_rate: 2.0e-6\n")
    with pytest.raises(ValueError, match=r"learning_rate=1e-06 and train.learning_rate=2e-06 set the same option"):
        load_config(str(path))
    path.write_text("gradient_checkpointing: true\nactivation_checkpointing: false\n")  # two TRL names, one option
    with pytest.raises(ValueError, match="gradient_checkpointing=True and activation_checkpointing=False|"
                                         "activation_checkpointing=False and gradient_checkpointing=True"):
        load_config(str(path))


def test_equal_values_under_both_names_are_one_option(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("learning_rate: 1e-6\ntrain:\n  learning_rate: 1.0e-6\nbeta: 0\nloss:\n  beta: 0.0\n")
    config = load_config(str(path), ["temperature=0.7", "sampling.temperature=0.70", "report_to=tensorboard",
                                     "report_to=[tensorboard]"])
    assert (config.train.learning_rate, config.loss.beta, config.sampling.temperature) == (1e-6, 0.0, 0.7)
    assert config.report_to == ("tensorboard",)


def test_the_command_line_overrides_a_file_under_either_name(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("beta: 0.1\nsampling:\n  temperature: 0.5\n")
    config = load_config(str(path), ["loss.beta=0.2", "temperature=0.9"])
    assert (config.loss.beta, config.sampling.temperature) == (0.2, 0.9)


@pytest.mark.parametrize("overrides, expected", [
    (["report_to=tensorboard"], dict(report_to=("tensorboard",))),
    (["report_to=none"], dict(report_to=())),
    (["report_to=[wandb, none]"], dict(report_to=("wandb",))),
    (["eval_steps=10"], dict(eval=dict(steps=10))),
    (["num_generations_eval=4"], dict(eval=dict(num_generations=4))),
    (["reward_funcs=grpo_jax.data.task:exact_match"], dict(reward=dict(functions=("grpo_jax.data.task:exact_match",)))),
    (["reward_funcs=[grpo_jax.data.task:exact_match, grpo_jax.data.task:char_accuracy]"],
     dict(reward=dict(functions=("grpo_jax.data.task:exact_match", "grpo_jax.data.task:char_accuracy")))),
    (["scale_rewards=false"], dict(train=dict(scale_rewards="none"))),
    (["bf16=true"], dict(model=dict(dtype="bfloat16"))),
    (["gradient_checkpointing=true"], dict(model=dict(remat="full"))),
    (["dtype=bfloat16"], dict(model=dict(param_dtype="bfloat16"))),
    (["min_p=null", "eval_steps=null", "bf16=null"], dict()),  # TRL's "unset": our defaults
    (["model_name_or_path=/m", "save_steps=7", "logging_steps=3", "max_steps=9", "seed=5", "output_dir=/o"],
     dict(model=dict(path="/m"), save_steps=7, logging_steps=3, max_steps=9, seed=5, output_dir="/o")),
    # TRL's ModelConfig defaults: r 16, alpha 32, dropout 0.05
    (["use_peft=true"], dict(model=dict(lora=dict(rank=16, alpha=32.0, dropout=0.05)))),
    (["use_peft=true", "lora_r=8", "lora_alpha=16", "lora_target_modules=[q_proj, v_proj]", "use_rslora=true",
      "lora_dropout=0.1"],
     dict(model=dict(lora=dict(rank=8, alpha=16.0, target_modules=("q_proj", "v_proj"), use_rslora=True,
                               dropout=0.1)))),
    # TRL's disable_dropout zeroes every nn.Dropout of the PEFT model: the adapters' dropout here
    (["use_peft=true", "lora_dropout=0.1", "disable_dropout=true"],
     dict(model=dict(lora=dict(rank=16, alpha=32.0, dropout=0.0)))),
    (["disable_dropout=false"], dict()),
    (["use_peft=false", "lora_r=16", "lora_alpha=32", "lora_dropout=0.05"], dict()),  # TRL reads them with use_peft
    (["lora_r=4"], dict(model=dict(lora=dict(rank=4)))),
    (["use_vllm=false", "push_to_hub=false", "optim=adamw_torch_fused", "fp16=false"], dict()),
])
def test_trl_names_users_write(overrides, expected):
    def nested(obj, values):
        return dataclasses.replace(obj, **{k: nested(getattr(obj, k), v) if isinstance(v, dict) else v
                                           for k, v in values.items()})
    assert load_config(None, overrides) == nested(Config(), expected)


@pytest.mark.parametrize("overrides, match", [
    (["use_vllm=true"], "use_vllm=True is TRL's: grpo_jax samples with its own jitted sampler"),
    (["push_to_hub=true"], "push_to_hub=True is TRL's: write a Hugging Face folder with `grpo-jax export`"),
    (["optim=sgd"], "optim='sgd' is TRL's: grpo_jax's optimizer is AdamW"),
    (["report_to=all"], "report_to=all .* list them"),
    (["dtype=float16"], "dtype='float16' .* set model.param_dtype"),
    (["use_peft=false", "model.lora.rank=8"], "use_peft=false with model.lora.rank=8"),
    (["use_peft=true", "lora_dropout=1.0"], "model.lora.dropout=1.0 must be in \\[0, 1\\)"),
    (["disable_dropout=yes please"], "disable_dropout='yes please' must be true or false"),
])
def test_trl_values_we_cannot_honour_are_refused(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, overrides)


def test_use_peft_in_a_file_keeps_a_rank_given_on_the_command_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("use_peft: true\nlora_alpha: 64\n")
    lora = load_config(str(path), ["model.lora.rank=4"]).model.lora
    assert lora == LoRAConfig(rank=4, alpha=64.0, dropout=0.05)
    assert apply_overrides(Config(), ["use_peft=true"]).model.lora.rank == 16


def test_trainer_only_names_are_ignored_with_a_warning():
    with pytest.warns(UserWarning, match="TRL keys ignored .*: dataloader_num_workers, torch_compile"):
        config = load_config(None, ["dataloader_num_workers=4", "torch_compile=true"])
    assert config == Config()


def _trl_fields():
    trl = pytest.importorskip("trl")
    fields = dataclasses.fields(trl.GRPOConfig) + dataclasses.fields(trl.ModelConfig)
    return [f for f in fields if f.name not in LEAD_MAPS]


def test_every_trl_grpo_and_model_config_field_is_handled():
    """TRL 1.16's fields at TRL's defaults (what a TRL YAML dump holds): each builds a config, warns that it is
    ignored, or is refused naming the option; none is an unknown key."""
    unknown = []
    for field in _trl_fields():
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        override = f"{field.name}={yaml.safe_dump(default, default_flow_style=True).strip().removesuffix('...')}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                load_config(None, [override.strip()])
            except ValueError as e:
                if "unknown config key" in str(e):
                    unknown.append(f"{override}: {e}")
    assert not unknown, "\n".join(unknown)


@pytest.mark.parametrize("value, shuffle", [("true", True), ("false", False), ("null", False)])
def test_shuffle_dataset_is_data_shuffle(value, shuffle):
    """TRL's RepeatSampler tests shuffle_dataset for truth: None reads the rows in order, as False does."""
    assert load_config(None, [f"shuffle_dataset={value}"]).data.shuffle is shuffle


@pytest.mark.parametrize("override", ['chat_template_kwargs={"enable_thinking": false}',
                                      """chat_template_kwargs='{"enable_thinking": false}'""",
                                      "data.chat_template_kwargs={enable_thinking: false}"])
def test_chat_template_kwargs_is_one_json_object(override):
    """TRL's chat_template_kwargs (a dict, or its JSON text on TRL's command line) is data.chat_template_kwargs, kept
    as JSON text so a checkpoint's flat keys hold it as one value."""
    data = load_config(None, [override]).data
    assert data.chat_template_kwargs == '{"enable_thinking": false}'
    assert data.template_kwargs == {"enable_thinking": False}


@pytest.mark.parametrize("override, match", [("data.chat_template_kwargs='{x'", "is not JSON"),
                                             ("data.chat_template_kwargs='[1]'", "must be a JSON object"),
                                             ("data.chat_template_kwargs=3", "must be a mapping")])
def test_bad_chat_template_kwargs_name_the_key(override, match):
    with pytest.raises(ValueError, match=rf"^data\.chat_template_kwargs=.*{match}"):
        load_config(None, [override])


@pytest.mark.parametrize("strategy, save_steps, per_epoch", [("no", 0, 0), ("'no'", 0, 0), ("epoch", -1, 80),
                                                               ("steps", 7, 7)])
def test_save_strategy_means_what_it_means_in_trl(strategy, save_steps, per_epoch):
    """TRL's save_strategy (before: refused unless "steps"): "no" saves no checkpoint between the steps (one at the end
    and at a stop still, so that the run resumes), "epoch" one an epoch (640 prompts, 8 a one-step round: 80 steps),
    "steps" every save_steps; the same through GRPOConfig; "best" is refused in one line."""
    from grpo_jax import GRPOConfig
    from grpo_jax.config import for_run

    config = load_config(None, [f"save_strategy={strategy}", "save_steps=7"])
    assert config.save_steps == save_steps
    assert (config.train.prompts_per_round, config.train.steps_per_round) == (8, 1)
    assert for_run(config, row_devices=1, num_prompts=640).save_steps == per_epoch
    assert GRPOConfig(output_dir="/tmp/x", save_strategy=yaml.safe_load(strategy), save_steps=7).save_steps == save_steps
    with pytest.raises(ValueError, match=r"^config key save_strategy='best' is TRL's: use no, epoch or steps"):
        load_config(None, ["save_strategy=best"])


def test_generation_kwargs_set_the_sampling_keys_they_name_over_trls_flat_ones():
    """TRL updates its generation config with generation_kwargs: they win over temperature / top_k given flat, and
    num_beams, length_penalty, early_stopping and max_new_tokens are our sampling keys; a file's JSON string works."""
    from grpo_jax import GRPOConfig

    kwargs = {"do_sample": True, "top_k": 50, "num_beams": 2, "length_penalty": -0.1, "early_stopping": "never",
              "max_new_tokens": 12, "temperature": 0.9}
    config = GRPOConfig(output_dir="/tmp/x", temperature=0.7, top_k=5, generation_kwargs=kwargs)
    s = config.sampling
    assert (s.top_k, s.num_beams, s.length_penalty, s.early_stopping, s.max_completion_length, s.temperature) == (
        50, 2, -0.1, "never", 12, 0.9)
    from_cli = load_config(None, ['generation_kwargs={"num_beams": 3, "top_p": 0.8}'])
    assert (from_cli.sampling.num_beams, from_cli.sampling.top_p) == (3, 0.8)
    assert load_config(None, []).sampling.num_beams == 1


@pytest.mark.parametrize("kwargs,match", [
    ({"do_sample": False}, r"^config key generation_kwargs do_sample=false would give every completion"),
    ({"suppress_tokens": [1], "num_beams": 2}, r"^config key generation_kwargs suppress_tokens: grpo_jax's sampler "
                                                r"takes early_stopping, length_penalty"),
    ("{num_beams", r"^config key generation_kwargs='\{num_beams' is not JSON"),
    ({"num_beams": 0}, r"^sampling.num_beams=0 must be an integer >= 1"),
    ({"early_stopping": "sometimes"}, r"^sampling.early_stopping='sometimes': use false, true or never"),
])
def test_generation_kwargs_we_cannot_honour_are_refused_by_name(kwargs, match):
    from grpo_jax import GRPOConfig

    with pytest.raises(ValueError, match=match):
        GRPOConfig(output_dir="/tmp/x", generation_kwargs=kwargs)


@pytest.mark.parametrize("overrides,match", [
    (["tools=[os:getcwd]"], r"^sampling.num_beams=2 with tools or an environment: a beam search decodes one turn"),
    (["model.model_type=qwen3_moe", "model.num_experts=4",
      "model.num_experts_per_tok=2", "model.routing_replay=true"], r"^sampling.num_beams=2 with model.routing_replay"),
    (["sampling.max_batch_rows=4"], r"^sampling.max_batch_rows=4 with sampling.num_beams=2: a beam search decodes "
                                    "every row at once"),
])
def test_beam_search_refuses_what_it_cannot_do_in_one_line(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, ["sampling.num_beams=2", *overrides])
