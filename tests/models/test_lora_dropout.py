"""LoRA dropout: PEFT's semantics (an inverted-dropout mask on the adapter's input, in the update's forward only),
checked against PEFT's own LoRA layer, and a train step with it: deterministic from the state, its own mask per
step, sharded == single device."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tests.algo.test_train_step import one_device_mesh
from tests.models.test_lora import with_adapters

from grpo_jax.algo.programs import jit_train_step, state_from_params
from grpo_jax.algo.train_step import StepOptions
from grpo_jax.algo.trajectory import Trajectory
from grpo_jax.config.model import LoRAConfig
from grpo_jax.device import sharding
from grpo_jax.losses import LossConfig
from grpo_jax.models import lora

P = 0.3


def _layer(seed=0):
    """A 6 -> 5 `LoRALinear` of rank 2 with random A, B and bias, dropout P."""
    layer = lora.LoRALinear(6, 5, lora=LoRAConfig(rank=2, alpha=4, dropout=P), rngs=nnx.Rngs(seed, lora=seed + 1),
                            use_bias=True)
    rng = np.random.default_rng(seed)
    layer.lora_b[...] = jnp.asarray(rng.normal(0, 0.5, (2, 5)), jnp.float32)
    layer.bias[...] = jnp.asarray(rng.normal(0, 0.5, 5), jnp.float32)
    return layer


def test_dropout_matches_peft_lora_layer_in_train_and_eval_mode():
    """PEFT's lora.Linear with our mask in its ``lora_dropout`` slot (train mode) gives our output with a key; in
    eval mode (no dropout) ours without a key. So the mask acts on the adapter's input only, scaled by 1/(1-p)."""
    torch = pytest.importorskip("torch")
    peft_lora = pytest.importorskip("peft.tuners.lora")
    layer = _layer()
    graphdef, params = nnx.split(layer)
    x = np.random.default_rng(1).normal(0, 1, (3, 4, 6)).astype(np.float32)
    drop_graphdef, drop_params = lora.with_dropout(graphdef, params, jax.random.PRNGKey(7))
    ours_train = np.asarray(nnx.merge(drop_graphdef, drop_params)(x))
    ours_eval = np.asarray(nnx.merge(graphdef, params)(x))
    layer_key = nnx.to_pure_dict(drop_params)["dropout_key"]
    keep = np.asarray(lora.dropout_mask(layer_key, x.shape, P))
    assert 0.5 < keep.mean() < 0.9  # a real mask, not all-keep

    base = torch.nn.Linear(6, 5)
    peft_layer = peft_lora.Linear(base, "default", config=peft_lora.LoraConfig(r=2, lora_alpha=4, lora_dropout=P),
                                  r=2, lora_alpha=4, lora_dropout=P)
    with torch.no_grad():
        base.weight.copy_(torch.from_numpy(np.asarray(layer.kernel[...]).T.copy()))
        base.bias.copy_(torch.from_numpy(np.asarray(layer.bias[...])))
        peft_layer.lora_A["default"].weight.copy_(torch.from_numpy(np.asarray(layer.lora_a[...]).T.copy()))
        peft_layer.lora_B["default"].weight.copy_(torch.from_numpy(np.asarray(layer.lora_b[...]).T.copy()))
    assert isinstance(peft_layer.lora_dropout["default"], torch.nn.Dropout)

    class FixedMask(torch.nn.Module):  # torch's Dropout in train mode, with our draw
        def forward(self, t):
            return t * torch.from_numpy(keep.astype(np.float32)) / (1 - P) if self.training else t

    peft_layer.lora_dropout["default"] = FixedMask()
    peft_layer.train()
    with torch.no_grad():
        np.testing.assert_allclose(ours_train, peft_layer(torch.from_numpy(x)).numpy(), rtol=1e-5, atol=1e-6)
        peft_layer.eval()
        np.testing.assert_allclose(ours_eval, peft_layer(torch.from_numpy(x)).numpy(), rtol=1e-5, atol=1e-6)
    assert np.abs(ours_train - ours_eval).max() > 1e-3


def test_mask_rate_matches_torch_dropout():
    """Our mask drops a fraction p of the elements, as torch's nn.Dropout(p) does in train mode (binomial bounds)."""
    torch = pytest.importorskip("torch")
    n = 200_000
    ours = 1.0 - float(np.asarray(lora.dropout_mask(jax.random.PRNGKey(0), (n,), P)).mean())
    torch.manual_seed(0)
    theirs = float((torch.nn.Dropout(P).train()(torch.ones(n)) == 0).float().mean())
    bound = 5 * (P * (1 - P) / n) ** 0.5
    assert abs(ours - P) < bound and abs(theirs - P) < bound and abs(ours - theirs) < 2 * bound


def test_every_layer_and_module_draws_its_own_mask(tiny_model):
    """The stacked layers get one key each (a scan draws a mask per layer); the model without a key (sampling,
    old and reference log-probs) is the dropout-free model bit for bit; rate 0 leaves the model untouched."""
    config, _, base = tiny_model
    graphdef, params = with_adapters(dataclasses.replace(config, lora=LoRAConfig(rank=2, dropout=P)), base, b_std=0.3)
    drop_graphdef, drop_params = lora.with_dropout(graphdef, params, jax.random.PRNGKey(3))
    keys = [np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(drop_params)
            if "dropout_key" in sharding.path_name(path)]
    assert len(keys) == 7 and all(k.shape == (config.num_hidden_layers, 2) for k in keys)
    rows = {tuple(row) for k in keys for row in k}
    assert len(rows) == 7 * config.num_hidden_layers
    from tests.models.test_lora import IDS, MASK, _logits
    plain = np.asarray(_logits(graphdef, params, IDS, MASK))
    dropped = np.asarray(_logits(drop_graphdef, drop_params, IDS, MASK))
    assert np.abs(dropped - plain).max() > 1e-3
    no_dropout = dataclasses.replace(config, lora=LoRAConfig(rank=2))
    np.testing.assert_array_equal(plain, np.asarray(_logits(*with_adapters(no_dropout, base, b_std=0.3), IDS, MASK)))
    zero_graphdef, zero_params = with_adapters(no_dropout, base, b_std=0.3)
    assert lora.with_dropout(zero_graphdef, zero_params, jax.random.PRNGKey(3)) == (zero_graphdef, zero_params)
    assert lora.has_dropout(graphdef, params) and not lora.has_dropout(zero_graphdef, zero_params)


def _step(config, base, mesh, *, step=0, dropout=P, grad_accum=2):
    """One train step (SGD, lr 1) of LoRA rank 2 with ``dropout`` on a fixed batch: (new state, metrics)."""
    import optax
    lora_config = dataclasses.replace(config, lora=LoRAConfig(rank=2, dropout=dropout))
    graphdef, params = with_adapters(lora_config, base, b_std=0.3)
    optimizer = optax.sgd(1.0)
    state = state_from_params(params, optimizer, seed=0, with_reference=False, mesh=mesh)
    state = state._replace(step=jax.device_put(jnp.asarray(step, jnp.int32), state.step.sharding))
    rng = np.random.default_rng(0)
    B, Pn, T = 8, 4, 5
    batch = Trajectory(rng.integers(1, 32, (B, Pn)), np.ones((B, Pn), np.int32), rng.integers(1, 32, (B, T)),
                       np.ones((B, T), np.int32), np.ones((B, T), np.int32), np.zeros((B, T), np.float32),
                       np.zeros((B, T), np.int32), np.zeros(B, bool), rng.normal(0, 1, B).astype(np.float32), None,
                       None)
    options = StepOptions(LossConfig(beta=0.0), 1.0, gradient_accumulation_steps=grad_accum)
    fn = jit_train_step(graphdef, optimizer, options, mesh, sharding.tree_shardings(state))
    return jax.device_get(fn(state, batch))


def test_train_step_with_dropout_is_deterministic_and_differs_by_step(tiny_model):
    """The update's masks come from the state (key, step): the same state gives the same bits, another step other
    masks, and dropout changes the update (on-policy the ratio stays 1: old = the same forward, detached)."""
    config, _, base = tiny_model
    mesh = one_device_mesh()
    a, metrics = _step(config, base, mesh)
    b, _ = _step(config, base, mesh)
    jax.tree.map(np.testing.assert_array_equal, a.params, b.params)
    other, _ = _step(config, base, mesh, step=1)
    plain, _ = _step(config, base, mesh, dropout=0.0)
    differ = lambda x, y: any(not np.array_equal(u, v) for u, v in  # noqa: E731
                              zip(jax.tree.leaves(x.params), jax.tree.leaves(y.params)))
    assert differ(a, other) and differ(a, plain)
    assert float(metrics["clip_ratio/region_mean"]) == 0.0


def test_sharded_step_with_dropout_equals_single_device(tiny_model):
    """Rows split over 4 x 2 devices draw the same masks (jax's partitionable threefry): the dropout forward's
    entropy agrees to 1e-5 (another mask moves it by far more), the update up to float summation order, measured
    against the largest update (SGD at lr 1 on gradients of ~50): without dropout this step sharded differs by
    1.7e-4 of its largest update, with dropout by 0.4-1.7e-4, while dropping dropout moves it by over 1e-2."""
    if len(jax.devices()) < 8:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
    config, _, base = tiny_model
    start = lora.split_trainable(with_adapters(dataclasses.replace(config, lora=LoRAConfig(rank=2)), base,
                                               b_std=0.3)[1])[0]
    single, single_metrics = _step(config, base, one_device_mesh())
    sharded, metrics = _step(config, base, sharding.make_mesh(4, 2, 1))
    plain, plain_metrics = _step(config, base, one_device_mesh(), dropout=0.0)
    np.testing.assert_allclose(metrics["entropy"], single_metrics["entropy"], rtol=1e-5)
    assert abs(float(plain_metrics["entropy"]) - float(single_metrics["entropy"])) > 1e-3
    updates = [[u - b for u, b in zip(jax.tree.leaves(lora.split_trainable(s.params)[0]), jax.tree.leaves(start))]
               for s in (single, sharded, plain)]
    scale = max(np.abs(u).max() for u in updates[0])
    for one, many, none in zip(*updates):
        np.testing.assert_allclose(many, one, atol=5e-4 * scale)
    assert max(np.abs(none - one).max() for one, none in zip(updates[0], updates[2])) > 1e-2 * scale
