"""Decode attention of builds of the native extension side by side in one process, their calls
alternating, each from a cold last-level cache (bench_attention's cold_operands): on a shared machine
whose memory bandwidth drifts by tens of percent within minutes, the way a change of 10% shows at all.
Copy pyengine/_C*.so aside before and after a change (or build each variant), then:

    python bench/lab/ab_attention.py OLD.so NEW.so [--caches bf16,int8,fp8,fp32] [--points 8x2048,32x2048,8x8192]
                                 [--rounds 9] [--threads 2]

bench_attention's decode shapes (9 q heads, 3 kv heads, head_dim 64, block 16 or BENCH_ATTENTION_BLOCK;
bf16 q, fp32 q for the fp32 cache). Per point and cache: each build's fastest round in us and GB/s of
K/V read, the first build's time over each other's, and the largest difference between their outputs.
"""
from __future__ import annotations

import argparse
import time

import pyengine  # noqa: F401  (before torch: it sets the OpenMP spin policy)
import torch

import pyengine.ops.attention as attention_ops
import os
import sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout
from bench.lab.ab_builds import load_builds
from bench.kernels.bench_attention import WARM_CTX, cold_operands, kv_bytes, paged_call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("builds", nargs="+", help="paths of _C*.so builds")
    ap.add_argument("--caches", default="bf16,int8,fp8,fp32")
    ap.add_argument("--points", default="8x2048,32x2048,8x8192", help="batch x context, comma-separated")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    builds = load_builds(args.builds, args.threads)
    for point in args.points.split(","):
        batch, ctx = map(int, point.split("x"))
        for cache in args.caches.split(","):
            call, warm = paged_call(batch, ctx, cache), paged_call(1, WARM_CTX, cache)
            best, outs = [float("inf")] * len(builds), []
            for r in range(args.rounds):
                for i, build in enumerate(builds):
                    attention_ops.native = lambda device, build=build: build  # paged_attention's module
                    cold_operands(warm)
                    t0 = time.perf_counter()
                    out = call()
                    best[i] = min(best[i], time.perf_counter() - t0)
                    if r == 0:
                        outs.append(out.float().clone())
            diff = max((o - outs[0]).abs().max().item() for o in outs)
            gb = kv_bytes(batch, ctx, cache) / 1e9
            print(f"{batch:>3} x {ctx:<5} {cache:>4}  " + "  ".join(f"{t * 1e6:8.0f} us {gb / t:5.1f} GB/s" for t in best)
                  + "   old/new " + " ".join(f"{best[0] / t:.2f}x" for t in best[1:]) + f"   max diff {diff:.1e}",
                  flush=True)


if __name__ == "__main__":
    main()
