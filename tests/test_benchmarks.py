"""Smoke tests of the benchmark scripts (no timing asserts): model folders, FLOP counts, one timed step each."""
import dataclasses
import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import grpo_step  # noqa: E402
import lora_decode  # noqa: E402
import make_models  # noqa: E402

from grpo_jax.models import ModelConfig, init_model  # noqa: E402


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    make_models.build_model("tiny", out / "tiny")
    make_models.write_prompts(out / "prompts.jsonl", n=64)
    return out


def test_model_folder_loads_in_transformers(tiny_folder):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_folder / "tiny")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_folder / "tiny")
    c = model.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.intermediate_size, c.vocab_size, c.tie_word_embeddings) == (128, 2, 4, 2, 512, 128, True)
    assert len(tokenizer) == 128 and tokenizer.eos_token_id == 0 and tokenizer.pad_token_id == 1
    row = json.loads((tiny_folder / "prompts.jsonl").read_text().splitlines()[0])
    ids = tokenizer(row["prompt"]).input_ids
    assert len(ids) == 16 and tokenizer.decode(ids) == row["prompt"]
    assert row["answer"] == row["prompt"][:-1][::-1]


def test_matmul_weight_count_matches_the_model_kernels():
    arch = make_models.qwen2_config("tiny").to_dict()
    config = ModelConfig(vocab_size=arch["vocab_size"], hidden_size=128, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    _, params = init_model(config, seed=0)
    leaves = jax.tree_util.tree_leaves_with_path(params)
    # matmul operands: every kernel, and the tied embedding as the unembedding (norm weights are not)
    expected = sum(int(np.prod(x.shape)) for path, x in leaves
                   if any(name in jax.tree_util.keystr(path) for name in ("kernel", "embedding")))
    assert grpo_step.step_flops(arch, grpo_step.Setting())["params_matmul"] == expected


def test_step_flops_hand_computed():
    arch = dict(hidden_size=4, num_hidden_layers=1, intermediate_size=8, vocab_size=10, num_attention_heads=2,
                num_key_value_heads=1)
    s = grpo_step.Setting(prompts_per_step=1, num_generations=2, max_completion_length=1, prompt_length=1)
    # weights: q 4x4 + o 4x4 + k 4x2 + v 4x2 + mlp 3x4x8 = 144; attention 4*L*H*Dh*(1+2) = 48 per row
    full = 2 * (2 * (144 * 2 + 4 * 10 * 1) + 48)
    flops = grpo_step.step_flops(arch, s)
    assert flops["logps"] == full and flops["update"] == 3 * full
    assert flops["sample"] == 2 * (2 * (144 * 2 + 4 * 10 * 2) + 48)


def test_grpo_jax_and_trl_one_step_profiled(tiny_folder, tmp_path):
    """Both implementations, one timed step each; grpo_jax with a config override and one more round profiled."""
    pytest.importorskip("trl")
    import digest

    out = tmp_path / "result.json"
    result = grpo_step.main(["--model", str(tiny_folder / "tiny"), "--steps", "1", "--warmup", "1",
                             "--num-generations", "4", "--max-completion-length", "16",
                             "--set", "model.scan_layers=true", "--profile", str(tmp_path / "trace"),
                             "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    for impl in ("grpo_jax", "trl"):
        r = result[impl]
        assert r["steps_timed"] == 1
        for key in ("step_s", "sample_s", "logps_s", "update_s", "completion_tokens_per_s",
                    "matmul_peak_flops_per_s", "fraction_of_matmul_peak"):
            assert r[key] > 0, (impl, key)
        assert r["score_s"] >= 0 and r["compile_s"] >= 0
        assert 0 < r["mean_completion_tokens"] <= 4 * 4 * 16
    ratios = result["ratio_grpo_jax_over_trl"]
    assert set(ratios) == {"step", "sample", "score", "logps", "update", "step_per_completion_token"}
    ours, trl = result["grpo_jax"], result["trl"]
    assert ratios["step"] == ours["step_s"] / trl["step_s"]
    assert ratios["step_per_completion_token"] == pytest.approx(
        ours["step_s"] * trl["mean_completion_tokens"] / (trl["step_s"] * ours["mean_completion_tokens"]))
    r = result["grpo_jax"]
    assert r["overrides"] == ["model.scan_layers=true"]
    modules = r["profile"]["per_module_ms"]
    # the programs by their functions' names (programs.jit_decoder: a static batch decodes in generate)
    assert {"jit_generate", "jit_train_step"} <= set(modules) and r["profile"]["per_kind_ms"]["matmul"] > 0
    text = digest.digest(out)
    assert f"step_s: {r['step_s']}" in text and "top ops of jit_train_step" in text
    assert "missing" in digest.digest(tmp_path / "absent.json")


def test_trace_summary_self_times_and_kinds(tmp_path, monkeypatch):
    import gzip

    import trace_summary

    def op(ts, dur, op, name=None, tid=1, pid=1, module="jit_step"):
        return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name or op,
                "args": {"hlo_op": op, "hlo_module": module}}
    events = [  # a while op holding a dot and a copy; a fusion on another thread; host noise without hlo_op
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        op(0, 100, "while.3"), op(10, 30, "dot.1"), op(50, 20, "copy.2"), op(120, 5, "dot.1"),
        op(0, 40, "loop_fusion", tid=2), {"ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 999, "name": "Python"},
    ]
    path = tmp_path / "perfetto_trace.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    s = trace_summary.summarize(tmp_path)
    assert s["events"] == 5 and s["where"] == "host XLA threads" and not s["truncated"]
    assert s["per_kind_ms"] == pytest.approx({"matmul": 0.035, "copy": 0.02, "other": 0.09})  # while: 100-30-20
    assert s["total_ms"] == pytest.approx(0.145) and s["per_module_kind_ms"]["jit_step"] == s["per_kind_ms"]
    top = {o["op"]: (o["ms"], o["count"]) for o in s["top_ops"]["jit_step"]}
    assert top["dot.1"] == (pytest.approx(0.035), 2) and top["while.3"] == (pytest.approx(0.05), 1)
    # a device process: only its kernels count (the host's launches of them are not device time)
    events += [{"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
               op(5, 7, "fusion.9", name="nvjet_tst_128x64", pid=2, tid=7)]
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    s = trace_summary.summarize(path)
    assert s["where"] == "device streams" and s["per_kind_ms"] == pytest.approx({"matmul": 0.007})
    # a trace at the profiler's event cap lost its later ops: said, not summed silently
    monkeypatch.setattr(trace_summary, "TRACE_EVENT_CAP", len([e for e in events if e["ph"] == "X"]))
    s = trace_summary.summarize(path)
    assert s["truncated"] and "TRUNCATED" in trace_summary.format_summary(s)


def test_trace_summary_timeline_busy_time_and_overlap(tmp_path):
    import gzip

    import trace_summary

    def op(ts, dur, module, device, tid=1):
        return {"ph": "X", "pid": 1, "tid": tid, "ts": ts, "dur": dur, "name": "fusion",
                "args": {"hlo_op": "fusion", "hlo_module": module, "device_ordinal": device}}
    events = [  # device 0 samples twice; device 1 trains once (a nested op, then a second thread overlapping it)
        op(0, 100, "jit_advance", "0"), op(150, 50, "jit_generate", "0"), op(50, 70, "jit_step", "1"),
        op(60, 10, "jit_step", "1"), op(110, 30, "jit_step", "1", tid=2), op(300, 5, "jit_other", "2"),
        {"ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 999, "name": "Python"}]
    (tmp_path / "perfetto_trace.json.gz").write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    t = trace_summary.timeline(tmp_path, {"sample": ("advance", "generate"), "train": ("step",)})
    assert t["wall_ms"] == pytest.approx(0.305)
    assert t["busy_ms"] == pytest.approx({"0": 0.15, "1": 0.09, "2": 0.005})  # 50..140 on device 1
    assert t["phase_busy_ms"] == {"sample": {"0": pytest.approx(0.15)}, "train": {"1": pytest.approx(0.09)}}
    assert t["phase_wall_ms"] == pytest.approx({"sample": 0.15, "train": 0.09})
    assert t["overlap_ms"] == {"sample&train": pytest.approx(0.05)}  # 50..100
    # from the second train execution on (one run_id each; the nested op and the second thread share the first's)
    events[3]["args"]["run_id"] = events[4]["args"]["run_id"] = "9"
    (tmp_path / "perfetto_trace.json.gz").write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    t = trace_summary.timeline(tmp_path, {"sample": ("advance", "generate"), "train": ("step",)}, ("train", 1))
    assert t["busy_ms"] == pytest.approx({"0": 0.09, "1": 0.08, "2": 0.005})  # 60..140 on device 1
    assert t["overlap_ms"] == {"sample&train": pytest.approx(0.04)} and t["wall_ms"] == pytest.approx(0.245)


def test_lora_decode_merged_and_on_the_fly_sample_the_same_tokens():
    result = lora_decode.main(["--size", "tiny", "--rank", "4", "--rows", "2", "--prompt-length", "4",
                               "--new-tokens", "4", "--repeats", "1"])
    assert result["same_tokens_fraction"] == 1.0
    assert result["merged_per_call_tokens_per_s"] > 0 and result["on_the_fly_tokens_per_s"] > 0


def test_rollout_lengths_static_and_continuous_sample_the_same_lengths():
    import rollout_lengths

    result = rollout_lengths.main(["--size", "tiny", "--prompts", "2", "--generations", "4", "--prompt-length", "4",
                                   "--prompt-length-max", "8", "--max-completion-length", "24", "--vocab", "16",
                                   "--slots", "0,2", "--score-ms", "5"])
    static, continuous = result["settings"]
    # streamed scoring: a static batch hands over every row at once (nothing hidden), slots group by group
    assert continuous["streamed_sample_and_score_s"] > 0 and continuous["score_s"] == static["score_s"] == 0.04
    assert static["useful_tokens"] == continuous["useful_tokens"] > 0  # the same rows (the script checks the masks)
    assert continuous["padding_fraction"] < static["padding_fraction"]
    assert continuous["decode_steps"] > static["decode_steps"]


def test_packed_update_runs_fewer_tokens_for_the_same_loss():
    import packed_update

    result = packed_update.main(["--size", "tiny", "--prompts", "2", "--generations", "4", "--prompt-length", "4",
                                 "--prompt-length-max", "16", "--max-completion-length", "32",
                                 "--mean-completion", "6", "--repeats", "1"])
    padded, packed = result["padded"], result["packed"]
    # the first step of each layout starts from the same state: the same loss (later steps have moved it)
    np.testing.assert_allclose(packed["first_loss"], padded["first_loss"], rtol=1e-5, atol=1e-6)
    slots = packed["packed_length"] * packed["packed_buffers"]
    assert result["real_tokens"] <= slots < result["padded_tokens"]
    one = packed_update.main(["--size", "tiny", "--prompts", "2", "--generations", "4", "--prompt-length", "4",
                              "--prompt-length-max", "16", "--max-completion-length", "32", "--mean-completion", "6",
                              "--repeats", "1", "--layouts", "packed", "--layers", "1", "--attention", "dense"])
    assert (one["layers"], one["attention"], one["packed_over_padded_step"]) == (1, "dense", None)
    assert "padded" not in one and one["packed"]["packed_length"] == packed["packed_length"]


def test_tool_rounds_grpo_jax_and_trl_one_round(tmp_path):
    """Multi-turn rounds with a slow tool, both libraries, one timed round each: the tool is called and counted."""
    pytest.importorskip("trl")
    import tool_rounds

    out = tmp_path / "result.json"
    result = tool_rounds.main(["--size", "tiny", "--warmup", "1", "--rounds", "1", "--latency", "0.01",
                               "--max-completion-length", "16", "--async-tool", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    for impl in ("grpo_jax", "trl"):
        r = result[impl]
        assert len(r["rounds"]) == 1 and r["round_s"] > 0 and r["sample_s"] > 0, impl
        assert 1 <= r["turns_per_rollout"] <= 1 + 3 and 0 <= r["idle_fraction"] < 1, impl
        assert r["calls"] > 0 and r["tool_call_s"] >= 0.01 * r["calls"], impl  # a random model calls about half
    assert result["grpo_jax"]["chunks"] >= 1 and result["grpo_jax"]["tool_wait_s"] >= 0
    assert result["ratio_grpo_jax_over_trl"]["round"] == result["grpo_jax"]["round_s"] / result["trl"]["round_s"]


def _const_phases(**overrides):
    import async_sim

    fixed, row = overrides.pop("decode_fixed_s", 0.0), overrides.pop("decode_row_s", 0.0)
    fields = dict(decode_rows=(1, 2), decode_step_s=(fixed + row, fixed + 2 * row), prefill_row_s=0.0,
                  update_fixed_s=0.0, update_token_s=0.0)
    return async_sim.Phases(**{**fields, **overrides})


def test_async_sim_synchronous_rounds_are_sample_reward_update_in_turn():
    """k = 0, colocated: every round's three phases one after the other, each from the formulas by hand."""
    import async_sim

    phases = _const_phases(decode_fixed_s=0.01, decode_row_s=0.001, prefill_row_s=0.002, update_fixed_s=0.5,
                           update_token_s=1e-4, reward_row_s=0.003, sync_s=0.2)
    work = async_sim.Workload(rows_per_device=16, generations=4, rounds=8, mean_completion=50, max_completion=120)
    timeline = async_sim.simulate(phases, work, 4, 0)
    completion, prompt = async_sim.draw_lengths(work, 4)
    total = 0.0
    for r in range(8):
        sample = 0.002 * 16 + completion[r].max() * (0.01 + 0.001 * 16)
        tokens = max((completion[r] + prompt[r])[16 * d:16 * (d + 1)].sum() for d in range(4))
        total += sample + 0.003 * 16 + 0.5 + 1e-4 * tokens + 0.2
    np.testing.assert_allclose(timeline.update[-1, 1], total, rtol=1e-12)
    assert (timeline.staleness == 0).all() and timeline.round_s(0) == pytest.approx(total / 8)
    # prompts: one a group, split evenly over its rows; lengths the truncated geometric's mean (1 - q^M) / p
    assert (prompt.reshape(8, -1, 4) == prompt[:, ::4, None]).all() and 64 / 4 <= prompt.min() <= prompt.max() <= 128
    many = async_sim.draw_lengths(async_sim.Workload(rows_per_device=4096, rounds=4, max_completion=300), 4)[0]
    p = 1 / 256
    np.testing.assert_allclose(many.mean(), (1 - (1 - p) ** 300) / p, rtol=0.02)


def test_async_sim_colocated_staleness_hides_only_host_time():
    """Constant lengths: a colocated round takes max(sample + update, reward) for k >= 1: the host scores meanwhile."""
    import async_sim

    work = async_sim.Workload(rows_per_device=8, generations=8, prompt_lengths=(16, 16), mean_completion=1,
                              max_completion=1, rounds=40)
    sample, update = 8 * 0.01, 0.3 + 8 * 3 * 0.01  # 8 rows of 1 token decoded + 2 prompt tokens each
    for reward_row in (0.02, 0.1):  # the host hidden behind the devices, then the host the bottleneck
        phases = _const_phases(prefill_row_s=0.01, update_fixed_s=0.3, update_token_s=0.01, reward_row_s=reward_row)
        result = async_sim.speedups(phases, work, 8, [0, 1, 4])["by_staleness"]
        sync, hidden = sample + 8 * reward_row + update, max(sample + update, 8 * reward_row)
        assert result["0"]["colocated_speedup"] == pytest.approx(1.0)
        for k in (1, 4):
            assert result[str(k)]["colocated_speedup"] == pytest.approx(sync / hidden), (reward_row, k)


def test_async_sim_split_pipeline_of_two_equal_stages():
    """Sampling on half the devices as long as the update on the other half: k >= 1 overlaps them, so R rounds take
    R + 1 stage times instead of 2R (-> 2x); against the colocated round on all devices (each phase half as long)
    the pipeline only breaks even, as linear costs leave no idle time to fill."""
    import async_sim

    work = async_sim.Workload(rows_per_device=8, generations=8, prompt_lengths=(8, 8), mean_completion=1,
                              max_completion=1, rounds=64)
    # 8 devices, 4 sample 16 rows each (16 x 1 s), 4 train 16 rows of 1 + 1 tokens each (32 x 0.5 s)
    phases = _const_phases(decode_row_s=1.0, update_token_s=0.5)
    serial, pipelined = (async_sim.simulate(phases, work, 8, k, rollout_devices=4) for k in (0, 1))
    assert serial.update[-1, 1] == pytest.approx(2 * 64 * 16.0)
    assert pipelined.update[-1, 1] == pytest.approx(65 * 16.0)
    assert serial.round_s(0) / pipelined.round_s(0) == pytest.approx(2 * 64 / 65)
    assert pipelined.round_s(16) == pytest.approx(16.0) and (pipelined.staleness[1:] == 1).all()
    assert async_sim.simulate(phases, work, 8, 0).round_s(16) == pytest.approx(8.0 + 8.0)  # colocated
    # a broadcast after each update delays the next round's params: round r starts once update r - k - 1 is there
    slow = async_sim.simulate(dataclasses.replace(phases, sync_s=3.0), work, 8, 2, rollout_devices=4)
    assert (slow.sample[3:, 0] >= slow.update[:-3, 1] + 3.0 - 1e-9).all()
    assert slow.round_s(16) == pytest.approx(16.0 + 3.0)  # the train devices' all-reduce (4 of them) too
    assert async_sim.simulate(phases, work, 8, 1, 4).update.tolist() == pipelined.update.tolist()  # deterministic


def test_async_sim_command_line(tmp_path):
    import async_sim

    fields = dict(decode_rows=[8, 64, 128], decode_step_s=[0.012, 0.025, 0.06], prefill_row_s=0.005, update_fixed_s=0.1,
                  update_token_s=2e-5, reward_row_s=1e-4, sync_s=0.01, max_rows_per_device=256)
    (tmp_path / "phases.json").write_text(json.dumps({"phases": fields}))
    result = async_sim.main(["--phases", str(tmp_path / "phases.json"), "--devices", "8,16", "--rounds", "12",
                             "--staleness", "0,2", "--out", str(tmp_path / "out.json")])
    assert json.loads((tmp_path / "out.json").read_text()) == json.loads(json.dumps(result))
    for row in result["table"]:
        assert row["by_staleness"]["0"]["colocated_speedup"] == pytest.approx(1.0)
        assert row["by_staleness"]["2"]["split_speedup"] > row["by_staleness"]["0"]["split_speedup"]
        assert row["devices"] * 64 / row["by_staleness"]["2"]["split_rollout_devices"] <= 256


def test_async_sim_decode_step_joins_the_measured_points():
    import async_sim

    phases = async_sim.Phases(decode_rows=(8, 64, 128), decode_step_s=(0.01, 0.02, 0.06), prefill_row_s=0.0,
                              update_fixed_s=0.0, update_token_s=0.0)
    steps = [async_sim.step_s(phases, rows) for rows in (8, 36, 64, 96, 128, 256, 4)]
    assert steps == pytest.approx([0.01, 0.015, 0.02, 0.04, 0.06, 0.14, 0.01 - 4 * 0.01 / 56])


def test_async_curves_reward_bins_and_staleness(tmp_path):
    import async_curves

    lines = [{"step": s, "reward": float(s), "async/staleness": s % 2, "step_time": 10.0 if s == 1 else s / 10,
              "completions/mean_length": 2.0 * s} for s in range(1, 8)] + [{"step": 7, "x": 1}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(line) for line in lines))
    summary = {"eval_before": {"greedy/exact_match": 0.0}, "eval_after": {"greedy/exact_match": 0.5},
               "reward_first_10pct": 1.0, "reward_last_10pct": 7.0}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    (tmp_path / "config.yaml").write_text("train:\n  train_batch_size: 4\n")
    result = async_curves.curve(tmp_path, 3)
    assert result["reward_every"] == [2.0, 5.0, 7.0] and result["steps"] == 7  # the eval-only line is no step
    assert result["staleness_mean"] == pytest.approx(4 / 7) and result["eval_after"] == summary["eval_after"]
    assert result["median_step_s"] == pytest.approx(0.45) and result["mean_completion_length"] == 8.0
    tokens, seconds = sum(4 * 2.0 * s for s in range(2, 8)), sum(s / 10 for s in range(2, 8))
    assert result["tokens_per_s"] == pytest.approx(tokens / seconds)


def test_async_curves_long_task_rows_and_overrides(tmp_path):
    import async_curves
    from grpo_jax.config import load_config
    from transformers import AutoTokenizer

    overrides = async_curves.long_task(tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "sort_train.jsonl").read_text().splitlines()]
    assert len(rows) == 2000 and len((tmp_path / "sort_test.jsonl").read_text().splitlines()) == 200
    for row in rows:
        digits = row["prompt"][:-1]
        assert row["prompt"][-1] == "^" and 128 <= len(digits) <= 384 and set(digits) <= {"0", "1"}
        assert row["answer"] == "0" * digits.count("0") + "1" * digits.count("1")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tokenizer")
    assert len(tokenizer(rows[0]["prompt"])["input_ids"]) == len(rows[0]["prompt"])  # one token a character
    config = load_config(None, overrides)
    assert config.data.path == str(tmp_path / "sort_train.jsonl") and config.sampling.max_completion_length == 512
