"""pyengine vs llama.cpp on the same GGUF files, same run, same threads (never in CI: needs a llama.cpp
build, given by its build folder).

Files: the default model's Q4_1 file, its Q8_0 requantization (bench_quant.requantized), and a Q4_K_M
written by llama.cpp's own `llama-quantize --allow-requantize` from the Q4_1 file (so both engines read
llama.cpp's K-quant choices). Per file:
  batch 1: decode tok/s, 128 tokens after a 128-token prompt: pyengine (bench_quant.decode_rate, one
           engine loaded in this process) vs `llama-bench -p 0 -n 128` (tg128), taken in turn `--pairs`
           times: a pair's two runs are seconds apart, so a loaded host's drift (tens of percent over
           minutes) falls on both; the median of the pairs' ratios is the figure;
  64 streams: output tok/s of 64 x 128 greedy tokens after 16-token prompts: pyengine's whole generate
           (prefill included; with --gguf also its decode alone) vs `llama-batched-bench -npp 16 -ntg 128
           -npl 64`'s S_TG (decode only). Both engines' KV caches are committed before the timings
           (bench_quant.load).

    # llama.cpp from the llama-cpp-python sdist (its vendored copy), e.g.:
    pip download --no-deps --no-binary :all: llama-cpp-python && tar xzf llama_cpp_python-*.tar.gz
    cmake -S llama_cpp_python-*/vendor/llama.cpp -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF
    cmake --build build -j2 --target llama-quantize llama-bench llama-batched-bench
    python bench/compare/bench_llamacpp.py build [--threads 2] [--pairs 5] [--repeats 2]
    python bench/compare/bench_llamacpp.py build --gguf FILE [--kv-cache-mib 3072]   (one file of any size
        instead, e.g. bench/engine/bench_quant_real.py's 1.7B-shaped Q4_K_M; our 64 streams then run in this
        process with a KV cache of --kv-cache-mib, so all 64 fit at once)

On AMX hosts (Sapphire Rapids) built with GCC 12, that copy's batched path (M > 1 on Q4_0/Q4_1/Q8_0/K-quants:
ggml-cpu/amx/mmq.cpp) dies with SIGILL at its first `tilezero`: GCC drops the stores that fill the tile
config on the stack before `_tile_loadconfig` (it does not see the instruction read them), so every tile is
configured with 0 rows (upstream fix: ggml-org/llama.cpp#26954). batch 1 (llama-bench tg) takes its VNNI
path and runs. Make the stores visible, e.g. with `asm volatile("" : : "m"(tc) : "memory");` just before
`_tile_loadconfig(&tc)` in ggml_tile_config_init, and rebuild libggml-cpu. The tools run with their own
folder on LD_LIBRARY_PATH, so a patched libggml-cpu.so.0 copied next to them is the one they load.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout

from bench.engine.bench_quant import GEN, PROMPT, STREAMS, measure, requantized
from bench.common import default_gguf

STREAM_PROMPT = 16


def tool(build: str, name: str) -> str:
    for sub in ("bin", ""):
        path = os.path.join(build, sub, name)
        if os.path.isfile(path):
            return path
    sys.exit(f"no {name} under {build} (build the llama-quantize, llama-bench and llama-batched-bench targets)")


def run_tool(build: str, name: str, *args: str) -> str:
    """stdout of llama.cpp tool `name` (its folder's libraries first: see the docstring)."""
    path = tool(build, name)
    libs = os.pathsep.join([os.path.dirname(path), os.environ.get("LD_LIBRARY_PATH", "")])
    env = {**os.environ, "LD_LIBRARY_PATH": libs}
    return subprocess.run([path, *args], check=True, capture_output=True, text=True, env=env).stdout


def llama_q4_k_m(build: str, src: str) -> str:
    name = os.path.basename(src).replace("Q4_1", "Q4_K_M")
    dst = os.path.join(tempfile.gettempdir(), "pyengine-bench-llamacpp-" + name)
    if not os.path.exists(dst):
        run_tool(build, "llama-quantize", "--allow-requantize", src, dst + ".part", "Q4_K_M")
        os.replace(dst + ".part", dst)
    return dst


def llama_decode(build: str, path: str, threads: int) -> float:
    """llama-bench tg128 tok/s."""
    out = run_tool(build, "llama-bench", "-m", path, "-t", str(threads), "-p", "0", "-n", str(GEN), "-r", "2",
                   "-o", "json")
    return float(json.loads(out)[0]["avg_ts"])


def llama_streams(build: str, path: str, threads: int) -> float:
    """llama-batched-bench S_TG tok/s at 64 streams."""
    ctx = STREAMS * (STREAM_PROMPT + GEN) + 256
    out = run_tool(build, "llama-batched-bench", "-m", path, "-t", str(threads), "-tb", str(threads), "-c", str(ctx),
                   "-b", "2048", "-ub", "512", "-npp", str(STREAM_PROMPT), "-ntg", str(GEN), "-npl", str(STREAMS))
    rows = [line.split("|") for line in out.splitlines() if re.match(r"\|\s*\d+\s*\|", line)]
    # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
    return float(rows[-1][8])


def batch1_in_turn(build: str, path: str, threads: int, pairs: int,
                   kv_mib: int | None = None) -> list[tuple[float, float]]:
    """(pyengine, llama.cpp) batch-1 decode tok/s, `pairs` times in turn, our engine loaded once."""
    import gc
    import random

    from bench.engine.bench_quant import KV_BYTES, decode_rate, load

    llm = load(path, "auto", threads, KV_BYTES if kv_mib is None else kv_mib << 20)
    rng = random.Random(0)
    rates = [(decode_rate(llm, rng), llama_decode(build, path, threads)) for _ in range(pairs)]
    del llm
    gc.collect()
    return rates


def ours_streams(path: str, threads: int, kv_mib: int) -> tuple[float, float]:
    """Our output tok/s of STREAMS x GEN greedy tokens after STREAM_PROMPT-token prompts: the whole generate,
    and its decode alone (bench_quant.generate_rates)."""
    import random

    from bench.engine.bench_quant import generate_rate, generate_rates, load, stream_prompts

    llm = load(path, "auto", threads, kv_mib << 20)
    generate_rate(llm, [[100] * STREAM_PROMPT], 4)  # warm-up
    return generate_rates(llm, stream_prompts(random.Random(0)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("build", help="llama.cpp build folder (with bin/llama-bench ...)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=5, help="batch-1 runs of each engine, in turn")
    ap.add_argument("--repeats", type=int, default=2, help="64-stream runs of each engine, in turn")
    ap.add_argument("--batch1-only", action="store_true",
                    help="skip the 64-stream column (llama-batched-bench: SIGILL on unpatched AMX builds, see above)")
    ap.add_argument("--gguf", default=None, help="compare on this file alone (see the top)")
    ap.add_argument("--kv-cache-mib", type=int, default=3072, help="with --gguf: our KV cache")
    args = ap.parse_args()
    if args.gguf:
        files = {os.path.basename(args.gguf)[:40]: args.gguf}
    else:
        folder, name = default_gguf()
        q4 = os.path.join(folder, name)
        files = {"Q4_1": q4, "Q8_0": requantized(q4, "Q8_0"), "Q4_K_M": llama_q4_k_m(args.build, q4)}
    kv_mib = args.kv_cache_mib if args.gguf else None
    batch1 = {kind: batch1_in_turn(args.build, path, args.threads, args.pairs, kv_mib) for kind, path in files.items()}
    streams = []
    if not args.batch1_only:
        for kind, path in files.items():
            for _ in range(args.repeats):  # alternating engines, same file
                ours = (ours_streams(path, args.threads, args.kv_cache_mib) if args.gguf
                        else (measure(path, "auto", args.threads)["gen64"], None))
                streams.append((kind, *ours, llama_streams(args.build, path, args.threads)))
    print(f"\n{args.threads} threads; batch 1: prompt {PROMPT}, {GEN} tokens, {args.pairs} runs of each engine in turn")
    w = max(7, *(len(kind) for kind in files))  # the file column
    print(f"{'file':{w}s} {'ours tok/s':>22s} {'llama tok/s':>22s} {'ratio (median)':>30s}")
    for kind, rates in batch1.items():
        ratios = sorted(d / ld for d, ld in rates)
        print(f"{kind:{w}s} {min(d for d, _ in rates):10.1f}..{max(d for d, _ in rates):<10.1f} "
              f"{min(ld for _, ld in rates):10.1f}..{max(ld for _, ld in rates):<10.1f} "
              f"{ratios[0]:.2f}..{ratios[-1]:.2f}x ({statistics.median(ratios):.2f}x)")
    if streams:
        print(f"\n{STREAMS} streams: prompt {STREAM_PROMPT}, {GEN} tokens each, output tok/s (pyengine: whole "
              "generate, and its decode alone with --gguf; llama.cpp: S_TG, decode alone)")
        print(f"{'file':{w}s} {'ours whole':>10s} {'ours decode':>11s} {'llama S_TG':>10s} {'ratios':>14s}")
        for kind, g, d, lg in streams:
            decode = f"{d:11.1f}" if d else f"{'':11s}"
            ratios = f"{g / lg:5.2f}x" + (f" {d / lg:5.2f}x" if d else "")
            print(f"{kind:{w}s} {g:10.1f} {decode} {lg:10.1f} {ratios:>14s}")


if __name__ == "__main__":
    main()
