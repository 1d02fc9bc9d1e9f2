#!/usr/bin/env bash
# One call on a fresh GPU machine: build for the local card, run the `cuda` tests, then the benchmarks,
# printing every figure next to its goal (issue #15) and the card's measured copy bandwidth.
#
#   bash bench/gpu/device_check.sh [pytest -k expression]
#
# Each step runs under its own timeout, cut so that the whole script ends inside DEADLINE seconds (default
# 540: the device tool allows 600 per command); a failed or timed-out step is reported and the next one runs.
# Logs go to $OUT (the device tool's output folder) or ./device-out: build.log, tests.log, kernels.log,
# e2e.log, summary.txt. The `cuda` tests and benchmarks need no package beyond the device image's (gguf and
# xgrammar only for GGUF files and grammars); wheels in ./.whl, when that folder exists, are installed first.
set -uo pipefail
OUT=${OUT:-device-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYENGINE_CUDA_ARCHS=${PYENGINE_CUDA_ARCHS:-90} MAX_JOBS=${MAX_JOBS:-16}
DEADLINE=${DEADLINE:-540}
START=$(date +%s)
SUMMARY="$OUT/summary.txt"; : >"$SUMMARY"
say() { echo "[$(( $(date +%s) - START ))s] $*" | tee -a "$SUMMARY"; }

# step NAME MAX_SECONDS LOG CMD...: runs CMD with stdout+stderr in LOG under min(MAX, time left - 10 s).
step() {
  local name=$1 max=$2 log=$3; shift 3
  local left=$(( DEADLINE - ($(date +%s) - START) - 10 ))
  local limit=$(( max < left ? max : left ))
  if (( limit < 15 )); then say "SKIP $name: no time left"; return 1; fi
  say "+ $name (timeout ${limit}s): $*"
  local t0=$(date +%s) rc
  timeout --kill-after=5 "$limit" "$@" >"$log" 2>&1; rc=$?
  local verdict=ok; (( rc == 124 || rc == 137 )) && verdict=TIMEOUT; (( rc != 0 && rc != 124 && rc != 137 )) && verdict=FAILED
  say "  $name: $verdict (rc $rc, $(( $(date +%s) - t0 ))s)"
  return $rc
}

say "device: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -1)"
say "python: $(python3 -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1 | tail -1)"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >"$OUT/pip.log" 2>&1 && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  say "wheels from .whl: rc $?"
fi
missing=$(python3 -c '
import importlib.util as u
print(" ".join(m for m in ("gguf", "xgrammar", "pytest_asyncio", "transformers", "tokenizers") if u.find_spec(m) is None))')
[ -n "$missing" ] && say "missing Python packages (tests that import them fail): $missing"

step build 240 "$OUT/build.log" python3 setup.py build_ext --inplace
build_rc=$?
(( build_rc != 0 )) && tail -40 "$OUT/build.log"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}

if (( build_rc == 0 )); then
  step "cuda tests" 200 "$OUT/tests.log" python3 -m pytest -m cuda -q -rfE --tb=short -p no:cacheprovider \
      tests/test_cuda_build.py tests/test_cuda_ops.py tests/test_cuda_graphs.py tests/test_cuda_model.py ${1:+-k "$1"}
  grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed|skipped|errors?)" "$OUT/tests.log" | tail -30 | tee -a "$SUMMARY"
  step "kernel benchmarks" 130 "$OUT/kernels.log" python3 bench/gpu/bench_cuda.py --quick
  cat "$OUT/kernels.log"
  step "engine benchmarks" 170 "$OUT/e2e.log" python3 bench/gpu/bench_cuda_e2e.py
  cat "$OUT/e2e.log"
fi

say "== figures against their goals =="
grep -hE "copy bandwidth|PASS|MISS|ERROR" "$OUT/kernels.log" "$OUT/e2e.log" 2>/dev/null | tee -a "$SUMMARY"
say "done in $(( $(date +%s) - START ))s"
