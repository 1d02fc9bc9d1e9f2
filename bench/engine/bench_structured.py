"""Decode throughput with a JSON schema on every request vs unconstrained, same run.

Batch 32, short prompts, 128 generated tokens per request, temperature 1.0 in both modes (so both
take the native sampler). The schema (a list of at least 100 {name, qty} objects) cannot finish
within 128 tokens, so every constrained request runs its full 128 tokens, like the unconstrained
ones (ignore_eos). Rounds alternate between the modes; the best round of each is reported, with
the time spent filling grammar bitmasks per step.

    python bench/engine/bench_structured.py [--threads 2] [--device cpu] [--rounds 3]
"""
from __future__ import annotations

import argparse
import random

import pyengine  # noqa: F401  (before torch: it sets the OpenMP spin policy)
import torch

import os

import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout

from bench.common import Timer

BATCH, PROMPT, GEN = 32, 16, 128
SCHEMA = {"type": "object", "properties": {"items": {
    "type": "array", "minItems": 100,
    "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "qty": {"type": "integer", "minimum": 0, "maximum": 999}},
              "required": ["name", "qty"]}}}, "required": ["items"]}


def run(llm, prompts, constrained: bool) -> dict:
    from pyengine import SamplingParams, StructuredOutputsParams

    so = StructuredOutputsParams(json=SCHEMA) if constrained else None
    params = [SamplingParams(max_tokens=GEN, temperature=1.0, seed=i, ignore_eos=not constrained,
                             structured_outputs=so) for i in range(len(prompts))]
    engine = llm.engine
    steps0, mask0 = engine.num_steps, engine.runner.mask_time
    with Timer() as t:
        outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == GEN * len(prompts), "every request must run its full length"
    steps = engine.num_steps - steps0
    return {"tok_s": tokens / t.s, "s": t.s, "steps": steps,
            "mask_ms_per_step": 1e3 * (engine.runner.mask_time - mask0) / steps}


def main() -> None:
    from pyengine import LLM

    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    llm = LLM(device=args.device, num_threads=args.threads if args.device == "cpu" else None,
              kv_cache_memory=512 << 20, max_num_seqs=BATCH)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(PROMPT)] for _ in range(BATCH)]
    run(llm, prompts[:4], True)  # warm-up (and the schema's one compile)
    run(llm, prompts[:4], False)
    best: dict[str, dict] = {}
    for _ in range(args.rounds):
        for name, constrained in (("unconstrained", False), ("json schema", True)):
            r = run(llm, prompts, constrained)
            if name not in best or r["tok_s"] > best[name]["tok_s"]:
                best[name] = r
    print(f"batch {BATCH}, prompt {PROMPT}, generate {GEN}, device {args.device}, best of {args.rounds} rounds")
    print(f"{'mode':<14} {'tok/s':>8} {'wall s':>7} {'steps':>6} {'mask ms/step':>13}")
    for name, r in best.items():
        print(f"{name:<14} {r['tok_s']:8.1f} {r['s']:7.2f} {r['steps']:6d} {r['mask_ms_per_step']:13.3f}")
    print(f"ratio json/unconstrained: {best['json schema']['tok_s'] / best['unconstrained']['tok_s']:.3f}")


if __name__ == "__main__":
    main()
