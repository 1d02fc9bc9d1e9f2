"""Offline throughput on a long-tailed request mix: lognormal prompt lengths (20..2000 tokens) and
output lengths (10..500), greedy, EOS ignored so every request produces its drawn length.
pyengine (continuous batching) vs transformers generate with static batches (left-padded, each
batch runs until its longest request is done), in the same run.

    python bench/engine/throughput.py [--num-requests 200] [--threads 2] [--hf-batch-size 16] [--hf-requests 32]

transformers runs on the first --hf-requests requests only (it is slow); tokens/s compare directly.
"""
from __future__ import annotations

import argparse

import numpy as np
import pyengine  # noqa: F401  (before torch: it sets the OpenMP spin policy)
import torch

import os

import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout

from bench.common import Timer, load_hf


def make_requests(n: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    plen = np.clip(rng.lognormal(mean=np.log(200), sigma=1.0, size=n), 20, 2000).astype(int)
    olen = np.clip(rng.lognormal(mean=np.log(80), sigma=0.9, size=n), 10, 500).astype(int)
    prompts = [rng.integers(100, 40000, size=p).tolist() for p in plen]
    return prompts, olen.tolist()


def bench_pyengine(prompts, olens, args) -> dict:
    from pyengine import LLM, SamplingParams

    llm = LLM(dtype=args.dtype, num_threads=args.threads, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=args.kv_gib << 30,
              enable_prefix_caching=False)
    params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for o in olens]
    llm.generate([prompts[0][:32]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    with Timer() as t:
        outs = llm.generate(prompts, params, use_tqdm=True)
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    assert gen == sum(olens)
    stats = llm.engine.stats()
    return {"requests": len(prompts), "gen_tokens": gen, "s": t.s, "steps": stats.num_steps,
            "preemptions": stats.num_preemptions}


def bench_hf(prompts, olens, args) -> dict:
    model = load_hf(torch.float32 if args.dtype == "float32" else torch.bfloat16)
    gen, total = 0, 0.0
    bs = args.hf_batch_size
    with torch.inference_mode():
        for i in range(0, len(prompts), bs):
            batch, outs = prompts[i:i + bs], olens[i:i + bs]
            width = max(map(len, batch))
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for j, p in enumerate(batch):  # left padding
                ids[j, width - len(p):] = torch.tensor(p)
                mask[j, width - len(p):] = 1
            with Timer() as t:
                model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max(outs),
                               min_new_tokens=max(outs), pad_token_id=0)
            total += t.s
            gen += sum(outs)  # useful tokens: what each request asked for
    return {"requests": len(prompts), "gen_tokens": gen, "s": total}


def report(name: str, r: dict) -> None:
    extra = f", {r['steps']} steps, {r['preemptions']} preemptions" if "steps" in r else ""
    print(f"{name}: {r['gen_tokens'] / r['s']:.1f} generated tok/s, {r['requests'] / r['s']:.2f} req/s "
          f"({r['requests']} requests in {r['s']:.1f}s{extra})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--kv-gib", type=int, default=4)
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--hf-requests", type=int, default=64)
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts, olens = make_requests(args.num_requests)
    print(f"{len(prompts)} requests: prompt tokens {sum(map(len, prompts))} (median {int(np.median(list(map(len, prompts))))}),"
          f" output tokens {sum(olens)} (median {int(np.median(olens))}); {args.threads} threads, {args.dtype}")
    rows = [("pyengine", bench_pyengine(prompts, olens, args))]
    report(*rows[0])
    if not args.skip_hf:
        k = min(args.hf_requests, len(prompts))
        rows.append((f"transformers (static batch {args.hf_batch_size}, first {k})", bench_hf(prompts[:k], olens[:k], args)))
        report(*rows[1])
    if len(rows) > 1:
        a, b = rows[0][1], rows[1][1]
        print(f"pyengine / transformers: {(a['gen_tokens'] / a['s']) / (b['gen_tokens'] / b['s']):.2f}x generated tok/s")


if __name__ == "__main__":
    main()
