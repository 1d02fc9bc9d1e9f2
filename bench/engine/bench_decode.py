"""Single-stream decode: batch 1, 128-token prompt, 256 generated tokens (greedy, EOS ignored).
pyengine vs transformers' best dtype, same machine, same run.

    python bench/engine/bench_decode.py [--threads 2] [--dtype float32] [--skip-hf]
"""
from __future__ import annotations

import argparse
import random

import pyengine  # noqa: F401  (before torch: it sets the OpenMP spin policy)
import torch

import os

import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout

from bench.common import Timer, load_hf

PROMPT, GEN = 128, 256


def bench_pyengine(prompt: list[int], dtype: str, threads: int) -> dict:
    from pyengine import LLM, SamplingParams

    llm = LLM(dtype=dtype, num_threads=threads, kv_cache_memory=256 << 20, max_num_seqs=8,
              max_model_len=PROMPT + GEN + 16)  # 8,192 tokens of an fp32 cache would not fit
    params = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)
    llm.generate([prompt[:16]], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)  # warm-up
    with Timer() as t:
        out = llm.generate([prompt], params, use_tqdm=False)[0]
    m = out.metrics
    n = len(out.outputs[0].token_ids)
    decode_s = m.last_token_time - m.first_token_time
    return {"tokens": n, "total_s": t.s, "ttft_s": m.ttft, "decode_tok_s": (n - 1) / decode_s, "e2e_tok_s": n / t.s}


def bench_hf(prompt: list[int], dtype: torch.dtype) -> dict:
    model = load_hf(dtype)
    ids = torch.tensor([prompt])
    kw = dict(do_sample=False, min_new_tokens=GEN, max_new_tokens=GEN, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:, :16], **{**kw, "min_new_tokens": 8, "max_new_tokens": 8})  # warm-up
        with Timer() as t1:
            model.generate(ids, **{**kw, "min_new_tokens": 1, "max_new_tokens": 1})
        with Timer() as t:
            out = model.generate(ids, **kw)
    n = out.shape[1] - len(prompt)
    return {"tokens": n, "total_s": t.s, "ttft_s": t1.s, "decode_tok_s": (n - 1) / (t.s - t1.s), "e2e_tok_s": n / t.s}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    prompt = [rng.randrange(100, 40000) for _ in range(PROMPT)]
    rows = [("pyengine " + args.dtype, bench_pyengine(prompt, args.dtype, args.threads))]
    if not args.skip_hf:
        for dt in (torch.float32, torch.bfloat16):
            rows.append((f"transformers {str(dt).removeprefix('torch.')}", bench_hf(prompt, dt)))
    print(f"batch 1, prompt {PROMPT}, generate {GEN}, {args.threads} threads")
    print(f"{'engine':28s} {'decode tok/s':>12s} {'e2e tok/s':>10s} {'TTFT ms':>8s} {'total s':>8s}")
    for name, r in rows:
        print(f"{name:28s} {r['decode_tok_s']:12.1f} {r['e2e_tok_s']:10.1f} {r['ttft_s'] * 1e3:8.1f} {r['total_s']:8.2f}")
    if len(rows) > 1:
        best = max(r["decode_tok_s"] for _, r in rows[1:])
        print(f"pyengine / best transformers (decode): {rows[0][1]['decode_tok_s'] / best:.2f}x")


if __name__ == "__main__":
    main()
