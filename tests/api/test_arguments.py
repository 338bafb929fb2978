"""The Python API checks its arguments up front (`grpo_jax.api.arguments.check_arguments`): each wrong one is a
TypeError/ValueError naming it before any folder, import or compilation; user code that raises while the run is
built (an environment's `__init__`, a reward module's import) is one line naming it, the original chained. Each case
lists its old outcome."""

import sys
import time

import pytest

import grpo_jax
from grpo_jax.api import arguments, trainer
from grpo_jax.api.trl_api import GRPOTrainer
from grpo_jax.config import load_config, make_config

CONFIG = make_config(max_steps=1)


def _reward(prompts, completions, **kwargs):
    return [0.0] * len(completions)


class BrokenEnv:
    """An environment whose constructor fails (its service is down)."""

    def __init__(self):
        raise ConnectionError("the sandbox service refused the connection")

    def reset(self, **row):
        return None


class _Instance:
    """An environment instance where its class was meant."""


@pytest.mark.parametrize("call, error, match", [
    # old: AttributeError: 'dict' object has no attribute 'report_to'
    (lambda: grpo_jax.train({"max_steps": 2}), TypeError, r"^config is a dict: build a Config from it with "
                                                          r"grpo_jax\.make_config\(\*\*config\)"),
    (lambda: grpo_jax.train("configs/grpo.yaml"), TypeError, r"^config is a str: pass a grpo_jax Config"),
    # old: failed after ~19 s of compiling, inside the train step
    (lambda: trainer.train(CONFIG, loss_fn=5), TypeError, r"^loss_fn is a int \(5\), not callable"),
    # old: TypeError: expected str, bytes or os.PathLike object, not int (reward_model.py)
    (lambda: trainer.train(CONFIG, reward_funcs=42), TypeError, r"^reward_funcs is a int \(42\), not callable"),
    (lambda: trainer.train(CONFIG, reward_funcs=[_reward, object()]), TypeError,
     r"^reward_funcs\[1\] is a object, not callable"),
    (lambda: trainer.train(CONFIG, reward_funcs=[]), ValueError, r"^reward_funcs is an empty list"),
    (lambda: trainer.train(CONFIG, eval_reward_funcs=[3.5]), TypeError, r"^eval_reward_funcs\[0\] is a float"),
    (lambda: trainer.train(CONFIG, train_dataset="data.jsonl"), TypeError,
     r"^train_dataset is a str: pass a datasets\.Dataset or a list of dicts"),
    (lambda: trainer.train(CONFIG, train_dataset=[{"prompt": "a"}, "b"]), TypeError,
     r"^train_dataset\[1\] is a str: each row is a dict"),
    (lambda: trainer.train(CONFIG, eval_dataset=7), TypeError, r"^eval_dataset is a int \(7\)"),
    (lambda: trainer.train(CONFIG, tools=_reward), TypeError, r"^tools is a function: pass a list"),
    (lambda: trainer.train(CONFIG, tools=[_reward, 1]), TypeError, r"^tools\[1\] is a int \(1\), not callable"),
    (lambda: trainer.train(CONFIG, environment_factory=_Instance()), TypeError,
     r"^environment_factory is a _Instance: pass a class"),
    (lambda: trainer.train(CONFIG, environment_factory={"a": 1}), TypeError, r"^environment_factory\['a'\] is a int"),
    (lambda: GRPOTrainer("no/such/model", reward_funcs=42), TypeError, r"^reward_funcs is a int \(42\)"),
    (lambda: GRPOTrainer("no/such/model", _reward, train_dataset={"prompt": ["a"]}), TypeError,
     r"^train_dataset is a dict"),
], ids=["config_dict", "config_str", "loss_fn", "reward_int", "reward_item", "reward_empty", "eval_reward",
        "dataset_str", "dataset_row", "eval_dataset", "tools_not_list", "tools_item", "env_instance", "env_dict",
        "trainer_reward", "trainer_dataset"])
def test_a_wrong_argument_is_named_at_once(call, error, match, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing may be written: a run folder would appear here
    start = time.perf_counter()
    with pytest.raises(error, match=match) as raised:
        call()
    assert "\n" not in str(raised.value)
    assert time.perf_counter() - start < 2.0  # before anything is built or compiled
    assert list(tmp_path.iterdir()) == []


def test_right_arguments_pass(tmp_path):
    """The kinds the API takes: callables, paths, folders, lists of dicts, datasets, environment classes by name."""
    import datasets

    arguments.check_arguments(CONFIG, loss_fn=lambda *a: None, reward_funcs=["m:f", _reward, tmp_path],
                              train_dataset=[{"prompt": "a"}],
                              eval_dataset=datasets.Dataset.from_list([{"prompt": "b"}]),
                              tools=(_reward, "m:f"), environment_factory={"a": BrokenEnv, "b": "m:Env"},
                              eval_reward_funcs=_reward)


def test_an_environment_whose_init_raises_is_one_line_naming_the_class(tmp_path):
    """Old outcome: a full traceback ending in a RuntimeError. New: one line naming the class and its error, the
    original chained (in Python; the CLI prints the line, or the traceback with --debug)."""
    config = load_config(None, [f"output_dir={tmp_path / 'run'}", "data.task=lookup", "max_steps=1",
                                "model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=1"])
    with pytest.raises(RuntimeError, match=r"^environment_factory \(BrokenEnv\) raised ConnectionError: the sandbox "
                                           r"service refused the connection$") as raised:
        trainer.train(config, environment_factory=BrokenEnv, show_progress=False)
    assert isinstance(raised.value.__cause__, ConnectionError)


def test_a_reward_module_raising_while_imported_is_one_line_naming_it(tmp_path, monkeypatch):
    """Old outcome: the module's traceback (a ZeroDivisionError at import). New: a ValueError naming the field, the
    module and its error, the original chained."""
    (tmp_path / "broken_rewards.py").write_text("RATE = 1 / 0\n\ndef score(prompts, completions, **kw):\n"
                                                "    return [0.0] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "broken_rewards", raising=False)
    config = load_config(None, [f"output_dir={tmp_path / 'run'}", "reward.functions=[broken_rewards:score]"])
    with pytest.raises(ValueError, match=r"^reward\.functions: reward function 'broken_rewards:score': importing "
                                         r"module 'broken_rewards' raised ZeroDivisionError: division by zero") as e:
        trainer.train(config, show_progress=False)
    assert isinstance(e.value.__cause__.__cause__, ZeroDivisionError)
