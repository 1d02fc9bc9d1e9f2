#!/usr/bin/env bash
# The native CPU kernels' tests under AddressSanitizer: pyengine._C (and the Cython modules) built with
# -fsanitize=address in a copy of this checkout (tracked and untracked files; its own build is left
# alone), then pytest on that copy with libasan preloaded into the (uninstrumented) python.
#
#   bash tools/asan_kernels.sh                 # the kernel test files below (~15 min on 2 cores)
#   bash tools/asan_kernels.sh tests/test_attention.py -k decode
#   PYENGINE_CPU_ARCH=x86-64-v3 bash tools/asan_kernels.sh   # the AVX2 paths (x86-64: the scalar ones)
#
# An out-of-bounds access stops the run with ASan's report (the faulting frame and the allocation's).
# libstdc++ is preloaded too: without it ASan's __cxa_throw interceptor aborts on the C++ exceptions the
# tests expect. Leak checking is off (the interpreter itself "leaks" at exit).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d /tmp/pyengine-asan.XXXXXX)
echo "asan build in $work"
git -C "$root" ls-files -z --cached --others --exclude-standard | (cd "$root" && tar --null -T - -cf -) | tar -xf - -C "$work"
cd "$work"
export CFLAGS="-fsanitize=address -fno-omit-frame-pointer" LDFLAGS="-fsanitize=address"
PYENGINE_SKIP_CUDA=1 python setup.py -q build_ext --inplace > build.log 2>&1 || { tail -30 build.log; exit 1; }
tests=("$@")
if [ ${#tests[@]} -eq 0 ]; then
  tests=(tests/test_attention.py tests/test_prefill_attention.py tests/test_linear_op.py tests/test_qlinear_op.py
         tests/test_qlinear_strips.py tests/test_kquants.py tests/test_native_layers.py tests/test_layer_ops.py
         tests/test_cache_ops.py tests/test_sampling_op.py)
fi
status=0
LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so.6)" \
ASAN_OPTIONS=detect_leaks=0 PYTHONPATH="$work" python -m pytest -q -p no:cacheprovider "${tests[@]}" || status=$?
if [ "$status" -eq 0 ]; then rm -rf "$work"; else echo "asan build kept in $work"; fi
exit "$status"
