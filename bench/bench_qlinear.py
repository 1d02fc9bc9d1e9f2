"""QuantLinear GEMV/GEMM per GGUF type and SIMD path: ms per call (min over calls, so a loaded machine's
stalls drop out) for a [N, K] weight at M = 1 (decode) and M = 16, one thread by default.

    python bench/bench_qlinear.py [--n 2048] [--k 2048] [--threads 1]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from engine_common import ROOT

import pyengine  # noqa: F401  (before torch)
import torch

sys.path.insert(0, os.path.join(ROOT, "tests"))

from pyengine import _C  # noqa: E402
from pyengine.ops.qlinear import QUANT_TYPES, QuantLinear  # noqa: E402
from test_qlinear_op import quantized_weight  # noqa: E402


def best_ms(f, calls: int = 40) -> float:
    for _ in range(3):
        f()
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    _C.set_num_threads(args.threads)
    isas, default = _C.qlinear_isas().split(",")[::-1], _C.qlinear_isa()
    print(f"[{args.n}, {args.k}] weight, {args.threads} thread(s); ms per call (min of 40)")
    print(f"{'type':7s} " + " ".join(f"{isa + ' M=' + str(m):>17s}" for isa in isas for m in (1, 16)))
    for type_name in QUANT_TYPES:
        blocks, _ = quantized_weight(type_name, args.n, args.k, seed=1)
        lin = QuantLinear(blocks, type_name)
        cells = []
        for isa in isas:
            _C.set_qlinear_isa(isa)
            for m in (1, 16):
                x = torch.randn(m, args.k, dtype=torch.bfloat16)
                cells.append(f"{best_ms(lambda: lin(x)):17.3f}")
        _C.set_qlinear_isa(default)
        print(f"{type_name:7s} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
