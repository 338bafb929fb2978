"""Beam search (`grpo_jax.algo.beam`): greedy against transformers' own ``generate(num_beams=n)`` token for token;
beam sampling against its definition (C continuations drawn without replacement, the best finished one kept)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.algo import beam, programs
from grpo_jax.algo.logprobs import completion_logps
from grpo_jax.algo.sampling import SamplingConfig
from grpo_jax.device import sharding
from grpo_jax.models import forward, from_pretrained, positions_from_mask, unembed
from grpo_jax.rollout import stream

import hf_fixtures as hf

PROMPT_IDS = np.array([[0, 0, 0, 5, 7, 9], [0, 3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8], [0, 0, 0, 0, 0, 6]], np.int32)
PROMPT_MASK = (np.arange(6)[None] >= np.array([[3], [1], [0], [5]])).astype(np.int32)
PAD = 0


def decoder_of(graphdef, config, *, eos, **sampling):
    return programs.jit_decoder(graphdef, sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1]), config,
                                config=SamplingConfig(**sampling), eos_token_ids=eos, pad_token_id=PAD)


def beams(model, *, greedy=False, key=0, eos=(-1,), ids=PROMPT_IDS, mask=PROMPT_MASK, **sampling):
    config, graphdef, params = model
    dec = decoder_of(graphdef, config, eos=eos, **sampling)
    return jax.device_get(stream.generate(dec, params, ids, mask, jax.random.key(key), greedy=greedy, group_size=1))


# --- greedy: transformers' beam search ----------------------------------------------------------------------------

HF_EOS = (1, 5, 9)  # made likelier below, so hypotheses end at many lengths
rng = np.random.default_rng(0)
HF_MASK = np.ones((3, 12), np.int32)
HF_MASK[0, :5] = 0
HF_MASK[1, :2] = 0
HF_IDS = np.where(HF_MASK == 1, rng.integers(3, hf.VOCAB, HF_MASK.shape), hf.PAD_ID).astype(np.int32)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(transformers model, our Model, params) of one tiny untied Llama whose EOS candidates are likelier."""
    torch = pytest.importorskip("torch")
    torch_model = hf.build_model("llama", False)
    with torch.no_grad():
        for e in HF_EOS:
            torch_model.lm_head.weight[e] *= 4.0
    model, params = from_pretrained(hf.save_model(torch_model, tmp_path_factory.mktemp("beam") / "llama"))
    return torch_model, model, params


def until_eos(row, eos) -> list:
    """A row's tokens up to and with its first EOS id (transformers pads after it with pad_token_id or EOS)."""
    row = [int(x) for x in row]
    ends = [i for i, x in enumerate(row) if x in eos]
    return row[: ends[0] + 1] if ends else row


@pytest.mark.parametrize("eos,num_beams,length_penalty,early_stopping,penalty", [
    ((1,), 2, 1.0, False, 1.0), ((1,), 3, -0.5, True, 1.0), (HF_EOS, 2, 2.0, "never", 1.0),
    (HF_EOS, 3, 0.0, False, 1.0), (HF_EOS, 2, 2.0, True, 1.0), (HF_EOS, 3, 1.0, False, 1.5)])
def test_greedy_beam_search_matches_transformers(llama, eos, num_beams, length_penalty, early_stopping, penalty):
    import torch

    torch_model, model, params = llama
    T = 10
    with torch.no_grad():
        expected = torch_model.generate(
            input_ids=torch.tensor(HF_IDS, dtype=torch.long), attention_mask=torch.tensor(HF_MASK), do_sample=False,
            num_beams=num_beams, length_penalty=length_penalty, early_stopping=early_stopping, max_new_tokens=T,
            repetition_penalty=penalty, eos_token_id=list(eos), pad_token_id=hf.PAD_ID).numpy()[:, HF_IDS.shape[1]:]
    dec = programs.jit_decoder(model.graphdef, sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1]), model.config,
                               config=SamplingConfig(max_completion_length=T, num_beams=num_beams,
                                                     length_penalty=length_penalty, early_stopping=early_stopping,
                                                     repetition_penalty=penalty),
                               eos_token_ids=eos, pad_token_id=hf.PAD_ID)
    out = jax.device_get(stream.generate(dec, params, HF_IDS, HF_MASK, jax.random.key(0), greedy=True))
    got = [list(ids[:n]) for ids, n in zip(out.completion_ids, out.completion_mask.sum(1))]
    assert got == [until_eos(row, eos) for row in expected]
    assert (out.completion_ids[out.completion_mask == 0] == hf.PAD_ID).all()
    np.testing.assert_array_equal(out.is_truncated, [row[-1] not in eos for row in got])
    if length_penalty == 2.0 and early_stopping is True:  # the setting changes what the search finds
        plain = beams((model.config, model.graphdef, params), greedy=True, eos=eos, ids=HF_IDS, mask=HF_MASK,
                      max_completion_length=T, num_beams=num_beams, length_penalty=length_penalty)
        assert [list(ids[:n]) for ids, n in zip(plain.completion_ids, plain.completion_mask.sum(1))] != got


# --- sampling: transformers' beam sampling, by its definition --------------------------------------------------


def test_sampled_beams_at_a_vanishing_temperature_are_the_greedy_search(tiny_model):
    """Scores over the temperature keep the greedy search's order, and the noise no longer moves it."""
    eos = (3, 4)
    for num_beams, length_penalty in ((2, 1.0), (3, -1.0)):
        kwargs = dict(eos=eos, max_completion_length=7, num_beams=num_beams, length_penalty=length_penalty)
        greedy = beams(tiny_model, greedy=True, **kwargs)
        cold = beams(tiny_model, key=4, temperature=1e-4, **kwargs)
        np.testing.assert_array_equal(cold.completion_ids, greedy.completion_ids)
        np.testing.assert_array_equal(cold.completion_mask, greedy.completion_mask)
    warm = beams(tiny_model, key=4, eos=eos, max_completion_length=7, num_beams=2)
    assert not np.array_equal(warm.completion_ids, greedy.completion_ids)


def test_one_token_beam_sample_keeps_the_best_of_draws_without_replacement(tiny_model):
    """T = 1, n = 2, no EOS: C = 4 tokens drawn without replacement from the filtered softmax, the likeliest of
    them kept; numpy's sequential draws without replacement are the reference."""
    config, graphdef, params = tiny_model
    n_rows = 4000
    ids, mask = np.repeat(PROMPT_IDS[2:3], n_rows, 0), np.repeat(PROMPT_MASK[2:3], n_rows, 0)
    out = beams(tiny_model, key=1, ids=ids, mask=mask, max_completion_length=1, num_beams=2, temperature=0.8,
                top_k=6)
    hidden, _ = forward(graphdef, params, ids[:1], positions_from_mask(mask[:1]), mask[:1])
    logits = np.asarray(unembed(graphdef, params, hidden[:, -1:]), np.float64)[0, 0]
    scores = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    scores = scores / 0.8
    top6 = np.argsort(-scores)[:6]
    probs = np.zeros_like(scores)
    probs[top6] = np.exp(scores[top6] - scores[top6].max())
    probs /= probs.sum()
    draws = np.random.default_rng(0)
    want = np.zeros(config.vocab_size)
    for _ in range(20000):
        picked = draws.choice(config.vocab_size, 4, replace=False, p=probs)
        want[picked[np.argmax(scores[picked])]] += 1
    want /= want.sum()
    freq = np.bincount(out.completion_ids[:, 0], minlength=config.vocab_size) / n_rows
    assert (freq > 0).sum() >= 2  # sampled, not one fixed token
    np.testing.assert_allclose(freq, want, atol=0.03)


def test_beam_rows_carry_the_policys_log_probs_and_their_own_noise(tiny_model):
    _, graphdef, params = tiny_model
    kwargs = dict(eos=(3, 4), max_completion_length=7, num_beams=3, temperature=0.7, top_p=0.9)
    out = beams(tiny_model, key=5, **kwargs)
    assert 0 < out.is_truncated.sum() < len(out.is_truncated)  # some rows end at EOS, some at T
    logps, _ = completion_logps(graphdef, params, PROMPT_IDS, PROMPT_MASK, out.completion_ids, out.completion_mask,
                                temperature=0.7)
    m = out.completion_mask == 1
    np.testing.assert_allclose(out.sampler_per_token_logps[m], np.asarray(logps)[m], atol=1e-5)
    assert (out.sampler_per_token_logps[~m] == 0).all() and (out.loss_mask == out.completion_mask).all()
    # rows 2.. alone, as rows 2.. of the call: the same tokens (each row draws its own noise)
    options = decoder_of(graphdef, tiny_model[0], **kwargs).options(2, 2, False)
    tail, _ = jax.jit(beam.generate, static_argnums=(0, 5))(graphdef, params, PROMPT_IDS[2:], PROMPT_MASK[2:],
                                                             jax.random.key(5), options, jnp.int32(2))
    np.testing.assert_array_equal(np.asarray(tail.completion_ids), out.completion_ids[2:])


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (XLA_FLAGS in conftest)")
@pytest.mark.parametrize("shape", [(8, 1, 1), (2, 2, 2)])
def test_sharded_beams_equal_one_device_and_the_cpu_path(tiny_model, shape):
    """Rows and their beams split over the row shards (params over fsdp / tensor), and the CPU speed-ups with
    host-thread chunks: the same rows."""
    config, graphdef, params = tiny_model
    ids, mask = np.tile(PROMPT_IDS, (2, 1)), np.tile(PROMPT_MASK, (2, 1))  # 8 rows: whole row shards
    kwargs = dict(max_completion_length=7, num_beams=2, temperature=0.8, top_k=9)
    want = beams(tiny_model, key=2, eos=(3, 4), ids=ids, mask=mask, **kwargs)
    mesh = sharding.make_mesh(*shape)
    dec = programs.jit_decoder(graphdef, mesh, config, config=SamplingConfig(**kwargs), eos_token_ids=(3, 4),
                               pad_token_id=PAD)
    got = stream.generate(dec, jax.device_put(params, sharding.param_shardings(mesh, params)), ids, mask,
                          jax.random.key(2))
    np.testing.assert_array_equal(np.asarray(got.completion_ids), want.completion_ids)
    fast = programs.jit_decoder(graphdef, sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1]), config,
                                config=SamplingConfig(host_threads=2, **kwargs), eos_token_ids=(3, 4),
                                pad_token_id=PAD, cpu_speedups=True)
    got = stream.generate(fast, params, ids, mask, jax.random.key(2))
    np.testing.assert_array_equal(np.asarray(got.completion_ids), want.completion_ids)
