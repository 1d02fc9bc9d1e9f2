"""Latency and throughput report of a request log (`python -m server --request-log PATH`).

    python -m pyengine.report PATH [PATH.1 ...] [--plots DIR] [--json]

Definitions (per successful request, status 200):
    TTFT  = first_token_ts - start_ts
    TPOT  = (end_ts - first_token_ts) / (N - 1), N = output tokens, requests with N > 1
    E2E   = end_ts - start_ts
    queue = scheduled_ts - queued_ts
    TPS   = output tokens of all requests / (last end_ts - first start_ts)   (also input TPS)
    RPS   = requests / (last end_ts - first start_ts)
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from pyengine.request_log import read_records

PERCENTILES = (50, 95, 99)
STAGES = ("tokenize_s", "queue_s", "prefill_s", "decode_s", "stream_s")


def latencies(rows: list[dict]) -> dict[str, list[float]]:
    """Per-request latency samples (seconds) of the successful rows."""
    out: dict[str, list[float]] = {"ttft": [], "tpot": [], "e2e": [], "queue": []}
    for r in rows:
        if r["status"] != 200:
            continue
        out["e2e"].append(r["end_ts"] - r["start_ts"])
        if r["first_token_ts"] is not None:
            out["ttft"].append(r["first_token_ts"] - r["start_ts"])
            if r["output_tokens"] > 1:
                out["tpot"].append((r["end_ts"] - r["first_token_ts"]) / (r["output_tokens"] - 1))
        if r["queued_ts"] is not None and r["scheduled_ts"] is not None:
            out["queue"].append(r["scheduled_ts"] - r["queued_ts"])
    return out


def summarize(rows: list[dict]) -> dict:
    ok = [r for r in rows if r["status"] == 200]
    statuses = sorted({r["status"] for r in rows} - {200})
    res: dict = {"requests": len(rows), "ok": len(ok),
                 "errors": {str(s): sum(r["status"] == s for r in rows) for s in statuses}}
    if not ok:
        return res
    span = max(r["end_ts"] for r in ok) - min(r["start_ts"] for r in ok)
    res["duration_s"] = span
    res["rps"] = len(ok) / span if span > 0 else None
    res["output_tps"] = sum(r["output_tokens"] for r in ok) / span if span > 0 else None
    res["input_tps"] = sum(r["input_tokens"] for r in ok) / span if span > 0 else None
    res["cached_token_fraction"] = sum(r["cached_tokens"] or 0 for r in ok) / max(1, sum(r["input_tokens"] for r in ok))
    res["latency"] = {k: percentiles(v) for k, v in latencies(rows).items()}
    res["stages"] = {k: percentiles([r[k] for r in ok if r.get(k) is not None]) for k in STAGES}
    return res


def percentiles(values: list[float], qs: tuple[int, ...] = PERCENTILES) -> dict[str, float] | None:
    """mean, p<q> for each q (linear interpolation) and n; None without values."""
    if not values:
        return None
    a = np.asarray(values, dtype=np.float64)
    return {"mean": float(a.mean()), **{f"p{q}": float(np.percentile(a, q)) for q in qs}, "n": len(values)}


def format_report(s: dict) -> str:
    lines = [f"requests: {s['requests']} ({s['ok']} ok" + "".join(f", {n} x {k}" for k, n in s["errors"].items()) + ")"]
    if "latency" not in s:
        return "\n".join(lines)
    lines.append(f"duration: {s['duration_s']:.2f} s   RPS: {s['rps']:.2f}   output TPS: {s['output_tps']:.1f}   "
                 f"input TPS: {s['input_tps']:.1f}   cached prompt tokens: {100 * s['cached_token_fraction']:.1f}%")
    lines.append(f"{'ms':<12}" + "".join(f"{h:>10}" for h in ("mean", "p50", "p95", "p99", "n")))
    for title, table in (("", s["latency"]), ("stage ", s["stages"])):
        for k, v in table.items():
            if v is None:
                continue
            cells = "".join(f"{1e3 * v[h]:>10.1f}" for h in ("mean", "p50", "p95", "p99"))
            lines.append(f"{title + k.removesuffix('_s'):<12}{cells}{v['n']:>10}")
    return "\n".join(lines)


def write_plots(rows: list[dict], out_dir: str) -> list[str]:
    """Latency CDFs, and output tokens/s and requests in flight over time (1 s bins)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    lat = latencies(rows)
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for ax, (name, vals) in zip(axes, lat.items()):
        if vals:
            x = np.sort(np.asarray(vals) * 1e3)
            ax.plot(x, np.arange(1, len(x) + 1) / len(x))
        ax.set_title(f"{name.upper()} CDF")
        ax.set_xlabel("ms")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests")
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "latency_cdf.png"))
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)

    ok = [r for r in rows if r["status"] == 200]
    if ok:
        t0 = min(r["start_ts"] for r in ok)
        n_bins = int(np.ceil(max(r["end_ts"] for r in ok) - t0)) + 1
        tps, inflight = np.zeros(n_bins), np.zeros(n_bins)
        for r in ok:
            a, b = r["start_ts"] - t0, r["end_ts"] - t0
            inflight[int(a):int(b) + 1] += 1
            f = (r["first_token_ts"] or r["end_ts"]) - t0
            n = r["output_tokens"]
            if n:  # tokens spread evenly between first token and end
                for t in np.linspace(f, b, n):
                    tps[int(t)] += 1
        fig, ax = plt.subplots(figsize=(9, 3.6))
        ax.plot(np.arange(n_bins), tps, label="output tokens/s")
        ax.set_xlabel("seconds")
        ax.set_ylabel("tokens/s")
        ax2 = ax.twinx()
        ax2.plot(np.arange(n_bins), inflight, color="tab:orange", label="requests in flight")
        ax2.set_ylabel("requests in flight")
        fig.legend(loc="upper right")
        fig.tight_layout()
        paths.append(os.path.join(out_dir, "throughput.png"))
        fig.savefig(paths[-1], dpi=90)
        plt.close(fig)
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pyengine.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", help="request log(s), CSV or JSON Lines (rotated files too)")
    p.add_argument("--plots", metavar="DIR", help="write PNG plots into DIR")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = p.parse_args(argv)
    rows = [r for path in args.paths for r in read_records(path)]
    s = summarize(rows)
    print(json.dumps(s, indent=2) if args.json else format_report(s))
    if args.plots:
        for path in write_plots(rows, args.plots):
            print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
