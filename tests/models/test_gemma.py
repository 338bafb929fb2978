"""Gemma 2 and Gemma 3 (`models.gemma`) against transformers' PyTorch models: logits on tiny random configs (each
Gemma option moving them) and at Gemma-3-1B's shapes, layer scan and remat, packed and shared layouts, LoRA
through PEFT, sharded forwards, EOS ids and a Gemma chat template. Folder in and out, greedy generation against
transformers' and the KV cache: tests/models/test_pretrained.py, whose zoo (`hf_fixtures.FAMILIES`) holds both."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import hf_fixtures as hf  # noqa: E402

from grpo_jax.algo.logprobs import completion_logps  # noqa: E402
from grpo_jax.config.model import LoRAConfig  # noqa: E402
from grpo_jax.device import sharding  # noqa: E402
from grpo_jax.models import abstract_model, eos_token_ids, forward, from_pretrained, positions_from_mask, unembed  # noqa: E402,E501
from grpo_jax.models.registry import config_fields  # noqa: E402

FAMILIES = ("gemma2", "gemma3")
# three rows of 12 slots, two left-padded: longer than the window of 4, so local and global layers differ
_RNG = np.random.default_rng(0)
MASK = np.ones((3, 12), np.int32)
MASK[0, :5] = 0
MASK[1, :2] = 0
IDS = np.where(MASK == 1, _RNG.integers(3, hf.VOCAB, MASK.shape), hf.PAD_ID).astype(np.int32)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """family -> (transformers model, its saved folder), tied embeddings as the released models."""
    root = tmp_path_factory.mktemp("gemma")
    models = {}
    for family in (*FAMILIES, "cohere2"):  # Cohere 2: windows too, with NoPE on its full layers
        model = hf.build_model(family, tied=True)
        models[family] = model, hf.save_model(model, root / family)
    return models


def torch_logits(model, ids=IDS, mask=MASK):
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask),
                     position_ids=torch.tensor(positions)).logits.float().numpy()


@functools.partial(jax.jit, static_argnums=0)
def _logits(graphdef, params, ids, mask):
    hidden, _ = forward(graphdef, params, ids, positions_from_mask(mask), mask)
    return unembed(graphdef, params, hidden)


def _graphdef(config):
    return abstract_model(config)[0].graphdef


# what each Gemma option is, and the config without it: the logits must move
NO_WINDOW = dict(layer_types=("full_attention",) * 3, sliding_window=None)
WITHOUT = {
    "gemma3": [NO_WINDOW, dict(rope_local_base_freq=None), dict(query_pre_attn_scalar=None),
               dict(rope_type="default", rope_factor=1.0)],
    "gemma2": [NO_WINDOW, dict(attn_logit_softcapping=None), dict(final_logit_softcapping=None),
               dict(query_pre_attn_scalar=None)],
}


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_and_every_option_matters(zoo, family):
    torch_model, folder = zoo[family]
    model, params = from_pretrained(folder)
    expected = torch_logits(torch_model)
    real = MASK == 1
    np.testing.assert_allclose(np.asarray(_logits(model.graphdef, params, IDS, MASK))[real], expected[real],
                               atol=1e-5, rtol=1e-5)
    for without in WITHOUT[family]:
        changed = dataclasses.replace(model.config, **without)
        moved = np.abs(np.asarray(_logits(_graphdef(changed), params, IDS, MASK)) - expected)[real].max()
        assert moved > 1e-3, (without, moved)


def test_config_fields_read_gemma3s_two_rope_bases_and_layer_types(zoo):
    config = zoo["gemma3"][0].config
    fields = config_fields(config)
    assert (fields["rope_theta"], fields["rope_type"], fields["rope_factor"], fields["rope_local_base_freq"]) == (
        1e6, "linear", 8.0, 10000.0)
    assert fields["layer_types"] == ("sliding_attention", "sliding_attention", "full_attention")
    assert (fields["sliding_window"], fields["query_pre_attn_scalar"], fields["qk_norm"]) == (4, 24, True)
    gemma2 = config_fields(zoo["gemma2"][0].config)
    assert gemma2["layer_types"] == ("sliding_attention", "full_attention", "sliding_attention")  # alternating
    assert (gemma2["attn_logit_softcapping"], gemma2["final_logit_softcapping"], gemma2["qk_norm"]) == (1.5, 2.0,
                                                                                                        False)
    bad = transformers.AutoConfig.for_model("gemma3_text", hidden_activation="silu", num_hidden_layers=2)
    with pytest.raises(ValueError, match=r"^here: hidden_activation 'silu' is not supported"):
        config_fields(bad, "here")
    yarn = transformers.AutoConfig.for_model("gemma3_text", num_hidden_layers=2, rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}})
    with pytest.raises(ValueError, match=r"sliding_attention.rope_type='linear' is not supported"):
        config_fields(yarn, "here")


# google/gemma-3-1b-it's config.json as the Hub serves it (written by transformers 4.50: RoPE at the top level,
# the 5:1 pattern as sliding_window_pattern, no layer_types)
GEMMA3_1B_CONFIG = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 106],
    "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
    "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768,
    "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
    "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "use_cache": True, "vocab_size": 262144}


@pytest.mark.parametrize("rope_scaling", [None, {"factor": 8.0, "rope_type": "linear"}])  # 1B; 4B and up
def test_the_hub_gemma3_config_resolves(tmp_path, rope_scaling):
    from grpo_jax.models import ModelConfig, resolve_config

    (tmp_path / "config.json").write_text(json.dumps({**GEMMA3_1B_CONFIG, "rope_scaling": rope_scaling}))
    config = resolve_config(ModelConfig(path=str(tmp_path)))
    assert config.layer_types == tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                       for i in range(26))
    assert (config.sliding_window, config.rope_theta, config.rope_local_base_freq, config.head_dim,
            config.query_pre_attn_scalar, config.num_key_value_heads) == (512, 1e6, 1e4, 256, 256, 1)
    assert (config.rope_type, config.rope_factor) == (("default", 1.0) if rope_scaling is None else ("linear", 8.0))
    assert (config.attn_logit_softcapping, config.final_logit_softcapping, config.qk_norm) == (None, None, True)


def test_gemma3_1b_shapes_match_transformers(tmp_path):
    """Gemma-3-1B's config.json (hidden 1152, 4 query heads, 1 kv head, head_dim 256, MLP 6912, RoPE bases 1e6 and
    1e4, query_pre_attn_scalar 256) with 2 layers (local, global), a 512-token vocabulary and a window of 8 (the
    real one is 512) so 16 tokens cross it."""
    config = transformers.AutoConfig.for_model(
        "gemma3_text", vocab_size=512, hidden_size=1152, intermediate_size=6912, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        bos_token_id=2, eos_token_id=[1, 106], pad_token_id=0, tie_word_embeddings=True)
    torch.manual_seed(0)
    torch_model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in torch_model.named_parameters():
            if "norm" in name:
                p.copy_(0.2 * torch.randn_like(p))
    torch_model.save_pretrained(tmp_path)
    mask = np.ones((2, 16), np.int32)
    mask[1, :3] = 0
    ids = np.where(mask == 1, np.random.default_rng(1).integers(3, 512, mask.shape), 0).astype(np.int32)
    model, params = from_pretrained(tmp_path)
    assert model.config.layer_types == ("sliding_attention", "full_attention")
    expected = torch_logits(torch_model, ids, mask)
    np.testing.assert_allclose(np.asarray(_logits(model.graphdef, params, ids, mask))[mask == 1],
                               expected[mask == 1], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_layer_scan_and_remat_equal_the_layer_loop(zoo, family):
    """With scan_layers the layer's kind index is a scan input: values and gradients equal the Python loop's."""
    model, params = from_pretrained(zoo[family][1])

    def loss(graphdef, params):
        return jnp.sum(jnp.tanh(_logits(graphdef, params, IDS, MASK)) * MASK[..., None])

    value, grads = jax.value_and_grad(loss, argnums=1)(model.graphdef, params)
    for options in (dict(scan_layers=True), dict(scan_layers=True, remat="full"), dict(remat="dots")):
        graphdef = _graphdef(dataclasses.replace(model.config, **options))
        value2, grads2 = jax.value_and_grad(loss, argnums=1)(graphdef, params)
        # recomputation and the scan reassociate float32 sums: equal up to a few ulps of each leaf's scale
        np.testing.assert_allclose(value2, value, rtol=1e-6)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-6 * np.abs(b).max(), rtol=0), grads2,
                     grads)


@pytest.mark.parametrize("family", (*FAMILIES, "cohere2"))
def test_packed_and_shared_layouts_equal_the_padded_one(zoo, family):
    """Each kind's window applied in the model from the packed positions: the same log-probs as the padded rows
    (prompts and completions longer than the window of 4); Cohere 2 too (interleaved RoPE on its windowed layers,
    none on its full one)."""
    model, params = from_pretrained(zoo[family][1])
    rng = np.random.default_rng(2)
    G, P, T = 2, 6, 7
    prompt_mask = np.repeat(np.array([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], np.int32), G, axis=0)
    prompt_ids = np.where(prompt_mask == 1, np.repeat(rng.integers(3, hf.VOCAB, (2, P)), G, axis=0), 0)
    completion_mask = (np.arange(T)[None] < np.array([[7], [5], [6], [2]])).astype(np.int32)
    completion_ids = np.where(completion_mask == 1, rng.integers(3, hf.VOCAB, (4, T)), 0)
    args = (model.graphdef, params, prompt_ids.astype(np.int32), prompt_mask, completion_ids.astype(np.int32),
            completion_mask)
    padded, _ = completion_logps(*args, temperature=1.0)
    real = completion_mask == 1
    # against transformers: the completion tokens' log-probs of prompt ++ completion
    ids = np.concatenate([prompt_ids, completion_ids], 1)
    mask = np.concatenate([prompt_mask, completion_mask], 1)
    logits = torch_logits(zoo[family][0], ids, mask)[:, P - 1:-1]
    want = np.take_along_axis(jax.nn.log_softmax(logits, -1), completion_ids[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(padded)[real], want[real], atol=1e-5)
    for layout in (dict(packed_length=32, prompt_group_size=G), dict(packed_length=48, packed_buffers=1),
                   dict(prompt_group_size=G)):
        got, _ = completion_logps(*args, temperature=1.0, **layout)
        np.testing.assert_allclose(np.asarray(got)[real], np.asarray(padded)[real], atol=1e-5, err_msg=str(layout))


def test_peft_loads_our_gemma3_adapters(zoo, tmp_path):
    """PEFT's names for Gemma 3's linear layers: peft loads our adapters onto transformers' model, same logits."""
    peft = pytest.importorskip("peft")
    from grpo_jax.io.export import export_policy
    from tests.models.test_lora import with_adapters

    torch_model, folder = zoo["gemma3"]
    base_model, base = from_pretrained(folder)
    config = dataclasses.replace(base_model.config, lora=LoRAConfig(rank=4, alpha=16.0, init_lora_weights=False))
    graphdef, params = with_adapters(config, base, b_std=0.3)
    params = jax.device_put(params)
    ours = np.asarray(_logits(graphdef, params, IDS, MASK))
    assert export_policy(graphdef, config, params, tmp_path / "adapter") == "peft"
    peft_model = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(folder).eval(), tmp_path / "adapter").eval()
    real = MASK == 1
    # as test_lora's PEFT parity: random adapters on every linear layer make logits of up to ~50, whose float32
    # rounding (PEFT adds x A B after the base matmul) reaches 2e-5
    np.testing.assert_allclose(ours[real], torch_logits(peft_model)[real], atol=1e-4, rtol=0)
    assert np.abs(ours - torch_logits(torch_model))[real].max() > 1e-2


needs_8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")


@needs_8
@pytest.mark.parametrize("shape", [(8, 1, 1), (2, 4, 1), (1, 4, 2)])
def test_sharded_forward_equals_single_device(zoo, shape):
    """Every Gemma parameter has a partition rule; rows split over data/fsdp, weights over fsdp/tensor."""
    model, params = from_pretrained(zoo["gemma3"][1])
    mesh = sharding.make_mesh(*shape)
    placed = jax.device_put(params, sharding.param_shardings(mesh, jax.eval_shape(lambda: params)))
    ids, mask = np.tile(IDS, (8, 1))[:8], np.tile(MASK, (8, 1))[:8]
    rows = sharding.row_sharded(mesh)
    got = _logits(model.graphdef, placed, jax.device_put(ids, rows), jax.device_put(mask, rows))
    want = np.asarray(_logits(model.graphdef, params, ids, mask))[mask == 1]
    # fsdp / tensor splits sum the hidden dim in pieces: float32 reassociation at the logits' scale (test_sharding)
    np.testing.assert_allclose(np.asarray(got)[mask == 1], want, atol=1e-5 * np.abs(want).max(), rtol=0)


# Gemma 3's chat template, text parts only (tokenizer_config.json of google/gemma-3-1b-it)
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- set first_user_prefix = messages[0]['content'] "
    "+ '\n\n' -%}{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = \"\" -%}"
    "{%- set loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}{%- else -%}"
    "{%- set role = message['role'] -%}{%- endif -%}{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if "
    "loop.first else \"\") }}{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{'<start_of_turn>model\n'}}{%- endif -%}")


def test_gemma_eos_ids_and_chat_template(tmp_path):
    """A Gemma-style folder built locally: generation_config's two EOS ids (<eos> 1, <end_of_turn> 106) both stop
    generation, and conversational prompts render through its template with the model's turn opened."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    from grpo_jax.data import prompts as data

    specials = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
    vocab = {tok: i for i, tok in enumerate(specials[:3])}
    vocab.update({c: 3 + i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz \n?")})
    vocab.update({"<start_of_turn>": 105, "<end_of_turn>": 106, "<unk>": 107})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("<[a-z_]+>|."), behavior="isolated")
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", padding_side="left",
        additional_special_tokens=["<start_of_turn>", "<end_of_turn>"])
    tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 2, "eos_token_id": [1, 106],
                                                                 "pad_token_id": 0}))
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert eos_token_ids(tmp_path, loaded) == (1, 106)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi?"}]
    text = data.render_prompt(loaded, messages)
    assert text == "<bos><start_of_turn>user\nbe brief\n\nhi?<end_of_turn>\n<start_of_turn>model\n"
    ids = loaded(text, add_special_tokens=False)["input_ids"]
    assert ids.count(2) == 1 and ids[:2] == [2, 105]  # one BOS: the template's (prompts tokenize without specials)
    assert ids[-7:] == [105] + [vocab[c] for c in "model\n"]
