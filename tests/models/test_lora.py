"""LoRA: the base at B = 0, gradients for the adapters only, PEFT folders in and out (peft as the reference), and a
short run that learns with adapters alone."""

import dataclasses
import functools
import json

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from tests.algo.test_train_step import one_device_mesh

from grpo_jax.algo.programs import jit_train_step, state_from_params
from grpo_jax.algo.state import model_graphdef
from grpo_jax.algo.train_step import StepOptions
from grpo_jax.algo.trajectory import Trajectory
from grpo_jax.config.model import LoRAConfig
from grpo_jax.device import sharding
from grpo_jax.io import checkpoint
from grpo_jax.losses import LossConfig, compute_loss
from grpo_jax.models import (
    ModelConfig,
    forward,
    from_pretrained,
    init_model,
    lora,
    peft_io,
    positions_from_mask,
    unembed,
)

IDS = np.array([[3, 4, 5, 6, 7, 8], [0, 0, 9, 10, 11, 12]], np.int32)
MASK = np.array([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]], np.int32)


@functools.partial(jax.jit, static_argnums=0)
def _logits(graphdef, params, ids, mask):
    hidden, _ = forward(graphdef, params, ids, positions_from_mask(mask), mask)
    return unembed(graphdef, params, hidden)


def _adapters(params) -> dict:
    return {sharding.path_name(p): np.asarray(x)
            for p, x in jax.tree_util.tree_leaves_with_path(nnx.filter_state(params, nnx.LoRAParam))}


def with_adapters(config, base, *, b_std: float, seed: int = 0):
    """(graphdef, params) of `config` (with `config.lora`): the given base, random A and B ~ N(0, b_std) (0: zero)."""
    abstract = nnx.filter_state(jax.eval_shape(lambda: init_model(config, 0)[1]), nnx.LoRAParam)
    rng = np.random.default_rng(seed)
    adapters = jax.tree_util.tree_map_with_path(
        lambda p, x: rng.normal(0, b_std if sharding.path_name(p).endswith("lora_b") else 0.3, x.shape)
        .astype(np.float32), abstract)
    return model_graphdef(config), jax.device_get(lora.join(adapters, base))  # a host copy: the base is shared


def test_zero_b_gives_exactly_the_base_logits(tiny_model):
    """Adapters with B = 0 change nothing, bit for bit; with random B, the reference graphdef (adapters off) is the
    base bit for bit and the merged kernels give the adapted model's logits."""
    base_config, base_graphdef, base = tiny_model
    config = dataclasses.replace(base_config, lora=LoRAConfig(rank=4, alpha=8.0))
    expected = np.asarray(_logits(base_graphdef, base, IDS, MASK))
    graphdef, params = with_adapters(config, base, b_std=0.0)
    np.testing.assert_array_equal(_logits(graphdef, params, IDS, MASK), expected)

    graphdef, params = with_adapters(config, base, b_std=0.3)
    adapted = np.asarray(_logits(graphdef, params, IDS, MASK))
    assert np.abs(adapted - expected).max() > 1e-2
    np.testing.assert_array_equal(_logits(lora.adapters_off(graphdef, params), params, IDS, MASK), expected)
    np.testing.assert_allclose(_logits(*lora.merged(graphdef, params), IDS, MASK), adapted, atol=1e-5, rtol=0)


def test_gradients_reach_only_the_adapters(tiny_model, tmp_path):
    """One train step of a bfloat16 base with a custom loss: every adapter (float32) moves, the base keeps its bits,
    the optimizer holds state for the adapters only and there is no reference copy (the base with the adapters off
    is the reference); the state comes back from a checkpoint bit for bit."""
    base_config, _, base = tiny_model
    config = dataclasses.replace(base_config, dtype="bfloat16", param_dtype="bfloat16",
                                 lora=LoRAConfig(rank=4, use_rslora=True))
    graphdef, before = with_adapters(config, jax.tree.map(lambda x: x.astype("bfloat16"), base), b_std=0.3)
    mesh, optimizer = one_device_mesh(), optax.adam(1e-3)
    state = state_from_params(before, optimizer, seed=0, with_reference=True, mesh=mesh)
    assert state.ref_params is None
    moments = [sharding.path_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(state.opt_state)]
    assert {m.split("mu.")[-1] for m in moments if "mu." in m} == set(_adapters(before))
    rng = np.random.default_rng(0)
    B, P, T = 8, 4, 5
    batch = Trajectory(rng.integers(1, 32, (B, P)), np.ones((B, P), np.int32), rng.integers(1, 32, (B, T)),
                       np.ones((B, T), np.int32), np.ones((B, T), np.int32), np.zeros((B, T), np.float32),
                       np.zeros((B, T), np.int32), np.zeros(B, bool), rng.normal(0, 1, B).astype(np.float32), None,
                       rng.normal(-3.5, 0.3, (B, T)).astype(np.float32))

    def my_loss(*args, **kwargs):
        loss, aux = compute_loss(*args, **kwargs)
        return loss, {"my/kl": aux.kl}

    options = StepOptions(LossConfig(beta=0.04), 1.0, loss_fn=my_loss)
    step = jit_train_step(graphdef, optimizer, options, mesh, sharding.tree_shardings(state))
    new_state, metrics = step(state, batch)
    after = jax.device_get(new_state.params)
    jax.tree.map(np.testing.assert_array_equal, lora.base_params(after), lora.base_params(before))
    assert {x.dtype for x in jax.tree.leaves(lora.base_params(after))} == {np.dtype("bfloat16")}
    assert all(a.dtype == np.float32 and not np.array_equal(a, _adapters(before)[k])
               for k, a in _adapters(after).items())
    assert float(metrics["my/kl"]) > 0
    mngr = checkpoint.manager(tmp_path)
    checkpoint.save(mngr, new_state, keep_ref=False, meta={}, wait=True)
    restored, _, _ = checkpoint.restore_step(mngr, 1, new_state, keep_ref=False)
    mngr.close()
    assert jax.tree.structure(restored) == jax.tree.structure(new_state)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), jax.device_get(new_state))


def test_adapters_are_split_like_their_kernels():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1] * 8).reshape(2, 2, 2, 1), sharding.AXES)  # shapes only
    config = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, lora=LoRAConfig(rank=4))
    specs = {sharding.path_name(p): tuple(s.spec) for p, s in jax.tree_util.tree_leaves_with_path(
        sharding.param_shardings(mesh, jax.eval_shape(lambda: init_model(config, 0)[1])))}
    assert specs["layers.self_attn.q_proj.lora_a"] == (None, "fsdp", None)
    assert specs["layers.self_attn.q_proj.lora_b"] == (None, None, "tensor")
    assert specs["layers.mlp.down_proj.lora_a"] == (None, "tensor", None)
    assert specs["layers.mlp.down_proj.lora_b"] == (None, None, "fsdp")


# --- PEFT folders in and out, against peft's PyTorch models ---------------------------------------------------

@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """A tiny random transformers Qwen2 model's folder."""
    pytest.importorskip("torch")
    import hf_fixtures as hf

    return hf.save_model(hf.build_model("qwen2", tied=False), tmp_path_factory.mktemp("qwen2") / "base")


def _torch_model(folder):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()


def _torch_logits(model):
    import torch

    positions = np.maximum(np.cumsum(MASK, -1) - 1, 0)
    with torch.no_grad():
        return model(input_ids=torch.tensor(IDS, dtype=torch.long), attention_mask=torch.tensor(MASK),
                     position_ids=torch.tensor(positions)).logits.float().numpy()


def test_peft_loads_our_adapters_and_the_merged_export_loads_in_transformers(qwen2, tmp_path):
    peft = pytest.importorskip("peft")

    from grpo_jax.io.export import export_policy

    folder = qwen2
    base_model, base = from_pretrained(folder)
    config = dataclasses.replace(base_model.config, lora=LoRAConfig(rank=4, alpha=16.0, init_lora_weights=False,
                                                                    target_modules=("q_proj", "v_proj", "down_proj")))
    graphdef, params = with_adapters(config, base, b_std=0.3)  # B random: the adapters change the logits
    params = jax.device_put(params)
    ours = np.asarray(_logits(graphdef, params, IDS, MASK))
    assert export_policy(graphdef, config, params, tmp_path / "adapter") == "peft"
    saved = json.loads((tmp_path / "adapter" / peft_io.CONFIG_FILE).read_text())
    assert (saved["r"], saved["lora_alpha"], saved["base_model_name_or_path"]) == (4, 16.0, folder)

    peft_model = peft.PeftModel.from_pretrained(_torch_model(folder), tmp_path / "adapter").eval()
    real = MASK == 1
    np.testing.assert_allclose(ours[real], _torch_logits(peft_model)[real], atol=1e-4, rtol=0)
    assert np.abs(ours - _torch_logits(_torch_model(folder)))[real].max() > 1e-2

    assert export_policy(graphdef, config, params, tmp_path / "merged", merge=True) == "hf"
    np.testing.assert_allclose(ours[real], _torch_logits(_torch_model(tmp_path / "merged"))[real], atol=1e-4,
                               rtol=0)


def test_we_load_peft_adapters(qwen2, tmp_path):
    peft = pytest.importorskip("peft")

    folder = qwen2
    peft_config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", use_rslora=True,
                                  init_lora_weights=False, task_type="CAUSAL_LM")
    peft_model = peft.get_peft_model(_torch_model(folder), peft_config).eval()
    expected = _torch_logits(peft_model)
    peft_model.save_pretrained(tmp_path / "adapter")

    lora_config = peft_io.resolve_lora(LoRAConfig(path=str(tmp_path / "adapter")))
    assert (lora_config.rank, lora_config.alpha, lora_config.use_rslora, lora_config.target_modules) == \
        (4, 8.0, True, "all-linear")
    model, base = from_pretrained(folder)
    config = dataclasses.replace(model.config, lora=lora_config)
    params = lora.join(peft_io.load_adapters(config), base)
    ours = np.asarray(_logits(model_graphdef(config), params, IDS, MASK))
    np.testing.assert_allclose(ours[MASK == 1], expected[MASK == 1], atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="model.lora.rank=8 conflicts with"):
        peft_io.resolve_lora(LoRAConfig(rank=8, path=str(tmp_path / "adapter")))


def test_full_rank_adapters_learn_the_embedded_task(tmp_path):
    """LoRA with rank = the model's width on every projection, the base frozen, still lifts the reward; the reference
    (beta 0.04) is the base with the adapters off, and final/ is a PEFT folder beside the random-init base."""
    from safetensors.numpy import load_file

    from grpo_jax.api import trainer
    from grpo_jax.config import load_config

    # frozen embeddings and norms cap a 0.02-init base's logits near uniform: the wider init leaves the adapters
    # room to sharpen them. Compilation is most of the cost; 100 steps lift the reward x3.9 on seed 0 (x2.6-4.4 on
    # seeds 0-2, first vs last 10 steps, with each row's own sampling key)
    config = load_config(None, [f"output_dir={tmp_path}", "seed=0", "max_steps=100", "eval.num_examples=0",
                                "model.initializer_range=0.2", "model.lora.rank=64", "model.lora.alpha=64",
                                "train.learning_rate=2e-3",
                                # the task these numbers were measured on (the demo before 2026-11-29: 3-4 digits)
                                "data.task_min_len=3", "data.task_num_train=2000", "model.rope_theta=10000",
                                "loss.beta=0.04", "reward.functions=[grpo_jax.data.task:char_accuracy]"])
    trainer.train(config, show_progress=False)
    history = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rewards = np.array([h["reward"] for h in history])
    first, last = rewards[:10].mean(), rewards[-10:].mean()
    assert last > 2.5 * first and last - first > 0.06, (first, last)
    assert history[-1]["kl"] > 0
    final = tmp_path / "final"
    saved = json.loads((final / peft_io.CONFIG_FILE).read_text())
    assert saved["r"] == 64 and saved["base_model_name_or_path"] == str(final / "base_model")
    assert (final / "base_model" / "config.json").is_file()
    tensors = load_file(final / peft_io.WEIGHTS_FILE)
    assert len(tensors) == 2 * 7 * 2 and all(np.abs(v).max() > 0 for k, v in tensors.items() if "lora_B" in k)
