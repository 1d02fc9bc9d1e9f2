"""Where a batch-1 decode step's time goes, beside a plain read of the weight bytes it streams.

1. One 128-token greedy generate (weights="auto"): per step, the native layers (decoder_layers, the final
   norm included), the lm_head, and the rest (embedding, sampling, scheduler, outputs: Python).
2. The same kernels alone, M = 1, min over repeats: every projection of every layer in model order,
   then the lm_head, each against pyengine's read_bandwidth probe over as many bytes (same threads).
   "x read" is the kernel's time over the read's: 1.00 would be a GEMV as fast as streaming its weight.

    python bench/engine/bench_decode_profile.py [--threads 2] [--file PATH.gguf]   (default: the default model)

Run it on a quiet machine: on a shared one the weights (~96 MB for the default model) fall out of L3
and both columns measure the neighbours.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections import defaultdict

import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout

from bench.common import default_gguf, min_time

import pyengine  # noqa: F401  (before torch)
import torch

from pyengine import LLM, SamplingParams, _C


def step_split(llm: LLM, tokens: int) -> dict[str, float]:
    """Median ms per decode step (the prompt's step left out): the whole step and its native parts."""
    eng, spent = llm.engine, defaultdict(list)
    head_class = type(eng.model.lm_head_linear)

    def timed(f, name):
        def g(*a, **k):
            t0 = time.perf_counter()
            r = f(*a, **k)
            spent[name].append(time.perf_counter() - t0)
            return r
        return g

    saved = _C.decoder_layers, eng.step, head_class.__call__
    _C.decoder_layers, eng.step = timed(saved[0], "layers"), timed(saved[1], "step")
    head_class.__call__ = timed(saved[2], "lm_head")
    try:
        prompt = [random.Random(0).randrange(100, 40000) for _ in range(128)]
        llm.generate([prompt], SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
    finally:
        _C.decoder_layers, eng.step, head_class.__call__ = saved
    out = {k: statistics.median(v[1:]) * 1e3 for k, v in spent.items()}
    out["rest"] = out["step"] - out["layers"] - out["lm_head"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--file", default=None, help="a GGUF file (default: the default model's Q4_1)")
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    path = args.file or os.path.join(*default_gguf())
    llm = LLM(path, dtype="bfloat16", weights="auto", num_threads=args.threads, kv_cache_memory=64 << 20,
              max_num_seqs=4, max_model_len=1024)
    _C.set_num_threads(args.threads)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)  # warm-up
    s = step_split(llm, args.tokens)
    print(f"{os.path.basename(path)}, {args.threads} threads, {args.tokens}-token generate, median ms per decode step:")
    print(f"  step {s['step']:.3f} = layers {s['layers']:.3f} + lm_head {s['lm_head']:.3f} + rest {s['rest']:.3f}")

    model = llm.engine.model
    lins = [x for layer in model.linears for x in layer]
    head = model.lm_head_linear
    xs = {k: torch.randn(1, k, dtype=torch.bfloat16) for k in {x.in_features for x in lins + [head]}}
    print("kernels alone, M = 1 (min over repeats), against a plain read of their bytes:")
    for name, group, reps in (("projections", lins, 20), ("lm_head", [head], 40)):
        nbytes = sum(x.nbytes for x in group) // 64 * 64
        buf = torch.ones(nbytes, dtype=torch.uint8)
        t = min_time(lambda: [x(xs[x.in_features]) for x in group], reps, warmup=1) * 1e3
        r = min_time(lambda: _C.read_bandwidth(buf.data_ptr(), nbytes, 0), reps, warmup=1) * 1e3
        print(f"  {name:11s} {nbytes / 1e6:6.1f} MB  {t:6.3f} ms ({nbytes / t / 1e6:5.1f} GB/s)  "
              f"read {r:6.3f} ms ({nbytes / r / 1e6:5.1f} GB/s)  {t / r:4.2f}x read")


if __name__ == "__main__":
    main()
