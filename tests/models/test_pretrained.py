"""Hugging Face checkpoints in and out, with transformers' PyTorch models (float32) as the reference."""

import dataclasses
import json
import os
import shutil
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import hf_fixtures as hf  # noqa: E402

from grpo_jax.algo.programs import jit_decoder  # noqa: E402
from grpo_jax.algo.sampling import SamplingConfig  # noqa: E402
from grpo_jax.device import sharding  # noqa: E402
from grpo_jax.models import (  # noqa: E402
    Model,
    abstract_model,
    ModelConfig,
    eos_token_ids,
    forward,
    from_pretrained,
    init_cache,
    init_model,
    positions_from_mask,
    resolve_config,
    save_pretrained,
    unembed,
)
from grpo_jax.models.registry import config_fields, to_hf_config  # noqa: E402
from grpo_jax.models.safetensors_io import INDEX_FILE  # noqa: E402
from grpo_jax.rollout import stream  # noqa: E402

VARIANTS = [(family, tied) for family in hf.FAMILIES for tied in (True, False)]
IDS = [f"{family}-{'tied' if tied else 'untied'}" for family, tied in VARIANTS]

# three rows of different real lengths, left-padded with PAD_ID (12 > the mistral window of 4)
_RNG = np.random.default_rng(0)
MASK = np.ones((3, 12), np.int32)
MASK[0, :5] = 0
MASK[1, :2] = 0
INPUT_IDS = np.where(MASK == 1, _RNG.integers(3, hf.VOCAB, MASK.shape), hf.PAD_ID).astype(np.int32)


class Zoo:
    """Builds each (family, tied) transformers model once per session and saves it to its own folder."""

    def __init__(self, root):
        self.root, self.cache = root, {}

    def get(self, family, tied):
        key = (family, tied)
        if key not in self.cache:
            model = hf.build_model(family, tied)
            self.cache[key] = model, hf.save_model(model, self.root / f"{family}-{tied}")
        return self.cache[key]


@pytest.fixture(scope="session")
def zoo(tmp_path_factory):
    return Zoo(tmp_path_factory.mktemp("hf_models"))


@pytest.fixture(params=VARIANTS, ids=IDS)
def variant(request, zoo):
    """(torch model, folder) of one family, tied or untied."""
    return zoo.get(*request.param)


def torch_logits(model, ids=INPUT_IDS, mask=MASK):
    """transformers' logits with left-padding positions cumsum(mask) - 1 (as its generate computes them)."""
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask),
                    position_ids=torch.tensor(positions))
    return out.logits.float().numpy()


_logits = jax.jit(lambda model, params, ids, mask: model(params, ids, mask), static_argnums=0)


# --- parity with transformers ----------------------------------------------------------------------------


def test_logits_match_transformers(variant):
    torch_model, folder = variant
    model, params = from_pretrained(folder)
    ours = np.asarray(_logits(model, params, INPUT_IDS, MASK))
    np.testing.assert_allclose(ours[MASK == 1], torch_logits(torch_model)[MASK == 1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("penalty", [1.0, 3.0])
def test_greedy_generation_matches_transformers(variant, penalty):
    """Greedy tokens equal transformers' generate, also with a repetition penalty (which transformers applies to
    the prompt's and the completion's tokens, greedy or sampled)."""
    torch_model, folder = variant
    model, params = from_pretrained(folder)
    new = 20
    with torch.no_grad():
        expected = torch_model.generate(
            input_ids=torch.tensor(INPUT_IDS, dtype=torch.long), attention_mask=torch.tensor(MASK),
            do_sample=False, max_new_tokens=new, eos_token_id=hf.EOS_ID, pad_token_id=hf.PAD_ID,
            repetition_penalty=penalty,
        ).numpy()[:, INPUT_IDS.shape[1]:]
        if penalty != 1.0:  # the penalty changes these tokens
            plain = torch_model.generate(
                input_ids=torch.tensor(INPUT_IDS, dtype=torch.long), attention_mask=torch.tensor(MASK),
                do_sample=False, max_new_tokens=new, eos_token_id=hf.EOS_ID, pad_token_id=hf.PAD_ID,
            ).numpy()[:, INPUT_IDS.shape[1]:]
            assert plain.shape != expected.shape or (plain != expected).any()
    mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    dec = jit_decoder(model.graphdef, mesh, model.config,
                      config=SamplingConfig(max_completion_length=new, repetition_penalty=penalty),
                      eos_token_ids=(hf.EOS_ID,), pad_token_id=hf.PAD_ID)
    out = stream.generate(dec, params, INPUT_IDS, MASK, jax.random.key(0), greedy=True)
    ours = np.asarray(out.completion_ids)
    # transformers stops once every row has emitted EOS; the rest is padding on our side
    np.testing.assert_array_equal(ours[:, :expected.shape[1]], expected)
    assert (ours[:, expected.shape[1]:] == hf.PAD_ID).all()


def test_kv_cache_path_equals_full_forward(variant):
    _, folder = variant
    model, params = from_pretrained(folder)
    B, T = INPUT_IDS.shape
    P = 7  # prefill 7 tokens, then one token per step (past the mistral window)
    full = np.asarray(_logits(model, params, INPUT_IDS, MASK))

    @jax.jit
    def step(params, cache, ids, mask_BxS, positions, index):
        hidden, cache = forward(model.graphdef, params, ids, positions, mask_BxS, cache, index)
        return unembed(model.graphdef, params, hidden), cache

    cache = init_cache(model.config, B, T)
    positions_BxT = np.asarray(positions_from_mask(MASK))
    mask_BxS = np.concatenate([MASK[:, :P], np.zeros((B, T - P), np.int32)], axis=1)
    logits, cache = step(params, cache, INPUT_IDS[:, :P], mask_BxS, positions_BxT[:, :P], 0)
    pieces = [np.asarray(logits)]
    for t in range(P, T):
        mask_BxS[:, t] = MASK[:, t]
        logits, cache = step(params, cache, INPUT_IDS[:, t:t + 1], mask_BxS, positions_BxT[:, t:t + 1], t)
        pieces.append(np.asarray(logits))
    cached = np.concatenate(pieces, axis=1)
    np.testing.assert_allclose(cached[MASK == 1], full[MASK == 1], atol=1e-5, rtol=0)


def test_round_trip_through_transformers(variant, tmp_path):
    torch_model, folder = variant
    model, params = from_pretrained(folder)
    save_pretrained(model, params, tmp_path / "out")
    with open(tmp_path / "out" / "config.json") as f:
        written = json.load(f)
    assert written["architectures"] == [type(torch_model).__name__]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert type(reloaded) is type(torch_model)
    original, again = torch_model.state_dict(), reloaded.state_dict()
    assert sorted(original) == sorted(again)
    for name in original:
        assert torch.equal(original[name], again[name]), name
    np.testing.assert_array_equal(torch_logits(reloaded), torch_logits(torch_model))
    # and back into JAX: bit-identical params
    _, params2 = from_pretrained(tmp_path / "out")
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(params), nnx.to_pure_dict(params2))
    assert os.path.isfile(tmp_path / "out" / "generation_config.json")


# --- sharded files, dtypes, shardings ----------------------------------------------------------------------


def test_sharded_checkpoints_load_and_save(zoo, tmp_path):
    torch_model, folder = zoo.get("llama", False)
    _, single = from_pretrained(folder)
    sharded = hf.save_model(torch_model, tmp_path / "hf_sharded", max_shard_size="40KB")
    assert os.path.isfile(os.path.join(sharded, INDEX_FILE))
    model, params = from_pretrained(sharded)
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(single), nnx.to_pure_dict(params))
    save_pretrained(model, params, tmp_path / "ours_sharded", max_shard_size="40KB")
    with open(tmp_path / "ours_sharded" / INDEX_FILE) as f:
        index = json.load(f)
    assert len(set(index["weight_map"].values())) > 2
    assert not os.path.exists(tmp_path / "ours_sharded" / "model.safetensors")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours_sharded").eval()
    np.testing.assert_array_equal(torch_logits(reloaded), torch_logits(torch_model))


def test_bf16_loading(zoo, tmp_path):
    torch_model, folder = zoo.get("qwen2", False)
    model, params = from_pretrained(folder, dtype="bfloat16")
    assert model.config.dtype == model.config.param_dtype == "bfloat16"
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    # the cast rounds exactly as torch's: q_proj of layer 1 equals the bf16 weight, transposed
    weight = torch_model.state_dict()["model.layers.1.self_attn.q_proj.weight"].to(torch.bfloat16).float().numpy()
    kernel = nnx.to_pure_dict(params)["layers"]["self_attn"]["q_proj"]["kernel"][1]
    np.testing.assert_array_equal(np.asarray(kernel, np.float32), weight.T)
    # bf16 weights and compute stay within 0.1 (3% of the logit range ~3) of the float32 reference
    ours = np.asarray(_logits(model, params, INPUT_IDS, MASK), np.float32)
    np.testing.assert_allclose(ours[MASK == 1], torch_logits(torch_model)[MASK == 1], atol=0.1, rtol=0)
    # a bf16 checkpoint loads into float32 without rounding
    bf16_folder = hf.save_model(hf.build_model("qwen2", False).to(torch.bfloat16), tmp_path / "bf16")
    _, params32 = from_pretrained(bf16_folder)
    norm = nnx.to_pure_dict(params32)["norm"]["weight"]
    assert norm.dtype == jnp.float32
    expected = hf.build_model("qwen2", False).to(torch.bfloat16).state_dict()["model.norm.weight"].float().numpy()
    np.testing.assert_array_equal(np.asarray(norm), expected)


def test_shardings_callable_and_pytree(zoo):
    _, folder = zoo.get("qwen3", False)
    _, reference = from_pretrained(folder)
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"), devices=jax.devices()[:8])
    P = jax.sharding.PartitionSpec

    def rule(path, shape):
        # last axis over "tensor" when it divides, else replicated
        spec = P(*([None] * (len(shape) - 1)), "tensor") if shape[-1] % 4 == 0 else P()
        return jax.sharding.NamedSharding(mesh, spec)

    _, by_rule = from_pretrained(folder, shardings=rule)
    kernel = nnx.to_pure_dict(by_rule)["layers"]["mlp"]["down_proj"]["kernel"]
    assert kernel.sharding.spec == P(None, None, "tensor") and len(kernel.addressable_shards) == 8
    tree = jax.tree.map(lambda x: rule(None, x.shape), reference)
    _, by_tree = from_pretrained(folder, shardings=tree)
    for a, b, c in zip(jax.tree.leaves(reference), jax.tree.leaves(by_rule), jax.tree.leaves(by_tree)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
        assert b.sharding == c.sharding


def test_model_is_hashable_static_and_pure(zoo):
    _, folder = zoo.get("qwen2", True)
    model_a, params = from_pretrained(folder)
    model_b, _ = from_pretrained(folder)
    assert model_a == model_b and hash(model_a) == hash(model_b)
    with pytest.raises(dataclasses.FrozenInstanceError):
        model_a.config = None
    eager = np.asarray(model_a(params, INPUT_IDS, MASK))
    np.testing.assert_allclose(np.asarray(_logits(model_b, params, INPUT_IDS, MASK)), eager, atol=1e-5)


def test_export_of_a_toy_model_without_qkv_bias(tmp_path):
    """The default toy ModelConfig (qwen2, no q/k/v bias) exports exactly, with zero biases."""
    config = ModelConfig(vocab_size=hf.VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                         num_key_value_heads=2, initializer_range=0.2, tie_word_embeddings=False)
    graphdef, params = init_model(config, seed=0)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=_word_tokenizer(), eos_token="<eos>",
                                                     pad_token="<eos>")
    save_pretrained(Model(graphdef, config), params, tmp_path / "toy", tokenizer=tokenizer)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "toy").eval()
    assert not reloaded.state_dict()["model.layers.0.self_attn.q_proj.bias"].any()
    ours = np.asarray(_logits(Model(graphdef, config), params, INPUT_IDS, MASK))
    np.testing.assert_allclose(ours[MASK == 1], torch_logits(reloaded)[MASK == 1], atol=1e-4, rtol=0)
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "toy").eos_token == "<eos>"
    assert eos_token_ids(tmp_path / "toy", None) == (0,)


def _word_tokenizer():
    from tokenizers import Tokenizer, models
    return Tokenizer(models.WordLevel({"<eos>": 0, "<unk>": 1, "a": 2}, unk_token="<unk>"))


# --- config.json ------------------------------------------------------------------------------------------


def test_resolve_config_keeps_runtime_fields_and_rejects_conflicts(zoo):
    _, folder = zoo.get("llama", False)
    base = ModelConfig(path=folder, dtype="bfloat16", param_dtype="bfloat16", remat="full")
    config = resolve_config(base)
    assert (config.path, config.dtype, config.param_dtype, config.remat) == (folder, "bfloat16", "bfloat16", "full")
    assert (config.model_type, config.rope_type, config.rope_factor, config.attention_bias, config.mlp_bias,
            config.attention_out_bias, config.tie_word_embeddings, config.vocab_size) == (
        "llama", "llama3", 8.0, True, True, True, False, hf.VOCAB)
    assert resolve_config(ModelConfig()) == ModelConfig()
    model, _ = from_pretrained(folder, config=ModelConfig(remat="full"))
    assert (model.config.remat, model.config.path, model.config.model_type) == ("full", folder, "llama")
    # a value equal to config.json is fine; a different non-default one names the field and both values
    assert resolve_config(dataclasses.replace(base, num_hidden_layers=2)) == config
    with pytest.raises(ValueError, match=r"model.hidden_size=32 conflicts with .*config.json \(hidden_size=64\)"):
        resolve_config(dataclasses.replace(base, hidden_size=32))


@pytest.mark.parametrize("config", [
    ModelConfig(vocab_size=32, model_type="qwen2", attention_bias=True, sliding_window=8),
    ModelConfig(vocab_size=32, model_type="qwen3", qk_norm=True, sliding_window=8, head_dim=16, rope_theta=1e6),
    ModelConfig(vocab_size=32, model_type="mistral", sliding_window=8, head_dim=16, tie_word_embeddings=False),
    ModelConfig(vocab_size=32, model_type="qwen3", qk_norm=True, sliding_window=8, head_dim=16,
                layer_types=("full_attention", "sliding_attention")),
    ModelConfig(vocab_size=32, model_type="gemma3_text", qk_norm=True, sliding_window=8, head_dim=16,
                hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=16, rope_local_base_freq=1e4,
                layer_types=("sliding_attention", "full_attention"), rope_type="linear", rope_factor=8.0),
    ModelConfig(vocab_size=32, model_type="gemma2", sliding_window=8, head_dim=16, hidden_act="gelu_pytorch_tanh",
                query_pre_attn_scalar=16, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                layer_types=("sliding_attention", "full_attention"), tie_word_embeddings=False),
    ModelConfig(vocab_size=32, model_type="llama", head_dim=16, rope_type="llama3", rope_factor=8.0,
                rope_original_max_position_embeddings=16, attention_bias=True, attention_out_bias=True,
                mlp_bias=True),
    ModelConfig(vocab_size=32, model_type="llama", head_dim=16, rope_type="linear", rope_factor=2.0),
], ids=["qwen2-window", "qwen3-window", "mistral-window", "qwen3-some-layers", "gemma3", "gemma2",
         "llama-llama3-bias", "llama-linear"])
def test_config_round_trips_through_transformers_config(config, tmp_path):
    to_hf_config(config).save_pretrained(tmp_path)
    assert resolve_config(ModelConfig(path=str(tmp_path))) == dataclasses.replace(config, path=str(tmp_path))


def test_old_style_rope_and_sliding_window_fields():
    """transformers < 5 configs keep rope_theta / rope_scaling at the top level."""
    old = types.SimpleNamespace(
        model_type="qwen2", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-6, tie_word_embeddings=True,
        max_position_embeddings=64, rope_theta=5e5, rope_scaling={"type": "linear", "factor": 4.0},
        use_sliding_window=True, sliding_window=16, max_window_layers=0)
    fields = config_fields(old)
    assert (fields["rope_theta"], fields["rope_type"], fields["rope_factor"], fields["sliding_window"]) == (
        5e5, "linear", 4.0, 16)
    assert fields["layer_types"] is None  # every layer slides
    partial = config_fields(types.SimpleNamespace(**{**vars(old), "max_window_layers": 2}))
    assert (partial["sliding_window"], partial["layer_types"]) == (16, ("full_attention",) * 2
                                                                   + ("sliding_attention",) * 2)
    assert config_fields(types.SimpleNamespace(**{**vars(old), "use_sliding_window": False}))["sliding_window"] is None


def test_a_window_on_some_layers_loads_and_saves(tmp_path):
    """qwen2's use_sliding_window with max_window_layers: the layers from it on slide (transformers' layer_types)."""
    torch_model = hf.build_model("qwen2", True, use_sliding_window=True, sliding_window=4, max_window_layers=1)
    model, params = from_pretrained(hf.save_model(torch_model, tmp_path / "in"))
    assert (model.config.sliding_window, model.config.layer_types) == (4, ("full_attention", "sliding_attention"))
    expected = torch_logits(torch_model)
    np.testing.assert_allclose(np.asarray(_logits(model, params, INPUT_IDS, MASK))[MASK == 1], expected[MASK == 1],
                               atol=1e-4, rtol=0)
    unwindowed, _ = abstract_model(dataclasses.replace(model.config, sliding_window=None, layer_types=None))
    assert np.abs(np.asarray(_logits(unwindowed, params, INPUT_IDS, MASK)) - expected)[MASK == 1].max() > 1e-3
    save_pretrained(model, params, tmp_path / "out")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert reloaded.config.layer_types == ["full_attention", "sliding_attention"]
    np.testing.assert_array_equal(torch_logits(reloaded), expected)


def test_eos_token_ids(tmp_path):
    tokenizer = types.SimpleNamespace(eos_token_id=7)
    assert eos_token_ids(tmp_path, tokenizer) == (7,)
    assert eos_token_ids(None, tokenizer) == (7,)
    for value, expected in [(3, (3,)), ([3, 4], (3, 4))]:
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": value}))
        assert eos_token_ids(tmp_path, tokenizer) == expected
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ValueError, match="generation_config.json: eos_token_id='x'"):
        eos_token_ids(tmp_path, tokenizer)
    with pytest.raises(ValueError, match="no EOS token"):
        eos_token_ids(None, types.SimpleNamespace(eos_token_id=None))


# --- bad input ---------------------------------------------------------------------------------------------


def _copy(folder, tmp_path, name="bad"):
    return shutil.copytree(folder, tmp_path / name)


def _edit_weights(folder, edit):
    from safetensors.torch import load_file, save_file
    file = os.path.join(folder, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def _edit_config(folder, **changes):
    file = os.path.join(folder, "config.json")
    with open(file) as f:
        raw = json.load(f)
    raw.update(changes)
    with open(file, "w") as f:
        json.dump(raw, f)


BAD_FOLDERS = [
    ("no_folder", r"model folder '.*nowhere' does not exist"),
    ("no_config", r"has no config.json"),
    ("no_weights", r"no weights: expected model.safetensors or model.safetensors.index.json"),
    ("missing", r"bad/model.safetensors: tensor model.layers.1.mlp.up_proj.weight \(for layers.mlp.up_proj.kernel\) is "
                r"missing"),
    ("extra", r"unexpected tensors \['model.layers.0.mlp.extra.weight'\] \(in .*bad/model.safetensors\)"),
    ("shape", r"bad/config.json: intermediate_size=96 but the weights hold 128 \(model.layers.0.mlp.gate_proj."
              r"weight in model.safetensors\)"),
    ("truncated", r"model.safetensors: .*truncated or corrupt"),
    ("gpt2", r"model_type 'gpt2' is not supported: supported are \['cohere2', 'gemma2', 'gemma3_text', 'glm4_moe', "
             r"'gpt_oss', 'llama', 'mistral', 'qwen2', 'qwen3', 'qwen3_moe'\]"),
    ("dynamic", r"rope_type 'dynamic' is not supported: supported are \('default', 'linear', 'llama3', 'yarn'\)"),
    ("gelu", r"hidden_act 'gelu' is not supported"),
]


@pytest.mark.parametrize("breakage, match", BAD_FOLDERS, ids=[b for b, _ in BAD_FOLDERS])
def test_bad_folders(zoo, tmp_path, breakage, match):
    _, folder = zoo.get("qwen2", True)
    bad = tmp_path / "bad"
    if breakage != "no_folder":
        _copy(folder, tmp_path)
    if breakage == "no_folder":
        bad = tmp_path / "nowhere"
    elif breakage == "no_config":
        os.remove(bad / "config.json")
    elif breakage == "no_weights":
        os.remove(bad / "model.safetensors")
    elif breakage == "missing":
        _edit_weights(bad, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    elif breakage == "extra":
        _edit_weights(bad, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}))
    elif breakage == "shape":
        _edit_config(bad, intermediate_size=96)
    elif breakage == "truncated":
        with open(bad / "model.safetensors", "r+b") as f:
            f.truncate(os.path.getsize(bad / "model.safetensors") - 8)
    elif breakage == "gpt2":
        transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(bad)
    elif breakage == "dynamic":
        _edit_config(bad, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    elif breakage == "gelu":
        _edit_config(bad, hidden_act="gelu")
    with pytest.raises(ValueError, match=match):
        from_pretrained(bad)


def test_save_rejects_inexpressible_configs(tmp_path):
    config = ModelConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                         num_key_value_heads=1, model_type="llama", attention_bias=True)
    graphdef, params = init_model(config, seed=0)
    with pytest.raises(ValueError, match=r"model_type='llama' cannot express .*attention_out_bias == attention_bias"):
        save_pretrained(Model(graphdef, config), params, tmp_path / "x")
    with pytest.raises(ValueError, match=r"max_shard_size='5 potatoes' is not a size"):
        save_pretrained(Model(graphdef, dataclasses.replace(config, attention_out_bias=True)), params,
                        tmp_path / "y", max_shard_size="5 potatoes")
