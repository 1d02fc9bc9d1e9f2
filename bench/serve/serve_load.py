"""Load generator for a running `python -m server`: closed-loop clients, open-loop Poisson
arrivals, long-tailed lengths, replay of a request log, and sweeps with plots.

    # closed loop: N clients send back to back
    python bench/serve/serve_load.py --url http://127.0.0.1:8000 --concurrency 8 --num-requests 32 \
        --prompt-len 128 --output-len 64 [--endpoint chat|completions] [--json out.json]
    # open loop: Poisson arrivals at 2 req/s, long-tailed prompt and output lengths
    python bench/serve/serve_load.py --request-rate 2 --length-dist lognormal --num-requests 100
    # replay the arrival times and lengths of a request log (python -m server --request-log)
    python bench/serve/serve_load.py --replay requests.csv --replay-speed 2
    # sweep: one run per rate (or concurrency), a report and plots, goodput under an SLO
    python bench/serve/serve_load.py --sweep rate:0.5,1,2,4 --slo-ttft 500 --slo-tpot 100 --out sweep/

Every request streams with ignore_eos, so it produces exactly its output length. Per request:
TTFT (send -> first token), TPOT ((E2E - TTFT) / (tokens - 1)), E2E, and the gaps between tokens
(ITL); each carries `X-Request-Id: <tag>-<i>`, so its row in the server's request log is known.
Goodput: requests per second that met both SLOs (milliseconds).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from pyengine.report import percentiles as report_percentiles  # noqa: E402
from pyengine.request_log import read_records  # noqa: E402

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


async def one_request(session: aiohttp.ClientSession, args: argparse.Namespace, prompt: str, max_tokens: int,
                      index: int | None) -> Result:
    common = {"model": args.model, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
              "temperature": args.temperature, "stream_options": {"include_usage": True}}
    if args.endpoint == "chat":
        url, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], **common}
    else:
        url, body = "/v1/completions", {"prompt": prompt, **common}
    res = Result(ok=False)
    start = last = time.perf_counter()
    try:
        headers = {"X-Request-Id": f"{args.tag}-{index}"} if index is not None else None
        async with session.post(args.url.rstrip("/") + url, json=body, headers=headers) as resp:
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
    """mean and p50/p90/p95/p99 as pyengine.report computes them; all None without samples."""
    return report_percentiles(xs, (50, 90, 95, 99)) or dict.fromkeys(("mean", "p50", "p90", "p95", "p99"))


def sample_lengths(rng: random.Random, args: argparse.Namespace, n: int) -> list[tuple[int, int]]:
    """(prompt words, output tokens) per request: fixed, or long-tailed with the given means
    (lognormal sigma 1, or Pareto alpha 1.5), clipped to [1, 8 x mean]."""
    def draw(mean: int) -> int:
        if args.length_dist == "fixed":
            return mean
        if args.length_dist == "lognormal":
            x = rng.lognormvariate(math.log(mean) - 0.5, 1.0)  # E = mean
        else:
            x = mean / 3 * rng.paretovariate(1.5)  # E = mean
        return max(1, min(int(round(x)), 8 * mean))

    return [(draw(args.prompt_len), draw(args.output_len)) for _ in range(n)]


def make_schedule(rng: random.Random, args: argparse.Namespace) -> list[tuple[float, int, int]]:
    """(send time offset in s, prompt words, output tokens) per request; closed-loop runs ignore
    the offsets."""
    if args.replay:
        rows = sorted((r for r in read_records(args.replay) if r["status"] == 200), key=lambda r: r["start_ts"])
        rows = rows[: args.num_requests] if args.num_requests else rows
        t0 = rows[0]["start_ts"]
        return [((r["start_ts"] - t0) / args.replay_speed, max(1, r["input_tokens"]), max(1, r["output_tokens"]))
                for r in rows]
    lengths = sample_lengths(rng, args, args.num_requests)
    t, out = 0.0, []
    for p, o in lengths:
        out.append((t, p, o))
        if args.request_rate != math.inf:
            t += rng.expovariate(args.request_rate)  # Poisson arrivals
    return out


async def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    schedule = make_schedule(rng, args)
    prompts = [make_prompt(rng, p) for _, p, _ in schedule]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    open_loop = args.request_rate != math.inf or args.replay
    limit = args.concurrency if not open_loop else (args.max_concurrency or 0)
    connector = aiohttp.TCPConnector(limit=limit)
    results: list[Result] = []
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector) as session:
        if args.model is None:
            async with session.get(args.url.rstrip("/") + "/v1/models") as r:
                args.model = (await r.json())["data"][0]["id"]
        for _ in range(args.warmup):
            await one_request(session, args, make_prompt(rng, args.prompt_len), args.output_len, None)
        t0 = time.perf_counter()
        if open_loop:
            sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

            async def send(i: int) -> None:
                await asyncio.sleep(max(0.0, t0 + schedule[i][0] - time.perf_counter()))
                if sem is None:
                    results.append(await one_request(session, args, prompts[i], schedule[i][2], i))
                    return
                async with sem:
                    results.append(await one_request(session, args, prompts[i], schedule[i][2], i))

            await asyncio.gather(*(send(i) for i in range(len(schedule))))
        else:
            queue = list(reversed(range(len(schedule))))

            async def client() -> None:
                while queue:
                    i = queue.pop()
                    results.append(await one_request(session, args, prompts[i], schedule[i][2], i))

            await asyncio.gather(*(client() for _ in range(args.concurrency)))
        wall = time.perf_counter() - t0
    return report(args, results, wall)


def report(args: argparse.Namespace, results: list[Result], wall: float) -> dict:
    good = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in good)
    slo_ok = [r for r in good if (args.slo_ttft is None or r.ttft * 1e3 <= args.slo_ttft)
              and (args.slo_tpot is None or r.tpot is None or r.tpot * 1e3 <= args.slo_tpot)]
    return {
        "config": {k: v for k, v in vars(args).items() if k not in ("api_key", "json")},
        "completed": len(good), "failed": len(results) - len(good),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": wall,
        "prompt_tokens": sum(r.prompt_tokens for r in good), "output_tokens": out_tokens,
        "request_throughput": len(good) / wall, "output_throughput": out_tokens / wall,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in good)) / wall,
        "goodput": len(slo_ok) / wall, "slo_attainment": len(slo_ok) / len(results) if results else None,
        "ttft_s": percentiles([r.ttft for r in good]),
        "tpot_s": percentiles([r.tpot for r in good if r.tpot is not None]),
        "itl_s": percentiles([x for r in good for x in r.itl]),
        "e2e_s": percentiles([r.e2e for r in good]),
    }


def table(rep: dict) -> str:
    lines = [f"requests: {rep['completed']} ok, {rep['failed']} failed in {rep['duration_s']:.2f} s",
             f"tokens: {rep['prompt_tokens']} prompt, {rep['output_tokens']} output",
             f"throughput: {rep['request_throughput']:.2f} req/s, {rep['output_throughput']:.1f} output tok/s, "
             f"{rep['total_token_throughput']:.1f} total tok/s; goodput {rep['goodput']:.2f} req/s",
             f"{'metric (ms)':<12}{'mean':>10}{'p50':>10}{'p90':>10}{'p95':>10}{'p99':>10}"]
    for name in ("ttft", "tpot", "itl", "e2e"):
        p = rep[f"{name}_s"]
        cells = "".join(f"{p[k] * 1000:>10.1f}" if p[k] is not None else f"{'-':>10}"
                        for k in ("mean", "p50", "p90", "p95", "p99"))
        lines.append(f"{name.upper():<12}{cells}")
    for e in rep["errors"]:
        lines.append(f"error: {e}")
    return "\n".join(lines)


def sweep(args: argparse.Namespace) -> list[dict]:
    """One run per value of --sweep rate:... or concurrency:...; a table, sweep.json and plots in --out."""
    kind, _, values = args.sweep.partition(":")
    if kind not in ("rate", "concurrency") or not values:
        raise SystemExit("--sweep takes rate:R1,R2,... or concurrency:C1,C2,...")
    reps = []
    for v in values.split(","):
        run_args = argparse.Namespace(**vars(args))
        if kind == "rate":
            run_args.request_rate = float(v)
        else:
            run_args.concurrency = int(v)
        run_args.tag = f"{args.tag}-{kind}{v}"
        rep = asyncio.run(run(run_args))
        rep["sweep"] = {kind: float(v)}
        reps.append(rep)
        print(f"--- {kind} {v}\n{table(rep)}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sweep.json"), "w") as f:
        json.dump(reps, f, indent=2)
    print(f"{kind:>12}{'req/s':>10}{'tok/s':>10}{'goodput':>10}{'TTFT p95':>10}{'TPOT p95':>10}")
    for r in reps:
        print(f"{r['sweep'][kind]:>12g}{r['request_throughput']:>10.2f}{r['output_throughput']:>10.1f}"
              f"{r['goodput']:>10.2f}{_ms(r['ttft_s']['p95']):>10}{_ms(r['tpot_s']['p95']):>10}")
    plot_sweep(reps, kind, args)
    return reps


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1e3 * v:.1f}"


def plot_sweep(reps: list[dict], kind: str, args: argparse.Namespace) -> None:
    """throughput vs TTFT / TPOT p95, and goodput under the SLO, per sweep point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tput = [r["output_throughput"] for r in reps]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key, slo in ((axes[0], "ttft_s", args.slo_ttft), (axes[1], "tpot_s", args.slo_tpot)):
        ax.plot(tput, [1e3 * (r[key]["p95"] or 0) for r in reps], "o-")
        for r, x in zip(reps, tput):
            ax.annotate(f"{r['sweep'][kind]:g}", (x, 1e3 * (r[key]["p95"] or 0)), fontsize=8)
        if slo is not None:
            ax.axhline(slo, color="red", linestyle="--", label="SLO")
            ax.legend()
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(f"{key[:4].upper()} p95 (ms)")
        ax.grid(alpha=0.3)
    axes[2].plot([r["sweep"][kind] for r in reps], [r["request_throughput"] for r in reps], "o-", label="throughput")
    axes[2].plot([r["sweep"][kind] for r in reps], [r["goodput"] for r in reps], "o-", label="goodput (SLO met)")
    axes[2].set_xlabel(kind)
    axes[2].set_ylabel("requests/s")
    axes[2].legend()
    axes[2].grid(alpha=0.3)
    fig.tight_layout()
    path = os.path.join(args.out, "sweep.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    print(f"wrote {path}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--model", default=None, help="model name; default: the server's first model")
    p.add_argument("--api-key", default=None)
    p.add_argument("--endpoint", choices=["chat", "completions"], default="completions")
    p.add_argument("--concurrency", type=int, default=8, help="closed loop: concurrent streaming clients")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="open loop: Poisson arrivals at this many requests/s (inf: closed loop)")
    p.add_argument("--max-concurrency", type=int, default=None, help="open loop: cap on requests in flight")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128, help="(mean) prompt length in words (about tokens)")
    p.add_argument("--output-len", type=int, default=64, help="(mean) tokens per response (ignore_eos)")
    p.add_argument("--length-dist", choices=["fixed", "lognormal", "pareto"], default="fixed",
                   help="prompt and output lengths: fixed, or long-tailed around the means")
    p.add_argument("--replay", default=None, metavar="LOG",
                   help="send requests at the times and lengths of a request log (--request-log)")
    p.add_argument("--replay-speed", type=float, default=1.0, help="replay this many times faster")
    p.add_argument("--sweep", default=None, metavar="rate:R1,R2|concurrency:C1,C2",
                   help="one run per value; writes sweep.json and sweep.png to --out")
    p.add_argument("--out", default="sweep-out", help="directory for the sweep's report and plots")
    p.add_argument("--slo-ttft", type=float, default=None, help="goodput: TTFT SLO in ms")
    p.add_argument("--slo-tpot", type=float, default=None, help="goodput: TPOT SLO in ms")
    p.add_argument("--tag", default="load", help="X-Request-Id prefix")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=1, help="requests sent before measuring")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the report as JSON to this path")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.sweep:
        reps = sweep(args)
        return 0 if all(r["failed"] == 0 for r in reps) else 1
    rep = asyncio.run(run(args))
    print(table(rep))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=2)
    return 0 if rep["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
