"""The engine's three headline rows, measured in one run on the default model (128-token prompts, greedy,
EOS ignored). The same rows beside llama.cpp and vLLM-CPU, each run side by side, are bench/compare/'s.

  decode 1 stream   batch-1 decode tokens/s after a 128-token prompt
  generate 64       generated tokens/s over 64 concurrent prompts, prefill included
  prefill 64        prompt tokens/s for 64 prompts at once, max_tokens=1

    python bench/engine/headline.py [--threads 2] [--dtype auto] [--weights auto|dequantize] [--gen 128]
"""
from __future__ import annotations

import argparse
import random
import time

import pyengine  # noqa: F401  (before torch: it sets the OpenMP spin policy)
from pyengine import LLM, SamplingParams

PROMPT = 128


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--gen", type=int, default=128, help="tokens generated per request")
    ap.add_argument("--weights", default="auto", choices=["auto", "dequantize"],
                    help="GGUF weights: quantized kernels where they exist, or dequantized to --dtype")
    args = ap.parse_args()
    llm = LLM(dtype=args.dtype, num_threads=args.threads, kv_cache_memory=2 << 30, max_num_seqs=256,
              enable_prefix_caching=False, weights=args.weights, kv_cache_prefault=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(PROMPT)] for _ in range(64)]
    greedy = dict(temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, **greedy), use_tqdm=False)  # warm-up

    one = llm.generate([prompts[0]], SamplingParams(max_tokens=256, **greedy), use_tqdm=False)[0]
    m = one.metrics
    decode = (len(one.outputs[0].token_ids) - 1) / (m.last_token_time - m.first_token_time)

    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, **greedy), use_tqdm=False)
    prefill = 64 * PROMPT / (time.perf_counter() - t)

    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=args.gen, **greedy), use_tqdm=False)
    generate = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)

    print(f"default model, {llm.engine.dtype}, weights {args.weights}, {args.threads} threads, {PROMPT}-token prompts")
    print(f"{'row':18s} {'pyengine':>10s} {'bar':>8s}")
    for name, value, bar in [("decode 1 stream", decode, 141), (f"generate 64 x {args.gen}", generate, 832),
                             ("prefill 64", prefill, 2900)]:
        print(f"{name:18s} {value:10.1f} {bar:8d}  tok/s")


if __name__ == "__main__":
    main()
