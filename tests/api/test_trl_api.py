"""The Python API a TRL user meets (grpo_jax/__init__.py, grpo_jax/api/trl_api.py): the top-level names import lazily,
`GRPOTrainer(...).train()` is exactly `train(config)` on the same run, and what it cannot honour is refused."""

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
import yaml

from grpo_jax.config import LoRAConfig, load_config

ROWS = [{"prompt": f"{i % 10}{(3 * i) % 10}>", "answer": str(i % 10)} for i in range(16)]
TINY = dict(max_steps=2, num_generations=4, max_completion_length=4, beta=0.0,
            train={"train_batch_size": 8}, **{"eval.num_examples": 0})  # TRL's flat names, a section, a dotted key


# TRL 1.16's defaults that GRPOConfig takes where ours differ (grpo_jax.api.trl_api.TRL_DEFAULTS), in our keys
TRL_DEFAULTS_OURS = ["seed=42", "logging_steps=10", "save_total_limit=null", "num_train_epochs=3",
                     "loss.loss_type=dapo", "loss.use_bias_correction_kl=true", "train.lr_scheduler_type=linear",
                     "train.adam_beta2=0.999"]


def answer_reward(prompts, completions, answer, **kwargs):
    """Differs inside every group (the update is not zero) and reads a column of the rows."""
    return [float(i % 2) + 0.25 * len(c) + 0.5 * a.endswith("1") for i, (c, a) in enumerate(zip(completions, answer))]


def test_the_top_level_names_import_lazily_without_jax():
    code = ("import sys, grpo_jax; from grpo_jax import Config, GRPOConfig, GRPOTrainer, load_config, make_config; "
            "print(sorted(m for m in ('jax', 'flax', 'transformers') if m in sys.modules)); "
            "from grpo_jax import train; import grpo_jax.api.trainer; print(train is grpo_jax.api.trainer.train)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:2] == ["[]", "True"], out


def test_use_cpu_makes_the_cpu_jaxs_only_backend():
    """GRPOConfig(use_cpu=True) before JAX starts (a fresh interpreter, no JAX_PLATFORMS): JAX starts on the CPU
    alone, TRL's meaning; without it JAX's platforms stay unset (its default pick of an accelerator)."""
    import os
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    code = ("from grpo_jax import GRPOConfig; GRPOConfig(use_cpu={}); import jax; "
            "print(jax.config.jax_platforms, jax.default_backend() if {} else '')")
    run = lambda on: subprocess.run([sys.executable, "-c", code.format(on, on)], capture_output=True,  # noqa: E731
                                    text=True, check=True, env=env).stdout.split()
    assert run(True) == ["cpu", "cpu"]
    assert run(False) == ["None"]


def test_a_config_from_keywords_is_the_config_of_the_same_overrides():
    from grpo_jax import GRPOConfig, make_config

    expected = load_config(None, ["loss.beta=0", "train.learning_rate=1e-6", "sampling.temperature=0.7",
                                  "train.num_generations=4", "train.train_batch_size=16"])
    assert make_config(beta=0.0, train={"learning_rate": 1e-6, "train_batch_size": 16}, num_generations=4,
                       **{"sampling.temperature": 0.7}) == expected
    assert make_config(beta=0.0, learning_rate=1e-6, temperature=0.7, num_generations=4,
                       **{"train.train_batch_size": 16}) == expected
    with pytest.raises(ValueError, match=r"config keys learning_rate=1e-06 and train.learning_rate=1e-05 set the "
                                         r"same option \(train.learning_rate\) to different values"):
        make_config(learning_rate=1e-6, train={"learning_rate": 1e-5})
    with pytest.raises(ValueError, match="config key train.learning_rate is given twice"):
        make_config(train={"learning_rate": 1e-6}, **{"train.learning_rate": 1e-5})
    for override, keywords in (("train.nope=1", dict(train={"nope": 1})), ("sampling.top_p=2", dict(top_p=2.0)),
                               ("dataset_name=x", dict(dataset_name="x"))):
        with pytest.raises(ValueError) as theirs:
            load_config(None, [override])
        with pytest.raises(ValueError) as ours:
            make_config(**keywords)
        assert str(ours.value) == str(theirs.value)  # the one-line message a YAML file or the CLI gets


def test_peft_options_map_to_model_lora_or_are_refused():
    from grpo_jax.api.trl_api import lora_options

    # PEFT's defaults: r 8, alpha 8, target_modules None = q_proj and v_proj for these families
    assert LoRAConfig(**lora_options({})) == LoRAConfig(rank=8, alpha=8.0, target_modules=("q_proj", "v_proj"))
    given = dict(r=4, lora_alpha=16, target_modules=["v_proj", "q_proj"], use_rslora=True, task_type="CAUSAL_LM")
    assert LoRAConfig(**lora_options(given)) == LoRAConfig(rank=4, alpha=16.0, target_modules=("q_proj", "v_proj"),
                                                           use_rslora=True)
    with pytest.raises(ValueError, match=r"peft_config.use_dora=True has no counterpart .* leave it at PEFT's"):
        lora_options(dict(r=4, use_dora=True))
    with pytest.raises(ValueError, match="peft_config.task_type='SEQ_CLS'"):
        lora_options(dict(task_type="SEQ_CLS"))
    peft = pytest.importorskip("peft")
    assert lora_options(peft.LoraConfig(**given)) == lora_options(given)
    assert lora_options(peft.LoraConfig(r=8, target_modules="all-linear"))["rank"] == 8  # PEFT's default, given
    with pytest.raises(ValueError, match=r"peft_config.bias='all' has no counterpart"):
        lora_options(peft.LoraConfig(bias="all"))
    with pytest.raises(ValueError, match=r"peft_config is a IA3Config: grpo_jax trains LoRA adapters only"):
        lora_options(peft.IA3Config())


def test_the_trainer_takes_a_cached_model_id_and_refuses_objects(tmp_path, monkeypatch):
    import huggingface_hub.constants

    from grpo_jax import GRPOConfig, GRPOTrainer
    from grpo_jax.data import task

    snapshot = tmp_path / "hub" / "models--me--tiny" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    trainer = GRPOTrainer("me/tiny", answer_reward, args=GRPOConfig(beta=0.0), peft_config={"r": 4}, train_dataset=ROWS)
    # TRL's reward_funcs take Hub ids of reward models too: the cached snapshot, as for model
    assert GRPOTrainer("me/tiny", ["me/tiny", answer_reward, "grpo_jax.data.task:exact_match"],
                       train_dataset=ROWS).reward_funcs == \
        [str(snapshot), answer_reward, "grpo_jax.data.task:exact_match"]
    with pytest.raises(ValueError, match=r"reward_funcs entry 'me/other' is neither .* in the local Hugging Face"):
        GRPOTrainer("me/tiny", "me/other", train_dataset=ROWS)
    assert trainer.args.model.path == str(snapshot) and trainer.args.loss.beta == 0.0
    assert trainer.args.model.lora == LoRAConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
    assert trainer.reward_funcs == [answer_reward]
    with pytest.raises(ValueError, match=r"model='me/other' is neither a folder nor a model id in the local"):
        GRPOTrainer("me/other", answer_reward, train_dataset=ROWS)
    with pytest.raises(ValueError, match=r"model is a dict: .* or a transformers model object"):
        GRPOTrainer({"weights": 1}, answer_reward, train_dataset=ROWS)
    with pytest.raises(ValueError, match=r"processing_class is a \w+ not loaded from a folder"):
        GRPOTrainer(str(snapshot), answer_reward, processing_class=task.build_tokenizer(), train_dataset=ROWS)
    with pytest.raises(ValueError, match=r"peft_config: model.lora.dropout=1.5 must be in \[0, 1\)"):
        GRPOTrainer(str(snapshot), answer_reward, peft_config={"lora_dropout": 1.5}, train_dataset=ROWS)
    assert GRPOTrainer(str(snapshot), answer_reward, peft_config={"lora_dropout": 0.05},
                       train_dataset=ROWS).args.model.lora.dropout \
        == 0.05
    with pytest.raises(ValueError, match=r"model.init=random with model.path="):
        GRPOTrainer(str(snapshot), answer_reward, args=GRPOConfig(model={"init": "random"}), train_dataset=ROWS)
    for hook in ({"callbacks": [object()]}, {"optimizers": (object(), None)}, {"quantization_config": {"bits": 4}}):
        with pytest.raises(ValueError, match=f"{next(iter(hook))} is TRL's PyTorch hook"):
            GRPOTrainer(str(snapshot), answer_reward, **hook, train_dataset=ROWS)
    assert GRPOTrainer(str(snapshot), answer_reward, callbacks=[], optimizers=(None, None),
                       train_dataset=ROWS).args.model.path
    with pytest.raises(TypeError, match=r"^rollout_func is a int: pass a function \(prompts, trainer\)"):
        GRPOTrainer(str(snapshot), answer_reward, rollout_func=3, train_dataset=ROWS)


def test_the_trl_shaped_trainer_is_train_on_the_same_config_bit_for_bit(tmp_path):
    """A TRL script's calls (a model folder, a reward function, a list of dicts) train as `train(config)` does with
    the config written out by hand: the same metrics and final weights, bit for bit. The learning rate is TRL's
    1e-6 for a pretrained folder, recorded in config.yaml; the run resumes with it, and an older run's saved rate
    is kept when the command leaves it unset."""
    pytest.importorskip("torch")
    import hf_fixtures
    from safetensors.numpy import load_file

    from grpo_jax import GRPOConfig, GRPOTrainer, train
    from grpo_jax.api.run import build
    from grpo_jax.data import task

    folder = hf_fixtures.save_model(hf_fixtures.build_model("qwen2", tied=True), tmp_path / "hf")
    task.build_tokenizer(folder)
    summary = GRPOTrainer(model=folder, reward_funcs=answer_reward, train_dataset=ROWS,
                          args=GRPOConfig(output_dir=str(tmp_path / "trl"), **TINY)).train()
    config = load_config(None, [f"output_dir={tmp_path / 'ours'}", "max_steps=2", "train.num_generations=4",
                                "sampling.max_completion_length=4", "loss.beta=0", "train.train_batch_size=8",
                                "eval.num_examples=0", f"model.path={folder}", *TRL_DEFAULTS_OURS])
    train(config, train_dataset=ROWS, reward_funcs=[answer_reward], show_progress=False)

    def untimed(run):
        return [{k: v for k, v in json.loads(line).items() if not k.startswith("step_time")}
                for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 2 and untimed("trl") == untimed("ours")
    assert [line["learning_rate"] for line in untimed("trl")] == pytest.approx([1e-6, 5e-7])  # TRL's linear decay
    saved = tmp_path / "ours" / "config.yaml"
    assert yaml.safe_load(saved.read_text())["train"]["learning_rate"] == 1e-6  # the resolved value
    ours, theirs = load_file(tmp_path / "ours" / "final" / "model.safetensors"), \
        load_file(tmp_path / "trl" / "final" / "model.safetensors")
    initial = load_file(f"{folder}/model.safetensors")
    assert all(np.array_equal(ours[k], theirs[k]) for k in initial)
    assert any(not np.array_equal(ours[k], initial[k]) for k in initial)  # it trained

    def built_rate(config):
        run, _, held = build(config, train_dataset=ROWS, reward_funcs=[answer_reward])
        held.release()
        return run.config.train.learning_rate
    assert built_rate(config) == 1e-6
    older = yaml.safe_load(saved.read_text())
    older["train"]["learning_rate"] = 5e-4  # a run saved when 5e-4 was every run's default
    saved.write_text(yaml.safe_dump(older, sort_keys=False))
    assert built_rate(config) == 5e-4
    with pytest.raises(ValueError, match=r"train.learning_rate: saved 0.0005, now 0.001"):
        built_rate(dataclasses.replace(config, train=dataclasses.replace(config.train, learning_rate=1e-3)))
