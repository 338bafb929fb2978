"""Fingerprints of the reward functions, tools and environments (grpo_jax/rewards/code_fingerprints.py): a resume over a
changed one is refused in one line naming reward.allow_changed; with it the run continues, warned."""

import functools
import json
import warnings

import pytest

from grpo_jax.api import trainer
from grpo_jax.config import load_config
from grpo_jax.rewards import code_fingerprints
from tests.io.test_checkpoint import TINY


def reward_v1(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


def reward_v2(prompts, completions, **kwargs):
    return [float(len(c)) + 1.0 for c in completions]


class Env:
    def reset(self, **kwargs):
        return None


class OtherEnv:
    def reset(self, **kwargs):
        return ""


def _exec_defined(body: str):
    """A function with no readable source (a notebook cell's, exec'd text)."""
    scope = {}
    exec(f"def reward(prompts, completions, **kwargs):\n    return {body}\n", scope)  # noqa: S102
    return scope["reward"]


def test_the_hash_follows_the_code_not_the_object():
    h = code_fingerprints.code_hash
    assert h(reward_v1) == h(reward_v1) and h(reward_v1) != h(reward_v2)
    assert h(_exec_defined("[0.0] * len(completions)")) == h(_exec_defined("[0.0] * len(completions)"))
    assert h(_exec_defined("[0.0] * len(completions)")) != h(_exec_defined("[1.0] * len(completions)"))
    assert h(functools.partial(reward_v1, scale=2)) != h(functools.partial(reward_v1, scale=3))
    assert h(Env()) == h(Env) != h(OtherEnv)  # an instance by its class, never by its address


def test_a_changed_entry_is_refused_naming_it_and_the_override():
    Tooling = type("Tooling", (), {})
    tooling = Tooling()
    tooling.tools, tooling.factories, tooling.probes = (reward_v1,), {None: Env}, {None: Env()}
    saved = json.loads(json.dumps(code_fingerprints.fingerprint([("r", reward_v1)], tooling)))  # as meta holds it
    assert code_fingerprints.check(saved, code_fingerprints.fingerprint([("r", reward_v1)], tooling), step=4,
                                   allow_changed=False) is None
    assert code_fingerprints.check(None, saved, step=4, allow_changed=False) is None  # an older checkpoint
    with pytest.raises(ValueError, match=r"^cannot resume: reward function 'r' has other code \(xxh3 \w+ now, \w+ "
                                         r"then\) since checkpoint 4, .* set reward.allow_changed=true") as e:
        code_fingerprints.check(saved, code_fingerprints.fingerprint([("r", reward_v2)], tooling), step=4,
                                allow_changed=False)
    assert "\n" not in str(e.value)
    tooling.probes = {None: OtherEnv()}
    with pytest.raises(ValueError, match="environment 'None' has other code"):
        code_fingerprints.check(saved, code_fingerprints.fingerprint([("r", reward_v1)], tooling), step=4,
                                allow_changed=False)
    with pytest.raises(ValueError, match=r"the reward functions are now \['r', 's'\], then \['r'\]"):
        code_fingerprints.check(saved, code_fingerprints.fingerprint([("r", reward_v1), ("s", reward_v1)], tooling),
                                step=4, allow_changed=False)
    assert "continuing with them (reward.allow_changed=true)" in code_fingerprints.check(
        saved, code_fingerprints.fingerprint([("r", reward_v2)], tooling), step=4, allow_changed=True)


def test_a_resume_with_a_changed_reward_function_is_refused(tmp_path):
    """The run saved with reward_v1: rerun with other code under the same name, it stops before a
    step; with reward.allow_changed=true it continues; the unchanged function resumes as before."""
    out = tmp_path / "run"

    def run(fn, *overrides):
        config = load_config(None, [f"output_dir={out}", *TINY, "save_steps=2", "model.init=random", *overrides])
        return trainer.train(config, reward_funcs=[fn], show_progress=False)

    assert run(reward_v1, "max_steps=2")["steps"] == 2
    changed = _exec_defined("[float(len(c)) + 1.0 for c in completions]")
    changed.__name__ = "reward_v1"  # the same name, other code: what a user edits between two runs
    with pytest.raises(ValueError, match=r"cannot resume: reward function 'reward_v1' has other code .* since "
                                         r"checkpoint 2, .* set reward.allow_changed=true"):
        run(changed, "max_steps=3")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["2"]  # nothing trained, nothing saved
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert run(changed, "max_steps=3", "reward.allow_changed=true")["steps"] == 3
    assert any("reward.allow_changed=true" in str(w.message) for w in caught)
    with pytest.raises(ValueError, match="reward function 'reward_v1' has other code"):
        run(reward_v1, "max_steps=4")  # checkpoint 3 ran the changed one
