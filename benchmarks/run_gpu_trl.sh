#!/usr/bin/env bash
# grpo_jax against TRL 1.16 on one GPU, same folders, same process kind (benchmarks/RESULTS.md's GPU section).
# TRL, datasets, dill and multiprocess travel as wheels in .whl/ (the GPU image lacks them); run from the repository
# root on the GPU machine; writes JSON and logs to ${OUT:-/tmp/bench_out}.
set -uo pipefail
OUT=${OUT:-/tmp/bench_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false TRL_EXPERIMENTAL_SILENCE=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install -e . failed"
nvidia-smi -L; lscpu | grep "Model name"
python3 -c "import jax, torch, trl, transformers; print('jax', jax.__version__, 'torch', torch.__version__, 'trl',
trl.__version__, 'transformers', transformers.__version__, jax.devices())"
python3 benchmarks/make_models.py --out /tmp/bm --sizes qwen0.5b > /dev/null 2>&1
# the command line against TRL: Qwen2.5-0.5B shapes, 4 prompts x 8, 16 + 128 tokens, bf16 compute on both sides
timeout 270 python3 benchmarks/cli_step.py --model /tmp/bm/qwen0.5b --bf16 --max-completion-length 128 --steps 5 \
  --warmup 2 --prompt-pool 4 --out "$OUT/cli_qwen05b.json" > "$OUT/cli_qwen05b.log" 2>&1 || echo "cli_step failed: $?"
# multi-turn rounds with a 100 ms tool against TRL's tool loop (small model, fp32 both)
timeout 150 python3 benchmarks/tool_rounds.py --size small --warmup 1 --rounds 3 --out "$OUT/tool_rounds_small.json" \
  > "$OUT/tool_rounds_small.log" 2>&1 || echo "tool_rounds failed: $?"
tail -n 4 "$OUT"/*.log
python3 - "$OUT" <<'PY'
import json, sys, pathlib
for p in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    r = json.loads(p.read_text())
    keep = {k: r[k] for k in ("ratio", "ratio_per_completion_token") if k in r}
    for impl in ("grpo_jax", "trl"):
        if impl in r:
            keep[impl] = {k: v for k, v in r[impl].items() if isinstance(v, (int, float, str)) and len(str(v)) < 80}
    print(p.name, json.dumps(keep))
PY
