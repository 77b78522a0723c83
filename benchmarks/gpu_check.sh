#!/usr/bin/env bash
# The one GPU check for the Triton backend (188 s on an H200; 355 s with ADDNORM_COMPAT=1 ADDNORM_BENCH_LAYER=1;
# benchmarks/results/gpu; torch preinstalled):
#   1. make addnorm importable (source tree on PYTHONPATH if it is not installed),
#   2. run the Triton tests on CUDA,
#   3. the graph-safety checks (tools/gpu_graph_check.py: CUDA-graph capture with dropout draws fresh masks,
#      no CUDA-graph skip under reduce-overhead, a tensor on cuda:1 when present, dresidual sharing, in-place ops)
#      and the per-call host overhead of each backend (benchmarks/bench_overhead.py), both into graph.txt,
#   4. run the add + RMSNorm benchmark table (bf16, fwd / bwd / fwd+bwd, N = 512 ... 262144),
#   5. profile the device kernels of one call (tools/profile_kernels.py) and time a Llama-width transformers
#      training step unpatched vs hf.apply (benchmarks/bench_hf_llama.py), into profile.txt and hf_llama.md.
# Results (test log, CSV, JSON, environment) go to $OUT when set, else benchmarks/results/.
# Usage: bash benchmarks/gpu_check.sh          (ADDNORM_BENCH_LAYER=1 also runs a short LayerNorm table;
#                                              ADDNORM_COMPAT=1 the upstream flash-attention/Liger test files;
#                                              ADDNORM_TUNE=1 also sweeps the Triton block sizes, ~3 more minutes)
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS="${OUT:-benchmarks/results}"
mkdir -p "$RESULTS"
start=$(date +%s)

# No pip install: the GPU machine reaches no package index, so pip's isolated build of the editable package (it
# fetches setuptools) would fail there. Its image holds torch, triton, numba, numpy and tqdm: the source tree on
# PYTHONPATH is enough when addnorm is not installed.
python -c "import addnorm" 2>/dev/null || export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
python -c "import addnorm, triton" || { echo "addnorm or triton does not import; see above"; exit 1; }
# Optional third-party providers for the benchmark: wheels carried in .whl/ (Liger is pure Python, see
# benchmarks/results/README.md). --no-deps and a separate target: they never replace the image's torch or triton.
if ls .whl/*.whl >/dev/null 2>&1; then
    python -m pip install -q --no-index --no-deps --no-compile --target /tmp/bench-site .whl/*.whl \
        && export PYTHONPATH="/tmp/bench-site${PYTHONPATH:+:$PYTHONPATH}"
fi
# one file for the environment: the device tool brings back at most 8 files, and ADDNORM_BENCH_LAYER=1 writes 8 with it
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python -m addnorm info; } > "$RESULTS/gpu.txt" 2>&1

echo "== Triton tests on CUDA (kernels, and the triton ops under torch.compile)"
timeout 180 python -m pytest -q -p no:cacheprovider -n 8 tests/ops/test_triton_add_norm.py tests/ops/test_triton_ops.py \
    tests/integrations/test_hf_integration.py::test_apply_to_a_model_already_on_the_gpu --durations=5 2>&1 | tee "$RESULTS/tests.txt"
tests_rc=${PIPESTATUS[0]}
echo "tests exit status $tests_rc after $(( $(date +%s) - start )) s"

echo "== graph-safety checks and per-call overhead"
# ~45 s, estimated without a GPU: a few Triton JITs, three Inductor compiles (reduce-overhead; forward + backward and
# the in-place op through the triton ops), then ~40 timed rows of 7 x 300 tiny calls
timeout 100 python tools/gpu_graph_check.py 2>&1 | tee "$RESULTS/graph.txt"
graph_rc=${PIPESTATUS[0]}
timeout 45 python benchmarks/bench_overhead.py --device cuda --out '' 2>&1 | tee -a "$RESULTS/graph.txt"

echo "== benchmark: add + RMSNorm, bf16"
# Budget, estimated without a GPU run: start-up and the copy-bandwidth run ~10 s; 6 sizes x 3 modes x the providers
# present, each row ~25 calls of at most a few ms plus one fp32 reference (~15 s for addnorm, eager and compile);
# Triton JIT of addnorm's kernels per N (~1 s each); 2 Inductor compiles for `compile` (dynamic shapes, see
# make_provider). Liger, if carried, adds its JIT per N. A run cut short still leaves every finished N in the CSV/JSON.
timeout 150 python benchmarks/bench_add_norm.py --norm rms --dtype bf16 \
    --sizes 512,1024,4096,16384,65536,262144 --reps 20 --out "$RESULTS" 2>&1 | tee "$RESULTS/bench_rms.txt"
bench_rc=${PIPESTATUS[0]}

echo "== device kernels per call (torch.profiler): addnorm, eager, Liger"
# ~20 s: 3 shapes x 2 modes x 3 providers, 5 profiled calls each; shows device time apart from host overhead
timeout 90 python tools/profile_kernels.py --shapes 16384x4096,65536x1024,4096x16384 2>&1 \
    | grep -v -i "warn" | tee "$RESULTS/profile.txt"

echo "== transformers Llama training step (hidden 4096, 4 layers, bf16): unpatched vs hf.apply"
# ~30 s: 3 variants x 13 steps of batch 4 x 2048 tokens
timeout 120 python benchmarks/bench_hf_llama.py --device cuda --dtype bf16 --layers 4 --hidden 4096 --heads 32 \
    --vocab 32000 --batch 4 --seq 2048 --repeats 10 --out "$RESULTS/hf_llama.md" 2>&1 | tee -a "$RESULTS/profile.txt"

if [ "${ADDNORM_COMPAT:-0}" = "1" ]; then
    # flash-attention's and Liger's own test files against addnorm.compat on the Triton backend (docs/compat.md);
    # the machine is offline: .compat-suites/ must travel with the tree (fetched where there is a network)
    echo "== upstream test files (flash-attention, Liger) on CUDA"
    # 8 pytest-xdist workers; the full grids (9,728 + 40 cases), flash-attention's stopped after 200 s if need be
    timeout 300 python tools/compat_suites.py all --device cuda --backend triton \
        --source flash-attn=.compat-suites/flash-attn --source liger=.compat-suites/liger --max-seconds 200 \
        --json "$RESULTS/compat.json" -- -n 8 2>&1 | tail -25 | tee -a "$RESULTS/tests.txt"
fi

if [ "${ADDNORM_BENCH_LAYER:-0}" = "1" ]; then
    echo "== benchmark: add + LayerNorm, bf16"
    timeout 60 python benchmarks/bench_add_norm.py --norm layer --dtype bf16 --modes fwd,fwd+bwd \
        --providers addnorm,eager,flash_attn,apex,liger --sizes 4096,65536 --reps 20 --out "$RESULTS" 2>&1 \
        | tee "$RESULTS/bench_layer.txt"
fi

if [ "${ADDNORM_TUNE:-0}" = "1" ]; then
    # the block-size sweep (tools/tune_triton.py): about 100 settings, ~1 s of JIT each; the summary is in the
    # log's last lines, every timing in tune_rms_bf16.csv / .json (with ADDNORM_BENCH_LAYER=1 too: 10 files, over
    # the device tool's 8, so run the two options in separate calls)
    echo "== tuning sweep: add + RMSNorm, bf16"
    timeout 240 python tools/tune_triton.py --norm rms --dtype bf16 --out "$RESULTS" 2>&1 | tee "$RESULTS/tune.txt"
fi

echo "done in $(( $(date +%s) - start )) s: tests rc=$tests_rc, graph checks rc=$graph_rc, benchmark rc=$bench_rc;" \
     "results in $RESULTS"
[ "$tests_rc" = 0 ] && [ "$graph_rc" = 0 ] && [ "$bench_rc" = 0 ]
