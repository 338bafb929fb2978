"""`grpo-jax plan` for released model shapes on 64-chip TPU slices: the markdown table of benchmarks/RESULTS.md.

Writes config.json-only folders (no weights, no tokenizer) for Qwen2.5-7B, Qwen3-30B-A3B (mixture of experts, the
experts split over `mesh.expert`) and Gemma-3-27B (text), then plans a GRPO run of each (16 completions per
prompt, 16 prompts a step: 256 rows, one row per chip per micro-batch, 4 decode rows per chip; remat full, scanned
layers one per iteration (`--scan-unroll`), bf16 compute over float32 params, beta 0.04 with a bf16 reference) on
v5p:4x4x4 and v6e:8x8 at 1k prompt + 7k and 15k completion tokens. Nothing is allocated; every program compiles here
with libtpu (`pip install -e '.[tpu]'`). One row per plan: the peak of each phase per chip, the HBM, the roofline
round and tokens/s/chip (padded, and real at half the completion budget); a comment line after it: each phase's temporaries.

    python benchmarks/plan_table.py                 # every row (compiles for minutes each)
    python benchmarks/plan_table.py --quick         # Qwen2.5-7B on v5p:4x4x4 at 1k + 7k only
    python benchmarks/plan_table.py --models qwen2.5-7b --topologies v6e:8x8 --completions 15360 --json out.json
    python benchmarks/plan_table.py --models gemma-3-27b --topologies v6e:8x8 --completions 7168 --lora none \
        --memory-only --layers 6 --scan-unroll 2    # what grows with depth: compare --layers 12
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CPU runs the script; libtpu only compiles

from grpo_jax.api import plan  # noqa: E402
from grpo_jax.device.chips import GIB  # noqa: E402
from grpo_jax.config import load_config  # noqa: E402

# the released config.json's architecture fields (Hugging Face hub: Qwen/Qwen2.5-7B, Qwen/Qwen3-30B-A3B,
# google/gemma-3-27b-it's text_config)
MODELS = {
    "qwen2.5-7b": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=3584,
                       intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       vocab_size=152064, max_position_embeddings=131072, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=False, hidden_act="silu"),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=2048,
                          intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                          num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                          tie_word_embeddings=False, hidden_act="silu"),
    "gemma-3-27b": dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], hidden_size=5376,
                        intermediate_size=21504, num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=16,
                        head_dim=128, vocab_size=262208, sliding_window=1024,
                        layer_types=["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(62)],
                        rope_theta=1000000.0, rope_local_base_freq=10000.0,
                        rope_scaling={"rope_type": "linear", "factor": 8.0}, query_pre_attn_scalar=168,
                        max_position_embeddings=131072, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
                        tie_word_embeddings=True),
}
TOPOLOGIES = ("v5p:4x4x4", "v6e:8x8")
PROMPT, COMPLETIONS = 1024, (7168, 15360)
ROWS, GROUP = 256, 16  # a step's rows (16 prompts x 16 completions): 4 a chip, one a chip per micro-batch


def write_folder(root: Path, name: str, layers: int | None = None) -> Path:
    """A model folder holding only config.json (what `grpo-jax plan` reads); ``layers``: its first that many decoder
    layers only (a memory diagnosis: what grows with the layers, what does not)."""
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    config = dict(MODELS[name])
    if layers is not None:
        config["num_hidden_layers"] = layers
        if "layer_types" in config:
            config["layer_types"] = config["layer_types"][:layers]
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}, indent=1))
    return folder


def overrides(folder: Path, name: str, completion: int, lora: bool, expert: int = 8, unroll: int = 1,
              rollout_tensor: int = 0) -> list[str]:
    """The run's config: GRPO at the users' lengths, the state split over every chip (experts over `expert`),
    decoding in the layout `rollout_tensor` names (`mesh.rollout_tensor`)."""
    mesh = ["mesh.data=1", "mesh.fsdp=-1", f"mesh.rollout_tensor={rollout_tensor}"] + (
        [f"mesh.expert={expert}"] if "a3b" in name else [])
    # LoRA's reference is the frozen base itself: no bf16 copy to cast
    lora_keys = ["model.lora.rank=16", "model.lora.alpha=32"] if lora else ["train.ref_param_dtype=bfloat16"]
    # one layer per scan iteration: the backward pass then holds one layer's MLP intermediates, not two
    return [f"model.path={folder}", "model.dtype=bfloat16", "model.param_dtype=float32", "model.remat=full",
            "model.scan_layers=true", f"model.scan_unroll={unroll}", f"data.max_prompt_length={PROMPT}",
            f"sampling.max_completion_length={completion}",
            f"train.num_generations={GROUP}", f"train.train_batch_size={ROWS}", "train.gradient_accumulation_steps=4",
            "train.logps_chunk_size=1", "loss.beta=0.04", *mesh, *lora_keys]


def whole_depth_layout(root: Path, name: str, completion: int, lora: bool, args, devices) -> int:
    """The decoding group a run of the whole model would choose (`rollout_layout.choose`; -1: the training layout),
    so that a plan of its first layers (``--layers``) decodes as the whole model's run would."""
    from grpo_jax.algo.state import abstract_state, optimizer_from_config
    from grpo_jax.api import plan_programs
    from grpo_jax.device import sharding
    from grpo_jax.device.chips import device_chip

    folder = write_folder(root / "whole", name, None)
    config = plan.resolved(load_config(None, overrides(folder, name, completion, lora, args.expert,
                                                       args.scan_unroll)))
    tc, m = config.train, config.mesh
    mesh = sharding.make_mesh(m.data, m.fsdp, m.tensor, devices=devices, expert=m.expert)
    _, optimizer = optimizer_from_config(tc, config.max_steps)
    shapes = abstract_state(config.model, optimizer, with_reference=config.loss.beta != 0.0,
                            ref_param_dtype=tc.ref_param_dtype)
    layout = plan_programs.decode_layout(config, mesh, config.model, device_chip(devices[0].device_kind), shapes,
                                         sharding.state_shardings(mesh, shapes))
    print(f"<!-- {name} {devices[0].device_kind} {completion}: the whole model decodes in "
          f"{'the training layout' if layout is None else layout.reason} -->", flush=True)
    return -1 if layout is None else layout.group


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one plan: qwen2.5-7b, v5p:4x4x4, 1k + 7k, full FT")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--topologies", nargs="+", default=list(TOPOLOGIES))
    parser.add_argument("--completions", nargs="+", type=int, default=list(COMPLETIONS))
    parser.add_argument("--lora", choices=("none", "only", "both"), default="both",
                        help="LoRA rows (rank 16): none, only, or both (LoRA for the first model only)")
    parser.add_argument("--expert", type=int, default=8,
                        help="the mixture of experts' mesh.expert (the rest of the chips: fsdp); 1: experts over fsdp")
    parser.add_argument("--scan-unroll", type=int, default=1,
                        help="model.scan_unroll: decoder layers per scan iteration (2 in the RESULTS.md rows planned "
                        "before 2026-11-29 03:00)")
    parser.add_argument("--layers", type=int, default=None,
                        help="plan the model's first N decoder layers only (how the peaks grow with depth)")
    parser.add_argument("--memory-only", action="store_true",
                        help="no FLOPs or bytes (no roofline): about half the compiles")
    parser.add_argument("--rollout-tensor", type=int, default=0,
                        help="mesh.rollout_tensor: 0 the layout a run chooses for the model's whole depth (also "
                        "under --layers), -1 the training layout, n groups of n chips")
    parser.add_argument("--json", help="also write every plan's `grpo-jax plan --json` object here")
    args = parser.parse_args()
    if args.quick:
        args.models, args.topologies, args.completions, args.lora = ["qwen2.5-7b"], ["v5p:4x4x4"], [7168], "none"
    root = Path(tempfile.mkdtemp(prefix="plan_models_"))
    print("| model | training | topology | prompt + completion | prefill / decode / logps / train peak GiB per chip "
          "| HBM GiB | fits | round s (roofline) | tokens/s/chip (padded / real at half the completion) | compile s |\n|" + "---|" * 10)
    results = []
    for name in args.models:
        folder = write_folder(root, name, args.layers)
        variants = {"none": [False], "only": [True], "both": [False, True] if name == args.models[0] else [False]}
        for topology in args.topologies:
            devices = plan.topology_devices(topology)
            for completion in args.completions:
                for lora in variants[args.lora]:
                    timer = time.perf_counter()
                    try:
                        tensor = args.rollout_tensor or whole_depth_layout(root, name, completion, lora, args,
                                                                            devices)
                        config = load_config(None, overrides(folder, name, completion, lora, args.expert,
                                                             args.scan_unroll, tensor))
                        p = plan.plan(config, devices, costs=not args.memory_only)
                    except Exception as e:  # noqa: BLE001 - a row that cannot be planned says why and the rest go on
                        print(f"| {name} | {'LoRA 16' if lora else 'full'} | {topology} | {PROMPT} + {completion} | "
                              f"error: {str(e).splitlines()[0][:200]} | | | | | |", flush=True)
                        continue
                    seconds = time.perf_counter() - timer
                    peaks = " / ".join(f"{'≥' if ph.error else ''}{ph.peak / GIB:.1f}" for ph in p.phases)
                    seconds_round = "-" if p.round_seconds is None else f"{p.round_seconds:.1f}"
                    rate = "-" if p.round_seconds is None else (f"{p.tokens_per_second_per_chip:,.0f} / "
                                                                 f"{p.real_tokens_per_second_per_chip:,.0f}")
                    print(f"| {name} | {'LoRA 16' if lora else 'full'} | {topology} | {PROMPT} + {completion} | "
                          f"{peaks} | {p.hbm_bytes / GIB:.0f} | {'yes' if p.fits else 'no'} | {seconds_round} "
                          f"| {rate} | {seconds:.0f} |", flush=True)
                    print(f"<!-- {name} {topology} {completion}: decoding in {p.layout} -->", flush=True)
                    print(f"<!-- {name} {topology} {completion}: temporaries GiB " + ", ".join(
                        f"{ph.name} {ph.temporaries / GIB:.2f}" for ph in p.phases) + " -->", flush=True)
                    if p.round_seconds is not None:
                        print(f"<!-- {name} {topology} {completion}: roofline s a run x runs: " + ", ".join(
                            f"{ph.name} {p.seconds(ph):.3g} x {ph.runs:g}" for ph in p.phases) + " -->", flush=True)
                    for ph in p.phases:
                        if not p.phase_fits(ph):
                            print(f"<!-- {name} {topology} {completion}: {plan.hint(p, ph)} -->", flush=True)
                    results.append({"model": name, "lora": lora, "topology": topology, "prompt": PROMPT,
                                    "completion": completion, "compile_seconds": seconds, **p.as_json()})
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
