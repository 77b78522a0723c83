#!/usr/bin/env bash
# The one GPU check for the Triton backend: one run of at most ADDNORM_GPU_CHECK_SECONDS (540 s), every step capped
# by the time left (a step that would not get its minimum is skipped with a message), most important first:
#   1. refuse a torch or triton that resolves inside the working tree (a carried .venv, site-packages or wheel would
#      shadow the GPU image's build, and everything measured would be of the wrong build),
#   2. the environment (GPU, driver, torch, triton, addnorm info) into gpu.txt,
#   3. the registers and spills of the kernels as this machine's Triton compiles them (tools/sm90_static.py
#      --on-device) into kernels_compiled.md: the image's Triton (3.6 so far) is not the 3.9 of the static table,
#   4. the per-call host overhead (benchmarks/bench_overhead.py), with bound launches (the default) and with
#      ADDNORM_TRITON_FAST_LAUNCH=0 (Triton's normal launch), into overhead.txt,
#   5. the decode benchmark (benchmarks/bench_generate.py, when present) into generate.md,
#   6. the Triton tests on CUDA (the bound launcher's bitwise check against the normal launch included), then the
#      rows beyond fp32's range (tests/ops/test_finite_range_triton.py), into tests.txt, then the graph-safety
#      checks (tools/gpu_graph_check.py) into graph.txt,
#   7. the add + RMSNorm table (bf16), the fused norm_add / norm_add_norm table (benchmarks/bench_norm_add.py,
#      fp32 and bf16, beside the unfused ops), the add + LayerNorm table with torch.compile beside it, the device
#      kernels per call (tools/profile_kernels.py) and a transformers Llama training step, as time allows,
#   8. with time left and asked for: ADDNORM_COMPAT=1 (flash-attention's and Liger's test files), ADDNORM_QUANT=1
#      (the quantized ops' CUDA tests and table), ADDNORM_TUNE=1.
# ADDNORM_WIDE=1 (issue 28, wide rows) runs its steps right after step 2, before everything else: the team kernels'
# GPU tests (team == fallback bit for bit, M * N > 2^31 elements, in place past 16384), the bf16 tables at
# N = 16384 ... 262144 with the team kernels on (ADDNORM_TRITON_TEAM=1) and with the looped grids sized from the
# compiled kernel (ADDNORM_TRITON_SIZED_GRIDS=1), the one-pass forward at N = 32768 against the looped one, the
# device kernels per call at the looped shapes (1024 x 65536, 256 x 262144) both ways, and, where the profiler is
# permitted, ncu's DRAM bytes per kernel.
# Results go to $OUT when set (the device tool brings that folder back), else benchmarks/results/gpu.
# Usage: bash benchmarks/gpu_check.sh        Exit status: 0 all ran and passed, 1 a step failed, 2 refused,
#                                            3 nothing failed but steps were skipped or stopped at their cap.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
RESULTS="${OUT:-benchmarks/results/gpu}"
mkdir -p "$RESULTS"
DEADLINE="${ADDNORM_GPU_CHECK_SECONDS:-540}"
RESERVE=3 # seconds kept for the summary
start=$(date +%s)
failed=()
incomplete=()

remaining() { echo $((DEADLINE - ($(date +%s) - start))); }

# cap N: N seconds, or fewer when less is left before the deadline (less the summary's reserve)
cap() {
    local left=$(($(remaining) - RESERVE))
    if ((left < $1)); then echo "$left"; else echo "$1"; fi
}

# step NAME MAX MIN LOG COMMAND...: run COMMAND for at most MAX seconds (fewer if the deadline is nearer), its
# output shown and appended to LOG ('' for none); skipped with a message when fewer than MIN seconds are left
step() {
    local name=$1 max=$2 min=$3 log=$4
    shift 4
    local t
    t=$(cap "$max")
    if ((t < min)); then
        echo "== $name: skipped, $(remaining) s left of $DEADLINE (needs $min s)"
        incomplete+=("$name (skipped)")
        return 0
    fi
    echo "== $name (at most $t s; $(remaining) s left)"
    local rc
    if [ -n "$log" ]; then
        timeout --kill-after=5 "$t" "$@" 2>&1 | tee -a "$log"
        rc=${PIPESTATUS[0]}
    else
        timeout --kill-after=5 "$t" "$@"
        rc=$?
    fi
    if ((rc == 124 || rc == 137)); then
        echo "   $name: stopped at its $t s cap"
        incomplete+=("$name (stopped at $t s)")
    elif ((rc != 0)); then
        echo "   $name: exit status $rc"
        failed+=("$name (exit $rc)")
    fi
    return 0
}

# -- 1. the image's torch and triton, not carried ones ----------------------------------------------------------
# No pip install of the package: the GPU machine reaches no package index. The source tree on PYTHONPATH is enough.
python -c "import addnorm" 2>/dev/null || export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
for wheel in .whl/*.whl; do
    [ -e "$wheel" ] || continue
    case "$(basename "$wheel")" in
        torch-* | triton-* | pytorch_triton-* | nvidia_*)
            echo "refusing: $wheel would shadow the GPU image's own torch/triton/CUDA build; leave it out of the tree"
            exit 2
            ;;
    esac
done
# Optional third-party providers for the benchmarks (e.g. Liger, pure Python): --no-deps into their own target
if ls .whl/*.whl >/dev/null 2>&1; then
    python -m pip install -q --no-index --no-deps --no-compile --target /tmp/bench-site .whl/*.whl \
        && export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/bench-site"
fi
where=$(timeout 60 python -c "import torch, triton; print(torch.__file__); print(triton.__file__)") || {
    echo "refusing: torch or triton does not import here (see above)"
    exit 2
}
while read -r path; do
    case "$path" in
        "$ROOT"/*)
            echo "refusing: $path is inside the working tree: a carried .venv/site-packages would shadow the GPU" \
                "image's torch and triton (check what the run carries, and PYTHONPATH)"
            exit 2
            ;;
    esac
done <<<"$where"
python -c "import addnorm" || {
    echo "refusing: addnorm does not import (see above)"
    exit 2
}

# -- ADDNORM_WIDE=1: wide rows (issue 28), first when asked for ---------------------------------------------------
wide_steps() {
    : >"$RESULTS/wide.txt"
    # the team kernel spins until its team meets: its bit-for-bit test runs in a subprocess under a timeout
    step "wide rows: GPU tests (team kernels, > 2^31 elements, in place)" 150 40 "$RESULTS/wide.txt" \
        python -m pytest -q -p no:cacheprovider tests/ops/test_triton_team.py tests/ops/test_triton_wide_cuda.py \
        --durations=5
    mkdir -p "$RESULTS/wide_team" "$RESULTS/wide_sized"
    step "wide rows: add + RMSNorm and add + LayerNorm, bf16, team kernels" 150 40 "$RESULTS/wide.txt" bash -c \
        "for norm in rms layer; do ADDNORM_TRITON_TEAM=1 python benchmarks/bench_add_norm.py --norm \$norm \
        --dtype bf16 --providers addnorm --sizes 4096,16384,32768,65536,262144 --reps 20 \
        --out '$RESULTS/wide_team' || exit 1; done"
    step "wide rows: add + RMSNorm, bf16, looped grids sized from the compiled kernel" 60 20 "$RESULTS/wide.txt" \
        env ADDNORM_TRITON_SIZED_GRIDS=1 python benchmarks/bench_add_norm.py --norm rms --dtype bf16 \
        --providers addnorm --sizes 32768,65536,262144 --reps 20 --out "$RESULTS/wide_sized"
    # issue 28 item 2: the rows forward at 32 warps up to N = 32768 (sm_90: 55/61 registers, no spills) against
    # the looped forward there; tune_triton times both settings with the benchmark's code
    step "wide rows: one-pass forward to N = 32768 (Tuning.max_fwd_block_n)" 60 20 "$RESULTS/wide.txt" bash -c \
        "for norm in rms layer; do python tools/tune_triton.py --norm \$norm --dtype bf16 --sizes 32768 --modes fwd \
        --knobs max_fwd_block_n --out '$RESULTS/wide_tune' || exit 1; done"
    step "wide rows: device kernels per call at the looped shapes, default then team" 90 20 "$RESULTS/wide.txt" \
        bash -c "python tools/profile_kernels.py --providers addnorm --shapes 1024x65536,256x262144 &&
        ADDNORM_TRITON_TEAM=1 python tools/profile_kernels.py --providers addnorm --shapes 1024x65536,256x262144"
    if command -v ncu >/dev/null; then
        # DRAM bytes per kernel (the 4-units target against the looped path's 5 and 6); a machine without
        # profiling permission (ERR_NVGPUCTRPERM) says so here and the step is not counted as failed
        step "wide rows: ncu DRAM bytes, 1024 x 65536, default then team" 90 30 "$RESULTS/wide.txt" bash -c \
            "for team in 0 1; do ADDNORM_TRITON_TEAM=\$team ncu --target-processes all --metrics \
            dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum -k 'regex:add_norm|fwd|bwd' \
            python tools/profile_kernels.py --providers addnorm --shapes 1024x65536 --calls 1 \
            || echo 'ncu: not permitted here or failed (see above)'; done"
    else
        echo "== wide rows: ncu DRAM bytes: skipped, ncu is not on PATH"
    fi
}
# -- 2. environment, 3. the kernels as compiled here ----------------------------------------------------------------
# shellcheck disable=SC2016 # the Python code is quoted on purpose
env_py='import torch, triton, sys; print("python", sys.version.split()[0]); print("torch", torch.__version__,
"cuda", torch.version.cuda); print("triton", triton.__version__, triton.__file__); print("gpu",
torch.cuda.get_device_name() if torch.cuda.is_available() else "none")'
: >"$RESULTS/gpu.txt"
step "environment" 30 5 "$RESULTS/gpu.txt" bash -c \
    "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python -c '$env_py'; python -m addnorm info"
if [ "${ADDNORM_WIDE:-0}" = "1" ]; then
    wide_steps
fi

# ~60-100 s: 20 benchmark shapes (bf16, N = 512 ... 262144, RMS and LayerNorm), forward + backward, each variant
# compiled once; the table is rewritten after every shape, so a step stopped at its cap keeps what it measured
step "registers and spills of the kernels compiled here" 120 20 "" \
    python tools/sm90_static.py --on-device --shapes bench --out "$RESULTS/kernels_compiled.md"

# -- 4. overhead, 5. decode ---------------------------------------------------------------------------------------
: >"$RESULTS/overhead.txt"
step "per-call overhead, bound launches" 60 20 "$RESULTS/overhead.txt" \
    python benchmarks/bench_overhead.py --device cuda --out ''
step "per-call overhead, Triton's normal launch (ADDNORM_TRITON_FAST_LAUNCH=0)" 60 20 "$RESULTS/overhead.txt" \
    env ADDNORM_TRITON_FAST_LAUNCH=0 python benchmarks/bench_overhead.py --device cuda --out ''
if [ -f benchmarks/bench_generate.py ]; then
    step "decode benchmark (generate)" 150 40 "" \
        python benchmarks/bench_generate.py --device cuda --family llama --dtype bf16 --batch 1,8 --hidden 4096 \
        --layers 4 --heads 32 --vocab 32000 --prompt 512 --new 32 --repeats 3 --rounds 3 --steps 64 --control \
        --no-progress --out "$RESULTS/generate.md"
else
    echo "== decode benchmark: skipped, benchmarks/bench_generate.py is not in this tree"
    incomplete+=("decode benchmark (no bench_generate.py)")
fi

# -- 6. tests and graph checks --------------------------------------------------------------------------------------
: >"$RESULTS/tests.txt"
step "Triton tests on CUDA" 150 40 "$RESULTS/tests.txt" \
    python -m pytest -q -p no:cacheprovider -n 8 tests/ops/test_triton_add_norm.py tests/ops/test_triton_ops.py \
    tests/ops/test_triton_fast_launch.py tests/ops/test_norm_add_cuda.py \
    tests/ops/test_batch_invariance.py::test_triton_on_the_gpu_row_does_not_depend_on_the_batch \
    tests/integrations/test_hf_integration.py::test_apply_to_a_model_already_on_the_gpu --durations=5
# rows beyond fp32's range (1e37, subnormal, eps = 0; bf16 subnormals, which the interpreter converts wrongly):
# forward and every gradient against float64, the scaled pass of addnorm.ops.triton.row_stats compiled
step "Triton finite-range tests on CUDA" 120 30 "$RESULTS/tests.txt" \
    python -m pytest -q -p no:cacheprovider -n 8 tests/ops/test_finite_range_triton.py --durations=5
: >"$RESULTS/graph.txt"
# ~45 s: a few JITs, three Inductor compiles (reduce-overhead), CUDA-graph capture with dropout
step "graph-safety checks" 100 30 "$RESULTS/graph.txt" python tools/gpu_graph_check.py

# -- 7. tables -------------------------------------------------------------------------------------------------------
step "add + RMSNorm table, bf16" 150 40 "$RESULTS/bench_rms.txt" \
    python benchmarks/bench_add_norm.py --norm rms --dtype bf16 --sizes 512,1024,4096,16384,65536,262144 \
    --reps 20 --out "$RESULTS"
step "norm_add / norm_add_norm table, fused beside unfused" 60 20 "$RESULTS/bench_norm_add.txt" \
    python benchmarks/bench_norm_add.py --device cuda --shapes 1x4096,8x4096,4096x4096,16384x4096 --reps 20 \
    --out "$RESULTS/norm_add.json"
step "add + LayerNorm table, bf16, with torch.compile" 90 30 "$RESULTS/bench_layer.txt" \
    python benchmarks/bench_add_norm.py --norm layer --dtype bf16 --modes fwd,fwd+bwd \
    --providers addnorm,eager,compile,flash_attn,apex,liger --sizes 4096,65536 --reps 20 --out "$RESULTS"
step "device kernels per call" 60 20 "$RESULTS/profile.txt" \
    python tools/profile_kernels.py --shapes 16384x4096,65536x1024,4096x16384
step "transformers Llama training step" 120 40 "$RESULTS/profile.txt" \
    python benchmarks/bench_hf_llama.py --device cuda --dtype bf16 --layers 4 --hidden 4096 --heads 32 \
    --vocab 32000 --batch 4 --seq 2048 --repeats 10 --out "$RESULTS/hf_llama.md"

# -- 8. optional ------------------------------------------------------------------------------------------------------
if [ "${ADDNORM_COMPAT:-0}" = "1" ]; then
    # .compat-suites/ must travel with the tree (fetched where there is a network: tools/compat_suites.py)
    step "upstream test files (flash-attention, Liger)" 300 60 "$RESULTS/tests.txt" \
        python tools/compat_suites.py all --device cuda --backend triton \
        --source flash-attn=.compat-suites/flash-attn --source liger=.compat-suites/liger --max-seconds 200 \
        --json "$RESULTS/compat.json" -- -n 8
fi
if [ "${ADDNORM_QUANT:-0}" = "1" ]; then
    # add + norm + FP8/INT8 (addnorm.add_rms_norm_quant ...): the hardware conversion on sm_89+, and its table
    step "quantized add + norm: tests on CUDA" 120 30 "$RESULTS/quant_tests.txt" \
        python -m pytest -q -p no:cacheprovider -n 8 tests/ops/test_quant_cuda.py
    step "quantized add + norm: table" 120 30 "" \
        python benchmarks/bench_quant.py --device cuda --backend triton \
        --shapes 4096x4096,16384x4096,4096x8192,16384x8192 --reps 50 --out "$RESULTS/quant_cuda"
fi
if [ "${ADDNORM_TUNE:-0}" = "1" ]; then
    step "tuning sweep: add + RMSNorm, bf16" 240 60 "$RESULTS/tune.txt" \
        python tools/tune_triton.py --norm rms --dtype bf16 --out "$RESULTS"
fi

echo "done in $(($(date +%s) - start)) s of $DEADLINE; results in $RESULTS"
((${#failed[@]})) && echo "failed: ${failed[*]}"
((${#incomplete[@]})) && echo "incomplete: ${incomplete[*]}"
if ((${#failed[@]})); then exit 1; fi
if ((${#incomplete[@]})); then exit 3; fi
exit 0
