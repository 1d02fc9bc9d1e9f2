"""The engine end to end on a GPU (bf16), against the issue's goals; needs a GPU.

    python bench/gpu/bench_cuda_e2e.py [--model PATH] [--skip-hf]

- Batch-1 decode: one 128-token prompt, 256 greedy tokens (EOS ignored); decode tokens/s between the
  first and the last token, eager and with CUDA graphs (goal >= 1000 tok/s).
- 64 x 128 generate: 64 prompts of 128 tokens, 128 new tokens each; generated tokens/s of the whole run,
  against transformers' generate (one batch of 64, same GPU, bf16) (goal >= 10x).
- Prefill: 16 prompts of 1024 tokens, one token each: prompt tokens/s with the split-KV and the
  tensor-core attention.
The model: --model, else the default model when its package is installed, else a random-weight checkpoint
of the default model's shapes (SmolLM2-135M: speed does not depend on the weights; EOS is ignored).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time

import pyengine  # noqa: F401  (before torch, as everywhere)
import torch

import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout

from bench.common import default_gguf

PROMPT, GEN = 128, 256
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
               rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


def random_smollm2(folder: str) -> str:
    """A SmolLM2-135M-shaped checkpoint with random weights and a word-level tokenizer of its vocabulary."""
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(**SMOLLM2)).to(torch.bfloat16).save_pretrained(folder)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(SMOLLM2["vocab_size"])}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "t2", "bos_token": "t1"}, f)
    return folder


def pick_model(arg: str | None) -> tuple[str, str]:
    """(path for pyengine, description)."""
    if arg:
        return arg, arg
    try:
        folder, name = default_gguf()
        import gguf  # noqa: F401  (the loader needs it)

        return os.path.join(folder, name), "default model (SmolLM2-135M-Instruct Q4_1, dequantized to bf16)"
    except (ImportError, AttributeError, TypeError):
        return random_smollm2(tempfile.mkdtemp()), "random weights in the default model's shapes (SmolLM2-135M)"


def load_hf(path: str):
    from transformers import AutoModelForCausalLM

    if os.path.isfile(path):
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                     dtype=torch.bfloat16)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    return model.cuda().eval()


def make_llm(path: str, **config):
    from pyengine import LLM

    return LLM(path, device="cuda", dtype="bfloat16", kv_cache_memory=8 << 30, max_model_len=2048, **config)


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 1, (n, length), generator=g).tolist()  # prefill() shifts ids by one


def decode_batch1(llm, vocab: int) -> float:
    from pyengine import SamplingParams

    p = prompts(1, PROMPT, vocab)
    llm.generate(p, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)  # warm-up
    out = llm.generate(p, SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    m = out.metrics
    return (len(out.outputs[0].token_ids) - 1) / (m.last_token_time - m.first_token_time)


def generate_64x128(llm, vocab: int) -> float:
    from pyengine import SamplingParams

    p = prompts(64, 128, vocab, seed=1)
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    llm.generate(p[:8], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(p, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


def prefill(llm, vocab: int) -> float:
    from pyengine import SamplingParams

    p = prompts(16, 1024, vocab, seed=2)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate(p[:2], one, use_tqdm=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate([[t + 1 for t in x] for x in p], one, use_tqdm=False)  # no prefix-cache hits
    return 16 * 1024 / (time.perf_counter() - t0)


def hf_64x128(path: str, vocab: int) -> float:
    model = load_hf(path)
    ids = torch.tensor(prompts(64, 128, vocab, seed=1), device="cuda")
    kw = dict(do_sample=False, min_new_tokens=128, max_new_tokens=128, pad_token_id=0,
              attention_mask=torch.ones_like(ids))
    with torch.inference_mode():
        model.generate(ids[:8], **{**kw, "min_new_tokens": 8, "max_new_tokens": 8,
                                   "attention_mask": torch.ones_like(ids[:8])})
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, **kw)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    del model
    torch.cuda.empty_cache()
    return 64 * 128 / dt


def report(label: str, fn) -> None:
    """Run one measurement; an error is printed and the next one runs (the device check wants every figure)."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        print(f"ERROR {label}: {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}", flush=True)
    gc.collect()  # the engine's memory (KV cache, graph pool) before the next one is built
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    path, what = pick_model(args.model)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  model: {what}")
    vocab = SMOLLM2["vocab_size"]
    generated = []  # 64x128 tokens/s of each pyengine run

    def decode(graphs: bool) -> None:
        t0 = time.perf_counter()
        llm = make_llm(path, cuda_graphs=graphs, max_num_seqs=64, max_num_batched_tokens=4096)
        start = time.perf_counter() - t0
        b1, g64 = decode_batch1(llm, vocab), generate_64x128(llm, vocab)
        generated.append(g64)
        print(f"cuda_graphs={graphs!s:<5}  start {start:5.1f} s  batch-1 decode {b1:7.0f} tok/s "
              f"(goal >= 1000: {'PASS' if b1 >= 1000 else 'MISS'})  64x128 generate {g64:7.0f} tok/s", flush=True)

    def prefill_run(tc: bool) -> None:
        llm = make_llm(path, tensor_core_prefill=tc, max_num_batched_tokens=16384, max_num_seqs=16,
                       long_prefill_tokens=0)
        print(f"tensor_core_prefill={tc!s:<5}  prefill 16 x 1024: {prefill(llm, vocab):8.0f} prompt tok/s", flush=True)

    def versus_hf() -> None:
        hf = hf_64x128(path, vocab)
        best = max(generated)
        print(f"transformers generate 64x128: {hf:7.0f} tok/s; pyengine (best) / transformers = {best / hf:5.1f}x "
              f"(goal >= 10x: {'PASS' if best / hf >= 10 else 'MISS'})", flush=True)

    for graphs in (False, True):
        report(f"cuda_graphs={graphs}", lambda g=graphs: decode(g))
    for tc in (False, True):
        report(f"tensor_core_prefill={tc}", lambda t=tc: prefill_run(t))
    if not args.skip_hf and generated:
        report("transformers", versus_hf)


if __name__ == "__main__":
    main()
