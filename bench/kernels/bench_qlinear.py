"""QuantLinear GEMV/GEMM per GGUF type and path: ms per call (min over calls, so a loaded machine's
stalls drop out) for a [N, K] weight at M = 1 (decode), 16 and 64 (64 streams' decode step), one thread by
default; the last row is the bf16 kernel (PackedLinear) on the same shape, the path weights="dequantize" runs.
Paths: "strips" (the weight dequantized for the bf16 kernel, linear/quant_strips.cpp, forced at every M) and
the int8 SIMD paths (qlinear_isas, the strips off).

    python bench/kernels/bench_qlinear.py [--n 2048] [--k 2048] [--threads 1] [--m 1,16,64] [--types Q4_1,Q8_0]
        [--paths strips,amx,avx512_vnni]   (default: strips and every SIMD path of this build but the scalar
                                            loop, ~100x slower: seconds a call at M = 64)
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout

from bench.common import ROOT, min_time

import pyengine  # noqa: F401  (before torch)
import torch

sys.path.insert(0, os.path.join(ROOT, "tests"))

from pyengine import _C  # noqa: E402
from pyengine.ops.linear import PackedLinear  # noqa: E402
from pyengine.ops.qlinear import QUANT_TYPES, QuantLinear  # noqa: E402
from test_qlinear_op import quantized_weight  # noqa: E402


def best_ms(f) -> float:
    return min_time(f, 40) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--m", default="1,16,64", help="comma-separated row counts")
    ap.add_argument("--types", default=",".join(QUANT_TYPES), help="comma-separated GGUF types")
    ap.add_argument("--paths", default=None, help="comma-separated SIMD paths (qlinear_isas)")
    args = ap.parse_args()
    _C.set_num_threads(args.threads)
    ms = [int(m) for m in args.m.split(",")]
    default = _C.qlinear_isa()
    default_rows = _C.qlinear_strip_rows()
    isas = args.paths.split(",") if args.paths else ["strips"] + [
        p for p in _C.qlinear_isas().split(",")[::-1] if p != "scalar"]
    xs = {m: torch.randn(m, args.k, dtype=torch.bfloat16) for m in ms}
    print(f"[{args.n}, {args.k}] weight, {args.threads} thread(s); ms per call (min of 40)")
    print(f"{'type':7s} " + " ".join(f"{isa + ' M=' + str(m):>17s}" for isa in isas for m in ms))
    for type_name in args.types.split(","):
        blocks, w = quantized_weight(type_name, args.n, args.k, seed=1)
        lin = QuantLinear(blocks, type_name)
        cells = []
        for isa in isas:
            _C.set_qlinear_strip_rows(1 if isa == "strips" else 0)
            _C.set_qlinear_isa(default if isa == "strips" else isa)
            cells += [f"{best_ms(lambda: lin(xs[m])):17.3f}" for m in ms]
        _C.set_qlinear_isa(default)
        _C.set_qlinear_strip_rows(default_rows)
        print(f"{type_name:7s} " + " ".join(cells), flush=True)
    bf16 = PackedLinear(w.to(torch.bfloat16))
    print(f"{'bf16':7s} " + " ".join(f"{best_ms(lambda: bf16(xs[m])):17.3f}" for m in ms))


if __name__ == "__main__":
    main()
