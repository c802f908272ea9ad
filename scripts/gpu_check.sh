#!/usr/bin/env bash
# The one prepared GPU check: on a machine with a CUDA GPU, run the tests marked `cuda` and the
# GPU benchmarks, writing logs under $OUT (or ./gpu_logs).  Finishes in under 9 minutes (the
# steps' time limits add up to 540 s).
#
# That machine has its own torch, triton, numba, safetensors, pytest and hypothesis but no
# network: this script uses its Python as is, installs the project with --no-deps, and installs
# the wheels carried in .whl/ (diffusers, expecttest, importlib_metadata) for what is missing.
# Prepare them on a machine with a package index:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux2014_x86_64 -d .whl \
#       diffusers==0.42.1 expecttest==0.3.0 importlib_metadata
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${OUT:-gpu_logs}
mkdir -p "$LOG"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
status=0
step() {  # step NAME TIMEOUT CMD...: run one step, log it, remember a failure
    local name=$1 limit=$2; shift 2
    echo "== $name ($(date +%T))" | tee -a "$LOG/summary.txt"
    timeout "$limit" "$@" >"$LOG/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$LOG/$name.log"
    echo "== $name: exit $rc" | tee -a "$LOG/summary.txt"
    [ $rc -eq 0 ] || status=1
}

{ nvidia-smi; $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"; } \
    >"$LOG/env.txt" 2>&1
cat "$LOG/env.txt" | tail -n 3

if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/fxb_site .whl/*.whl && export PYTHONPATH=/tmp/fxb_site${PYTHONPATH:+:$PYTHONPATH}
fi
$PY -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$LOG/install.log" 2>&1 \
    || { echo "install failed"; cat "$LOG/install.log"; exit 1; }

step cuda_tests 240 $PY -m pytest -q -m cuda -p no:cacheprovider tests
step bench_cuda 100 $PY scripts/bench.py --device cuda --sizes tiny,small --no-kernel-cache-runs \
    --backends eager,aot_eager,fxbackend --repeat 20 --json "$LOG/bench_cuda.json"
# bf16, as GPUs serve these models: Wan's rounded RoPE and its widened/narrowed epilogues
step bench_cuda_bf16 30 $PY scripts/bench.py --device cuda --dtype bfloat16 --sizes small \
    --families wan,flux --no-kernel-cache-runs --backends eager,fxbackend --repeat 10 \
    --json "$LOG/bench_cuda_bf16.json"
step bench_cuda_inductor 50 $PY scripts/bench.py --device cuda --sizes small --families flux \
    --no-kernel-cache-runs --backends eager,inductor,fxbackend --repeat 20 \
    --json "$LOG/bench_cuda_inductor.json"
step bench_rms_rope_cuda 40 $PY scripts/bench_rms_rope_cuda.py --out "$LOG/bench_rms_rope_cuda.txt"
step overhead_cuda 30 $PY scripts/bench_overhead.py --device cuda --rounds 3 --calls 100 --json "$LOG/overhead_cuda.json"
step bench_streams 50 $PY scripts/bench_streams.py --device cuda --rounds 3 --calls 5 --cuda-graphs \
    --json "$LOG/bench_streams.json"
echo "gpu_check: $([ $status -eq 0 ] && echo all steps passed || echo some step failed)" | tee -a "$LOG/summary.txt"
exit $status
