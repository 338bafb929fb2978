"""Reward models: a transformers `*ForSequenceClassification` folder scores in JAX what its PyTorch model scores
the way TRL 1.16 calls it (within 1e-4), string and conversational rows, and trains as a reward function."""

import json

import numpy as np
import pytest

from grpo_jax.api import trainer
from grpo_jax.api.run import check_inputs
from grpo_jax.config import load_config
from grpo_jax.data import task
from grpo_jax.rewards.reward_model import RewardModel, is_reward_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CHAT_TEMPLATE = ("{% for m in messages %}{{ '^' if m['role'] == 'user' else '=' }}{{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}>{% endif %}")


def _reward_folder(tmp_path, family: str) -> str:
    """A random transformers sequence classifier (one label) with the task's character tokenizer, saved."""
    import hf_fixtures as hf

    torch.manual_seed(1)
    config = hf.hf_config(family, tied=False, num_labels=1, pad_token_id=0)
    model = transformers.AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    folder = tmp_path / f"{family}-rm"
    model.eval().save_pretrained(folder)
    tokenizer = task.build_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return str(folder)


def _trl_scores(folder, prompts, completions) -> np.ndarray:
    """TRL 1.16 `_calculate_rewards` for an nn.Module reward function, on the PyTorch model."""
    from trl.data_utils import apply_chat_template, is_conversational

    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    if is_conversational({"prompt": prompts[0]}):
        texts = [apply_chat_template({"messages": p + c}, tokenizer)["text"] for p, c in zip(prompts, completions)]
    else:
        texts = [p + c for p, c in zip(prompts, completions)]
    inputs = tokenizer(text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    with torch.inference_mode():
        return model(**inputs).logits[:, 0].numpy()


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3", "mistral"])
def test_reward_model_scores_equal_transformers(tmp_path, family):
    folder = _reward_folder(tmp_path, family)
    assert is_reward_model(folder) and not is_reward_model(tmp_path)
    model = RewardModel(folder)
    shapes = []  # the shapes reaching the jitted program: one shape, so one compilation
    scores = model._scores
    model._scores = lambda params, weight, ids, *rest: (shapes.append(ids.shape), scores(params, weight, ids, *rest))[1]
    prompts = ["12>", "3>", "456>", "7>"]
    completions = ["21", "3", "6541", ""]  # rows of different lengths, one empty completion
    np.testing.assert_allclose(model(prompts, completions), _trl_scores(folder, prompts, completions),
                               rtol=1e-4, atol=1e-4)
    # 3 rows run in the 4-row program (rows filled up to a power of two): no new compilation, the same scores
    np.testing.assert_allclose(model(prompts[1:], completions[1:]), _trl_scores(folder, prompts[1:], completions[1:]),
                               rtol=1e-4, atol=1e-4)
    assert shapes == [(4, 64), (4, 64)]
    chats = [[{"role": "user", "content": p[:-1]}] for p in prompts]
    answers = [[{"role": "assistant", "content": c}] for c in completions]
    np.testing.assert_allclose(model(chats, answers), _trl_scores(folder, chats, answers), rtol=1e-4, atol=1e-4)


def test_a_reward_model_renders_conversations_with_the_chat_template_kwargs(tmp_path):
    """data.chat_template_kwargs reach a reward model's chat template as TRL passes its chat_template_kwargs."""
    from grpo_jax.rewards.reward_specs import resolve_all

    apply_chat_template = pytest.importorskip("trl.data_utils").apply_chat_template

    folder = _reward_folder(tmp_path, "qwen2")
    flagged = CHAT_TEMPLATE.replace("{% endfor %}", "{% endfor %}{% if loud %}!{% endif %}")
    (model, ) = [fn for _, fn in resolve_all([folder], max_completion_length=4, soft_punish_cache=0,
                                             template_kwargs={"loud": True})]
    model.tokenizer.chat_template = flagged
    chats = [[{"role": "user", "content": "12"}], [{"role": "user", "content": "3"}]]
    answers = [[{"role": "assistant", "content": "21"}], [{"role": "assistant", "content": "3"}]]
    expected = [apply_chat_template({"messages": p + c}, model.tokenizer, loud=True)["text"]
                for p, c in zip(chats, answers)]
    assert model.texts(chats, answers) == expected == ["^12 =21 !", "^3 =3 !"]


def test_a_reward_model_folder_is_a_reward_function_of_a_run(tmp_path):
    folder = _reward_folder(tmp_path, "qwen2")
    config = load_config(None, [f"output_dir={tmp_path / 'run'}", "max_steps=2", "train.train_batch_size=16",
                                "train.num_generations=4", "eval.num_examples=0", "sampling.max_completion_length=6",
                                f"reward.functions=[{folder},grpo_jax.data.task:char_accuracy]", "reward.weights=[1.0,0.5]"])
    trainer.train(config, show_progress=False)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and all(np.isfinite(line["rewards/qwen2-rm/mean"]) for line in lines)
    assert all(line["rewards/qwen2-rm/std"] > 0 for line in lines)  # completions scored one by one


def test_a_model_folder_without_a_classification_head_is_refused_by_name(tmp_path):
    import hf_fixtures as hf

    folder = hf.save_model(hf.build_model("qwen2", tied=True), tmp_path / "lm")
    with pytest.raises(ValueError, match=r"reward.functions: '.*lm' is a model folder but not a reward model "
                                         r"\(architectures \['Qwen2ForCausalLM'\]\): list a "
                                         r"\*ForSequenceClassification"):
        check_inputs(load_config(None, [f"reward.functions=[{folder}]"]))


def test_a_reward_model_object_is_converted_to_jax_and_scores_as_its_folder(tmp_path):
    """TRL's reward_funcs=[model]: a transformers *ForSequenceClassification object scores what its folder scores
    (and what TRL scores with it); its tokenizer from reward_processing_classes, else its name_or_path folder."""
    from grpo_jax.rewards.reward_specs import resolve_all

    folder = _reward_folder(tmp_path, "qwen2")
    prompts, completions = ["12>", "3>", "456>", "7>"], ["21", "3", "6541", ""]
    expected = RewardModel(folder)(prompts, completions)
    lengths = dict(max_completion_length=6, soft_punish_cache=0)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    [(name, fn)] = resolve_all([model], **lengths)  # the tokenizer saved at its name_or_path
    assert name == "qwen2-rm"
    np.testing.assert_array_equal(fn(prompts, completions), expected)
    np.testing.assert_allclose(expected, _trl_scores(folder, prompts, completions), rtol=1e-4, atol=1e-4)

    model.config._name_or_path = ""  # built in memory: nothing to find a tokenizer in
    with pytest.raises(ValueError, match=r"^reward_funcs: the Qwen2ForSequenceClassification object comes without a "
                                         r"tokenizer: pass reward_processing_classes=\[its tokenizer\]"):
        resolve_all([model], **lengths)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    [(name, fn), _] = resolve_all([model, "grpo_jax.data.task:char_accuracy"], processing_classes=[tokenizer, None],
                                  **lengths)
    assert name == "Qwen2ForSequenceClassification"
    np.testing.assert_array_equal(fn(prompts, completions), expected)

    import hf_fixtures as hf

    with pytest.raises(ValueError, match=r"^reward_funcs: a Qwen2ForCausalLM object is not a reward model"):
        resolve_all([hf.build_model("qwen2", tied=True)], **lengths)


def test_train_takes_a_reward_model_object(tmp_path):
    """The issue's case: the object failed with transformers' "You must specify exactly one of input_ids or
    inputs_embeds" (it was called as a function); its tokenizer comes from its folder here."""
    folder = _reward_folder(tmp_path, "llama")
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    config = load_config(None, [f"output_dir={tmp_path / 'run'}", "max_steps=1", "train.train_batch_size=16",
                                "train.num_generations=4", "eval.num_examples=0", "sampling.max_completion_length=6"])
    trainer.train(config, show_progress=False, reward_funcs=[model, "grpo_jax.data.task:char_accuracy"])
    [line] = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert np.isfinite(line["rewards/llama-rm/mean"]) and line["rewards/llama-rm/std"] > 0
