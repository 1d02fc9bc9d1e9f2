"""Fairness for expensive requests: the time to first token of an unrelated short request, idle vs
while an n=8 echo+logprobs request on a 2,000-token prompt runs (what a completions request with
n=8, echo=true, logprobs=5 asks of the engine). Same engine, same run, alternating. Goal: <= 2x idle.

    python bench/engine/bench_fairness.py [--prompt-tokens 2000] [--n 8] [--short-tokens 64] [--repeats 3]
                                   [--long-prefill-tokens N] [--solo-prefill-tokens N] [--cpu-steps]

The short request waits for the step in flight when it arrives, then goes first: the heavy request's
next prompt chunk makes room for its first chunk. So its TTFT is about what is left of the step in
flight plus one chunk's step, and grows with EngineConfig.long_prefill_tokens (the chunk size). A step
that is a chunk of the heavy prompt alone (solo_prefill_tokens) is interrupted instead
(pyengine/interrupt.py): the short request waits for about one layer of it.
Also printed: the heavy request's own end-to-end time alone (what the fairness costs it).

--cpu-steps: the same on the synchronous engine with one thread, timed in CPU seconds of the steps
(steady on a loaded machine, where wall-clock TTFTs are noise): the short request arrives at a
step boundary of the heavy request's prompt; "worst" adds what the heaviest step of the heavy
request's whole life (run alone: prompt chunks, the children's first step, decodes) in flight on
arrival costs it: all of a step that cannot be interrupted, one layer's share of a solo one.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import os

import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout

from bench.common import ROOT  # noqa: F401  (puts the checkout first on sys.path)

from pyengine.config import EngineConfig
from pyengine.engine.async_engine import AsyncLLM
from pyengine.sampling_params import SamplingParams


async def ttft(llm: AsyncLLM, prompt: list[int], rid: str) -> float:
    t0 = time.perf_counter()
    async for _ in llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0), rid):
        return time.perf_counter() - t0
    raise AssertionError("no output")


async def main(args) -> None:
    llm = AsyncLLM(EngineConfig(num_threads=args.threads, long_prefill_tokens=args.long_prefill_tokens,
                                solo_prefill_tokens=args.solo_prefill_tokens))
    await llm.start()
    vocab = llm.model_config.vocab_size
    big = [(17 + 31 * i) % (vocab - 200) + 100 for i in range(args.prompt_tokens)]
    heavy = SamplingParams(n=args.n, max_tokens=16, temperature=0.8, seed=0, logprobs=5, prompt_logprobs=5)
    idle, loaded, heavy_s = [], [], []
    await ttft(llm, [5, 6, 7], "warmup")
    t0 = time.perf_counter()
    async for _ in llm.generate([(t + args.repeats) % (vocab - 200) + 100 for t in big], heavy, "alone"):
        pass
    alone = time.perf_counter() - t0
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
    print(f"long_prefill_tokens={llm.engine.scheduler.long_prefill_tokens}, solo_prefill_tokens="
          f"{llm.engine.scheduler.solo_prefill_tokens}: short request ({args.short_tokens} tokens) TTFT, median of {args.repeats}: idle {mi * 1000:.0f} ms, "
          f"beside n={args.n} echo+logprobs on {args.prompt_tokens} tokens {ml * 1000:.0f} ms -> {ml / mi:.2f}x "
          f"(goal <= 2x); the heavy request took {statistics.median(heavy_s):.1f} s, {alone:.1f} s alone")
    print("idle ms:", [round(x * 1000) for x in idle], "loaded ms:", [round(x * 1000) for x in loaded])


def cpu_steps(args) -> None:
    from pyengine.engine.engine import Engine

    engine = Engine(EngineConfig(num_threads=1, long_prefill_tokens=args.long_prefill_tokens,
                                 solo_prefill_tokens=args.solo_prefill_tokens))
    vocab = engine.model_config.vocab_size

    def timed_step() -> tuple[float, list]:
        t0 = time.process_time()
        outs = engine.step()
        return time.process_time() - t0, outs

    def first_token(prompt: list[int], rid: str) -> float:
        """CPU seconds of the steps from adding `rid` to its first token."""
        engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0))
        total = 0.0
        while True:
            seconds, outs = timed_step()
            total += seconds
            if any(o.request_id == rid for o in outs):
                return total

    heavy = SamplingParams(n=args.n, max_tokens=16, temperature=0.8, seed=0, logprobs=5, prompt_logprobs=5)

    def heavy_prompt(r: int) -> list[int]:
        return [(17 + 31 * i + r) % (vocab - 200) + 100 for i in range(args.prompt_tokens)]

    solo: list[bool] = []  # per model run: a solo step (interrupted by an arrival: one layer of it is waited for)
    run = engine._run_isolating

    def run_noting_solo(sched, *rest):
        solo.append(sched.solo)
        return run(sched, *rest)

    engine._run_isolating = run_noting_solo
    layers = engine.model_config.num_hidden_layers
    first_token([5, 6, 7], "warmup")
    idle, loaded, chunk, alone, heaviest = [], [], [], [], []
    for r in range(args.repeats):
        idle.append(first_token([(97 * r + 13 * i) % (vocab - 200) + 100 for i in range(args.short_tokens)], f"i{r}"))
        engine.add_request(f"a{r}", heavy_prompt(args.repeats + r), heavy)  # alone, start to finish
        steps = []
        while engine.has_unfinished():
            steps.append(timed_step()[0])
        alone.append(sum(steps))
        heaviest.append(max(t / layers if s else t for t, s in zip(steps, solo[-len(steps):])))
        engine.add_request(f"h{r}", heavy_prompt(r), heavy)
        chunk += [timed_step()[0] for _ in range(3)]
        loaded.append(first_token([(89 * r + 7 * i) % (vocab - 200) + 100 for i in range(args.short_tokens)], f"l{r}"))
        engine.abort_request(f"h{r}")
    mi, ml, mc, mh, ma = (statistics.median(x) for x in (idle, loaded, chunk, heaviest, alone))
    print(f"long_prefill_tokens={engine.scheduler.long_prefill_tokens}, solo_prefill_tokens="
          f"{engine.scheduler.solo_prefill_tokens}, 1 thread, CPU ms (median of {args.repeats}): "
          f"short request ({args.short_tokens} tokens) alone {mi * 1000:.0f}; arriving at a step boundary of "
          f"n={args.n} echo+logprobs on {args.prompt_tokens} tokens {ml * 1000:.0f} -> {ml / mi:.2f}x; "
          f"heavy prompt chunk {mc * 1000:.0f}, heaviest heavy step's cost to an arrival {mh * 1000:.0f}; worst (that "
          f"step in flight) {(ml + mh) / mi:.2f}x (goal <= 2x); the heavy request alone {ma:.2f} CPU s")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--short-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--delay", type=float, default=0.2, help="seconds between the heavy and the short request")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--long-prefill-tokens", type=int, default=None, help="default: the engine's")
    ap.add_argument("--solo-prefill-tokens", type=int, default=None, help="default: the engine's")
    ap.add_argument("--cpu-steps", action="store_true", help="time the steps in CPU seconds (see above)")
    args = ap.parse_args()
    if args.cpu_steps:
        cpu_steps(args)
    else:
        asyncio.run(main(args))
