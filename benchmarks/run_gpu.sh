#!/usr/bin/env bash
# GPU measurements of benchmarks/RESULTS.md (Qwen2.5-0.5B-shaped random model, bf16 compute).
# Run from the repository root on the GPU machine; writes JSON to ${OUT:-/tmp/bench_out}, prints a digest last.
# Extra arguments go to the two grpo_step.py runs (e.g. --set model.scan_layers=true).
set -uo pipefail
OUT=${OUT:-/tmp/bench_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install -e . failed"
nvidia-smi -L
python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"
# decode throughput against the HBM bound (bf16 weights and cache)
python3 benchmarks/decode.py --size qwen0.5b --rows 64 --prompt-length 64 --new-tokens 256 \
  --dtype bfloat16 --param-dtype bfloat16 --out "$OUT/decode.json" > "$OUT/decode.log" 2>&1
# the issue's setting (4 prompts x 8, completions 32): phase split
python3 benchmarks/grpo_step.py --size qwen0.5b --impl grpo_jax --dtype bfloat16 --param-dtype float32 \
  --steps 5 --warmup 2 --profile /tmp/prof_issue --out "$OUT/step_issue.json" "$@" > "$OUT/step_issue.log" 2>&1
# a larger step for train-step MFU: 8 prompts x 8, prompts 128 + completions 128 tokens
python3 benchmarks/grpo_step.py --size qwen0.5b --impl grpo_jax --dtype bfloat16 --param-dtype float32 \
  --prompts-per-step 8 --prompt-length 128 --max-completion-length 128 --logps-chunk-size 16 \
  --steps 3 --warmup 2 --profile /tmp/prof_large --out "$OUT/step_large.json" "$@" > "$OUT/step_large.log" 2>&1
python3 benchmarks/digest.py "$OUT"/decode.json "$OUT"/step_issue.json "$OUT"/step_large.json
