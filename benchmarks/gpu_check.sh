#!/usr/bin/env bash
# The one GPU check for the Triton backend (about 4 minutes on an H100/H200; torch preinstalled):
#   1. install addnorm (+ triton) if needed,
#   2. run the Triton tests on CUDA,
#   3. run the add + RMSNorm benchmark table (bf16, fwd / bwd / fwd+bwd, N = 512 ... 262144).
# Results (test log, CSV, JSON, environment) go to $OUT when set, else benchmarks/results/.
# Usage: bash benchmarks/gpu_check.sh          (ADDNORM_BENCH_LAYER=1 also runs a short LayerNorm table)
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS="${OUT:-benchmarks/results}"
mkdir -p "$RESULTS"
start=$(date +%s)

python -c "import addnorm, triton" 2>/dev/null || pip install -q -e '.[triton]' || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$RESULTS/gpu.txt" 2>&1
addnorm info > "$RESULTS/info.txt" 2>&1

echo "== Triton tests on CUDA"
timeout 170 python -m pytest -q -p no:cacheprovider tests/test_triton_add_norm.py --durations=5 2>&1 | tee "$RESULTS/tests.txt"
tests_rc=${PIPESTATUS[0]}
echo "tests exit status $tests_rc after $(( $(date +%s) - start )) s"

echo "== benchmark: add + RMSNorm, bf16"
timeout 150 python benchmarks/bench_add_norm.py --norm rms --dtype bf16 \
    --sizes 512,1024,4096,16384,65536,262144 --reps 20 --out "$RESULTS" 2>&1 | tee "$RESULTS/bench_rms.txt"
bench_rc=${PIPESTATUS[0]}

if [ "${ADDNORM_BENCH_LAYER:-0}" = "1" ]; then
    echo "== benchmark: add + LayerNorm, bf16"
    timeout 60 python benchmarks/bench_add_norm.py --norm layer --dtype bf16 --modes fwd,fwd+bwd \
        --providers addnorm,eager,flash_attn,apex,liger --sizes 4096,65536 --reps 20 --out "$RESULTS" 2>&1 \
        | tee "$RESULTS/bench_layer.txt"
fi

echo "done in $(( $(date +%s) - start )) s: tests rc=$tests_rc, benchmark rc=$bench_rc; results in $RESULTS"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
