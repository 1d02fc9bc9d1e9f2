"""Model families through the whole engine (scheduler, paged cache, chunked prefill, batching):
greedy generations equal transformers' generate, on tiny random checkpoints whose generations run
well past their sliding window."""
from __future__ import annotations

import json
import os

import pytest
import torch

from pyengine import LLM, SamplingParams
from tests.model_helpers import TINY_WINDOW, write_tiny_checkpoint


def write_byte_tokenizer(folder: str) -> None:
    """A byte-level tokenizer.json of 256 tokens (no merges) matching the tiny checkpoints' vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"add_bos_token": False}, f)


@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "mistral_window", "qwen3", "phi3"])
def test_engine_greedy_matches_transformers(kind, tmp_path):
    from transformers import AutoModelForCausalLM

    folder = write_tiny_checkpoint(str(tmp_path), kind)
    write_byte_tokenizer(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 20, 37)]
    new = 2 * TINY_WINDOW  # every generation runs past the window
    llm = LLM(folder, dtype="float32", max_num_batched_tokens=16, max_model_len=128,  # 16: chunked prefill
              kv_cache_memory=8 << 20)
    outs = llm.generate(prompts, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        with torch.inference_mode():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == want
