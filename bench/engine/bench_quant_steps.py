"""One model step of M rows (a prompt chunk of one sequence) on GGUF weights: weights="dequantize" (the bf16
kernel), "auto" (from qlinear_strip_rows() rows the weight dequantized a strip at a time for that kernel) and
"auto" with the strips off (the int8 kernels at every M). CPU ms per step (all threads; one by default),
the three alternated, min over repeats: CPU time holds up on a loaded machine where wall time does not
(with more threads it counts their waits at the joins too: OpenMP workers spin before they sleep). The lm_head runs on the last row only, so at many streams (M rows of lm_head too) `auto` pays
one more dequantized weight per step than here.

    python bench/engine/bench_quant_steps.py [--file PATH.gguf] [--m 16,32,64,512,2000] [--repeats 3] [--threads 1]
                                      [--strip-rows N]   (auto's strips from N rows; default: the build's choice)
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout

from bench.common import ROOT, default_gguf

import pyengine  # noqa: F401  (before torch)
import torch

sys.path.insert(0, os.path.join(ROOT, "tests"))

from model_helpers import SequenceRunner  # noqa: E402
from pyengine import _C  # noqa: E402
from pyengine.model.loader import load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--file", default=None, help="GGUF file (default: the default model's Q4_1 file)")
    ap.add_argument("--m", default="16,32,64,512,2000", help="comma-separated rows per step")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--strip-rows", type=int, default=None,
                    help="auto's strips from this many rows (default: qlinear_strip_rows(), the build's choice)")
    args = ap.parse_args()
    path = args.file or os.path.join(*default_gguf())
    _C.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    cfg, auto = load_model(path, torch.bfloat16, "cpu")
    _, bf16 = load_model(path, torch.bfloat16, "cpu", weights="dequantize")
    sizes = [int(m) for m in args.m.split(",")]
    ids = torch.randint(100, 40000, (max(sizes),), generator=torch.Generator().manual_seed(0)).tolist()
    default_rows = _C.qlinear_strip_rows()
    strip_rows = default_rows if args.strip_rows is None else args.strip_rows
    configs = (("dequantize", bf16, strip_rows), ("auto", auto, strip_rows), ("auto, int8 only", auto, 0))
    best: dict[tuple[str, int], float] = {}
    for _ in range(args.repeats):
        for m in sizes:
            for name, model, rows in configs:
                _C.set_qlinear_strip_rows(rows)
                runner = SequenceRunner(model, cfg, m)
                t0 = time.process_time()
                runner.step(ids[:m])
                best[name, m] = min(best.get((name, m), float("inf")), (time.process_time() - t0) * 1e3)
    _C.set_qlinear_strip_rows(default_rows)
    print(f"{os.path.basename(path)}: CPU ms per step, {args.threads} thread(s), min of {args.repeats}; "
          f"auto's strips from {strip_rows or 'no'} rows; bf16 kernel {_C.linear_path(576)}; speed = dequantize ms / ms")
    print(f"{'M':>5s} {'dequantize':>11s} {'auto':>9s} {'int8 only':>10s} {'auto speed':>11s} {'int8 speed':>11s}")
    for m in sizes:
        d, a, i = best["dequantize", m], best["auto", m], best["auto, int8 only", m]
        print(f"{m:5d} {d:11.1f} {a:9.1f} {i:10.1f} {d / a:10.2f}x {d / i:10.2f}x")


if __name__ == "__main__":
    main()
