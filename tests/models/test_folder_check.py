"""grpo_jax.models.folder_check: each family's saved folder passes; a config.json edited away from its weights (layers,
per-layer kinds, vocabulary, hidden size, heads, MLP width, experts) is one ValueError naming the key, the config's
value and the weights' value, before transformers reads the config and before anything compiles."""

import json
import shutil

import pytest

from grpo_jax.config.model import ModelConfig
from grpo_jax.models import folder_check
from grpo_jax.models.registry import resolve_config
from tests.hf_fixtures import FAMILIES, build_model, save_model

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """One saved tiny folder per family (llama, qwen2, qwen3, mistral, gemma3, gemma2, qwen3_moe)."""
    root = tmp_path_factory.mktemp("families")
    return {name: save_model(build_model(name, tied=True), root / name) for name in FAMILIES}


def _edited(folders, tmp_path, family, **changes):
    """A copy of ``family``'s folder whose config.json has ``changes`` (None deletes a key)."""
    folder = tmp_path / family
    shutil.copytree(folders[family], folder)
    raw = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_familys_saved_folder_passes(folders, family):
    folder_check.check_folder(folders[family])
    assert resolve_config(ModelConfig(path=folders[family])).model_type == FAMILIES[family]["model_type"]


# (key, how it is changed, what the weights hold): hidden 64, 2 layers (3 for gemma), 4 heads of 16 (32 for
# qwen3, gemma3, qwen3_moe), 2 kv heads, vocab 128, intermediate 128
EDITS = [("num_hidden_layers", lambda v: v + 1, lambda raw: str(raw["num_hidden_layers"])),
         ("vocab_size", lambda v: v + 2, lambda raw: "128"),
         ("hidden_size", lambda v: v * 2, lambda raw: "64"),
         ("num_key_value_heads", lambda v: v - 1, lambda raw: "2 heads of"),
         ("intermediate_size", lambda v: v + 8, lambda raw: "128")]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("key, change, held", EDITS, ids=[e[0] for e in EDITS])
def test_an_edited_key_is_one_line_naming_it_and_both_values(folders, tmp_path, family, key, change, held):
    """Old outcome: a tensor-shape error that does not name the key, or (MoE intermediate_size) none at all."""
    if key == "intermediate_size" and family == "qwen3_moe":
        key, change = "moe_intermediate_size", lambda v: v + 8  # its experts' width; intermediate_size is unused
        held = lambda raw: "32"  # noqa: E731
    if key == "intermediate_size" and family == "gpt_oss":
        held = lambda raw: "32"  # noqa: E731  (its experts' width, from gate_up_proj [E, D, 2F])
    raw = json.loads(open(f"{folders[family]}/config.json").read())
    value = change(raw[key])
    folder = _edited(folders, tmp_path, family, **{key: value})
    with pytest.raises(ValueError) as error:
        resolve_config(ModelConfig(path=str(folder)))
    message = str(error.value)
    assert message.startswith(f"{folder / 'config.json'}: {key}={value} but the weights hold {held(raw)}"), message
    assert "\n" not in message


@pytest.mark.parametrize("key", ["num_experts", "num_local_experts"])
def test_a_moe_config_with_fewer_experts_than_its_weights_is_refused(folders, tmp_path, key):
    """Old outcome: config.json's num_experts: 4 over 8 experts' weights trained with exit 0 and no message
    (transformers reads num_local_experts). New: one line naming the key, 4 and 8."""
    folder = _edited(folders, tmp_path, "qwen3_moe", **{key: 4})
    with pytest.raises(ValueError, match=rf"config\.json: {key}=4 but the weights hold 8 \(model\.layers\.0\.mlp\."
                                         r"gate\.weight in model\.safetensors\)"):
        resolve_config(ModelConfig(path=str(folder)))


@pytest.mark.parametrize("family", ["gemma3", "gemma2", "mistral"])
def test_layer_types_of_the_wrong_length_are_one_line(folders, tmp_path, family):
    """Old outcome (gemma3_text, 2 layer_types for 3 layers): huggingface_hub's StrictDataclass traceback."""
    layers = json.loads(open(f"{folders[family]}/config.json").read())["num_hidden_layers"]
    folder = _edited(folders, tmp_path, family, layer_types=["sliding_attention"] * (layers - 1))
    with pytest.raises(ValueError, match=rf"config\.json: layer_types has {layers - 1} entries but the weights hold "
                                         rf"{layers} layers: give one kind"):
        resolve_config(ModelConfig(path=str(folder)))


def test_a_config_only_folder_is_checked_against_itself(tmp_path):
    """`grpo-jax plan` reads folders with config.json alone: layer_types against num_hidden_layers, no weights."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3_text", "num_hidden_layers": 3,
                                                      "layer_types": ["full_attention"] * 2}))
    with pytest.raises(ValueError, match="layer_types has 2 entries but num_hidden_layers says 3 layers"):
        folder_check.check_folder(str(tmp_path))
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="holds a JSON list, not an object"):
        folder_check.check_folder(str(tmp_path))
