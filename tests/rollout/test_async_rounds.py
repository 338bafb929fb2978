"""Asynchronous rounds (grpo_jax/rollout/async_rounds.py): the version rule, decoupled PPO against a naive NumPy version, and
runs that are bitwise equal to themselves and to their resumed selves in both placements."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.config import load_config
from grpo_jax.config.loss import LossConfig
from grpo_jax.config.sections import TrainConfig
from grpo_jax.losses import compute_loss
from grpo_jax.rollout import async_rounds
from tests.io.test_checkpoint import TINY, _assert_same_state, _lines, _state, _train


@pytest.mark.parametrize("K_steps, k, versions", [
    # (steps_per_generation, num_iterations), k, v(r) for r = 0..4, written out by hand from "the params after step
    # max(0, r*K - k)"
    ((1, 1), 0, [0, 1, 2, 3, 4]),
    ((1, 1), 2, [0, 0, 0, 1, 2]),
    ((2, 1), 1, [0, 1, 3, 5, 7]),
    ((2, 2), 3, [0, 1, 5, 9, 13]),
])
def test_the_version_rule_and_the_logged_staleness(K_steps, k, versions):
    tc = TrainConfig(train_batch_size=8, num_generations=4, steps_per_generation=K_steps[0],
                     num_iterations=K_steps[1], max_staleness=k)
    assert [async_rounds.version(tc, r) for r in range(5)] == versions
    K = K_steps[0] * K_steps[1]
    for r, v in enumerate(versions):
        for j in range(K):  # step r*K + j + 1 as logged: its update starts from the params after step r*K + j
            assert async_rounds.step_metrics(tc, r * K + j + 1) == {"async/staleness": r * K + j - v,
                                                                   "async/version": v}


def test_interruptible_rollouts_switch_params_by_segment_and_record_each_tokens_version():
    tc = TrainConfig(train_batch_size=8, num_generations=4, steps_per_generation=2, max_staleness=3,
                     interruptible_rollouts=True)
    # K = 2, k = 3: v(r) = 0, 0, 1, 3; the newest params a round switches to are those before its predecessor's last
    # update, max(v(r), 2r - 1) = 0, 1, 3, 5
    assert [async_rounds.last_version(tc, r) for r in range(4)] == [0, 1, 3, 5]
    assert [[async_rounds.segment_version(tc, r, j) for j in range(4)] for r in range(4)] == [
        [0, 0, 0, 0], [0, 1, 1, 1], [1, 2, 3, 3], [3, 4, 5, 5]]
    # segments of versions 4, 4, 5 leave rows at these lengths (a row admitted later starts at 0)
    lengths = [(4, np.array([2, 0, 1])), (4, np.array([3, 0, 1])), (5, np.array([5, 2, 1]))]
    np.testing.assert_array_equal(async_rounds._token_versions(lengths, (3, 6)), [[4, 4, 4, 5, 5, -1],
                                                                                  [5, 5, -1, -1, -1, -1],
                                                                                  [4, -1, -1, -1, -1, -1]])


def _naive_decoupled(logp, prox, behav, adv, mask, *, eps, mode, clip_min, clip_max):
    """AReaL's decoupled PPO, one token at a time: ℓ = -w · min(r·A, clip(r, 1-ε, 1+ε)·A), r = π/π_prox, w = π_prox /
    π_behav shaped as TRL's vllm_importance_sampling_mode says; the loss_type grpo mean over rows of row means."""
    B, T = logp.shape
    lo, hi = (-np.inf if clip_min is None else clip_min), (np.inf if clip_max is None else clip_max)
    rows = []
    for i in range(B):
        seq_log_w = sum(float(prox[i, t] - behav[i, t]) for t in range(T) if mask[i, t])
        total, n = 0.0, 0
        for t in range(T):
            if not mask[i, t]:
                continue
            r = np.exp(float(logp[i, t] - prox[i, t]))
            loss = -min(r * adv[i], min(max(r, 1 - eps), 1 + eps) * adv[i])
            w = np.exp(seq_log_w if mode.startswith("sequence") else float(prox[i, t] - behav[i, t]))
            if mode.endswith("truncate"):
                w = min(max(w, lo), hi)
            elif not lo <= w <= hi:
                w = 0.0
            total, n = total + w * loss, n + 1
        rows.append(total / max(n, 1))
    return np.mean(rows)


@pytest.mark.parametrize("mode, clip_min, clip_max", [
    ("token_truncate", None, 2.0), ("token_mask", 0.5, 1.5), ("sequence_mask", None, 3.0),
    ("sequence_truncate", 0.8, 1.2)])
def test_decoupled_ppo_loss_matches_a_naive_numpy_version(mode, clip_min, clip_max):
    """compute_loss with old = the proximal log-probs and the sampler's = the behaviour ones is decoupled PPO."""
    rng = np.random.default_rng(0)
    B, T = 4, 6
    logp = rng.normal(-1.5, 0.3, (B, T)).astype(np.float32)
    prox = (logp + rng.normal(0, 0.2, (B, T))).astype(np.float32)
    behav = (prox + rng.normal(0, 0.4, (B, T))).astype(np.float32)
    adv = rng.normal(0, 1, B).astype(np.float32)
    mask = (np.arange(T)[None] < np.array([6, 4, 1, 5])[:, None]).astype(np.float32)
    config = LossConfig(beta=0.0, epsilon=0.2, off_policy_correction="decoupled", vllm_importance_sampling_mode=mode,
                        vllm_importance_sampling_clip_min=clip_min, vllm_importance_sampling_clip_max=clip_max)
    loss, _ = compute_loss(jnp.asarray(logp), jnp.asarray(prox), None, jnp.asarray(adv), jnp.asarray(mask),
                           config=config, sampler_per_token_logps=jnp.asarray(behav), num_sequences=B)
    expected = _naive_decoupled(logp, prox, behav, adv, mask, eps=0.2, mode=mode, clip_min=clip_min,
                                clip_max=clip_max)
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5, atol=1e-7)


def test_invalid_combinations_are_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match="train.max_staleness=-1 must be an integer >= 0"):
        load_config(None, ["train.max_staleness=-1"])
    with pytest.raises(ValueError, match="set vllm_importance_sampling_correction=true"):
        load_config(None, ["loss.off_policy_correction=decoupled", "loss.vllm_importance_sampling_correction=false"])
    with pytest.raises(ValueError, match="loss.off_policy_correction='areal' is not supported"):
        load_config(None, ["loss.off_policy_correction=areal"])
    with pytest.raises(ValueError, match="mesh.rollout=8 leaves none of the 8 devices to train on"):
        _train(tmp_path / "run", "mesh.rollout=8", "max_steps=1")
    with pytest.raises(ValueError, match="train.interruptible_rollouts=true .* needs train.max_staleness > 0"):
        load_config(None, ["train.interruptible_rollouts=true"])
    with pytest.raises(ValueError, match="which only continuous batching has: set sampling.max_batch_rows"):
        _train(tmp_path / "static", "train.max_staleness=1", "train.interruptible_rollouts=true", "max_steps=1")


# K = 2 steps a round (TINY): a checkpoint at step 3, inside round 1, with round 2 queued; K = 1: at the end of
# round 2, with rounds 3 and 4 queued (k = 2: the params after steps 1 and 2)
ASYNC = {"colocated_k1": ["train.max_staleness=1"], "colocated_k2": ["train.max_staleness=2"],
         "colocated_K1_k2": ["train.max_staleness=2", "train.steps_per_generation=1"],
         "colocated_K1_k2_interruptible": ["train.max_staleness=2", "train.steps_per_generation=1",
                                           "train.train_batch_size=16", "sampling.max_batch_rows=8",
                                           "train.interruptible_rollouts=true"],
         "split_k1": ["train.max_staleness=1", "mesh.rollout=4"],
         "split_k2": ["train.max_staleness=2", "mesh.rollout=4", "loss.off_policy_correction=decoupled"]}


@pytest.mark.parametrize("name", list(ASYNC))
def test_async_runs_are_bitwise_equal_and_resume_bit_for_bit(tmp_path, name):
    """Two runs of one config give the same metrics and params; the run resumed from its step-3 checkpoint (the
    queued round's params version in it) ends as the uninterrupted one."""
    options = [*ASYNC[name], "max_steps=6", "save_steps=3", "save_total_limit=null"]
    _train(tmp_path / "a", *options)
    _train(tmp_path / "b", *options)
    lines = _lines(tmp_path / "a")
    assert lines == _lines(tmp_path / "b")
    _assert_same_state(_state(tmp_path / "a")[0], _state(tmp_path / "b")[0])
    k, K = int(ASYNC[name][0].split("=")[1]), 1 if "train.steps_per_generation=1" in ASYNC[name] else 2
    steps = [line for line in lines if "async/staleness" in line]
    assert [line["async/version"] for line in steps] == [max(0, K * (s // K) - k) for s in range(6)]
    # the params versions older than step 3 that queued rounds sample with are in its checkpoint
    meta = json.loads((tmp_path / "a" / "checkpoints" / "3" / "meta" / "metadata").read_text())
    saved = {int(key.split("_")[2]) for key in meta["arrays"] if key.startswith(async_rounds.VERSION_PREFIX)}
    assert saved == {(2, 2): {2}, (1, 2): {1, 2}}.get((K, k), set())
    if "train.interruptible_rollouts=true" in ASYNC[name]:  # from round 2 on rows may switch to newer params
        assert max(line["async/newer_tokens"] for line in steps) > 0
        assert all(line["async/newer_tokens"] == 0 for line in steps[:2])  # v(r) = max(v(r), r - 1) = 0
    # stopped at step 3: the same folder without what came after its checkpoint
    shutil.copytree(tmp_path / "a", tmp_path / "c")
    shutil.rmtree(tmp_path / "c" / "checkpoints" / "6")
    _train(tmp_path / "c", *options)
    assert _lines(tmp_path / "c") == lines
    _assert_same_state(_state(tmp_path / "c")[0], _state(tmp_path / "a")[0])


def test_a_reward_failing_on_the_sampler_thread_saves_and_the_rerun_ends_bitwise(tmp_path):
    """test_stops' late reward failure with k = 2: round 2 fails on the sampler thread, the loop finds out when its
    updates come (after step 4) and saves; the checkpoint keeps the params version round 2 samples with, and the
    same command then ends as the run that never failed."""
    from grpo_jax.io.preemption import RunFailed
    from tests.io.test_stops import FAILING_AT_ROUND_3, RUN, _shared

    stop = _shared()[0]
    options = [*RUN, "train.max_staleness=2"]
    try:
        stop.update(kind=None, at=None, calls=0)
        _train(tmp_path / "whole", *options)
        stop.update(kind="raise", at=FAILING_AT_ROUND_3, calls=0)
        with pytest.raises(RunFailed, match="training stopped after optimizer step 4: .*stopping_reward"):
            _train(tmp_path / "run", *options)
        assert _state(tmp_path / "run")[1] == 4
        stop.update(kind=None, at=None)
        _train(tmp_path / "run", *options)
    finally:
        stop.update(kind=None, at=None, calls=0)
    assert _lines(tmp_path / "run") == _lines(tmp_path / "whole")
    _assert_same_state(_state(tmp_path / "run")[0], _state(tmp_path / "whole")[0])


SEEN = []  # (old, sampler) log-probs and loss mask that `spy_loss` got, one entry a step


def spy_loss(*args, sampler_per_token_logps=None, **kwargs):
    """compute_loss, recording what the train step handed it."""
    def record(old, sampler, mask):
        SEEN.append((np.asarray(old), None if sampler is None else np.asarray(sampler), np.asarray(mask)))

    jax.debug.callback(record, args[1], sampler_per_token_logps, args[4])
    return compute_loss(*args, sampler_per_token_logps=sampler_per_token_logps, **kwargs)


def test_decoupled_rows_carry_proximal_and_behaviour_logps_to_the_loss(tmp_path):
    """With k = 2 and K = 2 round 0 samples with the params of its first update (proximal = behaviour, up to the
    rounding of a forward pass against the sampler's numbers) and round 1 with the params 2 steps before its first
    update (they differ); with correction none the loss gets the behaviour log-probs as old and no sampler's."""
    from grpo_jax.api import trainer

    def run(name, *options):
        SEEN.clear()
        config = load_config(None, [f"output_dir={tmp_path / name}", *TINY, "max_steps=4", "save_steps=0",
                                    "train.max_staleness=2", *options])
        trainer.train(config, show_progress=False, loss_fn=spy_loss)
        return list(SEEN)

    seen = run("decoupled", "loss.off_policy_correction=decoupled")
    assert len(seen) == 4 and all(sampler is not None for _, sampler, _ in seen)
    for step, (old, sampler, mask) in enumerate(seen):
        gap = np.abs((old - sampler) * mask).max()
        assert (gap < 1e-4) if step < 2 else (gap > 1e-3), (step, gap)
    seen = run("none")
    assert len(seen) == 4 and all(sampler is None for _, sampler, _ in seen)


@pytest.mark.parametrize("tensor", [0, 2])
def test_split_placement_samples_on_the_rollout_devices_and_trains_on_the_others(tmp_path, tensor):
    """mesh.rollout=4: the first 4 devices sample, the other 4 train; with mesh.rollout_tensor=2 the sampling
    devices decode in tensor 2 x data 2, each holding half of every params version's matrices, not a whole copy
    (on CPUs 0 keeps the whole copies: weights in host memory)."""
    from grpo_jax.api import trainer
    from grpo_jax.data import prompts as data

    config = load_config(None, [f"output_dir={tmp_path}", *TINY, "mesh.rollout=4", "train.max_staleness=2",
                                f"mesh.rollout_tensor={tensor}"])
    run, state, held = trainer.build(config)
    try:
        rollout, training = set(run.rollout_mesh.devices.flat), set(run.mesh.devices.flat)
        assert len(rollout) == len(training) == 4 and not rollout & training
        assert run.rollout_mesh.shape["tensor"] == max(tensor, 1)
        assert all(leaf.sharding.device_set == training for leaf in jax.tree.leaves(state))
        sampler = async_rounds.Sampler(run, state, next_round=0, data_state=data.DataState(0, 0, config.seed))
        sampler.feed(state, 0)  # k = K = 2: rounds 0 and 1 sample with the initial params, copied over
        assert sorted(sampler.queued) == [0, 1] and list(sampler.versions) == [0]
        assert all(leaf.sharding.device_set == rollout for leaf in jax.tree.leaves(sampler.versions[0]))
        q = next(leaf for path, leaf in jax.tree_util.tree_leaves_with_path(sampler.versions[0])
                 if "q_proj" in jax.tree_util.keystr(path))
        assert {s.data.shape[-1] for s in q.addressable_shards} == {q.shape[-1] // max(tensor, 1)}
        round_batch, _ = sampler.take(state, 0)
        assert all(leaf.sharding.device_set == training for leaf in jax.tree.leaves(round_batch.rows))
        sampler.close()
    finally:
        held.release()
