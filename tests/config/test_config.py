"""Config: YAML + dotted overrides, and validation errors that name the field and the fix."""

import dataclasses
import json
import re

import pytest
import yaml

from grpo_jax.api.run import check_inputs
from grpo_jax.api.trainer import build
from grpo_jax.config import Config, apply_overrides, load_config, to_dict


def test_defaults_round_trip_through_yaml(tmp_path):
    config = load_config(None, ["train.learning_rate=1e-4", "loss.beta=0", "reward.weights=[2.0]"])
    assert config.train.learning_rate == 1e-4 and config.loss.beta == 0.0 and config.reward.weights == (2.0,)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(to_dict(config)))
    assert load_config(str(path)) == config


def test_overrides_win_over_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("max_steps: 7\ntrain:\n  num_generations: 4\n")
    config = load_config(str(path), ["max_steps=9"])
    assert config.max_steps == 9 and config.train.num_generations == 4


def test_apply_overrides_to_a_built_config():
    base = load_config(None, ["train.logps_chunk_size=4", "model.remat=dots"])
    config = apply_overrides(base, ["model.scan_unroll=3", "train.logps_chunk_size=8"])
    assert (config.model.scan_unroll, config.train.logps_chunk_size, config.model.remat) == (3, 8, "dots")
    assert dataclasses.replace(config, model=base.model, train=base.train) == base  # the rest kept
    with pytest.raises(ValueError, match="unknown config key train.chunk"):
        apply_overrides(base, ["train.chunk=3"])
    with pytest.raises(ValueError, match="model.scan_unroll=0 must be an integer >= 1"):
        apply_overrides(base, ["model.scan_unroll=0"])


def test_every_shipped_config_loads():
    import pathlib
    for path in sorted(pathlib.Path(__file__).parents[2].glob("configs/*.yaml")):
        text = yaml.safe_load(path.read_text())
        if (text.get("data") or {}).get("path"):  # needs a user's data file
            continue
        assert isinstance(load_config(str(path)), Config), path


@pytest.mark.parametrize("overrides, match", [
    (["train.num_generations=3"], r"train.train_batch_size \* train.steps_per_generation = 64 .* "
                                  r"not divisible by train.num_generations=3"),
    (["train.gradient_accumulation_steps=5"], "train.train_batch_size=64 is not divisible by "
                                              "train.gradient_accumulation_steps=5"),
    (["train.num_generations=1"], "train.num_generations=1: GRPO needs >= 2"),
    (["train.scale_rewards=groups"], "train.scale_rewards='groups': use group, batch or none"),
    (["loss.loss_type=ppo"], "loss.loss_type"),
    (["loss.beta=-1"], "loss.beta"),
    (["sampling.temperature=0"], "sampling.temperature"),
    (["sampling.top_p=1.5"], "sampling.top_p"),
    (["model.num_attention_heads=3"], "model.num_attention_heads"),
    (["reward.weights=[1.0, 2.0]", "reward.functions=[grpo_jax.data.task:exact_match]"],
     "reward.weights has 2 entries for 1 reward.functions"),
    (["data.truncation=right"], "data.truncation='right'"),
    (["mesh.data=-1", "mesh.fsdp=-1"], "at most one of mesh.data"),
    (["max_steps=0"], "max_steps=0 must be >= 1"),
    (["compile_threads=0"], "compile_threads=0 must be >= 1, or null"),
    (["train.learning_rate=fast"], "train.learning_rate='fast' must be a number"),
    (["train.learning_rate=.inf"], "train.learning_rate=inf must be a finite number"),
    (["train.learning_rate=.nan"], "train.learning_rate=nan must be a finite number"),
    (["reward.weights=[.nan]"], r"reward.weights=\[nan\]: every weight must be a finite number"),
    (["loss.beta=.inf"], "loss.beta=inf must be a finite number"),
    (["train.num_iterations=1.5"], "train.num_iterations=1.5 must be an integer"),
    (["trian.learning_rate=1"], r"unknown config key trian \(did you mean train\?\): valid keys here are seed, "),
    (["train.learning_rat=1"], r"unknown config key train.learning_rat \(did you mean train.learning_rate\?\): "
                               "valid keys here are num_generations"),
    (["train.learning_rate"], "override 'train.learning_rate' must look like section.key=value"),
    (["train.sync_ref_model=true", "loss.beta=0"], "train.sync_ref_model=true with loss.beta=0: there is no reference"),
    (["train.ref_model_mixup_alpha=0"], r"train.ref_model_mixup_alpha=0.0 must be in \(0, 1\]"),
    (["train.ref_model_sync_steps=0"], "train.ref_model_sync_steps=0 must be >= 1"),
    (["train.advantage_estimator=ppo"], "train.advantage_estimator='ppo' is unknown: use grpo, rloo"),
    (["train.multi_objective_aggregation=mean"], "train.multi_objective_aggregation='mean': use sum_then_normalize"),
    (["train.advantage_estimator=rloo", "train.scale_rewards=none"],
     "train.scale_rewards='none' only applies to train.advantage_estimator='grpo'"),
    (["train.advantage_estimator=rloo", "train.multi_objective_aggregation=normalize_then_sum"],
     "only applies to train.advantage_estimator='grpo', not 'rloo'"),
    (["train.multi_objective_aggregation=normalize_then_sum", "train.scale_rewards=batch"],
     "does not apply to train.multi_objective_aggregation='normalize_then_sum'"),
    (["train.max_num_gen_batches=0"], "train.max_num_gen_batches=0 must be >= 1"),
    (["reward.soft_punish_cache=2"], "reward.soft_punish_cache=2 and reward.functions does not list "
                                     "grpo_jax.rewards.functions:soft_overlong_punishment"),
    (["reward.functions=[grpo_jax.rewards.functions:soft_overlong_punishment]"],
     "reward.soft_punish_cache=0 and reward.functions lists"),
    (["reward.functions=[grpo_jax.rewards.functions:soft_overlong_punishment]", "reward.soft_punish_cache=9"],
     "reward.soft_punish_cache=9 exceeds sampling.max_completion_length=8"),
    (["model.lora.rank=8", "train.sync_ref_model=true"], "train.sync_ref_model=true with model.lora: the reference"),
    (["model.lora.rank=8", "train.offload_ref_params=true"], "train.offload_ref_params / train.ref_param_dtype with"),
    (["model.lora.path=adapters/"], "model.lora.path='adapters/' without model.path"),
    (["model.lora.rank=8", "model.lora.dropout=-0.1"], r"model.lora.dropout=-0.1 must be in \[0, 1\)"),
    (["model.lora.rank=8", "model.lora.target_modules=[lm_head]"], r"model.lora.target_modules=\('lm_head',\)"),
    (["model.lora.rank=8", "model.lora.init_lora_weights=pissa"], "model.lora.init_lora_weights='pissa'"),
])
def test_validation_errors_name_the_field(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, overrides)


@pytest.mark.parametrize("override, message", [
    ("train.adam_beta1=1.0", "train.adam_beta1=1.0 must be in [0, 1)"),
    ("train.adam_beta2=-0.1", "train.adam_beta2=-0.1 must be in [0, 1)"),
    ("train.weight_decay=-0.1", "train.weight_decay=-0.1 must be >= 0"),
    ("train.adam_epsilon=0", "train.adam_epsilon=0.0 must be > 0"),
    ("loss.epsilon=1.5", "loss.epsilon=1.5 must be in (0, 1)"),
    ("loss.epsilon=0", "loss.epsilon=0.0 must be in (0, 1)"),
    ("loss.epsilon_high=0", "loss.epsilon_high=0.0 must be > 0"),
    ("loss.sapo_temperature_neg=.nan", "loss.sapo_temperature_neg=nan must be a finite number"),
    ("sampling.temperature=.inf", "sampling.temperature=inf must be finite and > 0"),
    ("seed=-1", "seed=-1 must be in [0, 2**63)"),
])
def test_ranges_name_the_key_and_the_range(override, message):
    with pytest.raises(ValueError) as error:
        load_config(None, [override])
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_range_bounds_and_losses_that_do_not_clip():
    edges = load_config(None, ["train.adam_beta1=0", "train.adam_beta2=0.999", "train.weight_decay=0",
                               "loss.epsilon=0.999", "loss.epsilon_high=5", "seed=0"])
    assert (edges.train.adam_beta1, edges.loss.epsilon, edges.loss.epsilon_high) == (0.0, 0.999, 5.0)
    assert load_config(None, ["loss.loss_type=sapo", "loss.epsilon=1.5"]).loss.epsilon == 1.5  # sapo never clips
    with pytest.raises(ValueError, match="loss.epsilon_high=0.0 must be > 0 .cispo caps the ratio"):
        load_config(None, ["loss.loss_type=cispo", "loss.epsilon_high=0"])


def test_a_refused_value_on_the_command_line_is_one_line(capsys, tmp_path):
    from grpo_jax.api.cli import main
    with pytest.raises(SystemExit) as exit_:
        main(["--no-progress", "train.adam_beta1=1.0", f"output_dir={tmp_path}", "max_steps=1"])
    err = capsys.readouterr().err
    assert exit_.value.code != 0 and err.count("\n") == 1, err
    assert err.startswith("grpo-jax: config error: train.adam_beta1=1.0 must be in [0, 1)"), err


@pytest.mark.parametrize("overrides, match", [
    (["reward.functions=[grpo_jax.data.task:nope]"], "reward.functions: .*'grpo_jax.data.task:nope'.* no attribute"),
    (["reward.functions=[no_such_module_xyz:f]"], "reward.functions: .*no_such_module_xyz.*could not be imported"),
    (["reward.functions=[grpo_jax.data.task]"], "reward.functions: .*use 'package.module:function'"),
    (["eval.reward_functions=[no_such_module_xyz:f]"], "eval.reward_functions: .*no_such_module_xyz"),
    (["eval.answer_extractor=grpo_jax.data.task:nope"], "eval.answer_extractor: .*'grpo_jax.data.task:nope'"),
    (["data.path=/nonexistent.jsonl", "data.tokenizer_path=."], r"data.path=./nonexistent.jsonl. does not exist"),
    (["eval.path=/nonexistent.parquet"], r"eval.path='/nonexistent.parquet' does not exist"),
    (["data.tokenizer_path=/nonexistent"], r"data.tokenizer_path='/nonexistent' is not a folder"),
])
def test_what_a_config_names_outside_itself_is_checked_when_the_run_is_built(overrides, match):
    config = load_config(None, overrides)  # a schema: building it reads no file and imports no reward module
    with pytest.raises(ValueError, match=match):
        check_inputs(config)
    with pytest.raises(ValueError, match=match):  # build checks first, before it makes a run folder
        build(config)


def test_importing_the_config_loads_no_jax_and_no_user_code():
    import subprocess
    import sys
    code = ("import sys, grpo_jax.config as c; c.load_config(None, ['reward.functions=[no_such_module_xyz:f]']); "
            "print(sorted(m for m in ('jax', 'flax', 'transformers', 'no_such_module_xyz') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_missing_and_invalid_config_files(tmp_path):
    with pytest.raises(ValueError, match="config file .*nope.yaml' does not exist"):
        load_config(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ValueError, match="bad.yaml' is not valid YAML"):
        load_config(str(bad))


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().train.learning_rate = 1.0


def test_prompt_file_without_prompt_column_fails_at_build(tmp_path):
    from grpo_jax.data import task
    tokenizer_dir = tmp_path / "tok"
    task.build_tokenizer(tokenizer_dir)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"question": "12>"}) + "\n")
    config = load_config(None, [f"data.path={data}", f"data.tokenizer_path={tokenizer_dir}", "model.init=random",
                                f"output_dir={tmp_path / 'run'}", "eval.num_examples=0"])
    with pytest.raises(ValueError, match=r"d.jsonl: line 1 has no 'prompt' column"):
        build(config)


def test_data_path_requires_a_tokenizer(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "12>"}) + "\n")
    with pytest.raises(ValueError, match="neither data.tokenizer_path nor model.path"):
        load_config(None, [f"data.path={data}"])


def test_your_data_without_model_path_is_refused_before_anything_is_made(tmp_path, capsys):
    """A user's data trains a random model only when asked (model.init=random); the embedded tasks need no key."""
    from grpo_jax.api.cli import main as cli_main
    from grpo_jax.data import task
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "12>"}) + "\n")
    task.build_tokenizer(tmp_path / "tok")
    out = tmp_path / "run"
    assert cli_main([f"output_dir={out}", f"data.path={data}", f"data.tokenizer_path={tmp_path / 'tok'}"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("grpo-jax: data.path without model.path: set model.path") and err.count("\n") == 1, err
    assert "model.init=random" in err and not out.exists()
    with pytest.raises(ValueError, match=r"^train_dataset without model.path: .* or model.init=random"):
        check_inputs(Config(), train_dataset=[{"prompt": "12>"}])
    check_inputs(load_config(None, ["model.init=random"]), train_dataset=[{"prompt": "12>"}])
    check_inputs(Config())  # the embedded task
    with pytest.raises(ValueError, match="model.init='pretrained': use random"):
        load_config(None, ["model.init=pretrained"])


def test_the_learning_rate_default_is_trls_for_a_model_folder_and_the_embedded_tasks_own_otherwise():
    from grpo_jax.config import resolve_defaults
    rate = lambda *overrides, saved=None: resolve_defaults(load_config(None, overrides), saved).train.learning_rate
    assert Config().train.learning_rate is None  # resolved when the run is built, then recorded
    assert rate() == 5e-4 and rate("model.init=random") == 5e-4
    assert rate("model.path=models/x") == 1e-6  # TRL's default
    assert rate("model.path=models/x", "train.learning_rate=3e-5") == 3e-5  # given: always wins
    assert rate("model.path=models/x", saved={"train": {"learning_rate": 5e-4}}) == 5e-4  # a resumed run's
    assert rate("train.learning_rate=2e-3", saved={"train": {"learning_rate": 5e-4}}) == 2e-3


def test_trl_flat_names_are_our_dotted_keys(tmp_path):
    """A TRL user's GRPOConfig names work in a YAML file and on the command line, mean the same option, and are
    refused with the key to use where TRL's meaning differs."""
    path = tmp_path / "trl.yaml"
    path.write_text("beta: 0.1\nlearning_rate: 3.0e-6\nnum_generations: 4\nmax_completion_length: 64\n"
                    "loss_type: dr_grpo\nreward_weights: [2.0]\ntrain:\n  train_batch_size: 16\n")
    config = load_config(str(path), ["temperature=0.7", "epsilon_high=0.28"])
    ours = load_config(None, ["loss.beta=0.1", "train.learning_rate=3e-6", "train.num_generations=4",
                              "sampling.max_completion_length=64", "loss.loss_type=dr_grpo", "reward.weights=[2.0]",
                              "train.train_batch_size=16", "sampling.temperature=0.7", "loss.epsilon_high=0.28"])
    assert config == ours
    assert load_config(str(path), ["loss.beta=0.2"]).loss.beta == 0.2  # the command line wins, named either way
    path.write_text("beta: 0.1\nloss:\n  beta: 0.2\n")
    with pytest.raises(ValueError, match=r"beta=0.1 and loss.beta=0.2 set the same option \(loss.beta\)"):
        load_config(str(path))
    with pytest.raises(ValueError, match="per_device_train_batch_size .* and train.train_batch_size both set"):
        load_config(None, ["per_device_train_batch_size=8", "train.train_batch_size=16"])
    with pytest.raises(ValueError, match="fp16=True is TRL's: .* set model.dtype=bfloat16"):
        load_config(None, ["fp16=true"])


@pytest.mark.parametrize("override, hint", [
    ("train.beta=0.1", "did you mean loss.beta?"),
    ("train.learnig_rate=1", "did you mean train.learning_rate?"),
    ("lerning_rate=1", "did you mean learning_rate?"),
    ("model.pth=x", "did you mean model.path?"),
])
def test_unknown_keys_suggest_the_nearest(override, hint):
    with pytest.raises(ValueError, match=re.escape(f"unknown config key {override.split('=')[0]} ({hint})")):
        load_config(None, [override])


def test_packaged_recipes_load_by_name():
    from grpo_jax.config import recipes
    names = recipes()
    assert {"dapo", "dr_grpo", "gspo", "cispo", "grpo_deepseekmath", "default"} <= set(names)
    # by name, from any working directory: the package's copy of configs/
    assert load_config("default") == load_config("configs/default.yaml") == Config()
    with pytest.raises(ValueError, match="'nope' does not exist: .* or the name of a packaged recipe: cispo, dapo"):
        load_config("nope")
