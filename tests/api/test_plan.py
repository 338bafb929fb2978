"""`grpo-jax plan` (grpo_jax/api/plan.py, grpo_jax/device/chips.py): the programs compiled for a TPU topology from here and for
the 8 fake CPU devices, their numbers against hand counts from the config, the JSON, the exit code and the errors."""

from __future__ import annotations

import importlib.util
import json

import pytest

from grpo_jax.api import cli
from grpo_jax.api import plan
from grpo_jax.config import load_config
from grpo_jax.device import chips

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu not installed (pip install -e '.[tpu]'): no TPU topology to "
                                  "compile for")

# a Llama-shaped model whose per-chip shards fill TPU tiles (8 x 128) over 4 chips, so XLA's sizes carry no padding:
# hidden 512 (128 a chip), 4 heads and 4 KV heads of 32, MLP 512, vocab 1024, tied embeddings, no biases
V, D, F, L, HD, KV_HD = 1024, 512, 512, 2, 4 * 32, 4 * 32
P, T, ROWS, G = 128, 128, 32, 4
CONFIG_JSON = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=V, hidden_size=D,
                   intermediate_size=F, num_hidden_layers=L, num_attention_heads=4, num_key_value_heads=4, head_dim=32,
                   max_position_embeddings=512, tie_word_embeddings=True, rms_norm_eps=1e-6)
OVERRIDES = [f"data.max_prompt_length={P}", f"sampling.max_completion_length={T}", f"train.num_generations={G}",
             f"train.train_batch_size={ROWS}", "train.gradient_accumulation_steps=2", "loss.beta=0.04",
             "train.share_prompt_prefix=false", "model.scan_layers=true", "model.remat=full", "mesh.data=1",
             "mesh.fsdp=-1"]


def split_and_whole() -> tuple[int, int]:
    """(parameters split over fsdp, parameters every chip holds whole), counted from the architecture: every
    matrix splits its hidden dim D over fsdp (sharding.PARTITION_RULES), the RMSNorm scales are replicated."""
    per_layer = D * HD + 2 * D * KV_HD + HD * D + 3 * D * F  # q, k, v, o; gate, up, down
    return V * D + L * per_layer, L * 2 * D + D  # tied embedding; two norms a layer and the final norm


def train_arguments_per_chip(shards: int) -> int:
    """The train step's argument bytes per chip, by hand: float32 params, Adam's two float32 moments and a float32
    reference copy (beta 0.04), each split or whole as above, the step, key and optimizer counts, and each chip's
    rows of what the step reads of the batch: int32 prompt ids and mask, completion ids, mask and loss mask, float32
    reference log-probs and advantages (jit drops the arguments a program never reads: turns, the sampler's
    log-probs, the truncation flags)."""
    split, whole = split_and_whole()
    state = 4 * (4 * (split // shards + whole)) + 4 + 8 + 2 * 4  # params, mu, nu, ref; step, key, two counts
    rows = ROWS // shards
    batch = rows * (2 * P * 4 + 3 * T * 4 + T * 4 + 4)
    return state + batch


def forward_flops_per_chip(shards: int, causal: bool = False) -> float:
    """The log-prob forward's FLOPs per chip by hand: 2 x the layers' matmul params x every token, the tied
    unembedding (2 x V x D) on the T slots that predict the completion only (the embedding is a lookup), and
    attention's scores and weighted values (2 x 2 x head dims a pair) over each row's whole (P + T)^2 square
    (dense attention), or with ``causal`` its S (S + 1) / 2 visible pairs (a kernel's)."""
    split, _ = split_and_whole()
    S, rows = P + T, ROWS // shards
    pairs = S * (S + 1) // 2 if causal else S * S
    return 2.0 * (split - V * D) * rows * S + 2.0 * V * D * rows * T + rows * L * 2 * 2 * pairs * HD


def model_folder(tmp_path, **changes):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**CONFIG_JSON, **changes}))  # no weights, no tokenizer
    return folder


@needs_libtpu
def test_tpu_plan_matches_hand_counts_and_exits_1_with_a_hint(tmp_path, capsys):
    """v5e:2x2 (4 chips, fsdp 4) from a config.json-only folder, judged against 1 MiB of HBM: exit 1, one hint line
    a phase, and the --json numbers equal to the hand counts (arguments exactly, forward FLOPs within 5 %, the rest
    being norms, softmaxes and RoPE)."""
    out = tmp_path / "plan.json"
    code = cli.main(["plan", "--topology", "v5e:2x2", "--json", str(out), "--hbm-gib", str(1 / 1024),
                     f"model.path={model_folder(tmp_path)}", *OVERRIDES])
    printed = capsys.readouterr().out
    assert code == 1
    result = json.loads(out.read_text())
    # decoding in its own layout on the TPU (`rollout_layout.choose`): its reshard, and the training layout's decode beside
    assert result["fits"] is False and set(result["phases"]) == {*plan.PHASES, plan.COMPARED}
    assert result["layout"].startswith("tensor ")
    group = int(result["layout"].split()[1])  # decoding's rows over its own layout's data groups
    assert result["phases"]["decode_step"]["rows_per_chip"] == ROWS / (4 // group)
    assert result["phases"]["logps"]["rows_per_chip"] == ROWS / 4
    for name, phase in result["phases"].items():
        assert {"peak_bytes", "hbm_bytes", "flops", "bytes_accessed", "est_seconds"} <= set(phase)
        assert phase["hbm_bytes"] == 2 ** 20 and phase["peak_bytes"] > 0.9 * 2 ** 20
        if name != plan.COMPARED:  # not in the round: judged by nothing
            assert sum(line.startswith(f"{name} needs ") for line in printed.splitlines()) == 1
    train = result["phases"]["train_step"]
    # every array is tile-aligned but the few scalars and [rows] vectors, which TPU layouts pad (4 KiB at most each)
    assert 0 <= train["arguments_bytes"] - train_arguments_per_chip(4) <= 8 * 4096
    logps = result["phases"]["logps"]
    # splash attention on the TPU: XLA's count of the rest plus the kernel's causal pairs by hand
    assert logps["flops"] == pytest.approx(forward_flops_per_chip(4, causal=True), rel=0.02)
    # the train step over the round's rows: a forward, a backward of two forwards' cost and, with remat full, what
    # XLA recomputes of the layers' forward (not the unembedding's): 3 to 4 forwards. Measured: 3.71 while the train
    # step held every row on every chip, 3.38 with its rows pinned to their shards, 3.01 without remat
    assert 3.2 < train["flops"] / logps["flops"] < 4.0
    chip = chips.CHIPS["v5e"]
    assert result["tokens_per_round"] == ROWS * (P + T)
    assert result["tokens_per_second_per_chip"] == pytest.approx(ROWS * (P + T) / result["round_seconds"] / 4)
    assert result["mean_completion_length"] == T // 2  # real tokens: rows at half their completion budget
    assert result["real_tokens_per_second_per_chip"] == pytest.approx(ROWS * (P + T // 2) / result["round_seconds"] / 4)
    assert logps["collective_seconds"] > 0 and logps["collectives"] > 0  # fsdp 4 gathers the layers' weights
    assert logps["est_seconds"] == pytest.approx(max(logps["flops"] / (chip.bf16_flops * plan.MFU),
                                                     logps["bytes_accessed"] / (chip.hbm_bandwidth * plan.HBM_EFFICIENCY))
                                                 + logps["collective_seconds"])


def test_local_plan_on_the_cpu_devices_matches_the_hand_count(tmp_path):
    """`--topology local`: the 8 fake CPU devices (fsdp 8), no padding: the train step's arguments are the hand
    count exactly, and the plan fits in the host's memory (no chip table entry: no roofline)."""
    config = load_config(None, [f"model.path={model_folder(tmp_path)}", *OVERRIDES])
    result = plan.plan(config, plan.topology_devices("local"))
    assert result.chips == 8 and result.fits and result.chip is None and result.round_seconds is None
    train = {p.name: p for p in result.phases}["train_step"]
    assert train.arguments == train_arguments_per_chip(8)
    logps = {p.name: p for p in result.phases}["logps"]
    assert logps.flops == pytest.approx(forward_flops_per_chip(8), rel=0.05)


@pytest.mark.parametrize("topology, message", [
    ("v9:2x2", "unknown TPU generation 'v9'"),
    ("v5p", "give the slice's shape"),
])
def test_a_bad_topology_is_one_line(topology, message, capsys):
    assert cli.main(["plan", "--topology", topology, "model.vocab_size=64", "data.max_prompt_length=8"]) == 1
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


@needs_libtpu
def test_a_mesh_that_does_not_divide_the_chips_is_one_line(capsys):
    assert cli.main(["plan", "--topology", "v5e:2x2", "model.vocab_size=64", "data.max_prompt_length=8",
                     "mesh.data=1", "mesh.fsdp=3"]) == 1
    err = capsys.readouterr().err.strip()
    assert "mesh.data*fsdp*tensor*expert" in err and len(err.splitlines()) == 1


def test_missing_libtpu_says_how_to_install_it(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else real(name, *a))
    assert cli.main(["plan", "--topology", "v5p:2x2x1", "model.vocab_size=64", "data.max_prompt_length=8"]) == 1
    assert "pip install -e '.[tpu]'" in capsys.readouterr().err


def test_a_beam_search_is_not_planned_as_plain_sampling():
    import jax

    with pytest.raises(ValueError, match=r"^sampling.num_beams=2: grpo-jax plan models sampling without beams"):
        plan.plan(load_config(None, ["sampling.num_beams=2", "model.vocab_size=64", "data.max_prompt_length=16"]),
                  jax.devices()[:1])


def test_the_plan_needs_the_prompt_length(capsys):
    assert cli.main(["plan", "--topology", "local", "model.vocab_size=64"]) == 1
    assert "set data.max_prompt_length" in capsys.readouterr().err


def test_topology_names_map_to_chips():
    assert chips.topology_chip("v5p:4x4x4") is chips.CHIPS["v5p"]
    assert chips.device_chip("TPU v5 lite") is chips.CHIPS["v5e"]
    assert chips.device_chip("NVIDIA H100 80GB HBM3") is chips.CHIPS["h100"]
    assert chips.device_chip("cpu") is None
    assert plan._accelerator_type("v5p", 64) == "v5p-128" and plan._accelerator_type("v5e", 4) == "v5litepod-4"


@pytest.mark.parametrize("attention, chip, dense", [("auto", "v5p", False), ("auto", None, True),
                                                     ("dense", "v5p", True), ("splash", None, False)])
def test_the_last_hint_blames_attention_scores_only_when_attention_is_dense(attention, chip, dense):
    """A phase too big for no other listed reason: the hint names dense attention's [L, L] scores only where the
    plan's attention is dense (``auto`` on a listed chip runs a kernel whose memory is linear in the sequence)."""
    config = load_config(None, [*OVERRIDES, f"model.attention={attention}", "model.remat=full",
                                "train.logps_chunk_size=1", "train.gradient_accumulation_steps=32"])
    phase = plan.Phase("train_step", 1, 0, 0, 0, 2 ** 40, 0.0, 0.0)
    plan_ = plan.Plan((phase,), chip and chips.CHIPS[chip], 2 ** 30, 4, 4, 1, config)
    line = plan.hint(plan_, phase)
    assert ("dense attention" in line) is dense and "lower sampling.max_completion_length" in line, line


def test_the_plan_tables_model_folders_hold_the_released_shapes(tmp_path):
    """benchmarks/plan_table.py's config.json-only folders read back (transformers, `resolve_config`) as the
    released models: Qwen2.5-7B, Qwen3-30B-A3B's 128 experts (8 a token), Gemma-3-27B's 5 local : 1 global layers."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import plan_table
    from grpo_jax.models import ModelConfig, resolve_config

    def read(name):
        return resolve_config(ModelConfig(path=str(plan_table.write_folder(tmp_path, name))))

    qwen = read("qwen2.5-7b")
    assert (qwen.hidden_size, qwen.num_hidden_layers, qwen.num_attention_heads, qwen.num_key_value_heads,
            qwen.intermediate_size, qwen.vocab_size) == (3584, 28, 28, 4, 18944, 152064)
    moe = read("qwen3-30b-a3b")
    assert (moe.hidden_size, moe.num_hidden_layers, moe.num_attention_heads, moe.num_key_value_heads, moe.head_dim,
            moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size, moe.vocab_size) == (
        2048, 48, 32, 4, 128, 128, 8, 768, 151936)
    gemma = read("gemma-3-27b")
    assert (gemma.hidden_size, gemma.num_hidden_layers, gemma.num_attention_heads, gemma.num_key_value_heads,
            gemma.head_dim, gemma.intermediate_size, gemma.vocab_size, gemma.sliding_window) == (
        5376, 62, 32, 16, 128, 21504, 262208, 1024)
    assert gemma.layer_types.count("full_attention") == 10 and gemma.layer_types[5] == "full_attention"


MOE_FOLDERS = {
    "qwen3_moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_hidden_layers=1,
                      num_experts=8, decoder_sparse_step=1, mlp_only_layers=[]),
    # a dense layer before a routed one, grouped routing, a shared expert, half-head RoPE; routing replay records
    # the routed layer only
    "glm4_moe": dict(model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"], num_hidden_layers=2,
                     first_k_dense_replace=1, n_routed_experts=8, n_group=2, topk_group=1, n_shared_experts=1,
                     routed_scaling_factor=2.0, use_qk_norm=False, attention_bias=True,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
}


@needs_libtpu
@pytest.mark.parametrize("family", list(MOE_FOLDERS))
def test_tpu_plan_compiles_a_mixture_of_experts_over_expert_and_fsdp(tmp_path, family):
    """A tiny qwen3_moe / glm4_moe on v5e:2x2 with its experts over mesh.expert=2 and the rest over fsdp 2: every
    phase compiles for the TPU (the expert-parallel block without axis_index: tests/test_moe.py checks its program
    holds no partition_id, which Qwen3-30B-A3B's train step over expert 8 x fsdp 8 was refused for)."""
    folder = tmp_path / "moe"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(dict(
        vocab_size=V, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512,
        tie_word_embeddings=False, **MOE_FOLDERS[family])))
    overrides = [o for o in OVERRIDES if not o.startswith("mesh.")] + [
        f"model.path={folder}", "mesh.data=1", "mesh.fsdp=2", "mesh.expert=2"] + (
        ["model.routing_replay=true"] if family == "glm4_moe" else [])
    result = plan.plan(load_config(None, overrides), plan.topology_devices("v5e:2x2"), costs=False)
    assert [p.name for p in result.phases if p.name != plan.COMPARED] == list(plan.PHASES)
    assert result.layout.startswith("expert ")  # experts split over the group, attention data parallel
    assert all(p.error is None and p.peak > 0 for p in result.phases)


def two_compile_costs(config, mesh):
    """The former cost pass, a naive reference: every phase compiled again at 1 and at 2 layers with the layers'
    scan unrolled whole and one micro-batch of rows; a layer = two - one, the rest = 2 x one - two, extrapolated to
    the model's depth, the train step times its micro-batches."""
    import dataclasses

    from grpo_jax.api import plan_programs

    tc, model, m = config.train, config.model, config.train.gradient_accumulation_steps
    micro = dataclasses.replace(config, train=dataclasses.replace(
        tc, train_batch_size=tc.train_batch_size // m, gradient_accumulation_steps=1,
        steps_per_generation=tc.steps_per_generation * m))  # the same rows a round, one micro-batch a step

    def cost(layers):
        variant = dataclasses.replace(model, num_hidden_layers=layers, scan_unroll=layers)
        return {name: plan_programs.xla_cost(p.compiled)
                for name, p in plan_programs.programs(micro, mesh, variant, tpu=False).items()}

    one, two, out = cost(1), cost(2), {}
    for name in two:
        outside = [2 * a - b for a, b in zip(one[name], two[name])]
        total = [o + model.num_hidden_layers * (a - o) for o, a in zip(outside, one[name])]
        out[name] = tuple(t * (m if name == "train_step" else 1) for t in total)
    return out


def test_the_cost_pass_equals_the_former_pass_and_the_unrolled_programs(tmp_path):
    """4 layers scanned 2 a trip, 2 micro-batches, on the 8 fake CPU devices: the run's own programs plus one
    recompile at scan_unroll 1 (`plan_programs.costs`) give the FLOPs of the former pass (1- and 2-layer models
    unrolled whole, three compiles a phase) and of the same programs with their 4 layers unrolled (every layer
    counted, no extrapolation). Bytes: the decoder's programs loop over layers in Python, so theirs are the unrolled
    programs' exactly (a decode step's read from its HLO); a scanned program's differ from an unrolled one's by its
    per-trip slices of the stacked layers (a dynamic slice read and its copy written: XLA counts them, the unrolled
    program has none)."""
    import dataclasses

    from grpo_jax.api import plan_programs
    from grpo_jax.device import sharding

    config = plan.resolved(load_config(None, [f"model.path={model_folder(tmp_path, num_hidden_layers=4)}",
                                              *OVERRIDES, "train.num_iterations=2"]))
    m = config.mesh
    mesh = sharding.make_mesh(m.data, m.fsdp, m.tensor, devices=plan.topology_devices("local"), expert=m.expert)
    compiled = plan_programs.programs(config, mesh, config.model, tpu=False)
    new, former = plan_programs.costs(config, mesh, compiled, tpu=False), two_compile_costs(config, mesh)
    unrolled = plan_programs.programs(config, mesh, dataclasses.replace(config.model, scan_unroll=4), tpu=False)
    whole = {name: plan_programs.xla_cost(p.compiled) for name, p in unrolled.items()}
    whole["train_step"] = tuple(2 * x for x in whole["train_step"])  # 2 micro-batches
    assert set(new) == set(plan.PHASES) - {"layout"}  # CPU devices decode in the training layout
    for name in new:
        assert new[name][0] == pytest.approx(former[name][0], rel=5e-3), name
        assert new[name][0] == pytest.approx(whole[name][0], rel=5e-3), name
    assert new["prefill"] == whole["prefill"]
    # a decode step's bytes: its loop's body and the call's one-time work over the round's steps (`hlo.traffic`),
    # which on a CPU (whose cost analysis counts an in-place update as its update, as `hlo` does) add up to XLA's
    # count of the program, the body once and the rest once (within 5 %: 3.8 % measured, XLA's finer rules for
    # some fused operands)
    traffic = unrolled["decode_step"].traffic
    assert new["decode_step"][1] == traffic.per_step + traffic.once / plan_programs.decode_steps(config)
    assert traffic.per_step + traffic.once == pytest.approx(whole["decode_step"][1], rel=0.05)
    for name in ("logps", "train_step"):
        assert new[name][1] == pytest.approx(whole[name][1], rel=0.1), name


@needs_libtpu
def test_a_chunked_unembedding_counts_every_chunk(tmp_path):
    """`train.logps_chunk_size` 1 loops over the rows and XLA counts one trip: the plan adds the others, so the
    log-prob forward's FLOPs equal the unchunked program's (XLA's count of every row), and the train step's exceed
    them by one more unembedding pass (the checkpointed chunks' forward again in the backward), by hand."""
    folder = model_folder(tmp_path)

    def flops(chunk):
        result = plan.plan(load_config(None, [f"model.path={folder}", *OVERRIDES, f"train.logps_chunk_size={chunk}"]),
                           plan.topology_devices("v5e:2x2"), decoding=False)  # the log-prob and train phases
        return {p.name: p.flops for p in result.phases}

    whole, chunked = flops(0), flops(1)
    assert chunked["logps"] == pytest.approx(whole["logps"], rel=2e-3)
    one_pass = 2.0 * V * D * T * ROWS / 4  # every row's completion slots, over 4 chips
    assert chunked["train_step"] == pytest.approx(whole["train_step"] + one_pass, rel=2e-3)


@needs_libtpu
def test_tpu_plan_counts_the_experts_kernel_flops(tmp_path, monkeypatch):
    """On TPU the experts multiply through megablox (`models.grouped`), whose calls XLA counts as 2 m k n over all
    the rows it is given, in one trip of the chunks' loop: over expert 2 x fsdp 2 a chunk's rows are both chips'
    (half of them another chip's experts') and the train step's micro-batch runs 4 chunks a chip. The plan counts
    the work done (`kernel_expert_flops`). A qwen3_moe of K=2 experts of width 128 a token does a dense MLP of
    width 256's work, plus its router (2 x D x E a token a pass) and, in the train step, the chunks' checkpointed
    forward again: its log-prob and train FLOPs equal that dense model's, XLA's own count, plus those."""
    from grpo_jax.models import moe

    monkeypatch.setattr(moe, "CHUNK_ASSIGNMENTS", 1024)  # 256 tokens a chunk: the kernel's path at these sizes
    Dm, E, K, Fe = 256, 8, 2, 128
    shape = dict(vocab_size=V, hidden_size=Dm, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=64, max_position_embeddings=512, tie_word_embeddings=False)
    dense = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], intermediate_size=K * Fe, **shape)
    sparse = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], intermediate_size=512,
                  moe_intermediate_size=Fe, num_experts=E, num_experts_per_tok=K, norm_topk_prob=True,
                  decoder_sparse_step=1, mlp_only_layers=[], **shape)
    flops = {}
    for name, config_json in (("dense", dense), ("sparse", sparse)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config_json))
        overrides = [o for o in OVERRIDES if not o.startswith("mesh.")] + [
            f"model.path={folder}", "mesh.data=1", f"mesh.fsdp={2 if name == 'sparse' else 4}",
            f"mesh.expert={2 if name == 'sparse' else 1}"]
        config = load_config(None, overrides)
        result = plan.plan(config, plan.topology_devices("v5e:2x2"), decoding=False)  # the log-prob and train phases
        flops[name] = {p.name: p.flops for p in result.phases}
    tokens = {"logps": config.train.generation_batch_size * (P + T) / 4, "train_step": ROWS * (P + T) / 4}  # a chip
    router, mlp = 2.0 * Dm * E, 6.0 * Dm * K * Fe  # a token's
    want = {"logps": flops["dense"]["logps"] + router * tokens["logps"],
            # remat full: forward, again, the backward's two; the chunks' forward once more
            "train_step": flops["dense"]["train_step"] + (4 * router + mlp) * tokens["train_step"]}
    for name in want:
        assert flops["sparse"][name] == pytest.approx(want[name], rel=0.02), name


@needs_libtpu
def test_the_paged_kernels_kv_reads_are_counted_by_hand():
    """XLA's cost analysis leaves a Mosaic paged-attention call's pool operands out of its byte total, so the plan
    adds them (`plan_programs.paged_kernel_bytes`): on v5p:2x2x1 in tensor 2 x data 2, a Gemma-3-like model (6
    layers, 1 of them full attention, 8 key/value heads of 128) reads a chip's 64 / 2 rows x 1 full layer x
    (P + T / 2) tokens x 2 x 4 heads x 128 x 2 bytes a step; nothing for a head dim of 64 (the dense read-back, which
    XLA counts), the contiguous cache or a CPU mesh."""
    import dataclasses

    from grpo_jax.api import plan_programs
    from grpo_jax.config.model import ModelConfig
    from grpo_jax.device import rollout_layout, sharding

    types = ("sliding_attention",) * 5 + ("full_attention",)
    model = ModelConfig(vocab_size=1024, hidden_size=512, intermediate_size=512, num_hidden_layers=6,
                        num_attention_heads=8, num_key_value_heads=8, head_dim=128, dtype="bfloat16",
                        sliding_window=512, layer_types=types)
    config = load_config(None, [f"data.max_prompt_length={P}", f"sampling.max_completion_length={T}",
                                "train.num_generations=4", "train.train_batch_size=64"])
    config = dataclasses.replace(config, model=model)
    mesh = sharding.make_mesh(1, -1, 1, devices=plan.topology_devices("v5p:2x2x1"))
    decode_mesh = rollout_layout.rollout_mesh(mesh, rollout_layout.Layout(2, "tensor", "test"))
    rows = config.train.generation_batch_size // 2
    assert plan_programs.paged_kernel_bytes(config, model, decode_mesh) == rows * 1 * (P + T / 2) * 2 * 4 * 128 * 2
    assert plan_programs.paged_kernel_bytes(config, dataclasses.replace(model, head_dim=64), decode_mesh) == 0
    contiguous = dataclasses.replace(config, sampling=dataclasses.replace(config.sampling, kv_cache="contiguous"))
    assert plan_programs.paged_kernel_bytes(contiguous, model, decode_mesh) == 0
    assert plan_programs.paged_kernel_bytes(config, model, sharding.make_mesh(1, -1, 1)) == 0
