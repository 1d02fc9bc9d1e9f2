"""How long one large request stalls the other streams of a running `python -m server`.

    python bench/serve/loop_stall.py --url http://127.0.0.1:8000 [--size-mb 1] [--repeats 3]

A streaming completion runs (ignore_eos) while, one after another, large requests arrive: a chat
request and a completion whose ~1 MB text the server must template and tokenize before it can
refuse them for the context length, and a /tokenize call of the same text. Everything the server
does for them on its event loop delays the stream's next chunk, so the report is the stream's
longest gap between two chunks while each large request was in progress, next to its median gap.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import aiohttp


async def stream(session: aiohttp.ClientSession, url: str, max_tokens: int, stamps: list[float],
                 started: asyncio.Event) -> None:
    body = {"prompt": "Count to a thousand:", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0}
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise SystemExit(f"the stream got {r.status}: {await r.text()}")
        async for line in r.content:
            if line.startswith(b"data: {"):
                stamps.append(time.perf_counter())
                if len(stamps) == 20:
                    started.set()


async def large(session: aiohttp.ClientSession, url: str, kind: str, text: str) -> tuple[float, float, int]:
    path, body = {
        "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 1}),
        "completion": ("/v1/completions", {"prompt": text, "max_tokens": 1}),
        "tokenize": ("/tokenize", {"prompt": text}),
    }[kind]
    t0 = time.perf_counter()
    async with session.post(url + path, data=json.dumps(body)) as r:
        await r.read()
        return t0, time.perf_counter(), r.status


def max_gap(stamps: list[float], t0: float, t1: float) -> float:
    """Longest gap between chunks that overlaps [t0, t1] (counting the time up to t1 if none came)."""
    inside = [s for s in stamps if s >= t0]
    before = [s for s in stamps if s < t0]
    points = before[-1:] + [s for s in inside if s <= t1] + [s for s in inside if s > t1][:1]
    return max((b - a for a, b in zip(points, points[1:])), default=t1 - t0)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--size-mb", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--stream-tokens", type=int, default=900,
                    help="length of the background stream (it must outlast the large requests)")
    args = ap.parse_args()
    text = ("lorem ipsum dolor sit amet " * int(args.size_mb * 2**20 / 27 + 1))[: int(args.size_mb * 2**20)]
    stamps: list[float] = []
    started = asyncio.Event()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        task = asyncio.create_task(stream(session, args.url, args.stream_tokens, stamps, started))
        await asyncio.wait([task, asyncio.create_task(started.wait())], return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()  # the stream failed or ended before it was under way
        rows = []
        for kind in ("chat", "completion", "tokenize"):
            for _ in range(args.repeats):
                await asyncio.sleep(0.3)  # let the stream settle between large requests
                t0, t1, status = await large(session, args.url, kind, text)
                rows.append((kind, status, t1 - t0, max_gap(stamps, t0, t1)))
        task.cancel()
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    print(f"stream: {len(stamps)} chunks, median gap {statistics.median(gaps) * 1e3:.0f} ms")
    print(f"{'request':<12}{'status':>7}{'latency ms':>12}{'stream max gap ms':>19}")
    for kind, status, latency, gap in rows:
        print(f"{kind:<12}{status:>7}{latency * 1e3:>12.0f}{gap * 1e3:>19.0f}")


if __name__ == "__main__":
    asyncio.run(main())
