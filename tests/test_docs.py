"""README, docs/configuration.md, shipped configs and CI stay true to the code: reference tables, defaults, test
command, fast --help.

Defaults are read from the dataclasses, never written here: when a default changes, these tests name the
docs/configuration.md row and the configs/default.yaml key to update, with the literal to write.
"""

import dataclasses
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from grpo_jax.config import Config, load_config, to_dict

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CONFIGURATION = ROOT / "docs" / "configuration.md"


def _defaults(config=None, prefix: str = "") -> dict:
    """Every config key as written in the reference (`seed`, `train.learning_rate`, `model.lora.rank`) -> its
    dataclass default."""
    out = {}
    config = Config() if config is None else config
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value):
            out.update(_defaults(value, f"{prefix}{field.name}."))
        else:
            out[prefix + field.name] = value
    return out


def _literal(value) -> str:
    """A default as the reference writes it: YAML literals, tuples as flow lists, 1e-6 not 1e-06."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    if isinstance(value, float) and "e" in repr(value):
        mantissa, exponent = repr(value).split("e")
        return f"{mantissa}e{int(exponent)}"
    return str(value)


def _same(cell, default) -> bool:
    """A YAML-loaded reference cell equals a dataclass default (lists vs tuples, ints as floats, YAML 1.1 1e-6)."""
    if isinstance(default, tuple):
        return isinstance(cell, list) and len(cell) == len(default) and all(map(_same, cell, default))
    if default is None or isinstance(default, (bool, str)):
        return type(cell) is type(default) and cell == default
    if isinstance(default, float) and isinstance(cell, str):  # PyYAML reads 1e-6 (no dot) as a string
        try:
            cell = float(cell)
        except ValueError:
            return False
    if isinstance(default, int):
        return type(cell) is int and cell == default
    return isinstance(cell, (int, float)) and not isinstance(cell, bool) and float(cell) == default


def _reference_rows() -> list[tuple[str, str]]:
    """(key, default cell) of every row of docs/configuration.md's `| key | default | meaning |` tables."""
    rows, in_table = [], False
    for line in CONFIGURATION.read_text().splitlines():
        if not line.startswith("|"):
            in_table = False
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if cells[:2] == ["key", "default"]:  # other tables (metrics, estimators) are not config rows
            in_table = True
        elif in_table and not cells[0].startswith("-"):
            assert len(cells) == 3, f"docs/configuration.md row needs key | default | meaning: {line}"
            rows.append((cells[0].strip("`"), cells[1].strip("`")))
    return rows


def _code_block_lines(text: str) -> list[str]:
    lines, inside = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            inside = not inside
        elif inside:
            lines.append(line)
    return lines


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def test_configuration_reference_lists_every_config_field_once():
    keys = [key for key, _ in _reference_rows()]
    expected = _defaults()
    duplicates = sorted({k for k in keys if keys.count(k) > 1})
    missing = [k for k in expected if k not in keys]
    unknown = [k for k in keys if k not in expected]
    problems = [f"listed twice: {k}" for k in duplicates]
    problems += [f"not a config field: {k}" for k in unknown]
    problems += [f"missing row: | `{k}` | `{_literal(expected[k])}` | ... |" for k in missing]
    assert not problems, "docs/configuration.md:\n" + "\n".join(problems)


def test_configuration_reference_defaults_equal_the_dataclass_defaults():
    expected = _defaults()
    wrong = []
    for key, cell in _reference_rows():
        if key in expected and not _same(yaml.safe_load(cell), expected[key]):
            wrong.append(f"`{key}`: docs/configuration.md says `{cell}`, the default is `{_literal(expected[key])}`")
    assert not wrong, "docs/configuration.md is stale:\n" + "\n".join(wrong)


def test_readme_test_command_is_what_ci_runs():
    commands = [line.strip() for line in _code_block_lines(README.read_text()) if "pytest" in line]
    assert len(commands) == 1, f"README should show exactly one test command in a code block, found {commands}"
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    assert commands[0] in ci_lines, f".ci/run does not run the README's {commands[0]!r}: {ci_lines}"
    # after the tests, only the plain-install stage: a fresh venv with `pip install -e .` alone
    assert ci_lines[ci_lines.index(commands[0]) + 1:] == [".ci/plain_install"], ci_lines
    assert "set -euo pipefail" in ci_lines
    plain = (ROOT / ".ci" / "plain_install").read_text()
    assert "python -m venv" in plain and 'pip install -q -e .\n' in plain and "site-packages" not in plain, plain


def test_readme_quick_start_runs_the_default():
    text = README.read_text()
    quick_start = text[text.index("## Quick start"):text.index("\n## ", text.index("## Quick start") + 1)]
    assert _code_block_lines(quick_start) == ["pip install -e . && grpo-jax",
                                              'pip install -e ".[test]" && python -m pytest -n 2 -q']


def test_cli_entry_point_is_declared():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^grpo-jax\s*=\s*"grpo_jax\.api\.cli:main"', pyproject, flags=re.M), pyproject


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"]])
def test_module_help_is_fast_and_does_not_import_jax(argv):
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "grpo_jax", *argv], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "section.key=value" in result.stdout
    assert "grpo-jax export --help" in " ".join(result.stdout.split())  # the other commands are listed
    imported = [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if "|" in line]
    heavy = [name for name in imported if name.split(".")[0] in ("jax", "jaxlib", "flax", "optax", "transformers")]
    assert not heavy, f"`python -m grpo_jax {' '.join(argv)}` imported {heavy[:5]}: keep cli.py imports lazy"


def test_console_script_help():
    """`grpo-jax --help`: the installed script if there is one, else what pip's wrapper runs."""
    exe = shutil.which("grpo-jax")
    wrapper = [sys.executable, "-c", "import sys; from grpo_jax.api.cli import main; sys.exit(main())"]
    result = subprocess.run(([exe] if exe else wrapper) + ["--help"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "section.key=value" in result.stdout
    assert "grpo-jax export --help" in " ".join(result.stdout.split())  # the other commands are listed


def test_default_config_file_is_the_default_run():
    path = ROOT / "configs" / "default.yaml"
    written = _flatten(yaml.safe_load(path.read_text()))
    expected = _flatten(to_dict(Config()))
    assert sorted(written) == sorted(expected), (
        f"configs/default.yaml must write every key: missing {sorted(set(expected) - set(written))}, "
        f"unknown {sorted(set(written) - set(expected))}")
    wrong = [f"{k}: {written[k]!r} -> {_literal(_defaults()[k])}" for k in expected
             if not _same(written[k], _defaults()[k])]
    assert not wrong, "configs/default.yaml differs from the dataclass defaults:\n" + "\n".join(wrong)
    assert load_config(str(path)) == Config()


def test_configs_for_user_data_load_once_pointed_at_files(tmp_path):
    """Configs whose data.path is a placeholder are valid once it, the tokenizer and the rewards exist."""
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "12>", "answer": "21"}) + "\n")
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    checked = 0
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        values = yaml.safe_load(path.read_text())
        if not (values.get("data") or {}).get("path"):
            continue
        overrides = [f"data.path={data}", f"data.tokenizer_path={tokenizer}"]
        functions = (values.get("reward") or {}).get("functions", [])
        if any(not p.startswith("grpo_jax.") for p in functions):  # user placeholders -> a built-in reward
            kept = [p if p.startswith("grpo_jax.") else "grpo_jax.data.task:exact_match" for p in functions]
            overrides.append(f"reward.functions=[{','.join(kept)}]")
        assert isinstance(load_config(str(path), overrides), Config), path
        checked += 1
    assert checked >= 1


def test_deepseekmath_config_has_the_papers_hyperparameters():
    """arXiv 2402.03300 §4.1: lr 1e-6, KL 0.04, 64 samples, max length 1024, batch 1024, one update per round."""
    c = yaml.safe_load((ROOT / "configs" / "grpo_deepseekmath.yaml").read_text())
    assert float(c["train"]["learning_rate"]) == 1e-6 and c["loss"]["beta"] == 0.04
    assert c["train"]["num_generations"] == 64 and c["train"]["train_batch_size"] == 1024
    assert c["sampling"]["max_completion_length"] == 1024
    assert c["train"]["steps_per_generation"] == 1 and c["train"]["num_iterations"] == 1


def test_readme_python_examples_run():
    blocks = _python_blocks(README.read_text()) + _python_blocks((ROOT / "docs" / "modules.md").read_text())
    namespaces = []
    for block in blocks:
        namespaces.append({})
        exec(compile(block, "README.md", "exec"), namespaces[-1])  # noqa: S102 - our own README
    rewards = [ns for ns in namespaces if "correctness" in ns]
    assert len(rewards) == 1, "README should show the `correctness` reward example"
    assert rewards[0]["correctness"](["1+1=", "2+2=", "x"], [" 2", "5", "?"], answer=[2, 4, None]) == [1.0, 0.0, None]
    library = [ns for ns in namespaces if "train_step" in ns]
    assert len(library) == 1, "docs/modules.md should show one library example ending in a train step"
    assert int(library[0]["state"].step) == 1 and set(library[0]["metrics"]) >= {"loss", "grad_norm", "kl"}


def test_every_commands_help_prints_its_percent_signs_once():
    """argparse formats help strings, not descriptions: a `%%` in a description is printed as written."""
    for command in ("plan", "export", "verify"):
        result = subprocess.run([sys.executable, "-m", "grpo_jax", command, "--help"], cwd=ROOT, capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 0 and "%%" not in result.stdout, (command, result.stdout)
