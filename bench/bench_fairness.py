"""Fairness for expensive requests: the time to first token of an unrelated short request, idle vs
while an n=8 echo+logprobs request on a 2,000-token prompt runs (what a completions request with
n=8, echo=true, logprobs=5 asks of the engine). Same engine, same run, alternating. Goal: <= 2x idle.

    python bench/bench_fairness.py [--prompt-tokens 2000] [--n 8] [--short-tokens 64] [--repeats 3]
                                   [--long-prefill-tokens N]

The short request waits for the step in flight when it arrives, then runs beside the heavy request's
next prompt chunk, so its TTFT grows with EngineConfig.long_prefill_tokens (the chunk size).
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from engine_common import ROOT  # noqa: F401  (puts the checkout first on sys.path)

from pyengine.config import EngineConfig
from pyengine.engine.async_engine import AsyncLLM
from pyengine.sampling_params import SamplingParams


async def ttft(llm: AsyncLLM, prompt: list[int], rid: str) -> float:
    t0 = time.perf_counter()
    async for _ in llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0), rid):
        return time.perf_counter() - t0
    raise AssertionError("no output")


async def main(args) -> None:
    llm = AsyncLLM(EngineConfig(num_threads=args.threads, long_prefill_tokens=args.long_prefill_tokens))
    await llm.start()
    vocab = llm.model_config.vocab_size
    big = [(17 + 31 * i) % (vocab - 200) + 100 for i in range(args.prompt_tokens)]
    heavy = SamplingParams(n=args.n, max_tokens=16, temperature=0.8, seed=0, logprobs=5, prompt_logprobs=5)
    idle, loaded, heavy_s = [], [], []
    await ttft(llm, [5, 6, 7], "warmup")
    for r in range(args.repeats):
        short = [(97 * r + 13 * i) % (vocab - 200) + 100 for i in range(args.short_tokens)]
        idle.append(await ttft(llm, short, f"idle{r}"))
        prompt = [(t + r) % (vocab - 200) + 100 for t in big]  # a fresh prompt: no prefix-cache help

        async def run_heavy():
            t0 = time.perf_counter()
            async for _ in llm.generate(prompt, heavy, f"heavy{r}"):
                pass
            heavy_s.append(time.perf_counter() - t0)

        task = asyncio.create_task(run_heavy())
        await asyncio.sleep(args.delay)  # the heavy request is mid-prefill when the short one arrives
        short = [(89 * r + 7 * i) % (vocab - 200) + 100 for i in range(args.short_tokens)]
        loaded.append(await ttft(llm, short, f"loaded{r}"))
        await task
    await llm.shutdown()
    mi, ml = statistics.median(idle), statistics.median(loaded)
    print(f"long_prefill_tokens={llm.engine.scheduler.long_prefill_tokens}: short request ({args.short_tokens} tokens) TTFT, median of {args.repeats}: idle {mi * 1000:.0f} ms, "
          f"beside n={args.n} echo+logprobs on {args.prompt_tokens} tokens {ml * 1000:.0f} ms -> {ml / mi:.2f}x "
          f"(goal <= 2x); the heavy request took {statistics.median(heavy_s):.1f} s")
    print("idle ms:", [round(x * 1000) for x in idle], "loaded ms:", [round(x * 1000) for x in loaded])


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--short-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--delay", type=float, default=0.2, help="seconds between the heavy and the short request")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--long-prefill-tokens", type=int, default=None, help="default: the engine's")
    asyncio.run(main(ap.parse_args()))
