#!/usr/bin/env bash
# GPU phase times for async_sim.py (Qwen2.5-0.5B shapes, bf16 compute), then the simulator on them.
# Run from the repository root on the GPU machine; writes JSON to ${OUT:-/tmp/bench_out}.
set -uo pipefail
OUT=${OUT:-/tmp/bench_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
nvidia-smi -L
python3 benchmarks/async_phases.py --size qwen0.5b --dtype bfloat16 --decode-rows 64,256 --new-tokens 128 \
  --update-groups 1,2,4 --layout groups --logps-chunk-size 16 --remat full --repeats 3 --out "$OUT/phases_h100.json" 2>&1 | grep -v '^ ' \
  | tee "$OUT/phases_h100.log"
python3 benchmarks/async_sim.py --phases "$OUT/phases_h100.json" --out "$OUT/sim_h100.json"
# Completion tokens/s of one chip, synchronous against colocated k = 1 and 2, at realistic lengths (not yet run on a GPU)
python3 benchmarks/async_curves.py --long --staleness 0,1,2 --every 10 max_steps=40 --out "$OUT/curves_gpu.json" \
  | tee "$OUT/curves_gpu.log"
