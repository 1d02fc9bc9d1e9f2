"""The whole model and engine on a GPU (needs one: `-m cuda`).

Tiny random-weight checkpoints, so no model file has to travel: the model's logits on cuda against
transformers on the CPU, and the engine on cuda against the same engine on the CPU (greedy and seeded
tokens), with chunked prefill, prefix hits, preemption and a quantized cache in the mix.
"""
from __future__ import annotations

import random

import pytest
import torch

from engine_fakes import FakeTokenizer
from model_helpers import TINY_ARCHS, SequenceRunner, write_tiny_checkpoint
from pyengine.config import EngineConfig
from pyengine.engine.engine import Engine
from pyengine.llm import LLM
from pyengine.model.loader import load_model
from pyengine.model.metadata import kv_bytes_per_token
from pyengine.sampling_params import SamplingParams
from test_engine import assert_all_free

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("kind", TINY_ARCHS)
def test_tiny_checkpoint_logits_on_cuda_match_transformers(kind, tmp_path):
    from transformers import AutoModelForCausalLM

    folder = write_tiny_checkpoint(str(tmp_path), kind)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    cfg, model = load_model(folder, torch.float32, "cuda")
    prompt = torch.randint(0, cfg.vocab_size, (130,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.inference_mode():
        want = hf(torch.tensor([prompt])).logits[0]
    runner = SequenceRunner(model, cfg, 160, device="cuda")
    got = runner.prefill(prompt[:70], chunk=32)  # chunked prefill over a shuffled block table
    got_rest = runner.step(prompt[70:], all_logits=True)
    span = float(want.max() - want.min())
    assert float((got - want[69]).abs().max()) <= 1e-4 * span
    assert float((got_rest - want[70:]).abs().max()) <= 1e-4 * span


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.int8])
def test_quantized_cache_on_cuda_matches_the_cpu(cache_dtype, tmp_path):
    """fp32 model, fp8/int8 cache: the CUDA path (q, k, v rotated by a matmul) gives the CPU path's
    logits (rotated by the native kernel). Measured on the CPU, leaving the rotation out moves them by
    4.2e-2 (fp8) / 9.6e-3 (int8) of their span."""
    folder = write_tiny_checkpoint(str(tmp_path), "llama")
    prompt = torch.randint(0, 256, (130,), generator=torch.Generator().manual_seed(0)).tolist()
    logits = []
    for device in ("cpu", "cuda"):
        cfg, model = load_model(folder, torch.float32, device)
        runner = SequenceRunner(model, cfg, 160, cache_dtype=cache_dtype, device=device)
        steps = [runner.step(prompt[:100], all_logits=True), runner.step(prompt[100:], all_logits=True)]
        logits.append(torch.cat(steps))
    got, want = logits[1], logits[0]
    assert float((got - want).abs().max()) <= 3e-3 * float(want.max() - want.min())


def tiny_llm(folder: str, device: str, dtype: str = "float32", kv_tokens: int = 8192, **config) -> LLM:
    torch_dtype = getattr(torch, dtype)
    cfg, model = load_model(folder, torch_dtype, device)
    cache_dtype = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}.get(config.get("kv_cache_dtype"), torch_dtype)
    config["kv_cache_memory"] = kv_tokens * kv_bytes_per_token(cfg, cache_dtype)
    engine = Engine(EngineConfig(device=device, dtype=dtype, **config), parts=(cfg, model, FakeTokenizer(), "tiny"))
    return LLM.from_engine(engine)


def mixed_prompts(vocab: int, n: int = 24) -> list[list[int]]:
    """Ragged prompts, half of them sharing a 100-token prefix (prefix-cache hits)."""
    rng = random.Random(0)
    shared = [rng.randrange(3, vocab) for _ in range(100)]
    prompts = []
    for i in range(n):
        own = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 300))]
        prompts.append(shared + own if i % 2 else own)
    return prompts


def tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")), "llama")


GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SEEDED = [SamplingParams(max_tokens=24, temperature=0.8, top_k=20, top_p=0.9, seed=i, ignore_eos=True)
          for i in range(24)]


def test_engine_on_cuda_matches_cpu_greedy_and_seeded(tiny_folder):
    prompts = mixed_prompts(256)
    cpu = tiny_llm(tiny_folder, "cpu", max_num_batched_tokens=256, max_num_seqs=16)
    gpu = tiny_llm(tiny_folder, "cuda", max_num_batched_tokens=256, max_num_seqs=16)
    for params in (GREEDY, SEEDED):
        want, got = tokens(cpu, prompts, params), tokens(gpu, prompts, params)
        same = sum(g == w for g, w in zip(got, want))
        assert same >= len(prompts) - 1, f"only {same}/{len(prompts)} sequences equal ({params})"
    assert gpu.engine.stats().prefix_cache_hits > 0
    assert_all_free(gpu.engine)


def test_engine_on_cuda_preempts_and_recovers(tiny_folder):
    prompts = mixed_prompts(256, n=16)
    roomy = tiny_llm(tiny_folder, "cuda", max_num_seqs=16)
    tight = tiny_llm(tiny_folder, "cuda", kv_tokens=1024, max_num_seqs=16, max_num_batched_tokens=128)
    want, got = tokens(roomy, prompts, GREEDY), tokens(tight, prompts, GREEDY)
    assert sum(g == w for g, w in zip(got, want)) >= len(prompts) - 1
    assert tight.engine.stats().num_preemptions > 0
    assert_all_free(tight.engine)


@pytest.mark.parametrize("dtype,kv", [("bfloat16", "auto"), ("float16", "fp8"), ("bfloat16", "int8")])
def test_engine_on_cuda_half_precision_and_quantized_cache(tiny_folder, dtype, kv):
    prompts = mixed_prompts(256, n=12)
    ref = tiny_llm(tiny_folder, "cuda")
    llm = tiny_llm(tiny_folder, "cuda", dtype=dtype, kv_cache_dtype=kv)
    want = tokens(ref, prompts, SamplingParams(max_tokens=1, temperature=0.0))
    got = tokens(llm, prompts, SamplingParams(max_tokens=1, temperature=0.0))
    assert sum(g == w for g, w in zip(got, want)) >= len(prompts) * 3 // 4  # low precision may flip a few
    out = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 24 for o in out)
    assert_all_free(llm.engine)
