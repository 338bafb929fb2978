"""Checkpoints: resumed == uninterrupted bit for bit, torn and corrupted saves, config checks."""

import errno
import importlib
import json
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import yaml

from grpo_jax.algo.state import TrainState
from grpo_jax.api import trainer
from grpo_jax.api.cli import main as cli_main
from grpo_jax.config import load_config, resolve_defaults, to_dict
from grpo_jax.data import task
from grpo_jax.io import checkpoint
from grpo_jax.io.preemption import RunFailed
from grpo_jax.io.reporting import MetricsWriter

ROOT = Path(__file__).resolve().parents[2]
# a tiny model and short rounds: every train call here compiles the sampler, log-probs and the step
TINY = ["train.train_batch_size=8", "train.num_generations=4", "train.steps_per_generation=2",
        "sampling.max_completion_length=4", "eval.num_examples=0", "model.hidden_size=32",
        "model.intermediate_size=64", "model.num_hidden_layers=1", "train.learning_rate=3e-3"]


def _lines(output_dir: Path) -> list[dict]:
    """metrics.jsonl without the timing keys (they differ between any two runs)."""
    lines = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in line.items() if not k.startswith("step_time")} for line in lines]


def _state(output_dir: Path):
    """The newest checkpoint's TrainState as saved (host arrays), and its step."""
    mngr = ocp.CheckpointManager(output_dir.absolute() / "checkpoints")
    step = mngr.latest_step()
    restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    return jax.device_get(restored.state), step


def _flat(tree) -> dict:
    """Leaves by their key path ("layers/mlp/up_proj/kernel"), whatever the containers (dicts, nnx.State)."""
    def name(key):
        return str(getattr(key, "key", getattr(key, "idx", getattr(key, "name", key))))
    return {"/".join(map(name, path)): np.asarray(leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _assert_same_state(a, b):
    a, b = _flat(a), _flat(b)
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def _train(output_dir: Path, *overrides: str) -> dict:
    return trainer.train(load_config(None, [f"output_dir={output_dir}", *TINY, *overrides]), show_progress=False)


def test_nonfinite_leaves_names_the_leaves_with_a_nan_or_an_infinity():
    """Every float leaf checked where it lives (float32, bfloat16, a scalar); integer leaves cannot hold either."""
    tree = {"a": jnp.ones((3, 4)), "b": {"c": jnp.zeros(5, jnp.bfloat16).at[2].set(jnp.inf), "d": jnp.arange(3)},
            "e": jnp.float32(np.nan), "f": [jnp.ones(2), jnp.ones(2).at[0].set(-jnp.inf)]}
    assert checkpoint.nonfinite_leaves(tree) == ["['b']['c']", "['e']", "['f'][1]"]
    assert checkpoint.nonfinite_leaves({"a": jnp.ones(3), "n": jnp.arange(2)}) == []
    assert checkpoint.nonfinite_leaves({"n": jnp.arange(2)}) == []


@pytest.mark.parametrize("options", [
    ["train.num_iterations=1"],
    # mu = 2 with a moving reference (TR-DPO): ref_params are in the checkpoint; so is the adaptive entropy
    # coefficient (TRL's use_adaptive_entropy: raised every step here, entropy below the target)
    ["train.num_iterations=2", "train.sync_ref_model=true", "train.ref_model_sync_steps=3",
     "loss.use_adaptive_entropy=true", "loss.entropy_target=100.0", "loss.entropy_coef_delta=0.01"],
    ["train.dynamic_sampling=true", "train.max_num_gen_batches=3",
     "reward.functions=[tests.api.test_trainer:half_constant_reward]"],
    # LoRA on a bfloat16 base: the checkpoint holds the adapters' optimizer state only, the reference is the base
    ["model.lora.rank=4", "model.lora.alpha=8", "model.param_dtype=bfloat16"],
    # LoRA dropout: the update's masks come from the state's key and step
    ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.dropout=0.1"],
], ids=["mu1", "mu2_sync_ref", "dynamic_sampling", "lora_bf16", "lora_dropout"])
def test_resumed_run_equals_uninterrupted_run_bitwise(tmp_path, capsys, options):
    """Stopped inside a round (max_steps=3 of a 2- or 4-step round), then resumed to 6 steps: same bits."""
    _train(tmp_path / "whole", "max_steps=6", "save_steps=0", *options)
    _train(tmp_path / "split", "max_steps=3", "save_steps=2", *options)
    # the first part saved at 2 (periodic) and 3 (the end, inside a round)
    assert sorted(int(p.name) for p in (tmp_path / "split" / "checkpoints").iterdir() if p.name.isdigit()) == [2, 3]
    capsys.readouterr()
    _train(tmp_path / "split", "max_steps=6", "save_steps=2", *options)
    assert "resuming from checkpoint" in capsys.readouterr().out
    whole, split = _lines(tmp_path / "whole"), _lines(tmp_path / "split")
    assert [line["step"] for line in split] == list(range(1, 7))
    assert whole == split
    (whole_state, whole_step), (split_state, split_step) = _state(tmp_path / "whole"), _state(tmp_path / "split")
    assert whole_step == split_step == 6
    _assert_same_state(whole_state, split_state)
    if "loss.use_adaptive_entropy=true" in options:  # the coefficient rose 0.01 a step, in the state and the log
        assert [line["entropy_coef"] for line in split] == pytest.approx([0.01 * s for s in range(1, 7)])
        np.testing.assert_allclose(_flat(split_state)["entropy_control"][0], 0.06, rtol=1e-6)
    if "model.lora.rank=4" in options:  # adapters trained, and only they carry Adam moments
        flat = _flat(split_state)
        assert any("lora_b" in k and np.abs(v).max() > 0 for k, v in flat.items() if k.startswith("params"))
        assert all("lora" in k for k in flat if k.startswith("opt_state") and flat[k].ndim > 1), sorted(flat)
    assert (tmp_path / "split" / "final").is_dir()


def test_resume_from_an_older_checkpoint_truncates_the_metrics_log(tmp_path):
    """A run killed after logging steps past its newest checkpoint resumes from that checkpoint: metrics.jsonl drops
    the lines after it, so every step is logged once and the log equals the uninterrupted run's."""
    options = ["train.num_iterations=2"]  # rounds of 4 steps: the checkpoint at step 2 is inside a round
    _train(tmp_path / "whole", "max_steps=6", "save_steps=0", *options)
    _train(tmp_path / "split", "max_steps=3", "save_steps=2", *options)
    shutil.rmtree(tmp_path / "split" / "checkpoints" / "3")  # as if killed before the save of step 3
    assert [line["step"] for line in _lines(tmp_path / "split")] == [1, 2, 3]
    _train(tmp_path / "split", "max_steps=6", "save_steps=2", *options)
    assert _lines(tmp_path / "split") == _lines(tmp_path / "whole")


def test_corrupted_newest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    """Lines written after the checkpoint that is used are dropped, and the run replays them identically."""
    out = tmp_path / "run"
    _train(out, "max_steps=4", "save_steps=2")
    lines, (state, _) = _lines(out), _state(out)
    for f in (out / "checkpoints" / "4" / "state").rglob("*"):
        if f.is_file() and f.parent.name == "d":
            f.write_bytes(b"\0garbage" * 16)
    with pytest.warns(RuntimeWarning, match=r"checkpoints/4 could not be restored"):
        _train(out, "max_steps=4", "save_steps=2")
    assert _lines(out) == lines
    _assert_same_state(_state(out)[0], state)


def _small_state(value: float, step: int) -> TrainState:
    params = {"w": jnp.full((4, 3), value, jnp.float32), "b": jnp.arange(3, dtype=jnp.float32)}
    return TrainState(params, (jnp.zeros((4, 3)),), None, jnp.asarray(step, jnp.int32), jax.random.PRNGKey(0))


def test_restore_skips_unreadable_steps_and_says_when_none_is_valid(tmp_path):
    mngr = checkpoint.manager(tmp_path, save_total_limit=None)
    for step in (1, 2):
        checkpoint.save(mngr, _small_state(float(step), step), keep_ref=False, meta={"n": step},
                        arrays={"rows": np.arange(step + 2)}, wait=True)
    step, state, meta, arrays = checkpoint.restore_latest(mngr, _small_state(0.0, 0), keep_ref=False)
    assert step == 2 and meta["n"] == 2 and state.ref_params is None
    np.testing.assert_array_equal(state.params["w"], 2.0)
    np.testing.assert_array_equal(arrays["rows"], np.arange(4))
    (tmp_path / "checkpoints" / "2" / "meta" / "metadata").unlink()  # a partly deleted step
    with pytest.warns(RuntimeWarning, match="checkpoints/2 could not be restored"):
        step, state, _, _ = checkpoint.restore_latest(checkpoint.manager(tmp_path), _small_state(0.0, 0),
                                                      keep_ref=False)
    assert step == 1
    np.testing.assert_array_equal(state.params["w"], 1.0)
    # moved aside, so the resumed run can save its step 2 again
    assert [p.name.split("-")[0] for p in (tmp_path / "unreadable_checkpoints").iterdir()] == ["2"]
    assert list(checkpoint.manager(tmp_path).all_steps()) == [1]
    (tmp_path / "checkpoints" / "1" / "state" / "manifest.ocdbt").unlink()
    with pytest.raises(ValueError, match="no trustworthy checkpoint in .*step 1: .*nothing was moved or deleted"):
        checkpoint.restore_latest(checkpoint.manager(tmp_path), _small_state(0.0, 0), keep_ref=False)
    assert list(checkpoint.manager(tmp_path).all_steps()) == [1]


def test_a_flipped_bit_is_caught_by_the_checksums(tmp_path, capsys):
    """One flipped bit in an array file of the newest step: `grpo-jax verify` names the file, and a restore warns,
    moves the step aside and uses the previous one. A step without checksums.json is not trusted: with no other
    step left, the restore fails and moves nothing."""
    mngr = checkpoint.manager(tmp_path, save_total_limit=None)
    for step in (1, 2):
        params = {"w": jax.random.normal(jax.random.PRNGKey(step), (64, 64)), "b": jnp.arange(3, dtype=jnp.float32)}
        checkpoint.save(mngr, _small_state(0.0, step)._replace(params=params), keep_ref=False, meta={"n": step},
                        wait=True)
    assert cli_main(["verify", str(tmp_path)]) == 0
    assert "checkpoints/2: ok" in capsys.readouterr().out
    files = [p for p in (tmp_path / "checkpoints" / "2" / "state").rglob("*") if p.is_file()]
    largest = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(largest.read_bytes())
    data[len(data) // 2] ^= 1 << 3
    largest.write_bytes(bytes(data))
    assert cli_main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "checkpoints/1: ok" in out and "checkpoints/2: CORRUPTED: 1 file(s)" in out
    assert f"{largest.relative_to(tmp_path / 'checkpoints' / '2').as_posix()}: contents differ" in out
    fresh = _small_state(0.0, 0)._replace(params={"w": jnp.zeros((64, 64)), "b": jnp.zeros(3)})
    with pytest.warns(RuntimeWarning, match="checkpoints/2 could not be restored .*does not match its checksums"):
        step, state, _, _ = checkpoint.restore_latest(checkpoint.manager(tmp_path), fresh, keep_ref=False)
    assert step == 1 and [p.name.split("-")[0] for p in (tmp_path / "unreadable_checkpoints").iterdir()] == ["2"]
    np.testing.assert_array_equal(state.params["w"], jax.random.normal(jax.random.PRNGKey(1), (64, 64)))
    (tmp_path / "checkpoints" / "1" / checkpoint.CHECKSUMS).unlink()
    (tmp_path / "checkpoints" / "3.orbax-checkpoint-tmp").mkdir()  # a save cut short
    assert cli_main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "checkpoints/1: NOT TRUSTED: no checksums.json" in out and "3.orbax-checkpoint-tmp: a save cut short" in out
    with pytest.raises(ValueError, match="no trustworthy checkpoint .*step 1: ValueError: checkpoint 1 is not trusted"):
        checkpoint.restore_latest(checkpoint.manager(tmp_path), fresh, keep_ref=False)
    deadline = time.monotonic() + 30  # orbax removes leftovers in the background, done before its first save
    while (tmp_path / "checkpoints" / "3.orbax-checkpoint-tmp").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["1"]  # the leftover removed at start


KILL_SCRIPT = textwrap.dedent("""
    import sys, time
    import jax, jax.numpy as jnp
    from grpo_jax.io import checkpoint
    from grpo_jax.algo.state import TrainState
    mngr = checkpoint.manager(sys.argv[1])
    def state(step, n):
        params = {"w": jnp.full((n,), float(step), jnp.float32)}
        return TrainState(params, (), None, jnp.asarray(step, jnp.int32), jax.random.PRNGKey(0))
    checkpoint.save(mngr, state(1, 8), keep_ref=False, meta={}, wait=True)
    checkpoint.save(mngr, state(2, 64 * 2**20), keep_ref=False, meta={})  # 256 MB, written in the background
    print("saving", flush=True)
    time.sleep(120)
""")


def test_a_save_killed_midway_is_never_loaded(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "saving\n", proc.communicate()
    deadline = time.monotonic() + 60  # the background write has started once its temporary folder exists
    while not list((tmp_path / "checkpoints").glob("2.orbax-checkpoint-tmp*")) and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.kill()
    proc.wait()
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert any(name.startswith("2.orbax-checkpoint-tmp") for name in names), names  # killed during the write
    assert list(checkpoint.manager(tmp_path).all_steps()) == [1]
    step, state, _, _ = checkpoint.restore_latest(checkpoint.manager(tmp_path), _small_state(0.0, 0)._replace(
        params={"w": jnp.zeros((8,))}, opt_state=()), keep_ref=False)
    assert step == 1
    np.testing.assert_array_equal(state.params["w"], 1.0)


def test_resume_refuses_a_changed_config_and_names_the_keys(tmp_path):
    config = load_config(None, [f"output_dir={tmp_path}", *TINY])
    # a run writes its config with the null defaults resolved (a random model: beta 0.1)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(to_dict(resolve_defaults(config)), sort_keys=False))
    changed = load_config(None, [f"output_dir={tmp_path}", *TINY, "loss.beta=0.2", "train.num_generations=2",
                                 "max_steps=7", "eval.num_examples=3"])
    with pytest.raises(ValueError, match=r"(?s)loss.beta: saved 0.1, now 0.2\n.*"
                                         r"train.num_generations: saved 4, now 2\nUse the saved values") as e:
        trainer.build(changed)
    assert "max_steps" not in str(e.value).split("Use the saved")[0]
    assert "eval.num_examples" not in str(e.value).split("Use the saved")[0]
    # the decode slots are a speed choice (a row's tokens do not depend on them): a run saved with 0 resumes
    saved = to_dict(load_config(None, [f"output_dir={tmp_path}", *TINY, "sampling.max_batch_rows=0"]))
    checkpoint.check_compatible(saved, to_dict(load_config(None, [f"output_dir={tmp_path}", *TINY])))


def test_a_round_saved_before_trajectories_resumes_as_it_trained():
    """A round buffer of the old `Batch` fields: its completion_mask was attention and loss alike, so it becomes
    both; token counts come from the masks. A current buffer passes through unchanged."""
    rng = np.random.default_rng(0)
    prompt_mask = np.ones((4, 3), np.int32)
    mask = (np.arange(5)[None] < np.array([[5], [2], [0], [3]])).astype(np.int32)
    old = {"prompt_ids": rng.integers(0, 9, (4, 3)), "prompt_mask": prompt_mask,
           "completion_ids": rng.integers(0, 9, (4, 5)), "completion_mask": mask,
           "advantages": rng.normal(size=4).astype(np.float32), "ref_per_token_logps": np.zeros((4, 5), np.float32),
           "step_rows": np.arange(4)[None]}
    rows, counts = checkpoint.saved_rows(old)
    np.testing.assert_array_equal(rows.loss_mask, mask)
    np.testing.assert_array_equal(rows.completion_mask, mask)
    np.testing.assert_array_equal(rows.turns, np.where(mask == 1, 0, -1))
    np.testing.assert_array_equal(counts, [[3, 5], [3, 2], [3, 0], [3, 3]])
    assert rows.old_per_token_logps is None and rows.sampler_per_token_logps.shape == (4, 5)
    current = {**rows._asdict(), "token_counts": counts + 1}  # saved counts are kept as saved
    again, kept = checkpoint.saved_rows({k: v for k, v in current.items() if v is not None})
    np.testing.assert_array_equal(kept, counts + 1)
    for a, b in zip(again, rows):
        assert (a is None and b is None) or np.array_equal(a, b)


def test_resume_false_on_a_non_empty_output_dir_is_an_error(tmp_path):
    (tmp_path / "config.yaml").write_text("seed: 0\n")
    with pytest.raises(ValueError, match="is not empty and resume=false: choose a new output_dir, delete it, or set "
                                         "resume=true"):
        trainer.build(load_config(None, [f"output_dir={tmp_path}", "resume=false"]))


# --- failures lose nothing -------------------------------------------------------------------------------

FLAKY = {}


def flaky_reward(prompts, completions, **kwargs):
    """The embedded task's reward; on its FLAKY["raise_at"]-th call it raises (a reward function failing late in
    a run), on its FLAKY["fill_at"]-th call it fills the disk with FLAKY["ballast"] (another writer)."""
    FLAKY["calls"] += 1
    if FLAKY["calls"] == FLAKY["raise_at"]:
        raise ConnectionError("the grading service went away")
    if FLAKY["calls"] == FLAKY["fill_at"]:
        try:
            with open(FLAKY["ballast"], "wb", buffering=0) as f:
                while True:
                    f.write(b"\0" * 4096)
        except OSError:  # full
            pass
    return task.char_accuracy(prompts, completions, **kwargs)


FLAKY_RUN = ["max_steps=6", "reward.functions=[tests.io.test_checkpoint:flaky_reward]"]


@pytest.fixture
def flaky():
    """FLAKY of the module `reward.functions` imports (`tests.io.test_checkpoint`, not pytest's `test_checkpoint`)."""
    state = importlib.import_module("tests.io.test_checkpoint").FLAKY
    state.update(calls=0, raise_at=None, fill_at=None, ballast=None)
    yield state
    state.update(calls=0, raise_at=None, fill_at=None, ballast=None)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """metrics lines and final state of the 6-step run of `flaky_reward` that nothing stops."""
    out = tmp_path_factory.mktemp("whole")
    importlib.import_module("tests.io.test_checkpoint").FLAKY.update(calls=0, raise_at=None, fill_at=None)
    _train(out, *FLAKY_RUN, "save_steps=0")
    return _lines(out), _state(out)[0]


def _mount(path: Path, options: str) -> Path | None:
    """`path`, a new tmpfs mounted with `options`; None where this platform does not let the tests mount one
    (it needs root, CAP_SYS_ADMIN and mount(8))."""
    path.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                                 capture_output=True, check=False).returncode == 0
    except OSError:
        mounted = False
    return path if mounted else None


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB filesystem of its own."""
    disk = _mount(tmp_path / "disk", "size=4m")
    if disk is None:
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN) and mount(8)")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_reward_failing_late_saves_first_and_the_rerun_continues_bitwise(tmp_path, flaky, uninterrupted):
    """The reward raises while the third round is prepared (after step 4, no checkpoint yet): the state after
    step 4 is saved, the error names the function, file and line, and a rerun of the same command (even with
    config.yaml deleted) continues as if nothing had happened."""
    flaky["raise_at"] = 4  # call 1 is the check before compiling (`rewards.check_reward_fns`), then one a round
    with pytest.raises(RunFailed, match=r"training stopped after optimizer step 4: RuntimeError: reward function "
                       r"'tests.io.test_checkpoint:flaky_reward' raised ConnectionError: the grading service went away "
                       r"\(raised in flaky_reward, .*test_checkpoint.py:\d+\)\. The state after step 4 was saved "
                       r"first\. Run the same command again to resume from the newest complete checkpoint, "
                       r".*checkpoints/4 \(step 4\)"):
        _train(tmp_path, *FLAKY_RUN, "save_steps=0")
    (tmp_path / "config.yaml").unlink()  # recovered from the checkpoint, not "delete the run folder"
    flaky["raise_at"] = None
    _train(tmp_path, *FLAKY_RUN, "save_steps=0")
    lines, state = uninterrupted
    assert _lines(tmp_path) == lines
    _assert_same_state(_state(tmp_path)[0], state)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's writes after the failure
def test_a_full_disk_stops_with_one_message_and_the_last_checkpoint_intact(small_disk, flaky, uninterrupted):
    """Another writer fills the run's filesystem in the middle of the run: one message names the folder and the
    bytes, no save is attempted, the last complete checkpoint verifies, metrics.jsonl ends in a whole line, and
    once there is space again the same command finishes the run bit for bit."""
    out = small_disk / "run"
    flaky.update(fill_at=4, ballast=small_disk / "ballast")  # in the third round (call 1: the check)
    with pytest.raises(RunFailed, match=r"no space left on the device of .*: [\d,]+ bytes free, and a checkpoint of "
                       r"this run needs about [\d,]+ bytes: free at least that much or move output_dir to a larger "
                       r"disk\. Run the same command again to resume from the newest complete checkpoint") as failure:
        _train(out, *FLAKY_RUN, "save_steps=1")
    newest = int(str(failure.value).rsplit("(step ", 1)[1].rstrip(")"))
    assert newest >= 3
    ok, report = checkpoint.verify_run(out)
    assert ok, report
    text = (out / "metrics.jsonl").read_text()
    assert text.endswith("\n") and len([json.loads(line) for line in text.splitlines()]) >= newest
    (small_disk / "ballast").unlink()
    flaky["fill_at"] = None
    _train(out, *FLAKY_RUN, "save_steps=1")
    assert not list((out / "checkpoints").glob("*" + checkpoint.TMP_SUFFIX))  # removed at start
    lines, state = uninterrupted
    assert _lines(out) == lines
    _assert_same_state(_state(out)[0], state)


def test_metrics_log_keeps_whole_lines_when_a_write_fails(tmp_path, monkeypatch):
    """A write cut short by a full disk (injected: half the line, then ENOSPC) leaves the log at its last whole line."""
    writer = MetricsWriter(tmp_path, max_steps=2, show_progress=False)
    writer.write({"step": 1, "reward": 0.5})
    real_open = Path.open

    class HalfThenFull:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def __getattr__(self, name):
            return getattr(self.f, name)

        def write(self, data):
            self.f.write(data[:len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "open", lambda self, *a, **k: HalfThenFull(real_open(self, *a, **k)))
    with pytest.raises(OSError, match="No space left"):
        writer.write({"step": 2, "reward": 0.25})
    monkeypatch.undo()
    assert (tmp_path / "metrics.jsonl").read_text() == json.dumps({"step": 1, "reward": 0.5}) + "\n"


LOCK_SCRIPT = "import sys, time; from grpo_jax.io import lock; held = lock.acquire(sys.argv[1]); print('locked', " \
              "flush=True); time.sleep(120)"


def test_one_writer_per_output_dir(tmp_path):
    """A second run on an output_dir a live process holds is refused, naming that process; once it is dead its
    lock is stale and the next run takes it. A read-only output_dir is one clear error."""
    proc = subprocess.Popen([sys.executable, "-c", LOCK_SCRIPT, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "locked\n", proc.communicate()
        with pytest.raises(ValueError, match=rf"output_dir='{tmp_path}' is in use by another grpo_jax run \(pid "
                                             rf"{proc.pid} on host .*, since .*\): wait for that run to end"):
            trainer.build(load_config(None, [f"output_dir={tmp_path}", *TINY]))
    finally:
        proc.kill()
        proc.wait()
    from grpo_jax.io import lock
    lock.acquire(tmp_path).release()
    readonly = _mount(tmp_path / "ro", "size=64k,ro")
    if readonly is not None:
        try:
            with pytest.raises(ValueError, match=r"output_dir='.*ro' is not writable \(Read-only file system"):
                trainer.build(load_config(None, [f"output_dir={readonly}", *TINY]))
        finally:
            subprocess.run(["umount", "-l", str(readonly)], check=False)


def test_a_run_saved_before_a_key_existed_resumes_with_that_keys_default(tmp_path):
    """config.yaml of an older version lacks the keys added since (tools, sampling.tool_timeout, ...): it ran with
    their defaults, so a resume with the defaults is allowed and one that sets them is refused, naming them."""
    from grpo_jax.io.runs import saved_config as _saved_config

    old = to_dict(resolve_defaults(load_config(None, [f"output_dir={tmp_path}", *TINY])))  # as a run writes it
    del old["tools"], old["environment_factory"], old["sampling"]["tool_timeout"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
    checkpoint.check_compatible(*_saved_config(tmp_path, load_config(None, [f"output_dir={tmp_path}", *TINY])))
    with pytest.raises(ValueError, match=r"tools: saved \[\], now \['m:f'\]"):
        checkpoint.check_compatible(*_saved_config(tmp_path, load_config(None, [f"output_dir={tmp_path}", *TINY,
                                                                              "tools=[m:f]"])))


def test_a_run_that_names_a_module_path_from_before_the_subpackages_is_refused_in_one_line(tmp_path):
    """The flat layout's module paths (`grpo_jax.task`, `grpo_jax.decoder`, ...) are gone in a 0.x package: a
    config.yaml that names one (a run from before the subpackage split) is refused in one line naming the path,
    whatever the new config says, and the old modules no longer import."""
    import importlib

    from grpo_jax.io.runs import saved_config as _saved_config

    old = to_dict(resolve_defaults(load_config(None, [f"output_dir={tmp_path}", *TINY])))
    old["reward"]["functions"] = ["grpo_jax.task:char_accuracy"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
    for now in ("grpo_jax.task:char_accuracy", "grpo_jax.data.task:char_accuracy"):
        config = load_config(None, [f"output_dir={tmp_path}", *TINY, f"reward.functions=[{now}]"])
        with pytest.raises(ValueError) as refused:
            checkpoint.check_compatible(*_saved_config(tmp_path, config))
        assert "\n" not in str(refused.value)
        assert "names 'grpo_jax.task:char_accuracy' (reward.functions)" in str(refused.value)
    for gone in ("grpo_jax.task", "grpo_jax.decoder", "grpo_jax.cli"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(gone)
