"""What a TRL script reads from its trainer after `.train()` (grpo_jax/api/trl_api.py): transformers' `TrainOutput`,
`state.log_history` whatever `report_to` says (the lines metrics.jsonl holds, under TRL's names), `save_model`, and
TRL's `RUN/checkpoint-N` folder for `resume_from_checkpoint`."""

import json

import numpy as np
import pytest

from grpo_jax.api.trl_state import trl_checkpoint, trl_line

ROWS = [{"prompt": f"{i % 10}{(3 * i) % 10}>", "answer": str(i % 10)} for i in range(16)]


def answer_reward(prompts, completions, answer, **kwargs):
    return [float(i % 2) + 0.25 * len(c) + 0.5 * a.endswith("1") for i, (c, a) in enumerate(zip(completions, answer))]


def test_trl_names_and_checkpoint_folders(tmp_path):
    assert trl_line({"step": 3, "loss": 0.5, "router_aux_loss": 0.1, "eval/reward": 1.0}) == \
        {"step": 3, "loss": 0.5, "aux_loss": 0.1, "eval_reward": 1.0}
    (tmp_path / "run" / "checkpoints" / "2").mkdir(parents=True)
    assert trl_checkpoint(str(tmp_path / "run" / "checkpoint-2")) == str(tmp_path / "run" / "checkpoints" / "2")
    assert trl_checkpoint(str(tmp_path / "other" / "checkpoint-2")) == str(tmp_path / "other" / "checkpoint-2")
    assert trl_checkpoint(True) is True and trl_checkpoint(None) is None


def test_the_final_line_carries_the_metrics_after_the_last_logging_boundary():
    """TRL logs (and clears) its metric means every logging_steps and logs the rest with the run's summary."""
    from grpo_jax.api.trl_state import residual_means

    history = [{"step": s, "loss": float(s), "reward": 10.0 * s} for s in range(1, 14)] + \
        [{"step": 13, "eval_reward": 1.0}]
    assert residual_means(history, 13, 10) == {"reward": 120.0}  # loss: the Trainer's, at logging steps only
    assert residual_means(history[:10], 10, 10) == {}
    assert residual_means(history, 13, 1) == {}  # every step logged already


def test_train_returns_trls_output_and_keeps_the_history_in_memory(tmp_path, capfd):
    pytest.importorskip("torch")
    import hf_fixtures
    from transformers.trainer_utils import TrainOutput

    from grpo_jax import GRPOConfig, GRPOTrainer
    from grpo_jax.data import task

    folder = hf_fixtures.save_model(hf_fixtures.build_model("qwen2", tied=True), tmp_path / "hf")
    task.build_tokenizer(folder)
    args = dict(output_dir=str(tmp_path / "run"), max_steps=2, num_generations=4, max_completion_length=4,
                per_device_train_batch_size=1, report_to="none", save_steps=1, disable_tqdm=True,
                **{"eval.num_examples": 0})
    trainer = GRPOTrainer(model=folder, reward_funcs=answer_reward, train_dataset=ROWS, args=GRPOConfig(**args))
    with pytest.raises(ValueError, match="save_model before train"):
        trainer.save_model(tmp_path / "saved")
    output = trainer.train()
    assert "grpo:" not in capfd.readouterr().err  # disable_tqdm: no "grpo: 50%|..." bar, the console line
    assert isinstance(output, TrainOutput) and output.global_step == 2 and output["steps"] == 2
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # report_to=none: no file, the history in memory
    steps = [line for line in trainer.state.log_history if "loss" in line]
    assert [line["step"] for line in steps] == [1, 2] and trainer.state.global_step == 2
    assert output.training_loss == pytest.approx(sum(line["loss"] for line in steps) / 2)
    assert trainer.state.log_history[-1]["train_loss"] == output.training_loss
    # TRL's epoch: steps x completions a step / (prompts x num_generations x num_iterations), 8 devices x 1 row a step
    assert [line["epoch"] for line in steps] == [s * 8 / (16 * 4) for s in (1, 2)]
    # num_tokens: the running total of the rounds' prompt and completion tokens (prompts of 3 tokens, 8 rows a round)
    assert 8 * 3 < steps[0]["num_tokens"] < steps[1]["num_tokens"] <= 2 * 8 * (3 + 4)
    assert {"clip_ratio/low_min", "clip_ratio/high_max", "completions/min_terminated_length",
            "completions/max_terminated_length"} <= steps[0].keys()
    final = trainer.state.log_history[-1]  # transformers' last line: speed metrics of this call's 2 steps
    assert {"train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos", "train_loss",
            "epoch", "step"} <= final.keys() and final["epoch"] == steps[-1]["epoch"]
    assert final["train_steps_per_second"] == pytest.approx(2 / final["train_runtime"], rel=1e-2)
    assert final["train_samples_per_second"] == pytest.approx(2 * 8 / final["train_runtime"], rel=1e-2)
    with pytest.raises(ValueError, match="evaluate.. needs an evaluation"):
        trainer.evaluate()  # eval.num_examples=0: the run evaluated nothing
    trainer.save_model(tmp_path / "saved")
    assert (tmp_path / "saved" / "config.json").is_file() and (tmp_path / "saved" / "model.safetensors").is_file()
    # with no folder, where TRL writes it: the run's own output_dir, which transformers then loads (before: only
    # final/ held it, and from_pretrained(output_dir) failed for want of config.json's model_type)
    import transformers

    trainer.save_model()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run")
    saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert all(np.array_equal(a.detach().numpy(), b.detach().numpy())
               for a, b in zip(loaded.state_dict().values(), saved.state_dict().values()))
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "run").get_vocab()
    assert (tmp_path / "run" / "config.yaml").is_file() and (tmp_path / "run" / "checkpoints").is_dir()
    import yaml  # resolved.yaml: what ran, TRL's per-device batch of 1 on 8 devices as 8 rows a step
    resolved = yaml.safe_load((tmp_path / "run" / "resolved.yaml").read_text())
    assert resolved["train"]["train_batch_size"] == 8 and resolved["model"]["model_type"] == "qwen2"

    # the same script again trains again from the start, as TRL's does (before: it resumed the finished run and
    # trained 0 steps); the earlier run is set aside, not lost
    again = GRPOTrainer(model=folder, reward_funcs=answer_reward, train_dataset=ROWS, args=GRPOConfig(**args))
    assert again.train().global_step == 2
    assert [line["step"] for line in again.state.log_history if "loss" in line] == [1, 2]
    assert "training from the start as TRL does" in capfd.readouterr().out
    previous = tmp_path / "run" / "previous-run"
    assert (previous / "config.yaml").is_file() and sorted(p.name for p in (previous / "checkpoints").iterdir()) \
        == ["1", "2"] and (previous / "config.json").is_file()  # the earlier save_model's files went with it
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["1", "2"]

    # TRL's layout names checkpoint 2 RUN/checkpoint-2: it resumes the run, whose history goes on
    more = GRPOTrainer(model=folder, reward_funcs=answer_reward, train_dataset=ROWS, eval_dataset=ROWS[:4],
                       args=GRPOConfig(**{**args, "max_steps": 3, "report_to": "jsonl", "eval.num_examples": 4}))
    assert more.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2")).global_step == 3
    assert [line["step"] for line in more.state.log_history if "loss" in line] == [1, 2, 3]
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [trl_line(line) for line in lines] == more.state.log_history[:-1]  # the same lines as the file
    final_eval = [line for line in lines if "eval/greedy/answer_reward" in line][-1]
    assert final_eval["step"] == 3 and more.evaluate() == trl_line(final_eval)  # the trained policy's evaluation


def test_evaluate_before_train_is_the_runs_step_0_evaluation(tmp_path):
    """`evaluate()` before `train()` (TRL evaluates the model as given): the held-out evaluation the run itself logs
    at step 0, under TRL's names; without held-out rows a one-line error."""
    pytest.importorskip("torch")
    import hf_fixtures

    from grpo_jax import GRPOConfig, GRPOTrainer
    from grpo_jax.data import task

    folder = hf_fixtures.save_model(hf_fixtures.build_model("qwen2", tied=True), tmp_path / "hf")
    task.build_tokenizer(folder)
    args = dict(output_dir=str(tmp_path / "run"), max_steps=1, num_generations=4, max_completion_length=4,
                per_device_train_batch_size=1, report_to="none", disable_tqdm=True)
    trainer = GRPOTrainer(model=folder, reward_funcs=answer_reward, train_dataset=ROWS, eval_dataset=ROWS[:4],
                          args=GRPOConfig(**args, **{"eval.num_examples": 4}))
    before = trainer.evaluate()
    assert before["step"] == 0 and "eval_greedy/answer_reward" in before
    # TRL samples its evaluation as it trains (num_generations per prompt) and logs the loss of those rows
    assert trainer.args.eval.num_generations == 4 and np.isfinite(before["eval_loss"])
    trainer.train()
    logged = [line for line in trainer.state.log_history if line.get("step") == 0 and "eval_greedy/answer_reward"
              in line]
    assert logged == [before]
    # TRL's evaluate(eval_dataset): the params as they are now (trained), a dict of datasets each under its name
    again = trainer.evaluate(eval_dataset={"a": ROWS[:4], "b": ROWS[4:8]})
    assert again["step"] == 1 and {"eval_a_greedy/answer_reward", "eval_b_greedy/answer_reward", "eval_a_loss",
                                   "eval_b_loss"} <= again.keys()
    final = [line for line in trainer.state.log_history if line.get("step") == 1 and "eval_greedy/answer_reward"
             in line]
    assert again["eval_a_greedy/answer_reward"] == final[-1]["eval_greedy/answer_reward"]  # the run's held-out rows
    assert trainer.evaluate(ROWS[:4], metric_key_prefix="test")["test_greedy/answer_reward"] == \
        final[-1]["eval_greedy/answer_reward"]
    bare = GRPOTrainer(model=folder, reward_funcs=answer_reward, train_dataset=ROWS,
                       args=GRPOConfig(**{**args, "output_dir": str(tmp_path / "bare")}, **{"eval.num_examples": 0}))
    with pytest.raises(ValueError, match="evaluate.. needs held-out rows: give eval_dataset"):
        bare.evaluate()


def test_trainer_model_names_parameters_and_buffers_as_pytorch_does(tmp_path):
    """GLM-4-MoE's router correction bias is a PyTorch buffer: `named_parameters` leaves it out (TRL's tests check
    every listed parameter moves) and `named_buffers` has it, as transformers' model lists them."""
    torch = pytest.importorskip("torch")
    import hf_fixtures

    from grpo_jax import GRPOConfig, GRPOTrainer
    from grpo_jax.data import task

    model = hf_fixtures.build_model("glm4_moe", tied=False)
    folder = hf_fixtures.save_model(model, tmp_path / "hf")
    task.build_tokenizer(folder)
    trainer = GRPOTrainer(model=folder, reward_funcs=answer_reward, train_dataset=ROWS,
                          args=GRPOConfig(output_dir=str(tmp_path / "run"), max_steps=1))
    ours = dict(trainer.model.named_parameters())  # the folder's names (experts one by one, as saved)
    assert ours and not [n for n in ours if "e_score_correction_bias" in n]
    assert all(torch.equal(ours[n], p.detach()) for n, p in model.named_parameters() if n in ours)
    buffers = {n: b for n, b in model.named_buffers() if "rotary" not in n}  # RoPE tables are not saved
    assert dict(trainer.model.named_buffers()).keys() == buffers.keys()
    assert all(torch.equal(b, buffers[n]) for n, b in trainer.model.named_buffers())


def test_a_model_object_trains_as_its_folder_and_trainer_model_reads_the_weights(tmp_path, monkeypatch):
    """`model=<transformers object>` is saved once to a folder named by its weights' hash (the same object, the same
    folder: a rerun resumes) and trains bit for bit as that folder does; `trainer.model` reads the policy's weights
    under transformers' names, before (the model's) and after (the trained ones) `train()`."""
    torch = pytest.importorskip("torch")
    import hf_fixtures

    from grpo_jax import GRPOConfig, GRPOTrainer
    from grpo_jax.api import trl_inputs
    from grpo_jax.data import task

    monkeypatch.setattr(trl_inputs, "MODEL_CACHE", tmp_path / "cache")
    model = hf_fixtures.build_model("qwen2", tied=True)
    folder = hf_fixtures.save_model(model, tmp_path / "hf")
    task.build_tokenizer(folder)
    args = dict(max_steps=1, num_generations=4, max_completion_length=4, train_batch_size=8,
                **{"eval.num_examples": 0})
    from_object = GRPOTrainer(model=model, reward_funcs=answer_reward, train_dataset=ROWS, processing_class=folder,
                              args=GRPOConfig(output_dir=str(tmp_path / "object"), **args))
    assert from_object.args.model.path == GRPOTrainer(model=model, reward_funcs=answer_reward,
                                                      train_dataset=ROWS).args.model.path
    assert from_object.args.model.path.startswith(str(tmp_path / "cache"))
    before = dict(from_object.model.named_parameters())
    assert before.keys() == dict(model.named_parameters()).keys()  # tied: no lm_head, as transformers names them
    assert all(torch.equal(before[n], p.detach()) for n, p in model.named_parameters())
    from_object.train()
    from_folder = GRPOTrainer(model=folder, reward_funcs=answer_reward, train_dataset=ROWS,
                              args=GRPOConfig(output_dir=str(tmp_path / "folder"), **args))
    from_folder.train()
    after = dict(from_object.model.named_parameters())
    assert all(torch.equal(after[n], from_folder.model.get_parameter(n)) for n in after)  # bit for bit
    assert any(not torch.equal(after[n], before[n]) for n in after)  # it trained
    from_object.model.save_pretrained(tmp_path / "copy")
    assert (tmp_path / "copy" / "model.safetensors").is_file()
    with pytest.raises(AttributeError, match="the policy has no parameter 'nope'"):
        from_object.model.get_parameter("nope")


@pytest.mark.parametrize("kwargs, message", [
    (dict(args=dict(reward_weights=[0.7, 0.3]), reward_funcs=[answer_reward]), "Number of reward weights"),
    (dict(reward_funcs=[answer_reward], reward_processing_classes=[None, None]),
     "The number of reward processing classes"),
    # one class, not in a list, for two functions: TRL takes it as a list of one
    (dict(reward_funcs=[answer_reward, answer_reward], reward_processing_classes="tokenizer-folder"),
     r"The number of reward processing classes \(1\) must match"),
])
def test_trls_init_checks_raise_trls_message(tmp_path, kwargs, message):
    """Arguments that TRL 1.16 refuses in GRPOTrainer.__init__ are refused with its message (grpo_trainer.py)."""
    from grpo_jax import GRPOConfig, GRPOTrainer

    folder = tmp_path / "model"
    folder.mkdir()
    ours = dict(kwargs, args=GRPOConfig(**kwargs.get("args", {})))
    with pytest.raises(ValueError, match=message):
        GRPOTrainer(model=str(folder), **ours, train_dataset=ROWS)
    assert GRPOConfig(reward_weights=[0.7, 0.3]).reward.weights == (0.7, 0.3)  # reward_funcs arrive later


def test_trls_warnings(tmp_path, caplog):
    from grpo_jax import GRPOConfig, GRPOTrainer

    folder = tmp_path / "model"
    folder.mkdir()
    with caplog.at_level("WARNING", logger="trl.trainer.grpo_trainer"):
        GRPOTrainer(model=str(folder), reward_funcs=[answer_reward],
                    args=GRPOConfig(importance_sampling_level="sequence"), train_dataset=ROWS)
    assert "the `'dapo'` loss sums per-token contributions" in caplog.text  # TRL's default loss_type


def test_model_init_kwargs_dtype_is_the_weights_dtype():
    from grpo_jax import GRPOConfig

    assert GRPOConfig(model_init_kwargs={"dtype": "bfloat16", "device_map": "auto"}).model.param_dtype == "bfloat16"
    with pytest.raises(ValueError, match="model_init_kwargs.trust_remote_code has no counterpart"):
        GRPOConfig(model_init_kwargs={"trust_remote_code": True})


def test_trls_mask_methods_are_trls_on_torch_tensors():
    """`GRPOTrainer.get_high_entropy_mask` / `get_off_policy_mask` (TRL's methods, which TRL's tests call) give
    TRL 1.16's own outputs on random inputs with padding."""
    torch = pytest.importorskip("torch")
    trl_trainer = pytest.importorskip("trl.trainer.grpo_trainer")
    from unittest.mock import Mock

    from grpo_jax import GRPOTrainer

    g = torch.Generator().manual_seed(0)
    entropies, logps, sampler = (torch.rand((4, 6), generator=g) * 3 for _ in range(3))
    mask = (torch.arange(6)[None] < torch.tensor([[6], [3], [1], [5]])).float()
    advantages = torch.tensor([[1.0], [-1.0], [-2.0], [-0.5]])
    trl = Mock(spec=trl_trainer.GRPOTrainer)
    trl.accelerator = Mock(num_processes=1, gather=lambda x: x, pad_across_processes=lambda x, dim, pad_index: x)
    for threshold in (0.0, 0.5, 0.8):
        ours = GRPOTrainer.get_high_entropy_mask(None, entropies, mask, threshold)
        assert torch.equal(ours, trl_trainer.GRPOTrainer.get_high_entropy_mask(trl, entropies, mask, threshold))
    for threshold in (0.1, 0.5, 1.5):
        ours = GRPOTrainer.get_off_policy_mask(advantages, -logps, -sampler, mask, threshold)
        theirs = trl_trainer.GRPOTrainer.get_off_policy_mask(advantages, -logps, -sampler, mask, threshold)
        assert torch.equal(ours, theirs), threshold


@pytest.mark.parametrize("tied", [False, True])
def test_trainer_model_reads_submodules_as_transformers_nests_them(tmp_path, tied):
    """`trainer.model.lm_head.weight` (TRL's tests read it) and any module path are the transformers model's own
    tensors, a tied head the embedding (as transformers ties them); `device` is torch's CPU."""
    torch = pytest.importorskip("torch")
    import hf_fixtures

    from grpo_jax import GRPOTrainer

    model = hf_fixtures.build_model("qwen2", tied=tied)
    folder = hf_fixtures.save_model(model, tmp_path / "hf")
    view = GRPOTrainer(model=folder, reward_funcs=answer_reward, train_dataset=ROWS).model
    assert torch.equal(view.lm_head.weight, model.lm_head.weight.detach())
    assert torch.equal(view.get_parameter("lm_head.weight"), model.get_parameter("lm_head.weight").detach())
    assert torch.equal(view.model.norm.weight, model.model.norm.weight.detach())
    assert torch.equal(view.model.embed_tokens.weight, model.model.embed_tokens.weight.detach())
    assert view.device == torch.device("cpu") == model.device
    for missing in ("nope", "model.nope"):
        with pytest.raises(AttributeError, match="the policy has no module"):
            eval(f"view.{missing}")


class _Scorer:
    def __call__(self, completions, **kwargs):
        return [0.0] * len(completions)


class _Counter:
    def reset(self, **kwargs):
        return None

    def get_reward(self) -> float:
        return 1.0


def test_reward_func_names_and_weights_are_trls(tmp_path):
    """`reward_func_names`, `reward_weights` and `reward_funcs` as TRL 1.16's GRPOTrainer sets them, for a function,
    a partial, a callable object and a reward model folder; an environment class with `get_reward` adds its name,
    weight 1 and its reward function."""
    import functools

    torch = pytest.importorskip("torch")
    trl = pytest.importorskip("trl")
    import datasets
    import hf_fixtures
    import transformers
    from trl_tools import qwen_tokenizer

    from grpo_jax import GRPOConfig, GRPOTrainer

    tokenizer = qwen_tokenizer()
    policy = hf_fixtures.save_model(hf_fixtures.build_model("qwen2", tied=True, vocab_size=len(tokenizer)),
                                    tmp_path / "policy")
    tokenizer.save_pretrained(policy)
    config = transformers.Qwen2Config(vocab_size=len(tokenizer), hidden_size=8, num_attention_heads=2,
                                      num_key_value_heads=1, num_hidden_layers=1, intermediate_size=16,
                                      num_labels=1, pad_token_id=tokenizer.pad_token_id)
    scorer = str(tmp_path / "my-scorer")
    transformers.Qwen2ForSequenceClassification(config).save_pretrained(scorer)
    tokenizer.save_pretrained(scorer)
    funcs = [answer_reward, functools.partial(answer_reward, answer=["1"]), _Scorer(), scorer]
    theirs = trl.GRPOTrainer(model=policy, reward_funcs=list(funcs), train_dataset=datasets.Dataset.from_list(ROWS),
                             args=trl.GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, report_to="none",
                                                 per_device_train_batch_size=2, num_generations=2,
                                                 reward_weights=[1.0, 0.5, 2.0, 0.25]))
    ours = GRPOTrainer(model=policy, reward_funcs=funcs, args=GRPOConfig(reward_weights=[1.0, 0.5, 2.0, 0.25]),
                       train_dataset=ROWS)
    assert ours.reward_func_names == theirs.reward_func_names == ["answer_reward", "answer_reward", "_Scorer",
                                                                   "my-scorer"]
    assert torch.equal(ours.reward_weights, theirs.reward_weights)
    with_env = GRPOTrainer(model=policy, reward_funcs=[answer_reward], environment_factory=_Counter,
                           args=GRPOConfig(max_steps=2))
    assert with_env.reward_func_names == ["answer_reward", "_Counter"]
    assert with_env.reward_weights.tolist() == [1.0, 1.0]
    # TRL lists the environment's reward after the given ones: each rollout's get_reward() where it is that class
    assert len(with_env.reward_funcs) == 2 and with_env.reward_funcs[0] is answer_reward
    assert with_env.reward_funcs[1](environments=[_Counter(), object()]) == [1.0, None]


def test_a_dataset_without_a_reward_source_is_trls_error(tmp_path):
    """TRL 1.16: no `reward_funcs` and no environment's `get_reward` is refused at construction, and so is no
    `train_dataset` without an environment (unless args name data.path); args' reward.functions count as a
    source."""
    from grpo_jax import GRPOConfig, GRPOTrainer

    folder = tmp_path / "model"
    folder.mkdir()
    with pytest.raises(ValueError, match="No reward source provided. Pass `reward_funcs`"):
        GRPOTrainer(model=str(folder), train_dataset=ROWS)
    with pytest.raises(ValueError, match="`train_dataset` is required unless an `environment_factory` is provided"):
        GRPOTrainer(model=str(folder), reward_funcs=answer_reward)
    data = {"path": "rows.jsonl", "tokenizer_path": str(folder)}  # the run's own data, checked when it is built
    assert GRPOTrainer(model=str(folder), args=GRPOConfig(data=data)).reward_funcs is None
    GRPOTrainer(model=str(folder), train_dataset=ROWS, args=GRPOConfig(reward_funcs=["my.module:score"]))
    with pytest.raises(ValueError, match=r"without a `train_dataset` \(the environment owns the data .*`max_steps` "
                                         "must be set to a positive value"):
        GRPOTrainer(model=str(folder), reward_funcs=answer_reward, environment_factory=_Counter)
    with pytest.raises(ValueError, match="multiple environments. requires a `train_dataset` with an `environment`"):
        GRPOTrainer(model=str(folder), reward_funcs=answer_reward, environment_factory={"a": _Counter, "b": _Counter})


def test_args_read_trls_names_as_trls_config_holds_them(tmp_path):
    """`trainer.args.beta` (TRL scripts read their config back) is what TRL 1.16's GRPOConfig holds for the same
    keywords; `args` stays a `Config`, `dataclasses.replace` keeps the view; a name with no counterpart says so."""
    import dataclasses

    trl = pytest.importorskip("trl")
    from grpo_jax import Config, GRPOConfig, GRPOTrainer

    given = dict(beta=0.1, num_generations=4, learning_rate=0.1, max_completion_length=8, temperature=0.7,
                 per_device_train_batch_size=4, gradient_accumulation_steps=2, loss_type="grpo", epsilon=0.3)
    theirs = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, report_to="none", **given)
    folder = tmp_path / "model"
    folder.mkdir()
    args = GRPOTrainer(model=str(folder), reward_funcs=answer_reward, args=GRPOConfig(**given), train_dataset=ROWS).args
    for name in (*given, "adam_beta2", "top_k", "top_p", "num_iterations"):
        assert getattr(args, name) == getattr(theirs, name), name
    assert args.dataloader_num_workers == 0  # grpo_jax reads rows in the training process
    assert isinstance(args, Config) and dataclasses.replace(args, seed=1).beta == 0.1
    with pytest.raises(AttributeError, match="no attribute 'use_vllm_magic'"):
        args.use_vllm_magic


def test_eval_dataset_as_trl_takes_it(tmp_path):
    """TRL's eval_dataset forms: a dict of datasets (kept as given, each checked; `train()` evaluates one held-out
    set and says so before anything is built) and a streamed dataset (kept as given, read as its rows)."""
    datasets = pytest.importorskip("datasets")
    from grpo_jax import GRPOTrainer
    from grpo_jax.api.trl_inputs import held_out

    folder = tmp_path / "model"
    folder.mkdir()
    rows = datasets.Dataset.from_list(ROWS)
    stream = rows.to_iterable_dataset()
    assert GRPOTrainer(model=str(folder), reward_funcs=answer_reward, eval_dataset=stream,
                       train_dataset=ROWS).eval_dataset is stream
    assert held_out(stream) == ROWS
    both = {"data1": rows, "data2": stream}
    trainer = GRPOTrainer(model=str(folder), reward_funcs=answer_reward, train_dataset=ROWS, eval_dataset=both)
    assert trainer.eval_dataset is both
    with pytest.raises(ValueError, match="eval_dataset is a dict of 2 datasets: a run evaluates one held-out set"):
        trainer.train()
    with pytest.raises(TypeError, match=r"eval_dataset is a int \(3\)"):
        GRPOTrainer(model=str(folder), reward_funcs=answer_reward, eval_dataset={"a": 3}, train_dataset=ROWS)


def test_a_streamed_train_dataset_is_read_as_the_rows_max_steps_reaches(tmp_path):
    """TRL's `streaming=True` train set: the rows whole rounds up to max_steps can take, in the stream's order, read
    once (a stream without max_steps is refused as TRL refuses it); `args.accelerator_config.dispatch_batches` is
    False, as TRL sets it for a stream (every process here reads its own rows)."""
    datasets = pytest.importorskip("datasets")
    from grpo_jax import GRPOConfig, GRPOTrainer

    folder = tmp_path / "model"
    folder.mkdir()
    reads = []

    def rows():
        for row in ROWS * 4:  # 64 rows
            reads.append(row)
            yield row

    stream = datasets.IterableDataset.from_generator(rows)
    # 2 optimizer steps a round (steps_per_generation 4 micro-batches / gradient accumulation 2) of 4 prompts x 2
    args = GRPOConfig(output_dir=str(tmp_path / "run"), max_steps=3, per_device_train_batch_size=2,
                      gradient_accumulation_steps=2, num_generations=2, steps_per_generation=4)
    trainer = GRPOTrainer(model=str(folder), reward_funcs=answer_reward, train_dataset=stream, args=args)
    assert trainer.args.accelerator_config.dispatch_batches is False
    import jax
    prompts_per_round = 2 * jax.device_count() * 4 // 2
    taken = trainer._train_rows()
    assert taken == (ROWS * 4)[:2 * prompts_per_round]  # ceil(3 steps / 2 a round) = 2 rounds, in order
    assert trainer._train_rows() is taken and len(reads) <= len(taken) + 1  # read once, no further than needed
    unbounded = GRPOTrainer(model=str(folder), reward_funcs=answer_reward, train_dataset=stream,
                            args=GRPOConfig(output_dir=str(tmp_path / "run2")))
    with pytest.raises(ValueError, match="streamed IterableDataset .* set max_steps"):
        unbounded._train_rows()


def test_accelerator_config_dispatch_batches_is_trls_and_a_stream_refuses_it(tmp_path):
    """accelerate's `dispatch_batches` (None by default): True with map-style rows is kept (every process reads the
    rows process 0 would dispatch), with a streamed train or eval set refused in TRL's words, False set for a stream
    as TRL sets it; each args has its own; accelerate's other fields only at their defaults, else named."""
    datasets = pytest.importorskip("datasets")
    from grpo_jax import GRPOConfig, GRPOTrainer

    folder = tmp_path / "model"
    folder.mkdir()
    assert GRPOConfig().accelerator_config.dispatch_batches is None
    dispatch = GRPOConfig(output_dir=str(tmp_path / "run"), max_steps=2,
                          accelerator_config={"dispatch_batches": True, "even_batches": True})
    trainer = GRPOTrainer(model=str(folder), reward_funcs=answer_reward, train_dataset=ROWS, args=dispatch)
    assert trainer.args.accelerator_config.dispatch_batches is True
    stream = datasets.IterableDataset.from_generator(lambda: iter(ROWS))
    for given in (dict(train_dataset=stream), dict(train_dataset=ROWS, eval_dataset={"held": stream})):
        with pytest.raises(ValueError, match=r"^Iterable datasets require `dispatch_batches=False`, but it is set to "
                                             r"`True` in `accelerator_config`. Please set it to `False`.$"):
            GRPOTrainer(model=str(folder), reward_funcs=answer_reward, args=dispatch, **given)
    plain = GRPOConfig(output_dir=str(tmp_path / "run"), max_steps=2)
    streamed = GRPOTrainer(model=str(folder), reward_funcs=answer_reward, train_dataset=stream, args=plain)
    assert streamed.args.accelerator_config.dispatch_batches is False
    assert plain.accelerator_config.dispatch_batches is None  # the trainer's copy, not the config it was given
    with pytest.raises(ValueError, match=r"^accelerator_config split_batches=True is accelerate's"):
        GRPOConfig(accelerator_config={"split_batches": True})


def test_reward_processing_classes_are_one_per_function_and_prompt_learning_is_named(tmp_path):
    """TRL keeps `reward_processing_classes` as a list, one per reward function (None each, or the one given);
    a PEFT prompt-learning config is refused saying so, as TRL refuses it."""
    from grpo_jax import GRPOTrainer

    folder = tmp_path / "model"
    folder.mkdir()
    assert GRPOTrainer(model=str(folder), reward_funcs=[answer_reward, answer_reward],
                       train_dataset=ROWS).reward_processing_classes == [None, None]
    one = object()
    assert GRPOTrainer(model=str(folder), reward_funcs=answer_reward, train_dataset=ROWS,
                       reward_processing_classes=one).reward_processing_classes == [one]
    peft = pytest.importorskip("peft")
    prompt_tuning = peft.PromptTuningConfig(task_type=peft.TaskType.CAUSAL_LM, num_virtual_tokens=8)
    with pytest.raises(ValueError, match=r"PromptTuningConfig \(prompt-learning\): grpo_jax trains LoRA adapters"):
        GRPOTrainer(model=str(folder), reward_funcs=answer_reward, train_dataset=ROWS, peft_config=prompt_tuning)


def test_trainer_tools_list_the_given_tools_then_each_environments_methods(tmp_path):
    """TRL's `trainer.tools`: the tools given, then a probe environment's public methods but reset and get_reward."""
    from grpo_jax import GRPOConfig, GRPOTrainer

    class Guessing:
        def reset(self, **kwargs):
            return None

        def guess(self, word: str) -> str:
            """Guess the word.

            Args:
                word: the guess.
            """
            return word

        def get_reward(self) -> float:
            return 1.0

    def shout(text: str) -> str:
        """Shout.

        Args:
            text: what to shout.
        """
        return text.upper()

    folder = tmp_path / "model"
    folder.mkdir()
    trainer = GRPOTrainer(model=str(folder), reward_funcs=answer_reward, tools=[shout], environment_factory=Guessing,
                          args=GRPOConfig(max_steps=1))
    assert [tool.__name__ for tool in trainer.tools] == ["shout", "guess"]
    assert trainer.tools[1]("a") == "a" and trainer._tools == [shout]  # the run gets the given ones


def test_reward_functions_are_called_once_a_generation_batch_in_row_order(tmp_path, monkeypatch):
    """TRL calls each reward function once per generation batch, on its rows in order (prompt after prompt, each
    prompt's num_generations completions together). Continuously batched (8 slots for 16 rows), a round's rows reach
    the host in several pieces as their groups end; the function still sees one call of all 16 rows a step
    (before: one call a piece, `enumerate` positions restarting in each). The first call is the check before
    compiling, on empty completions. `trainer._logs` (TRL's table of the newest round, which its tests read) holds
    the last call's rows, rewards and `log_extra` column."""
    pytest.importorskip("torch")
    import hf_fixtures

    from grpo_jax import GRPOConfig, GRPOTrainer
    from grpo_jax.data import task
    from grpo_jax.rollout import piece, scoring

    folder = hf_fixtures.save_model(hf_fixtures.build_model("qwen2", tied=True), tmp_path / "hf")
    task.build_tokenizer(folder)
    calls, pieces = [], []

    def recorded(prompts, completions, log_extra, **kwargs):
        calls.append((list(prompts), list(completions)))
        log_extra("head", [c[:2] for c in completions])
        return [float(len(c)) for c in completions]

    def joined(parts):
        pieces.append(len(parts))
        return piece.joined(parts)
    monkeypatch.setattr(scoring, "joined", joined)
    # (TRL's adaptive entropy rides along: trainer.entropy_coef is where the controller left it, one delta a step
    # up while the entropy stays below a target above any entropy)
    args = GRPOConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=2, num_generations=4,
                      max_completion_length=6, max_steps=3, report_to="none", disable_tqdm=True, entropy_coef=0.01,
                      log_completions=True, logging_steps=1,
                      use_adaptive_entropy=True, entropy_target=15.0,
                      **{"sampling.max_batch_rows": 8, "eval.num_examples": 0})
    trainer = GRPOTrainer(model=folder, reward_funcs=recorded, train_dataset=ROWS, args=args)
    assert not trainer._logs["completion"]
    trainer.train()
    prompts, completions = calls[-1]
    logs = trainer._logs
    assert list(logs["completion"]) == completions and list(logs["prompt"]) == prompts
    assert list(logs["rewards"]["recorded"]) == [float(len(c)) for c in completions]
    assert list(logs["extra"]["head"]) == [c[:2] for c in completions] and len(logs["advantages"]) == 16
    assert trainer.entropy_coef == pytest.approx(0.01 + 3 * 0.005, abs=1e-6)
    assert max(pieces) > 1  # the rows did come in pieces
    assert calls[0][1] == [""] * len(calls[0][1])  # the check, on empty completions
    assert [len(prompts) for prompts, _ in calls[1:]] == [16, 16, 16]
    for prompts, _ in calls[1:]:
        assert all(prompts[g * 4] != prompts[g * 4 + 4] for g in range(3))
        assert all(p == prompts[g * 4] for g in range(4) for p in prompts[g * 4:g * 4 + 4])


def test_under_lora_trainer_model_holds_a_peft_models_names_and_the_runs_adapters(tmp_path, monkeypatch):
    """With adapters, TRL's `trainer.model` is a `PeftModel`: our view has exactly its names (`base_model.model.`,
    `base_layer`, `lora_A.default`), the base weights, and the adapters the run starts from and ends with. With
    `peft_config` the run draws A itself: B is zero at step 0, so A's gradient is zero and step 1 leaves A as drawn
    (bit for bit) while B moves. A `PeftModel` as `model` starts from its own adapters."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    import hf_fixtures

    from grpo_jax import GRPOConfig, GRPOTrainer
    from grpo_jax.api import trl_inputs
    from grpo_jax.data import task

    monkeypatch.setattr(trl_inputs, "MODEL_CACHE", tmp_path / "cache")
    folder = hf_fixtures.save_model(hf_fixtures.build_model("qwen2", tied=True), tmp_path / "hf")
    task.build_tokenizer(folder)
    args = dict(max_steps=1, num_generations=4, max_completion_length=4, train_batch_size=8, learning_rate=0.01,
                **{"eval.num_examples": 0})
    import transformers

    def peft_model(init):
        base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        return peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=init))

    reference = dict(peft_model(True).named_parameters())
    trainer = GRPOTrainer(model=folder, reward_funcs=answer_reward, train_dataset=ROWS, processing_class=folder,
                          peft_config=peft.LoraConfig(r=4, lora_alpha=8),
                          args=GRPOConfig(output_dir=str(tmp_path / "config"), **args))
    before = dict(trainer.model.named_parameters())
    assert before.keys() == reference.keys()  # q_proj's and v_proj's weight and bias under base_layer
    assert any(".q_proj.base_layer.bias" in n for n in before) and any(".lora_A.default." in n for n in before)
    for name, tensor in reference.items():
        assert tensor.shape == before[name].shape, name
        if ".lora_" not in name:
            assert torch.equal(tensor, before[name]), name
        elif ".lora_B." in name:
            assert not before[name].any(), name
    trainer.train()
    after = dict(trainer.model.named_parameters())
    assert after.keys() == before.keys()
    for name in after:
        if ".lora_B." in name:
            assert after[name].any(), name
        else:  # the frozen base, and A (zero gradient while B was zero)
            assert torch.equal(after[name], before[name]), name
    assert torch.equal(trainer.model.get_parameter("base_model.model.lm_head.weight"),
                       before["base_model.model.model.embed_tokens.weight"])  # tied, as PEFT reads it

    given = peft_model(False)  # B random too: the adapters change the model before any step
    given_before = {n: p.detach().clone() for n, p in given.named_parameters()}
    with pytest.raises(ValueError, match="PeftModel with trained adapters and beta != 0"):
        GRPOTrainer(model=given, reward_funcs=answer_reward, train_dataset=ROWS, processing_class=folder,
                    args=GRPOConfig(output_dir=str(tmp_path / "beta"), beta=0.04, **args))
    with pytest.raises(ValueError, match="You passed a `PeftModel` instance together with a `peft_config`"):
        GRPOTrainer(model=given, reward_funcs=answer_reward, train_dataset=ROWS, peft_config=peft.LoraConfig())
    trainer = GRPOTrainer(model=given, reward_funcs=answer_reward, train_dataset=ROWS, processing_class=folder,
                          args=GRPOConfig(output_dir=str(tmp_path / "object"), **args))
    assert trainer.args.model.lora.rank == 4 and trainer.args.model.lora.path.endswith("-adapter")
    view = dict(trainer.model.named_parameters())
    assert view.keys() == given_before.keys()
    assert all(torch.equal(view[n], t) for n, t in given_before.items())
    trainer.train()
    after = dict(trainer.model.named_parameters())
    assert all(torch.equal(after[n], t) for n, t in given_before.items() if ".lora_" not in n)
    assert any(not torch.equal(after[n], t) for n, t in given_before.items() if ".lora_A." in n)


def test_trainer_ref_model_is_the_initial_model_then_the_synced_reference(tmp_path):
    """TRL's `trainer.ref_model` (beta != 0): the initial weights before training; with sync_ref_model, TR-DPO's
    mix after it. Synced once, at step 2 of 2: ref = alpha * policy(2) + (1 - alpha) * policy(0)."""
    torch = pytest.importorskip("torch")
    import hf_fixtures

    from grpo_jax import GRPOConfig, GRPOTrainer
    from grpo_jax.data import task

    folder = hf_fixtures.save_model(hf_fixtures.build_model("qwen2", tied=True), tmp_path / "hf")
    task.build_tokenizer(folder)
    args = dict(max_steps=2, num_generations=4, max_completion_length=4, train_batch_size=8, learning_rate=0.01,
                **{"eval.num_examples": 0})
    assert GRPOTrainer(model=folder, reward_funcs=answer_reward, train_dataset=ROWS,
                       args=GRPOConfig(beta=0.0, **args)).ref_model is None  # TRL keeps none at beta 0
    trainer = GRPOTrainer(model=folder, reward_funcs=answer_reward, train_dataset=ROWS, args=GRPOConfig(
        output_dir=str(tmp_path / "run"), beta=0.1, sync_ref_model=True, ref_model_sync_steps=2,
        ref_model_mixup_alpha=0.6, **args))
    start = dict(trainer.model.named_parameters())
    assert all(torch.equal(t, start[n]) for n, t in trainer.ref_model.named_parameters())
    trainer.train()
    policy = dict(trainer.model.named_parameters())
    ref = dict(trainer.ref_model.named_parameters())
    assert ref.keys() == start.keys()
    assert any(not torch.equal(policy[n], start[n]) for n in start)
    for name, tensor in ref.items():
        torch.testing.assert_close(tensor, 0.6 * policy[name] + 0.4 * start[name], rtol=1e-6, atol=1e-7)
    assert torch.equal(trainer.ref_model.get_parameter("lm_head.weight"), ref["model.embed_tokens.weight"])


def test_trainer_model_generate_is_transformers_generate_on_the_viewed_weights(tmp_path, monkeypatch):
    """`trainer.model.generate` (TRL scripts sample their trained policy with it): transformers' signature and
    output ([B, P + T], padded after EOS, cut where the last row ends), greedy tokens (and beam searches) equal to
    transformers' `generate` on the same folder, its generation config's defaults; after `train()` the trained
    weights'."""
    torch = pytest.importorskip("torch")
    import hf_fixtures
    import transformers

    from grpo_jax import GRPOConfig, GRPOTrainer
    from grpo_jax.data import task

    folder = hf_fixtures.save_model(hf_fixtures.build_model("qwen2", tied=True), tmp_path / "hf")
    task.build_tokenizer(folder)
    trainer = GRPOTrainer(model=folder, reward_funcs=answer_reward, train_dataset=ROWS, args=GRPOConfig(
        output_dir=str(tmp_path / "run"), max_steps=1, num_generations=4, max_completion_length=4,
        train_batch_size=8, learning_rate=0.05, **{"eval.num_examples": 0}))
    rng = np.random.default_rng(0)
    mask = np.ones((3, 9), np.int64)
    mask[0, :4], mask[1, :2] = 0, 0
    ids = torch.tensor(np.where(mask == 1, rng.integers(3, hf_fixtures.VOCAB, mask.shape), hf_fixtures.PAD_ID))
    mask = torch.tensor(mask)

    def reference(path, **kwargs):
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, do_sample=False, **kwargs)

    for kwargs in (dict(max_new_tokens=12, eos_token_id=hf_fixtures.EOS_ID, pad_token_id=hf_fixtures.PAD_ID), {},
                   dict(max_new_tokens=12, num_beams=3, length_penalty=0.5)):
        ours, theirs = trainer.model.generate(ids, attention_mask=mask, **kwargs), reference(folder, **kwargs)
        assert isinstance(ours, torch.Tensor) and ours.dtype == theirs.dtype and ours.shape == theirs.shape, \
            (ours.shape, theirs.shape)
        assert torch.equal(ours, theirs), (ours, theirs)
    with pytest.raises(ValueError, match="trainer.model.generate: num_beam_groups not supported"):
        trainer.model.generate(ids, attention_mask=mask, num_beam_groups=2)
    trainer.train()
    after = trainer.model.generate(ids, attention_mask=mask, max_new_tokens=12)
    assert torch.equal(after, reference(tmp_path / "run" / "final", max_new_tokens=12))
    from grpo_jax.api import policy_sampling

    reads = []
    monkeypatch.setattr(policy_sampling, "_model", lambda view, read=policy_sampling._model: reads.append(1) or
                        read(view))
    sampled = [trainer.model.generate(ids, attention_mask=mask, do_sample=True, max_new_tokens=12) for _ in range(2)]
    assert sampled[0].shape[0] == 3 and not torch.equal(sampled[0], sampled[1])  # each call draws anew
    assert not reads  # the trained weights were read once, by the call above: a loop of calls compiles once


def test_trainer_model_generate_under_lora_runs_the_base_with_the_viewed_adapters(tmp_path):
    """Under `peft_config` `trainer.model.generate` runs the base with the adapters the view reads: before training
    the drawn ones (B zero: the base's greedy tokens, as transformers' base model generates them), after it the
    trained ones (as peft's PeftModel over the base and the run's final/ adapter folder generates them)."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    import hf_fixtures
    import transformers

    from grpo_jax import GRPOConfig, GRPOTrainer
    from grpo_jax.data import task

    folder = hf_fixtures.save_model(hf_fixtures.build_model("qwen2", tied=True), tmp_path / "hf")
    task.build_tokenizer(folder)
    trainer = GRPOTrainer(model=folder, reward_funcs=answer_reward, train_dataset=ROWS, processing_class=folder,
                          peft_config=peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
                          args=GRPOConfig(output_dir=str(tmp_path / "run"), max_steps=2, num_generations=4,
                                          max_completion_length=4, train_batch_size=8, learning_rate=0.05,
                                          **{"eval.num_examples": 0}))
    mask = torch.ones((2, 7), dtype=torch.long)
    mask[0, :3] = 0
    ids = torch.where(mask == 1, torch.arange(3, 17).reshape(2, 7) * 7 % hf_fixtures.VOCAB, hf_fixtures.PAD_ID)
    options = dict(max_new_tokens=10, eos_token_id=hf_fixtures.EOS_ID, pad_token_id=hf_fixtures.PAD_ID)

    def reference(model):
        with torch.no_grad():
            return model.eval().generate(input_ids=ids, attention_mask=mask, do_sample=False, **options)

    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert torch.equal(trainer.model.generate(ids, attention_mask=mask, **options), reference(base))
    trainer.train()
    trained = peft.PeftModel.from_pretrained(base, tmp_path / "run" / "final")
    after = trainer.model.generate(ids, attention_mask=mask, **options)
    assert torch.equal(after, reference(trained))
    with trained.disable_adapter():
        assert not torch.equal(after, reference(trained))  # the adapters moved the tokens
