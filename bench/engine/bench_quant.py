"""Quantized weights (weights="auto") vs the bf16 path (weights="dequantize"), same run, same threads.

The default model's Q4_1 file and its Q8_0 and Q4_K_M requantizations (written here with the `gguf`
package's reference quantizer and pyengine.model.kquants, cached in the temp dir; on this model's rows
of 576 values Q4_K_M is mostly llama.cpp's Q5_0 / Q8_0 fallbacks, Q4_K / Q6_K only in ffn_down).
Per (file, weights): batch-1 decode tok/s (128-token prompt, 128 generated), a 64 x 128 generate (64 requests of 128 greedy tokens; output tok/s), prefill tok/s of one
512- and one 2,000-token prompt (prompt tokens over the time to the first token), and the process RSS before and after loading (each configuration runs in a fresh subprocess, alternating A/B,
`--repeats` times; figures are min..max over repeats).

`--cpu-time`: the 64 x 128 generate alone, both weights loaded in one process and run alternately, timed in
CPU seconds of the process (time.process_time; best of `--repeats`), by default on 1 thread (more threads
would count their spinning). A loaded host's preemption stretches wall time by whole factors between the two
subprocesses of a pair; CPU time of alternating runs gives the ratio that holds there.

    python bench/engine/bench_quant.py [--threads 2] [--repeats 2] [--files Q4_1,Q8_0,Q4_K_M]
    python bench/engine/bench_quant.py --cpu-time [--threads 1] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout

from bench.common import ROOT, default_gguf

PROMPT, GEN, STREAMS = 128, 128, 64
PREFILLS = (512, 2000)
KV_BYTES = 256 << 20


def load(path: str, weights: str, threads: int, kv_bytes: int = KV_BYTES, max_num_seqs: int = STREAMS):
    """The engine every measurement here runs: the same settings for both weights, or the ratio is not theirs.
    kv_bytes: larger for a larger model than the default one (KV_BYTES holds 64 of its streams). The KV cache
    is committed at load (kv_cache_prefault), as vLLM and llama.cpp commit theirs before their timings: else
    the first generate pays for it, in a virtual machine several seconds a GiB."""
    from pyengine import LLM

    return LLM(path, dtype="bfloat16", weights=weights, num_threads=threads, kv_cache_memory=kv_bytes,
               max_num_seqs=max_num_seqs, max_model_len=2048, kv_cache_prefault=True)


def greedy_generate(llm, prompts: list[list[int]], max_tokens: int) -> tuple[list, float]:
    """One generate of `prompts`, max_tokens greedy tokens each (EOS ignored): its outputs and wall seconds."""
    from pyengine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, time.perf_counter() - t0


def generate_rate(llm, prompts: list[list[int]], max_tokens: int = GEN) -> float:
    """Output tok/s of one greedy generate of `prompts`, prefill included."""
    outs, seconds = greedy_generate(llm, prompts, max_tokens)
    return sum(len(o.outputs[0].token_ids) for o in outs) / seconds


def generate_rates(llm, prompts: list[list[int]], max_tokens: int = GEN) -> tuple[float, float]:
    """Output tok/s of one greedy generate of `prompts` (max_tokens >= 2): over the whole generate, prefill
    included, and over its decode alone (llama-batched-bench's S_TG): the tokens after each request's first,
    from the last first token to the last token."""
    outs, seconds = greedy_generate(llm, prompts, max_tokens)
    first = max(o.metrics.first_token_time for o in outs)
    last = max(o.metrics.last_token_time for o in outs)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / seconds, (tokens - len(outs)) / (last - first)


def stream_prompts(rng) -> list[list[int]]:
    """The 64 x 128 generate's prompts: STREAMS of 16 random tokens."""
    return [[rng.randrange(100, 40000) for _ in range(16)] for _ in range(STREAMS)]


def decode_rate(llm, rng) -> float:
    """Batch-1 decode tok/s: GEN greedy tokens after a PROMPT-token prompt (after a short warm-up)."""
    from pyengine import SamplingParams

    prompt = [rng.randrange(100, 40000) for _ in range(PROMPT)]
    llm.generate([prompt[:16]], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)  # warm-up
    out = llm.generate([prompt], SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    m = out.metrics
    return (len(out.outputs[0].token_ids) - 1) / (m.last_token_time - m.first_token_time)


def one(path: str, weights: str, threads: int) -> dict:
    """Runs in the subprocess: load, measure, return figures."""
    import random

    import pyengine  # noqa: F401  (before torch)
    import psutil

    from pyengine import SamplingParams

    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    llm = load(path, weights, threads)
    rss1 = proc.memory_info().rss
    rng = random.Random(0)
    decode = decode_rate(llm, rng)
    gen = generate_rate(llm, stream_prompts(rng))
    prefill = {}
    for n in PREFILLS:
        long_prompt = [rng.randrange(100, 40000) for _ in range(n)]
        t0 = time.perf_counter()
        llm.generate([long_prompt], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        prefill[f"prefill{n}"] = n / (time.perf_counter() - t0)
    return {"decode": decode, "gen64": gen, **prefill, "rss_before": rss0, "rss_after_load": rss1,
            "weights_mib": llm.engine.model.weight_bytes() / 2**20}


def gen64_cpu(path: str, threads: int, repeats: int) -> dict[str, float]:
    """Output tokens per CPU second of the 64 x 128 generate, per weights, best of `repeats` alternating."""
    import random

    import pyengine  # noqa: F401  (before torch)

    from pyengine import SamplingParams

    llms = {w: load(path, w, threads) for w in ("dequantize", "auto")}
    prompts = stream_prompts(random.Random(0))
    params = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)
    best = {w: 0.0 for w in llms}
    for llm in llms.values():  # warm-up
        llm.generate(prompts[:4], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    for _ in range(repeats):
        for w, llm in llms.items():
            t0 = time.process_time()
            outs = llm.generate(prompts, params, use_tqdm=False)
            best[w] = max(best[w], sum(len(o.outputs[0].token_ids) for o in outs) / (time.process_time() - t0))
    return best


def measure(path: str, weights: str, threads: int) -> dict:
    """one() in a fresh subprocess (its RSS is the model's alone)."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    run = subprocess.run([sys.executable, os.path.abspath(__file__), "--threads", str(threads), "--one", path, weights],
                         capture_output=True, text=True, cwd=ROOT, env=env)
    line = next((x for x in run.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"{path} {weights} failed:\n{run.stderr[-3000:]}")
    return json.loads(line[7:])


def requantized(src: str, type_name: str) -> str:
    """`src` requantized to `type_name` (pyengine.model.gguf.requantize), cached in the temp dir."""
    from pyengine.model.gguf import requantize

    dst = os.path.join(tempfile.gettempdir(), "pyengine-bench-" + os.path.basename(src).replace("Q4_1", type_name))
    if not os.path.exists(dst):
        print(f"writing {dst} ({type_name} requantization of {os.path.basename(src)})", flush=True)
        requantize(src, dst + ".part", type_name)
        os.replace(dst + ".part", dst)
    return dst


def tensor_bytes(path: str) -> int:
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=None, help="default: 2, or 1 with --cpu-time")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--files", default="Q4_1,Q8_0,Q4_K_M", help="comma-separated subset of Q4_1,Q8_0,Q4_K_M")
    ap.add_argument("--cpu-time", action="store_true", help="gen64 only, in one process, CPU time (see top)")
    ap.add_argument("--one", nargs=2, metavar=("PATH", "WEIGHTS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(args.one[0], args.one[1], args.threads)))
        return
    folder, name = default_gguf()
    q4 = os.path.join(folder, name)
    kinds = args.files.split(",")
    files = {kind: q4 if kind == "Q4_1" else requantized(q4, kind) for kind in kinds}
    if args.cpu_time:
        threads = args.threads or 1
        print(f"gen64 ({STREAMS} x {GEN} tokens), output tok per CPU second, {threads} thread(s), best of {args.repeats}, "
              "alternating in one process")
        for kind, path in files.items():
            r = gen64_cpu(path, threads, args.repeats)
            print(f"{kind:6s} bf16 {r['dequantize']:7.1f}  auto {r['auto']:7.1f}  auto / bf16 {r['auto'] / r['dequantize']:.2f}x",
                  flush=True)
        return
    args.threads = args.threads or 2
    results: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.repeats):
        for kind, path in files.items():
            for weights in ("dequantize", "auto"):  # A/B back to back
                results.setdefault((kind, weights), []).append(measure(path, weights, args.threads))
    span = lambda xs, f="{:.1f}": f"{f.format(min(xs))}..{f.format(max(xs))}"  # noqa: E731
    print(f"\n{args.threads} threads, {args.repeats} repeats; decode: batch 1, prompt {PROMPT}, {GEN} tokens; "
          f"gen64: {STREAMS} x {GEN} tokens (output tok/s); KV cache {KV_BYTES >> 20} MiB")
    prefills = [f"prefill{n}" for n in PREFILLS]
    print(f"{'file':6s} {'weights':10s} {'decode tok/s':>14s} {'gen64 tok/s':>14s} "
          + " ".join(f"{p + ' tok/s':>18s}" for p in prefills) + f" {'weights MiB':>11s} {'RSS load MiB':>13s} {'RSS MiB':>9s}")
    for (kind, weights), rs in results.items():
        print(f"{kind:6s} {weights:10s} {span([r['decode'] for r in rs]):>14s} {span([r['gen64'] for r in rs]):>14s} "
              + " ".join(f"{span([r[p] for r in rs]):>18s}" for p in prefills) + f" {rs[0]['weights_mib']:11.1f} "
              f"{span([(r['rss_after_load'] - r['rss_before']) / 2**20 for r in rs], '{:.0f}'):>13s} "
              f"{span([r['rss_after_load'] / 2**20 for r in rs], '{:.0f}'):>9s}")
    for kind, path in files.items():
        a, b = results[kind, "auto"], results[kind, "dequantize"]
        ratio = lambda k: [x[k] / y[k] for x, y in zip(a, b)]  # noqa: E731 (pairs from the same repeat)
        limit = (1.1 * tensor_bytes(path) + KV_BYTES) / 2**20 + 150
        print(f"{kind}: auto / bf16  decode {span(ratio('decode'), '{:.2f}')}x  gen64 {span(ratio('gen64'), '{:.2f}')}x  "
              + "  ".join(f"{p} {span(ratio(p), '{:.2f}')}x" for p in prefills) + ";"
              f"  RSS growth at load {max((r['rss_after_load'] - r['rss_before']) / 2**20 for r in a):.0f} MiB "
              f"(1.1 x file tensors + KV + 150 MiB = {limit:.0f} MiB)")


if __name__ == "__main__":
    main()
