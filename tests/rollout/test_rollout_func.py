"""TRL's ``rollout_func`` (grpo_jax/rollout/rollout_func.py): a user's function makes the training passes' rows; they
are padded as TRL pads them, its extra fields reach the reward functions, and a run trains on exactly those rows."""

import json

import numpy as np
import pytest

from grpo_jax.data.prompts import PromptBatch
from grpo_jax.rollout import rollout_func
from grpo_jax.rollout.rollout_func import RolloutFunc

EOS, PAD = 1, 0


def _batch(n=4, P=5):
    return PromptBatch(np.zeros((n, P), np.int32), np.zeros((n, P), np.int32), [f"p{i // 2}" for i in range(n)],
                       {"answer": [str(i) for i in range(n)]}, 0)


def _fn(output):
    return RolloutFunc(lambda prompts, state: output, (EOS, 7), PAD)


def test_rows_are_padded_as_trl_pads_them():
    """Prompts left-padded to the longest (the batch's 4 slots widened to 5, the run's limit), completions
    right-padded; attention and the loss stop after the first EOS (TRL's completion mask); truncated where the
    returned row's last token is neither EOS nor padding (TRL's test); env_mask is the loss mask; other fields are
    columns (a list one value a row, anything else every row's)."""
    output = {"prompt_ids": [[5, 6], [5, 6, 8], [9], [9, 9, 9, 9, 9]],
              "completion_ids": [[3, EOS], [3, 4, 5], [3, EOS, 4], [7]],
              "logprobs": [[-0.1, -0.2], [-0.3, -0.4, -0.5], [-1.0, -2.0, -3.0], [-0.7]],
              "env_mask": [[1, 1], [1, 0, 1], [1, 1, 1], [1]], "source": ["a", "b", "c", "d"], "k": 3}
    batch, piece = rollout_func.rows(_fn(output), _batch(P=4), 5, 4, mesh=_mesh())
    np.testing.assert_array_equal(batch.prompt_ids, [[0, 0, 0, 5, 6], [0, 0, 5, 6, 8], [0, 0, 0, 0, 9], [9] * 5])
    np.testing.assert_array_equal(batch.prompt_mask, [[0, 0, 0, 1, 1], [0, 0, 1, 1, 1], [0, 0, 0, 0, 1], [1] * 5])
    np.testing.assert_array_equal(piece.completion_ids, [[3, EOS, 0, 0], [3, 4, 5, 0], [3, EOS, 0, 0], [7, 0, 0, 0]])
    np.testing.assert_array_equal(piece.completion_mask, [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]])
    # TRL reads the raw list's last token: a row going on after its EOS counts as truncated; 7 is a stop id too
    np.testing.assert_array_equal(piece.is_truncated, [False, True, True, False])
    np.testing.assert_array_equal(piece.loss_mask, [[1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]])
    trajectory = piece.trajectory
    np.testing.assert_allclose(np.asarray(trajectory.sampler_per_token_logps),
                               [[-0.1, -0.2, 0, 0], [-0.3, -0.4, -0.5, 0], [-1.0, -2.0, 0, 0], [-0.7, 0, 0, 0]])
    np.testing.assert_array_equal(np.asarray(trajectory.prompt_ids), batch.prompt_ids)
    np.testing.assert_array_equal(np.asarray(trajectory.turns), np.where(piece.completion_mask == 1, 0, -1))
    assert batch.columns == {"answer": ["0", "1", "2", "3"], "source": ["a", "b", "c", "d"], "k": [3] * 4}


def _mesh():
    import jax

    from grpo_jax.device import sharding
    return sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])


@pytest.mark.parametrize("output, match", [
    ({"prompt_ids": [[1]] * 4, "completion_ids": [[2]] * 4}, r"^rollout_func must return keys \['logprobs'\] in its "
                                                             r"output dict.$"),
    ({"prompt_ids": [[1]] * 3, "completion_ids": [[2]] * 4, "logprobs": [[0.0]] * 4},
     r"prompt_ids holds 3 rows for the 4 prompts"),
    ({"prompt_ids": [[1] * 6] * 4, "completion_ids": [[2]] * 4, "logprobs": [[0.0]] * 4},
     r"prompt_ids\[0\] has 6 tokens, over the run's 5: raise data.max_prompt_length"),
    ({"prompt_ids": [[1]] * 4, "completion_ids": [[2] * 5] * 4, "logprobs": [[0.0] * 5] * 4},
     r"completion_ids\[0\] has 5 tokens, over the run's 4: raise sampling.max_completion_length"),
    ({"prompt_ids": [[1]] * 4, "completion_ids": [[2, 2]] * 4, "logprobs": [[0.0]] * 4},
     r"logprobs\[0\] has 1 entries for the 2 tokens of completion_ids\[0\]"),
    ({"prompt_ids": [[1]] * 4, "completion_ids": [[2]] * 4, "logprobs": [[0.0]] * 4, "answer": [1] * 4},
     r"rollout_func returned 'answer', which the dataset \(or TRL\) names already"),
])
def test_a_bad_output_is_one_line_naming_the_field(output, match):
    with pytest.raises(ValueError, match=match):
        rollout_func.rows(_fn(output), _batch(P=4), 5, 4, mesh=_mesh())


def test_a_trainer_with_a_rollout_func_trains_on_its_rows(tmp_path):
    """GRPOTrainer(rollout_func=...): called once a generation batch with its prompts (each num_generations times,
    in order) and the trainer, whose processing_class tokenizes; the reward functions see its completions, their
    ids and its extra fields; the logged lengths are its rows'; the weights move. `_generate` is TRL's, and a
    function that leaves out a key fails with TRL's message."""
    pytest.importorskip("torch")
    import hf_fixtures
    from safetensors.numpy import load_file

    from grpo_jax import GRPOConfig, GRPOTrainer
    from grpo_jax.data import task

    folder = hf_fixtures.save_model(hf_fixtures.build_model("qwen2", tied=True), tmp_path / "hf")
    task.build_tokenizer(folder)
    rows = [{"prompt": f"{i}{i}>", "answer": str(i)} for i in range(8)]
    calls, seen, steps = [], [], []
    scripts = ["1", "12", "123", "1234"]

    def rollout(prompts, trainer):
        calls.append(list(prompts))
        steps.append(trainer.state.global_step)
        tok = trainer.processing_class
        prompt_ids = [tok(p, add_special_tokens=False).input_ids for p in prompts]
        ends = [[tok.eos_token_id] if i % 4 < 3 else [] for i in range(len(prompts))]  # every 4th runs out
        completion_ids = [tok(scripts[i % 4], add_special_tokens=False).input_ids + ends[i]
                          for i in range(len(prompts))]
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids,
                "logprobs": [[-0.5] * len(c) for c in completion_ids], "source": [f"r{i}" for i in range(len(prompts))]}

    def reward(prompts, completions, completion_ids, source, **kwargs):
        seen.append((list(completions), [list(c) for c in completion_ids], list(source)))
        return [float(len(c)) for c in completions]

    trainer = GRPOTrainer(model=folder, reward_funcs=reward, train_dataset=rows, rollout_func=rollout,
                          args=GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=2, num_generations=4,
                                          max_completion_length=4, beta=0.0, logging_steps=1, shuffle_dataset=False,
                                          train={"train_batch_size": 8}, **{"eval.num_examples": 0}))
    trainer.train()
    assert len(calls) == 2 and [len(c) for c in calls] == [8, 8] and steps == [0, 1]  # trainer.state: the run's
    assert calls[0] == [rows[0]["prompt"]] * 4 + [rows[1]["prompt"]] * 4  # each prompt G times, in order
    tok = trainer.processing_class
    for completions, ids, source in seen:
        assert completions == scripts * 2 and source == [f"r{i}" for i in range(8)]
        assert ids[0] == tok("1", add_special_tokens=False).input_ids + [tok.eos_token_id]  # EOS kept
    lengths = [len(tok(s, add_special_tokens=False).input_ids) + (i < 3) for i, s in enumerate(scripts)]
    lines = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [line["completions/mean_length"] for line in lines] == pytest.approx([np.mean(lengths)] * 2)
    assert lines[0]["completions/clipped_ratio"] == pytest.approx(0.25)  # the un-ended quarter
    initial, final = load_file(f"{folder}/model.safetensors"), load_file(tmp_path / "out" / "final" /
                                                                         "model.safetensors")
    assert any(not np.array_equal(final[k], initial[k]) for k in initial)
    generated = trainer._generate(["ab>", "ab>"])
    assert generated[0] == [tok("ab>", add_special_tokens=False).input_ids] * 2 and generated[3][1] == "12"
    assert generated[5] == {"source": ["r0", "r1"]}
    trainer.rollout_func = lambda prompts, trainer: {"prompt_ids": [[1]], "completion_ids": [[2]]}
    with pytest.raises(ValueError, match=r"rollout_func must return keys \['logprobs'\]"):
        trainer._generate(["ab>"])
