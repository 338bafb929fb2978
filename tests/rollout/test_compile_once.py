"""Every program of a run compiled once, before the first step (`grpo_jax.rollout.shapes`): after `compile_ahead` no round or
step compiles, though the rows change length from round to round."""

import collections

import jax
import numpy as np
import pytest

from grpo_jax.algo import trajectory
from grpo_jax.api import trainer
from grpo_jax.config import load_config
from grpo_jax.data import prompts as data
from grpo_jax.rollout import shapes, stream

START = data.DataState(epoch=0, index=0, seed=0)
COMPILE = "/jax/core/compile/backend_compile_duration"  # fired for every executable made, compiled or loaded


class Compiles:
    """Every executable jax makes while listening, by function name (jit(name))."""

    def __init__(self):
        self.names = []
        self.listening = False
        jax.monitoring.register_event_duration_secs_listener(self._heard)

    def _heard(self, event, seconds, fun_name="?", **kwargs):
        if self.listening and event == COMPILE:
            self.names.append(fun_name)

    def during(self, fn, *args, **kwargs):
        """(fn's result, the names of what it compiled)."""
        self.names, self.listening = [], True
        try:
            return fn(*args, **kwargs), collections.Counter(self.names)
        finally:
            self.listening = False


def test_after_the_warm_up_no_round_or_step_compiles(tmp_path):
    """Prompts of 2-9 digits, completions of 1-12 tokens from a random policy (each round's groups need different
    packed lengths), 2 steps a round that gather their rows, and each round decoding at another of the listed slot
    counts (the CPU switch off: on it a round decodes at one slot count): the warm-up compiles each listed shape,
    and the rounds after it compile nothing."""
    config = load_config(None, [f"output_dir={tmp_path}", "train.num_generations=4", "train.train_batch_size=8",
                                "train.steps_per_generation=2", "train.packing=true", "data.task_min_len=2",
                                "data.task_max_len=9", "sampling.max_completion_length=12", "eval.num_examples=0",
                                "max_steps=8", "cpu_speedups=false",
                                # the setting whose random policy's rows change length (the demo before 2026-11-29)
                                "data.task_num_train=2000", "model.rope_theta=10000", "loss.beta=0.04",
                                "reward.functions=[grpo_jax.data.task:char_accuracy]"])
    listen = Compiles()
    run, state, held = trainer.build(config)
    listed = run.shapes
    assert listed.step_packings and (0, 0) not in listed.step_packings  # packing=true: packed layouts only
    assert len(listed.decode_slots) > 1 and listed.decode_slots[0] == 0

    (count, seconds, peaks, programs), warm = listen.during(shapes.compile_ahead, run, state, listed, workers=2)
    # fewer executables than programs where an earlier test of this process compiled the same small program
    # (`sample_key`, `advantages`): jit's in-memory cache holds it, and no executable is made
    assert count >= sum(warm.values()) and seconds > 0
    # each program named with its seconds, in the order lowered: a step per packing, after the passes it reads
    names = [name for name, _, _ in programs]
    assert [n for n in names if n.startswith("train_step")] == [
        f"train_step {K}x{L}" for L, K in listed.step_packings] and names[0] == "sample_key"
    # seconds each (0.000 where jit's in-memory cache held it: the same program twice, or from an earlier test)
    assert all(lower_s >= 0 and compile_s >= 0 for _, lower_s, compile_s in programs)
    assert sum(compile_s for _, _, compile_s in programs) > 0
    # the phases' peaks per device (a run's plan for the devices at hand): the step holds at least its state's shards
    state_bytes = sum(s.data.nbytes for x in jax.tree.leaves(state) for s in x.addressable_shards[:1])
    assert peaks["train_step"] >= state_bytes and peaks["decode"] > 0 and peaks["logps"] > 0
    # each listed shape compiled once: a step and a reference pass per packing, a call's programs per slot count
    continuous = len(listed.decode_slots) - 1
    assert warm["jit(train_step)"] == len(listed.step_packings)
    assert warm["jit(logps)"] == len(listed.round_packings)
    assert warm["jit(generate)"] == 1 and warm["jit(start)"] == warm["jit(advance)"] == continuous

    data_state, used_steps = START, set()
    for round_index in range(4):
        slots = listed.decode_slots[round_index % len(listed.decode_slots)]
        (round_batch, data_state), compiled = listen.during(trainer.prepare_round, run, state, data_state, round_index,
                                                             slots=slots)
        assert not compiled, f"round {round_index} (slots {slots}) compiled {dict(compiled)}"
        (state, round_batch, lines), compiled = listen.during(trainer.run_steps, run, state, round_batch,
                                                              until=config.max_steps)
        assert not compiled, f"the steps of round {round_index} compiled {dict(compiled)}"
        used_steps.update(line["packed_length"] for line in lines)
    assert len(used_steps) > 1  # the rows did change length: several packed programs ran, none compiled then


def test_programs_compiled_on_threads_are_the_ones_jit_calls():
    """`shapes._Compiler`: 4 programs on 2 threads; a later output's stand-in from the lowering (its sharding fixed by
    the program) or from the compiled program (XLA's choice); the calls after it compile nothing, and give what a
    plain call gives; a lowering's error raised as it is."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    double = jax.jit(lambda x: 2.0 * x, out_shardings=rows)
    total = jax.jit(lambda x, n: x.sum(axis=0) * n, static_argnums=1)
    x = jax.device_put(np.arange(32.0).reshape(16, 2), rows)
    listen, compiler = Compiles(), shapes._Compiler(2)
    fixed = compiler.compile("double", lambda: double.lower(jax.ShapeDtypeStruct((16, 2), np.float32, sharding=rows)))
    assert fixed.sharding == rows  # from the lowering: no wait
    chosen = [compiler.compile(f"total {n}", lambda: total.lower(fixed, n)) for n in (1, 2, 3)]
    assert all(c.shape == (2,) and c.sharding is not None for c in chosen)  # XLA's output sharding, waited for
    names, peaks = compiler.finish()
    assert [n for n, _, _ in names] == ["double", "total 1", "total 2", "total 3"]
    (y, z), compiled = listen.during(lambda: (double(x), [total(double(x), n) for n in (1, 2, 3)]))
    assert not compiled, dict(compiled)
    np.testing.assert_array_equal(np.asarray(z[2]), np.asarray(x).sum(0) * 6.0)
    with pytest.raises(TypeError, match="bad"):
        shapes._Compiler(2).compile("bad", lambda: (_ for _ in ()).throw(TypeError("bad")))


def test_choose_packing_within_listed_shapes_takes_the_cheapest_that_fits():
    """Against a hand count: groups needing 20 and 37 slots (prompt 5 less 1, then 4 rows of 1 + completion)."""
    prompt = np.array([5] * 8)
    completion = np.array([1, 2, 3, 6, 4, 4, 6, 7])  # group needs: 4 + 4 + 12 = 20, 4 + 4 + 21 = 29
    assert trajectory.packed_need(prompt, completion, 4) == 29
    shapes_ = ((0, 0), (24, 2), (32, 2), (64, 1))
    flops = (1.0, 0.0)  # matmuls only: the fewest slots win
    # (24, 2) cannot hold the 29-slot group; (32, 2) runs 64 slots, (64, 1) 64 too but comes later; static runs
    # 2 * 5 + 8 * 8 = 74
    assert trajectory.choose_packing(prompt, completion, 4, 5, 8, flops, packing=None, shapes=shapes_) == (32, 2)
    assert trajectory.choose_packing(prompt, completion, 4, 5, 8, flops, packing=None,
                                     shapes=((0, 0), (24, 2))) == (0, 0)
    with pytest.raises(ValueError, match="fit none of the listed shapes"):
        trajectory.choose_packing(prompt, completion, 4, 5, 8, flops, packing=True, shapes=((24, 2),))


def test_packing_shapes_cover_every_need_on_a_ladder_of_two_an_octave():
    """Prompts of 3-10 tokens, 16 rows in groups of G = 4, T = 8: a group needs 3 - 1 + 4 * 2 = 10 to
    10 - 1 + 4 * 9 = 45 slots. Matmul FLOPs only: one buffer of the 4 groups pads least, so needs of 40 to 180 on
    the ladder 48, 64, 96, 128, 192, of which the longest 2 (the default `train.packed_lengths`) are kept;
    attention only: a buffer a group (K L^2 the fewest), needs of 10 to 45: 16, 24, 32, 48."""
    matmuls, attention = (1.0, 0.0), (0.0, 1.0)
    listed = trajectory.packing_shapes((3, 10), 4, 16, 10, 8, matmuls, packing=True)
    assert listed == ((128, 1), (192, 1))
    assert trajectory.packing_shapes((3, 10), 4, 16, 10, 8, attention, packing=True) == ((32, 4), (48, 4))
    assert trajectory.packing_shapes((3, 10), 4, 16, 10, 8, attention, packing=True, max_lengths=5) == (
        (16, 4), (24, 4), (32, 4), (48, 4))
    # with the static layout weighed, lengths whose shortest rows cost more packed than static are left out: static
    # runs 4 * 10 + 16 * 8 = 168 slots, one buffer of 192 more
    weighed = trajectory.packing_shapes((3, 10), 4, 16, 10, 8, matmuls, packing=None)
    assert weighed == ((0, 0), (96, 1), (128, 1))
    assert trajectory.packing_shapes((3, 10), 4, 16, 10, 8, matmuls, packing=False) == ((0, 0),)
    # T = 4: needs of 40 to 4 * (10 - 1 + 4 * 5) = 116
    assert trajectory.packing_shapes((3, 10), 4, 16, 10, 4, matmuls, packing=True, max_lengths=3) == (
        (64, 1), (96, 1), (128, 1))
    # 2 devices split the rows: a buffer count of 2 or 4, here 2 (2 groups a buffer: needs of 20 to 90)
    assert trajectory.packing_shapes((3, 10), 4, 16, 10, 8, matmuls, packing=True, shards=2) == ((64, 2), (96, 2))
    rng = np.random.default_rng(0)
    for _ in range(50):  # any rows within the ranges fit a listed shape
        prompt, completion = np.repeat(rng.integers(3, 11, 4), 4), rng.integers(1, 9, 16)
        L, K = trajectory.choose_packing(prompt, completion, 4, 10, 8, matmuls, packing=True, shapes=listed)
        assert (L, K) in listed and trajectory.packed_need(prompt, completion, 4, K) <= L


def test_plan_slots_chooses_among_the_listed_slot_counts():
    rng = np.random.default_rng(1)
    for rows, chunks in ((64, 2), (16, 1), (8, 1)):
        choices = stream.slot_choices(rows, chunks)
        plan = stream.SlotPlan()
        for _ in range(6):
            lengths = rng.integers(1, 40, rows)
            plan = stream.plan_slots(plan, lengths, slots=plan.slots, steps=stream.call_steps(lengths, plan.slots,
                                     chunks), seconds=float(rng.uniform(0.5, 2.0)), chunks=chunks)
            assert plan.slots in choices



def test_a_short_run_compiles_a_bounded_set_once_before_its_first_step(tmp_path, monkeypatch, capsys):
    """A whole 4-step `train` (2 rounds of 2 steps, the reference on): the warm-up compiles exactly the programs its
    shapes list, named and counted by hand from them, on 2 threads, and nothing compiles inside a round or a step
    after it (the final save's and export's small programs come after the last step)."""
    config = load_config(None, [f"output_dir={tmp_path}", "max_steps=4", "train.train_batch_size=8",
                                "train.num_generations=4", "train.steps_per_generation=2", "loss.beta=0.04",
                                "sampling.max_completion_length=8", "eval.num_examples=0", "compile_threads=2"])
    listen, warmups, inside = Compiles(), [], collections.Counter()
    listen.listening = True
    compile_ahead = shapes.compile_ahead

    def warm_up(run, state, listed, **kwargs):
        warmups.append((run, listed, compile_ahead(run, state, listed, **kwargs)))
        return warmups[-1][2]

    monkeypatch.setattr(shapes, "compile_ahead", warm_up)
    for name in ("_next_round", "_steps"):  # a round's sampling and scoring, then its optimizer steps
        def counted(*args, _fn=getattr(trainer, name), **kwargs):
            before = len(listen.names)
            try:
                return _fn(*args, **kwargs)
            finally:
                inside.update(listen.names[before:])
        monkeypatch.setattr(trainer, name, counted)
    summary = trainer.train(config, show_progress=False)
    listen.listening = False
    assert summary["steps"] == 4 and not inside, f"compiled inside the rounds or steps: {dict(inside)}"
    (run, listed, warmup), = warmups
    # by hand from the shapes: the sampling key, the static batch's decoding (+ the host-thread chunks' concat), a
    # reference pass per round layout (float32: the sampler's log-probs are the old ones), the round's rows, a
    # step's gather, a step per step layout; + the host's advantages
    layout = lambda L, K: f"{K}x{L}" if L else "static"  # noqa: E731
    chunks = run.programs.decoder.chunks(8, 4)
    expected = (["sample_key", "generate all"] + ["concat"] * (chunks > 1)
                + [f"ref_logps {layout(L, K)}" for L, K in listed.round_packings] + ["rows", "take"]
                + [f"train_step {layout(L, K)}" for L, K in listed.step_packings])
    assert [name for name, _, _ in warmup.programs] == expected and warmup.count == len(expected) + 1
    assert listed.decode_slots == (0,) and len(listed.step_packings) <= 3  # packed_lengths 2, and the static layout
    # the startup line names the slowest three programs, slowest first
    slowest = max(warmup.programs, key=lambda p: p[1] + p[2])
    line = next(x for x in capsys.readouterr().out.splitlines() if "before the first step" in x)
    assert f"on 2 thread(s) (slowest: {slowest[0]} {slowest[1] + slowest[2]:.1f}s, " in line
