"""Prompt-lookup speculation, pyengine's n-gram drafts beside llama.cpp's llama-lookup: the default model,
bench_spec.py's code-edit prompt, greedy, EOS ignored, the same tokens and threads, the four runs in turn
each round (a shared host's drift falls on all four), best of --rounds.

  pyengine  off / on: bench_spec.py's engines (n-gram k=5, prompt_lookup 2..4), decode tok/s of the request
            (first to last token: llama-lookup's timer also starts after the prompt);
  llama.cpp off / on: `llama-lookup --spec-draft-n-max 0` (no drafts: plain decoding through the same loop
            and timer) and `--spec-draft-n-max K` (its n-gram cache over the context, n-grams of 1..4).

    cmake -S llama.cpp -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_AVX512=ON \
        -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DLLAMA_CURL=OFF
    cmake --build build -j2 --target llama-lookup
    python bench/compare/bench_spec_llamacpp.py --llama-bin build/bin [--threads 2] [--max-tokens 256] [--rounds 2]

(On AMX hosts build with GGML_NATIVE=OFF: see bench_llamacpp.py on the SIGILL of the native build.)
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout

from bench.common import default_gguf
from bench.engine.bench_spec import CODE, chat

EDIT = "Repeat this code exactly, but rename `items` to `entries`:\n\n" + CODE  # bench_spec.py's code edit


def llama_lookup(bin_dir: str, model: str, prompt: str, args: argparse.Namespace, k: int) -> dict:
    """tok/s, tokens, drafted and accepted of one llama-lookup run (k = 0: no drafts)."""
    env = {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join([bin_dir, os.environ.get("LD_LIBRARY_PATH", "")])}
    cmd = [os.path.join(bin_dir, "llama-lookup"), "-m", model, "-p", prompt, "-n", str(args.max_tokens),
           "-t", str(args.threads), "-tb", str(args.threads), "-c", "2048", "--temp", "0", "--ignore-eos",
           "--spec-draft-n-max", str(k)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    log = out.stdout + out.stderr
    dec = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
    return {"tps": int(dec.group(1)) / float(dec.group(2)), "tokens": int(dec.group(1)),
            "prompt": int(re.search(r"encoded\s+(\d+) tokens", log).group(1)),
            "drafted": logged(log, "n_drafted"), "accepted": logged(log, "n_accept")}


def logged(log: str, name: str) -> int:
    """A `name = N` line of llama-lookup's closing statistics."""
    return int(re.search(rf"{name}\s*=\s*(\d+)", log).group(1))


def ours(llm, prompt: list[int], max_tokens: int) -> dict:
    """Decode tok/s (first to last token), tokens, drafted and accepted of one greedy request."""
    from pyengine import SamplingParams

    m = llm.engine.metrics
    d0, a0 = m.spec_draft_tokens._value.get(), m.spec_accepted_tokens._value.get()
    out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)[0]
    n, t = len(out.outputs[0].token_ids), out.metrics
    return {"tps": (n - 1) / (t.last_token_time - t.first_token_time), "tokens": n, "prompt": len(prompt),
            "drafted": int(m.spec_draft_tokens._value.get() - d0),
            "accepted": int(m.spec_accepted_tokens._value.get() - a0)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-bin", required=True, metavar="DIR", help="the folder with llama-lookup")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--k", type=int, default=5, help="most draft tokens per step, both engines")
    args = ap.parse_args()

    import pyengine  # noqa: F401  (before torch: it sets the OpenMP spin policy)
    from pyengine import LLM

    model = os.path.join(*default_gguf())
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    common = dict(model=model, num_threads=args.threads, kv_cache_memory=512 << 20, max_model_len=2048,
                  kv_cache_prefault=True)
    engines = {"off": LLM(**common), "on": LLM(speculative=spec, **common)}
    tok = engines["off"].engine.tokenizer
    prompt = chat(tok, EDIT)
    text = tok.apply_chat_template([{"role": "user", "content": EDIT}])
    for llm in engines.values():  # warm-up
        ours(llm, prompt[:16], 8)
    runs: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for key, llm in engines.items():
            runs.setdefault(f"pyengine {key}", []).append(ours(llm, prompt, args.max_tokens))
        for key, k in (("off", 0), ("on", args.k)):
            runs.setdefault(f"llama.cpp {key}", []).append(llama_lookup(args.llama_bin, model, text, args, k))
    print(f"code edit, {args.max_tokens} tokens, {args.threads} threads, k={args.k}, best of {args.rounds} rounds")
    print(f"{'engine':>14} {'prompt':>7} {'tokens':>7} {'tok/s':>7} {'on/off':>7} {'acceptance':>11}")
    for name, rs in runs.items():
        best = max(rs, key=lambda r: r["tps"])
        base = max(r["tps"] for r in runs[name.replace(" on", " off")])
        acc = f"{best['accepted'] / best['drafted']:.0%}" if best["drafted"] else "-"
        print(f"{name:>14} {best['prompt']:7d} {best['tokens']:7d} {best['tps']:7.1f} {best['tps'] / base:6.2f}x "
              f"{acc:>11}")


if __name__ == "__main__":
    main()
