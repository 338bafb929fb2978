"""The CLI's error paths while a run is built: each is exactly one line on stderr (no traceback), naming what is
wrong; `--debug` gives Python's traceback instead. Each case lists its old outcome."""

import json
import shutil
import sys

import pytest

from grpo_jax.api import cli, run
from grpo_jax.data import task

TINY = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=1", "max_steps=1"]


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    pytest.importorskip("torch")
    from tests.hf_fixtures import build_model, save_model

    root = tmp_path_factory.mktemp("models")
    return {name: save_model(build_model(name, tied=True), root / name) for name in ("qwen3_moe", "gemma3")}


def _edited(source, folder, **changes):
    shutil.copytree(source, folder)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, **changes}))
    return folder


def _case(name, tmp_path, folders, monkeypatch):
    """(the command's arguments, the start of its one line) for one error path."""
    if name == "yaml":  # old: the YAML parser's message over 8 lines
        (tmp_path / "bad.yaml").write_text("train:\n  learning_rate: [1e-6\n")
        return ["--config", str(tmp_path / "bad.yaml")], "grpo-jax: config error: "
    if name == "moe_experts":  # old: trained with exit 0 and no message
        folder = _edited(folders["qwen3_moe"], tmp_path / "moe", num_experts=4)
        return [f"model.path={folder}"], f"grpo-jax: {folder / 'config.json'}: num_experts=4 but the weights hold 8"
    if name == "layer_types":  # old: huggingface_hub's StrictDataclass traceback
        folder = _edited(folders["gemma3"], tmp_path / "gemma", layer_types=["full_attention"] * 2)
        return [f"model.path={folder}"], f"grpo-jax: {folder / 'config.json'}: layer_types has 2 entries but the " \
                                         "weights hold 3 layers"
    if name == "config_json":
        (tmp_path / "broken").mkdir()
        (tmp_path / "broken" / "config.json").write_text("{")
        return [f"model.path={tmp_path / 'broken'}"], f"grpo-jax: {tmp_path / 'broken' / 'config.json'}: not " \
                                                      "readable as JSON"
    if name == "environment":  # old: a full traceback ending in a RuntimeError
        return ["data.task=lookup", "environment_factory=tests.api.test_arguments:BrokenEnv"], \
            "grpo-jax: RuntimeError: environment_factory (BrokenEnv) raised ConnectionError: the sandbox service " \
            "refused the connection (raised in __init__"
    if name == "reward_import":  # old: the module's ZeroDivisionError traceback
        (tmp_path / "broken_cli_rewards.py").write_text("RATE = 1 / 0\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.delitem(sys.modules, "broken_cli_rewards", raising=False)
        return ["reward.functions=[broken_cli_rewards:score]"], "grpo-jax: reward.functions: reward function " \
            "'broken_cli_rewards:score': importing module 'broken_cli_rewards' raised ZeroDivisionError"
    if name == "data_line":
        task.build_tokenizer(tmp_path / "tok")
        (tmp_path / "d.jsonl").write_text('{"prompt": "12>"}\n{"prompt": \n')
        return [f"data.path={tmp_path / 'd.jsonl'}", f"data.tokenizer_path={tmp_path / 'tok'}", "model.init=random"], \
            f"grpo-jax: {tmp_path / 'd.jsonl'}: line 2"
    if name == "internal":  # anything else that escapes the build: where it was raised, and --debug
        def broken(*args, **kwargs):
            raise KeyError("row")

        monkeypatch.setattr(run, "check_inputs", broken)
        return [], "grpo-jax: KeyError: 'row' (raised in broken, "
    raise AssertionError(name)


CASES = ["yaml", "moe_experts", "layer_types", "config_json", "environment", "reward_import", "data_line", "internal"]


@pytest.mark.parametrize("name", CASES)
def test_each_build_error_is_one_line_on_stderr(name, tmp_path, moe_folder, monkeypatch, capsys):
    args, start = _case(name, tmp_path, moe_folder, monkeypatch)
    try:
        code = cli.main([*TINY, f"output_dir={tmp_path / 'run'}", *args])
    except SystemExit as e:  # argparse's exit for a config error
        code = e.code
    err = capsys.readouterr().err
    assert code in (1, 2)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(start), err
    if name == "internal":
        assert err.rstrip().endswith("(--debug prints the traceback)")


def test_debug_gives_the_traceback(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise KeyError("row")

    monkeypatch.setattr(run, "check_inputs", broken)
    with pytest.raises(KeyError, match="row"):
        cli.main([*TINY, "--debug", f"output_dir={tmp_path / 'run'}"])
