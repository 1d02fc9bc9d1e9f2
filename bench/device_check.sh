#!/usr/bin/env bash
# One call on a GPU machine: build for the local card, run the `cuda` tests, time the CUDA kernels.
# Logs go to $OUT (the device tool's output folder) or ./device-out.
#   bash bench/device_check.sh [pytest -k expression]
set -uo pipefail
OUT=${OUT:-device-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYENGINE_CUDA_ARCHS=${PYENGINE_CUDA_ARCHS:-90}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__)'
start=$(date +%s)
python3 setup.py build_ext --inplace >"$OUT/build.log" 2>&1 || { tail -60 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
python3 -m pytest -m cuda -q -rf --tb=short -p no:cacheprovider tests/test_cuda_build.py tests/test_cuda_ops.py \
    tests/test_cuda_model.py ${1:+-k "$1"} >"$OUT/tests.log" 2>&1
rc=$?
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -40
echo "tests: rc $rc, $(( $(date +%s) - start )) s"
PYTHONPATH=. timeout 180 python3 bench/bench_cuda.py 2>&1 | tee "$OUT/bench.log" | tail -25
exit $rc
