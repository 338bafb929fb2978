"""The packaged recipes run as shipped from any folder (grpo_jax/config `load_config`, configs/): their example data
are read beside the recipe, and what a recipe cannot guess (the model) is asked for in one line."""

import pytest
import yaml

from grpo_jax.config import RECIPES, load_config, recipes


def test_recipes_read_their_shipped_data_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no configs/ here
    model = tmp_path / "model"
    model.mkdir()
    checked = 0
    for name in recipes():
        values = yaml.safe_load((RECIPES / f"{name}.yaml").read_text())
        path = (values.get("data") or {}).get("path")
        if not path:
            assert load_config(name).data.path is None  # the embedded task
            continue
        config = load_config(name, [f"model.path={model}"])
        assert config.data.path == str(RECIPES.absolute() / path) and (RECIPES / path).is_file(), name
        assert all(f.startswith("grpo_jax.") for f in config.reward.functions), name  # no placeholder module
        if (values.get("model") or {}).get("path") is None:
            with pytest.raises(ValueError, match=f"recipe '{name}' trains a pretrained model on .*: add model.path="):
                load_config(name)
        checked += 1
    assert checked >= 8
    # a path that exists from the working directory is the user's, not the recipe's
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "math_example.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    assert load_config("dapo", [f"model.path={model}"]).data.path == "data/math_example.jsonl"
