"""Two engine replicas x 1 thread on Ray Serve (`python -m server.ray`) against one `python -m server`
with 2 threads, in the same run, on two workloads:

- distinct: closed loop, every prompt different (no prefix to share): raw throughput and TTFT;
- conversations: concurrent multi-turn conversations (each turn's prompt extends the last one
  after a long private preamble), where KV locality decides how much prefill is recomputed.

    python bench/serve/bench_ray.py [--model PATH] [--concurrency 8] [--json out.json]

Both servers run at once (each idle while the other is measured). Besides serve_load's report it
prints each server's prefix-cache hit rate over the workload (tokens found / tokens looked up,
from /metrics, summed over replicas) and the router's decisions. Last, Ray replicas with
`--routing least-loaded` run the conversations alone: what prefix routing adds.

One run on a shared 2-core CPU (load average ~20 from other jobs, so compare within a run only):

    workload        server                          req/s  out tok/s  TTFT p50 ms  prefix hits
    distinct        single (1 engine x 2 threads)    1.77       56.7         3393         0.0%
    distinct        ray (2 replicas x 1 thread)      0.92       29.5         5813         0.0%
    conversations   single (1 engine x 2 threads)    1.35       43.1         1176        71.0%
    conversations   ray (2 replicas x 1 thread)      0.79       25.1         2016        71.1%
    conversations   ray, least-loaded routing        0.71       22.6         1861        65.2%

On two cores, two 1-thread replicas plus Ray's processes lose to one 2-thread engine; alone (one
request at a time) a token through Serve costs about what it costs direct, and TTFT gains ~50 ms
(the ingress -> replica hops). Prefix routing keeps the hit rate of one engine (24 of 32 turns
routed by prefix); least-loaded keeps 65% only because with 2 replicas a conversation's next turn
arrives just as its own replica frees a slot. With 8 replicas and random (or power-of-two) routing a
turn finds its prefix with p ~ 1/8: hit rate ~71%/8 ~ 9%, so prefill recomputes 91% of the prompt
tokens instead of 29% (3.1x the prefill work), and each conversation's KV (~700 tokens x 23 KB)
ends up copied on several replicas, so the cluster caches up to 8x fewer conversations.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request

import aiohttp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout
from bench.serve import serve_load  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], log_path: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT)  # this checkout, in the Ray workers too
    proc = subprocess.Popen([sys.executable, "-m", *cmd, "--port", str(port), "--stats-interval", "0",
                             "--log-level", "warning"], cwd=ROOT, env=env, stdout=open(log_path, "w"),
                            stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(proc: subprocess.Popen, url: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {proc.returncode}")
        try:
            if urllib.request.urlopen(f"{url}/health", timeout=2).status == 200:
                return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not ready after {timeout} s")


def counters(url: str) -> dict[str, float]:
    """Prefix-cache and routing counters, summed over replicas."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in ("pyengine:prefix_cache_queries_total", "pyengine:prefix_cache_hits_total"):
                out[s.name] = out.get(s.name, 0.0) + s.value
            elif s.name == "pyengine_ray:routing_decisions_total":
                out[f"route_{s.labels['reason']}"] = s.value
    return out


async def conversations(args: argparse.Namespace, load: argparse.Namespace) -> dict:
    """args.concurrency conversations of args.turns turns each, all at once; a turn's prompt is the
    last turn's prompt plus new words, after a private preamble of args.preamble words."""
    rng = random.Random(args.seed)
    results: list[serve_load.Result] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def conversation(c: int) -> None:
            prompt = f"Conversation {c}. " + serve_load.make_prompt(rng, args.preamble)
            for t in range(args.turns):
                prompt += f"\nTurn {t}: " + serve_load.make_prompt(rng, args.turn_words)
                results.append(await serve_load.one_request(session, load, prompt, args.output_len, c * 100 + t))

        t0 = time.perf_counter()
        await asyncio.gather(*(conversation(c) for c in range(args.concurrency)))
        wall = time.perf_counter() - t0
    return serve_load.report(load, results, wall)


def measure(name: str, url: str, workload: str, args: argparse.Namespace) -> dict:
    load = serve_load.build_parser().parse_args([
        "--url", url, "--concurrency", str(args.concurrency), "--num-requests", str(args.num_requests),
        "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len), "--seed", str(args.seed),
        "--tag", f"{name}-{workload}"])
    with urllib.request.urlopen(f"{url}/v1/models") as r:
        load.model = json.load(r)["data"][0]["id"]
    before = counters(url)
    rep = asyncio.run(serve_load.run(load) if workload == "distinct" else conversations(args, load))
    time.sleep(2.5)  # the Ray ingress polls replica metrics every second
    after = counters(url)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    queries = delta.get("pyengine:prefix_cache_queries_total", 0.0)
    rep["prefix_hit_rate"] = delta.get("pyengine:prefix_cache_hits_total", 0.0) / queries if queries else None
    rep["routing"] = {k[6:]: v for k, v in delta.items() if k.startswith("route_") and v}
    return rep


def run_servers(commands: dict[str, list[str]], workloads: tuple[str, ...], args: argparse.Namespace,
                reports: dict[str, dict]) -> None:
    """Start the servers together, measure each workload on each in turn, stop them."""
    servers = {name: start(cmd, f"/tmp/bench_ray_{i}.log") for i, (name, cmd) in enumerate(commands.items())}
    try:
        for proc, url in servers.values():
            wait_ready(proc, url)
        for workload in workloads:
            for name, (_, url) in servers.items():
                rep = reports[f"{workload} / {name}"] = measure(name.split()[0], url, workload, args)
                hit = "-" if rep["prefix_hit_rate"] is None else f"{100 * rep['prefix_hit_rate']:.1f}%"
                print(f"\n== {workload} / {name}\n{serve_load.table(rep)}\nprefix hit rate: {hit}"
                      + (f"; routing: {rep['routing']}" if rep["routing"] else ""), flush=True)
    finally:
        for proc, _ in servers.values():
            proc.send_signal(2)  # SIGINT: the servers shut down cleanly (Ray stops its workers)
        for proc, _ in servers.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model for both servers; default: the bundled one")
    p.add_argument("--concurrency", type=int, default=8, help="clients (distinct) / conversations at once")
    p.add_argument("--num-requests", type=int, default=32, help="distinct: requests")
    p.add_argument("--prompt-len", type=int, default=128, help="distinct: prompt words")
    p.add_argument("--output-len", type=int, default=32, help="tokens per response (ignore_eos)")
    p.add_argument("--preamble", type=int, default=400, help="conversations: private preamble words")
    p.add_argument("--turns", type=int, default=4, help="conversations: turns each")
    p.add_argument("--turn-words", type=int, default=30, help="conversations: new words per turn")
    p.add_argument("--kv-cache-memory", default="256MiB", help="KV cache per engine (the single server gets 2x)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write both reports as JSON to this path")
    args = p.parse_args(argv)

    model = ["--model", args.model] if args.model else []
    common = [*model, "--max-model-len", "4096"]
    kv = int(args.kv_cache_memory.lower().removesuffix("mib"))
    single = ["server", *common, "--num-threads", "2", "--kv-cache-memory", f"{2 * kv}MiB"]
    replicas = ["server.ray", *common, "--replicas", "2", "--num-threads", "1", "--kv-cache-memory", f"{kv}MiB"]
    reports: dict[str, dict] = {}
    # the baseline without prefix routing runs alone: one Ray application per local Ray instance
    run_servers({"single (1 engine x 2 threads)": single, "ray (2 replicas x 1 thread)": replicas},
                ("distinct", "conversations"), args, reports)
    run_servers({"ray, least-loaded routing": [*replicas, "--routing", "least-loaded"]},
                ("conversations",), args, reports)
    print("\nworkload        server                          req/s  out tok/s  TTFT p50 ms  TTFT p90 ms  prefix hits")
    for key, rep in reports.items():
        workload, name = key.split(" / ")
        hit = "-" if rep["prefix_hit_rate"] is None else f"{100 * rep['prefix_hit_rate']:.1f}%"
        print(f"{workload:<15} {name:<30} {rep['request_throughput']:>6.2f} {rep['output_throughput']:>10.1f} "
              f"{1e3 * rep['ttft_s']['p50']:>12.0f} {1e3 * rep['ttft_s']['p90']:>12.0f} {hit:>12}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=2)
    return 0 if all(r["failed"] == 0 for r in reports.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
