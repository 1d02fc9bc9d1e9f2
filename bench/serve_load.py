"""Load generator for a running `python -m server`: N concurrent streaming clients.

    python bench/serve_load.py --url http://127.0.0.1:8000 --concurrency 8 --num-requests 32 \
        --prompt-len 128 --output-len 64 [--endpoint chat|completions] [--json out.json]

Each client sends streaming requests back to back (closed loop) with ignore_eos so every request
produces exactly --output-len tokens. Per request: TTFT (send -> first token), TPOT
((E2E - TTFT) / (tokens - 1)), E2E, and the gaps between tokens (ITL). Reports p50/p90/p99 and
throughput (output tokens/s, requests/s) as a table and, with --json, as JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

import aiohttp

WORDS = ("time person year way day thing man world life hand part child eye woman place work week "
         "case point number group problem fact river stone light cloud engine paper window").split()


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def make_prompt(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


async def one_request(session: aiohttp.ClientSession, args: argparse.Namespace, prompt: str) -> Result:
    common = {"model": args.model, "max_tokens": args.output_len, "stream": True, "ignore_eos": True,
              "temperature": args.temperature, "stream_options": {"include_usage": True}}
    if args.endpoint == "chat":
        url, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], **common}
    else:
        url, body = "/v1/completions", {"prompt": prompt, **common}
    res = Result(ok=False)
    start = last = time.perf_counter()
    try:
        async with session.post(args.url.rstrip("/") + url, json=body) as resp:
            if resp.status != 200:
                res.error = f"{resp.status}: {(await resp.text())[:200]}"
                return res
            async for raw in resp.content:  # one SSE line at a time
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"]["message"]
                    return res
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                for c in chunk["choices"]:
                    piece = c.get("text") if "text" in c else c.get("delta", {}).get("content")
                    if piece:
                        now = time.perf_counter()
                        if res.ttft == 0.0:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last = now
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        res.error = repr(e)
        return res
    res.e2e = time.perf_counter() - start
    res.ok = res.output_tokens > 0
    return res


def percentiles(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    xs = sorted(xs)

    def p(q: float) -> float:  # nearest rank
        return xs[min(len(xs) - 1, max(0, int(round(q / 100 * len(xs) + 0.5)) - 1))]

    return {"mean": statistics.fmean(xs), "p50": p(50), "p90": p(90), "p99": p(99)}


async def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    prompts = [make_prompt(rng, args.prompt_len) for _ in range(args.num_requests)]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    connector = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector) as session:
        if args.model is None:
            async with session.get(args.url.rstrip("/") + "/v1/models") as r:
                args.model = (await r.json())["data"][0]["id"]
        for _ in range(args.warmup):
            await one_request(session, args, make_prompt(rng, args.prompt_len))
        queue = list(reversed(prompts))
        results: list[Result] = []

        async def client() -> None:
            while queue:
                results.append(await one_request(session, args, queue.pop()))

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(args.concurrency)))
        wall = time.perf_counter() - t0
    good = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in good)
    return {
        "config": {k: v for k, v in vars(args).items() if k not in ("api_key", "json")},
        "completed": len(good), "failed": len(results) - len(good),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": wall,
        "prompt_tokens": sum(r.prompt_tokens for r in good), "output_tokens": out_tokens,
        "request_throughput": len(good) / wall, "output_throughput": out_tokens / wall,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in good)) / wall,
        "ttft_s": percentiles([r.ttft for r in good]),
        "tpot_s": percentiles([r.tpot for r in good if r.tpot is not None]),
        "itl_s": percentiles([x for r in good for x in r.itl]),
        "e2e_s": percentiles([r.e2e for r in good]),
    }


def table(rep: dict) -> str:
    lines = [f"requests: {rep['completed']} ok, {rep['failed']} failed in {rep['duration_s']:.2f} s",
             f"tokens: {rep['prompt_tokens']} prompt, {rep['output_tokens']} output",
             f"throughput: {rep['request_throughput']:.2f} req/s, {rep['output_throughput']:.1f} output tok/s, "
             f"{rep['total_token_throughput']:.1f} total tok/s",
             f"{'metric (ms)':<12}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}"]
    for name in ("ttft", "tpot", "itl", "e2e"):
        p = rep[f"{name}_s"]
        cells = "".join(f"{p[k] * 1000:>10.1f}" if p[k] is not None else f"{'-':>10}"
                        for k in ("mean", "p50", "p90", "p99"))
        lines.append(f"{name.upper():<12}{cells}")
    for e in rep["errors"]:
        lines.append(f"error: {e}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--model", default=None, help="model name; default: the server's first model")
    p.add_argument("--api-key", default=None)
    p.add_argument("--endpoint", choices=["chat", "completions"], default="completions")
    p.add_argument("--concurrency", type=int, default=8, help="concurrent streaming clients")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128, help="prompt length in words (about tokens)")
    p.add_argument("--output-len", type=int, default=64, help="tokens per response (ignore_eos)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=1, help="requests sent before measuring")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the report as JSON to this path")
    args = p.parse_args(argv)
    rep = asyncio.run(run(args))
    print(table(rep))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=2)
    return 0 if rep["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
