"""reshape_and_cache at the default model's shapes (3 kv heads, 9 q heads, head_dim 64, bf16 K/V), ms
per layer-write (best of N) for T = 1 (a decode step), 64 (a prefill chunk), 2048 tokens: a bf16
cache, int8 and fp8 without q (fp8: the scale search alone) and with the step's q (K rounded for it, as
the model writes). Row "64 streams": a decode step of 64 sequences, each token into a block of its own
among 30 layers' caches (8 blocks a sequence), the layers written in turn, so the lines a token writes
come cold from memory as in a 64-stream generate.

    python bench/kernels/bench_kv_write.py [--threads 2]
"""
import argparse

import os

import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout

from bench.common import min_time  # (and puts the checkout first on sys.path)
import pyengine  # noqa: F401  (before torch: it sets the OpenMP spin policy)
import torch

from pyengine import _C
from pyengine.ops.attention import kv_cache_shapes
from pyengine.ops.cache import reshape_and_cache

KV_HEADS, HEADS, HEAD_DIM, BLOCK = 3, 9, 64, 16
CACHES = {"bf16": (torch.bfloat16, False), "int8": (torch.int8, False), "int8 + q": (torch.int8, True),
          "fp8": (torch.float8_e4m3fn, False), "fp8 + q": (torch.float8_e4m3fn, True)}


STREAMS, LAYERS, BLOCKS_PER_STREAM = 64, 30, 8


def best_ms(T: int, cache_dtype: torch.dtype, with_q: bool, streams: bool = False) -> float:
    layers = LAYERS if streams else 1
    nb = STREAMS * BLOCKS_PER_STREAM if streams else (T + BLOCK - 1) // BLOCK
    k_shape, v_shape = kv_cache_shapes(nb, KV_HEADS, BLOCK, HEAD_DIM, "cpu", cache_dtype)
    caches = [(torch.zeros(k_shape, dtype=cache_dtype), torch.zeros(v_shape, dtype=cache_dtype)) for _ in range(layers)]
    quant = cache_dtype != torch.bfloat16
    ks, vs = (torch.zeros(nb, KV_HEADS, BLOCK), torch.zeros(nb, KV_HEADS, BLOCK)) if quant else (None, None)
    key, value = torch.randn(T, KV_HEADS, HEAD_DIM).bfloat16(), torch.randn(T, KV_HEADS, HEAD_DIM).bfloat16()
    q = torch.randn(T, HEADS, HEAD_DIM).bfloat16() if with_q else None
    # streams: each token at offset 5 of a block of its own, the blocks drawn at random from the pool
    slots = (torch.randperm(nb)[:T] * BLOCK + 5) if streams else torch.arange(T)

    def write() -> None:
        for kc, vc in caches:
            reshape_and_cache(key, value, kc, vc, slots, k_scales=ks, v_scales=vs, query=q)
    return min_time(write, 200 // layers if T < 2048 else 20, warmup=0) * 1e3 / layers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    _C.set_num_threads(args.threads)
    print(f"{'tokens':>10} " + " ".join(f"{name:>9}" for name in CACHES) + "   (ms per layer-write)")
    for T in (1, 64, 2048):
        print(f"{T:>10} " + " ".join(f"{best_ms(T, *spec):9.3f}" for spec in CACHES.values()))
    print(f"{'64 streams':>10} " + " ".join(f"{best_ms(STREAMS, *spec, streams=True):9.3f}" for spec in CACHES.values()))


if __name__ == "__main__":
    main()
