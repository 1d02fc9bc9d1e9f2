"""The default model in fp32 and in bf16 (weights="auto": its quantized tensors stay quantized either way),
same run, alternating fresh subprocesses: prefill tok/s of one 512- and one 2,000-token prompt, a 64 x 128
generate (output tok/s) and batch-1 decode tok/s. The figures behind dtype="auto"'s choice on a CPU
without bf16 dot products (AVX2), where fp32 is what auto picks today.

    python bench/engine/bench_cpu_dtype.py [--threads 2] [--repeats 2]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, random, sys, time
import pyengine
from pyengine import LLM, SamplingParams
llm = LLM(dtype=sys.argv[1], num_threads=int(sys.argv[2]), kv_cache_memory=1 << 30, max_num_seqs=64,
          max_model_len=2304)
rng = random.Random(0)
ids = lambda n: [rng.randrange(100, 40000) for _ in range(n)]
greedy = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
llm.generate([ids(16)], greedy(4), use_tqdm=False)  # warm-up
r = {}
for n in (512, 2000):
    t = time.perf_counter()
    llm.generate([ids(n)], greedy(1), use_tqdm=False)
    r[f"prefill{n}"] = n / (time.perf_counter() - t)
t = time.perf_counter()
outs = llm.generate([ids(128) for _ in range(64)], greedy(128), use_tqdm=False)
r["gen64x128"] = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)
m = llm.generate([ids(128)], greedy(128), use_tqdm=False)[0].metrics
r["decode"] = 127 / (m.last_token_time - m.first_token_time)
print(json.dumps(r))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {"float32": [], "bfloat16": []}
    for _ in range(args.repeats):
        for dtype in runs:
            out = subprocess.run([sys.executable, "-c", CHILD, dtype, str(args.threads)], capture_output=True,
                                 text=True, check=True).stdout
            runs[dtype].append(json.loads(out.strip().splitlines()[-1]))
    print(f"{'dtype':10}" + "".join(f"{k:>18}" for k in runs["float32"][0]))
    for dtype, rs in runs.items():
        print(f"{dtype:10}" + "".join(f"{min(r[k] for r in rs):8.0f}..{max(r[k] for r in rs):<8.0f}" for k in rs[0]))


if __name__ == "__main__":
    main()
