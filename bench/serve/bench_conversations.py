"""Stored conversations under load: N concurrent conversations x T turns through /v1/responses, each
turn chained to the last by previous_response_id, so turn t re-sends (server-side) all earlier turns.

    python -m server --store /tmp/bench.sqlite3 --max-num-seqs 32 &
    python bench/serve/bench_conversations.py --url http://127.0.0.1:8000 [--conversations 32 --turns 5] [--json out.json]

Per turn: TTFT (send -> first response.output_text.delta) p50/p95, input tokens, and the share of
them the prefix cache served (usage.input_tokens_details.cached_tokens). The prefix cache should
keep turn T's TTFT near turn 1's although its context is several times longer (goal: p50 ratio
<= 1.3). The store's own overhead per request (history read + write, from the server's
pyengine_server:response_store_time_seconds histogram) should stay <= 2 ms at p95.

So that turn 1 and turn T are measured under the same load, each of the N clients runs its
measured conversation between unmeasured ones, at a different phase: client i first runs i mod T
turns of another conversation, and T - 1 - i mod T after it; at any moment every turn number is in
flight. Before each turn a client waits a random think time in [0, --think] seconds (default: one
turn's duration, measured alone first), so turns arrive spread out, as users' do, and not in
lockstep (every turn has the same fixed output length, ignore_eos).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench.serve.serve_load import WORDS  # noqa: E402
from pyengine.report import percentiles  # noqa: E402

WAIT_METRIC = "pyengine_server:response_store_time_seconds"  # per request, as it waits (thread hops included)
WORK_METRIC = "pyengine_server:response_store_work_seconds"  # per request, on the store's thread


async def turn(session: aiohttp.ClientSession, args: argparse.Namespace, text: str,
               previous: str | None) -> dict:
    body = {"model": args.model, "input": text, "stream": True, "max_output_tokens": args.output_len,
            "ignore_eos": True, "temperature": 0, "previous_response_id": previous}
    start = time.perf_counter()
    ttft = None
    async with session.post(args.url.rstrip("/") + "/v1/responses", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[6:])
            if event["type"] == "response.output_text.delta" and ttft is None:
                ttft = time.perf_counter() - start
            elif event["type"] == "error":
                raise RuntimeError(event["message"])
            elif event["type"] in ("response.completed", "response.incomplete"):
                r = event["response"]
                return {"id": r["id"], "ttft": ttft, "input": r["usage"]["input_tokens"],
                        "cached": r["usage"]["input_tokens_details"]["cached_tokens"]}
    raise RuntimeError("the stream ended without response.completed")


async def client(session: aiohttp.ClientSession, args: argparse.Namespace, rng: random.Random, think: float,
                 phase: int) -> list[dict]:
    """Runs `phase` turns of a warm-up conversation, the measured conversation, then T - 1 - phase
    turns more; returns the measured conversation's rows."""
    await conversation(session, args, rng, think, phase)
    rows = await conversation(session, args, rng, think, args.turns)
    await conversation(session, args, rng, think, args.turns - 1 - phase)
    return rows


async def conversation(session: aiohttp.ClientSession, args: argparse.Namespace, rng: random.Random,
                       think: float, turns: int) -> list[dict]:
    rows, previous = [], None
    for _ in range(turns):
        await asyncio.sleep(rng.uniform(0, think))
        text = " ".join(rng.choice(WORDS) for _ in range(args.input_words))
        row = await turn(session, args, text, previous)
        previous = row["id"]
        rows.append(row)
    return rows


async def histograms(session: aiohttp.ClientSession, url: str) -> dict[str, dict[float, float]]:
    """Cumulative bucket counts {upper bound: count} of the two store-time histograms."""
    async with session.get(url.rstrip("/") + "/metrics") as r:
        text = await r.text()
    out: dict[str, dict[float, float]] = {WAIT_METRIC: {}, WORK_METRIC: {}}
    for line in text.splitlines():
        name = line.split("_bucket{", 1)[0]  # one model: one series per histogram
        if name in out:
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[name][float(le)] = float(line.rsplit(" ", 1)[1])
    return out


def histogram_quantile(q: float, before: dict[float, float], after: dict[float, float]) -> float | None:
    """Prometheus' histogram_quantile over the run's observations (linear within a bucket)."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] == 0:
        return None
    rank, lo, prev = q * counts[-1], 0.0, 0.0
    for b, c in zip(bounds, counts):
        if c >= rank:
            return lo if b == float("inf") else lo + (b - lo) * (rank - prev) / max(c - prev, 1e-12)
        lo, prev = b, c
    return None


async def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=args.timeout),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        if args.model is None:
            async with session.get(args.url.rstrip("/") + "/v1/models") as r:
                args.model = (await r.json())["data"][0]["id"]
        await turn(session, args, "warm up", None)
        think = args.think
        if think is None:  # one turn's duration, measured alone
            t = time.perf_counter()
            await turn(session, args, "warm up again", None)
            think = time.perf_counter() - t
        before = await histograms(session, args.url)
        t0 = time.perf_counter()
        convs = await asyncio.gather(*(client(session, args, random.Random(rng.random()), think, i % args.turns)
                                       for i in range(args.conversations)))
        wall = time.perf_counter() - t0
        after = await histograms(session, args.url)
    per_turn = []
    for t in range(args.turns):
        rows = [c[t] for c in convs]
        ttft = percentiles([r["ttft"] for r in rows], (50, 95))
        per_turn.append({"turn": t + 1, "ttft_p50_ms": 1e3 * ttft["p50"], "ttft_p95_ms": 1e3 * ttft["p95"],
                         "input_tokens_mean": sum(r["input"] for r in rows) / len(rows),
                         "cached_share": sum(r["cached"] for r in rows) / sum(r["input"] for r in rows)})
    wait = histogram_quantile(0.95, before[WAIT_METRIC], after[WAIT_METRIC])
    work = histogram_quantile(0.95, before[WORK_METRIC], after[WORK_METRIC])
    requests = after[WAIT_METRIC].get(float("inf"), 0) - before[WAIT_METRIC].get(float("inf"), 0)
    return {"conversations": args.conversations, "turns": args.turns, "wall_s": wall, "think_s": think,
            "per_turn": per_turn,
            "ttft_p50_ratio_last_vs_first": per_turn[-1]["ttft_p50_ms"] / per_turn[0]["ttft_p50_ms"],
            "context_ratio_last_vs_first": per_turn[-1]["input_tokens_mean"] / per_turn[0]["input_tokens_mean"],
            "store_wait_p95_ms": None if wait is None else 1e3 * wait,
            "store_work_p95_ms": None if work is None else 1e3 * work, "store_requests": int(requests)}


def table(rep: dict) -> str:
    lines = [f"{rep['conversations']} conversations x {rep['turns']} turns in {rep['wall_s']:.1f} s "
             f"(think time up to {rep['think_s']:.2f} s before each turn)",
             f"{'turn':>4} {'TTFT p50 ms':>12} {'TTFT p95 ms':>12} {'input tok':>10} {'cached':>7}"]
    for r in rep["per_turn"]:
        lines.append(f"{r['turn']:>4} {r['ttft_p50_ms']:>12.1f} {r['ttft_p95_ms']:>12.1f} "
                     f"{r['input_tokens_mean']:>10.0f} {100 * r['cached_share']:>6.1f}%")
    lines.append(f"TTFT p50 turn {rep['turns']} / turn 1: {rep['ttft_p50_ratio_last_vs_first']:.2f}x "
                 f"(goal <= 1.3x) with {rep['context_ratio_last_vs_first']:.1f}x the context")
    lines.append(f"store p95 over {rep['store_requests']} requests (goal <= 2 ms): "
                 f"{_ms(rep['store_wait_p95_ms'])} waited per request (thread hops included), "
                 f"{_ms(rep['store_work_p95_ms'])} of the store's own work per request")
    return "\n".join(lines)


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f} ms"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=os.environ.get("PYENGINE_API_KEY"))
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--input-words", type=int, default=40, help="words of new user input per turn")
    p.add_argument("--output-len", type=int, default=32, help="output tokens per turn")
    p.add_argument("--think", type=float, default=None, help="most seconds a conversation waits before a turn")
    p.add_argument("--seed", type=int, default=None, help="of the random inputs (default: a new one, so a rerun "
                   "against the same server does not find its turns in the prefix cache)")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--json", default=None, help="also write the report here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rep = asyncio.run(run(args))
    print(table(rep))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
