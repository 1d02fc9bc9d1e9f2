"""Decode with a quantized KV cache: 16 sequences x 4,000-token prompts, then 64 decode steps
(greedy, EOS ignored), default model (its Q4_1 weights on the int8 kernels, bf16 activations), KV cache
bf16 / int8 / fp8, their steps interleaved in one run. --dtype float32: fp32 activations and an fp32
cache in place of bf16 (what CPUs without AVX512-BF16 run by default).

    python bench/engine/bench_kv_decode.py [--threads 2] [--seqs 16] [--prompt 4000] [--steps 64]
                                    [--block-sizes 16,128] [--fp8-paths] [--dtype bfloat16|float32]

One engine per (block size, cache) on the same weights; each runs its prefills untimed, then the
engines take turns, one decode step each (seqs tokens: every sequence decodes), each step timed on
its own. The machine's bandwidth drifts by tens of percent over minutes; steps taken in turn see
the same drift, so the ratios hold where whole runs one after another did not. At this size a step
reads about fifteen times more K/V (1.5 GB in bf16) than weights (the 94 MB file), so the cache's
bytes set the pace when attention streams at memory speed. The table shows tok/s at each engine's
median step time (and its fastest), with the ratio to bf16. --fp8-paths adds an fp8 engine whose
steps run the decode kernel capped to avx512_bf16 (fp8 codes widened to bf16), beside the default
fp8 one (fp16 FMAs on CPUs with AVX512-FP16).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import os

import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout

from bench.common import CAPPED_DECODE as CAPPED  # (also puts the checkout first on sys.path)
import pyengine  # noqa: F401  (before torch: it sets the OpenMP spin policy)
import torch

KV_DTYPES = ("auto", "int8", "fp8")


def prefilled_engine(parts, kv: str, prompts: list[list[int]], steps: int, threads: int, block_size: int,
                     dtype: str):
    """An engine whose sequences have all finished their prefills (each decodes from its next step)."""
    from pyengine.config import EngineConfig
    from pyengine.engine.engine import Engine
    from pyengine.model.metadata import kv_bytes_per_token
    from pyengine.sampling_params import SamplingParams

    max_len = len(prompts[0]) + steps + 32
    cache_dtype = {"auto": getattr(torch, dtype), "int8": torch.int8, "fp8": torch.float8_e4m3fn}[kv]
    # whole blocks for every sequence's max_len, and one spare: with less, a step preempts sequences
    blocks = len(prompts) * (-(-max_len // block_size) + 1)
    config = EngineConfig(dtype=dtype, kv_cache_dtype=kv, max_model_len=max_len, max_num_seqs=len(prompts),
                          enable_prefix_caching=False, num_threads=threads, block_size=block_size,
                          kv_cache_memory=blocks * block_size * kv_bytes_per_token(parts[0], cache_dtype))
    engine = Engine(config, parts=parts)
    params = SamplingParams(max_tokens=steps + 16, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params, prompt_token_ids=p)
    requests = [engine.groups[str(i)].children[0] for i in range(len(prompts))]
    while any(r.num_output_tokens == 0 for r in requests):
        engine.step()
    return engine


def decoded_tokens(engine) -> int:
    """Output tokens of the engine's sequences so far."""
    return sum(r.num_output_tokens for g in engine.groups.values() for r in g.children)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=4000)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--block-sizes", default="16", help="comma-separated KV block sizes (tokens), one row each per cache")
    ap.add_argument("--fp8-paths", action="store_true", help="also fp8 on the avx512_bf16 decode path (fp8@bf16)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="activations, and the cache of the 'auto' rows")
    args = ap.parse_args()
    from pyengine import _C
    from pyengine.model.loader import load_model, resolve_model_path
    from pyengine.tokenizer import Tokenizer

    path = resolve_model_path(None)
    cfg, model = load_model(path, getattr(torch, args.dtype), torch.device("cpu"))
    parts = (cfg, model, Tokenizer.from_model_path(path), "smollm2-135m")
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 40000) for _ in range(args.prompt)] for _ in range(args.seqs)]
    sizes = [int(b) for b in args.block_sizes.split(",")]
    kinds = KV_DTYPES + (tuple(CAPPED) if args.fp8_paths else ())
    runs = [(bs, kv) for bs in sizes for kv in kinds]
    engines = {}
    for bs, kv in runs:
        print(f"prefilling: block {bs:>3} kv {kv:>4}", flush=True)
        engines[bs, kv] = prefilled_engine(parts, CAPPED.get(kv, (kv,))[0], prompts, args.steps, args.threads, bs,
                                           args.dtype)
    times: dict[tuple[int, str], list[float]] = {run: [] for run in runs}
    default_path = _C.decode_attention_path()
    for _ in range(args.steps):
        for bs, kv in runs:
            _C.set_decode_attention_path(CAPPED[kv][1] if kv in CAPPED else default_path)
            before = decoded_tokens(engines[bs, kv])
            t0 = time.perf_counter()
            engines[bs, kv].step()
            times[bs, kv].append(time.perf_counter() - t0)
            if decoded_tokens(engines[bs, kv]) - before != args.seqs:  # the table's tok/s assumes it
                raise SystemExit(f"block {bs} kv {kv}: a step decoded {decoded_tokens(engines[bs, kv]) - before} "
                                 f"tokens, not {args.seqs} (preempted or finished sequences)")
    _C.set_decode_attention_path(default_path)
    median = {run: args.seqs / statistics.median(ts) for run, ts in times.items()}
    act = {"bfloat16": "bf16", "float32": "fp32"}[args.dtype]
    print(f"\n{args.seqs} x {args.prompt}-token prompts, {args.steps} decode steps each, taken in turn, "
          f"{args.threads} threads, default model (Q4_1 weights, {act} activations)")
    first = f"x {act}@{sizes[0]}"
    print(f"{'block':>5} {'KV cache':>8} {'tok/s (median)':>15} {'(fastest)':>10} {'x ' + act:>7} {first:>10}")
    for bs, kv in runs:
        print(f"{bs:>5} {act if kv == 'auto' else kv:>8} {median[bs, kv]:>15.1f} "
              f"{args.seqs / min(times[bs, kv]):>10.1f} {median[bs, kv] / median[bs, 'auto']:>6.2f}x "
              f"{median[bs, kv] / median[sizes[0], 'auto']:>9.2f}x")


if __name__ == "__main__":
    main()
